"""What a run's network is conditioned on: nothing, class labels, or text read by a tower trained with
the model, by a frozen pretrained tower, or encoded ahead of time (train/encode.py).

A condition is decided once from the data and the flags (eqxdiff/run/open_condition.py) and owns every
question a run asks about it:

    model_kwargs()            the network's sizes: num_classes= or context_dim=, pooled_dim=
    build(make_net, key)      the network, wrapped where the condition trains its own tower
    records(source)           the records the step reads (captions tokenized on the host)
    frozen()                  the training step's frozen argument (a pretrained tower, its null), or None
    pretrained()              the pretrained modules it loaded, by the name SHARDING_RULES know them by
    cond(batch, frozen)       the condition of a batch, inside the step
    null(frozen)              THE null condition of classifier-free guidance, one row: caption and label
                              dropout in training and the unconditional half of guided sampling read it
    for_sampling(rows, per)   (condition, null) of sample rows (labels or prompts), `per` images each
    to_config()               every constructor argument, for the checkpoint (eqxdiff/run/open_condition.py
                              rebuilds it)

A new kind (a class label and a caption together, an image embedding) is one class (docs/edits.md, edit (f)).
"""

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from eqxdiff.data import TokenizedSource
from eqxdiff.nn import CLIPTextModel, TextCond, TextConditioned
from eqxdiff.text.conditioning import TextConditioning, encode_tokens


def repeat_rows(tree: Any, per_row: int) -> Any:
    """Each row (leading axis) of every leaf `per_row` times in a row: a sample grid's conditions, one per image."""
    return jax.tree.map(lambda a: np.repeat(a, per_row, axis=0), tree)


class NoCondition:
    """An unconditional model."""

    dropout_flag = "label_dropout"  # train/main.py's flag of its classifier-free dropout (none to drop here)

    def model_kwargs(self) -> dict:
        return {"num_classes": 0}

    def build(self, make_net, key: jax.Array) -> Any:
        return make_net(key, **self.model_kwargs())

    def records(self, source: Any) -> Any:
        """The record source the step reads (text conditions: captions as token ids, on the host)."""
        return source

    def frozen(self) -> dict | None:
        return None

    def pretrained(self) -> dict:
        """The pretrained modules it loaded into the mesh, by the first name of their leaves' paths in
        train/main.py's SHARDING_RULES: {} (a frozen tower: {"text_encoder": tower})."""
        return {}

    def cond(self, batch: dict, frozen: dict | None) -> Any:
        return None

    def null(self, frozen: dict | None) -> Any:
        return None

    def for_sampling(self, rows: Sequence | np.ndarray | None, per_row: int) -> tuple[Any, Any]:
        return None, None

    def to_config(self) -> dict:
        return {"kind": "none"}


class Labels(NoCondition):
    """Class labels 0..n-1; the null condition is label n (the label table's extra row)."""

    def __init__(self, num_classes: int):
        self.num_classes = num_classes

    def model_kwargs(self) -> dict:
        return {"num_classes": self.num_classes}

    def cond(self, batch: dict, frozen: dict | None) -> Any:
        return batch["label"]

    def null(self, frozen: dict | None) -> np.ndarray:
        return np.full((1,), self.num_classes, np.int32)

    def for_sampling(self, rows: Sequence | np.ndarray | None, per_row: int) -> tuple[np.ndarray, np.ndarray]:
        """`rows`: a label each."""
        return np.repeat(np.asarray(rows, np.int32), per_row), self.null(None)

    def to_config(self) -> dict:
        return {"kind": "labels", "num_classes": self.num_classes}


class TextCondition(NoCondition):
    """Captions, tokenized on the host by `text.tokenizer`; `specs` name the tower and tokenizer as a
    checkpoint stores them (folders absolute, or "scratch" / a dataset's built-in tokenizer)."""

    dropout_flag = "text_dropout"

    def __init__(self, text: TextConditioning | None):
        self.text = text  # None: a condition used only inside a step (benchmarks/bench_text_step.py)

    def model_kwargs(self) -> dict:
        return self.text.model_dims()

    def records(self, source: Any) -> Any:
        if "caption" not in source.fields:  # tokens or encoded captions already
            return source
        return TokenizedSource(source, self.text.tokenizer, self.text.max_length)

    def to_config(self) -> dict:
        tower, tokenizer = self.text.specs
        return {
            "kind": self.kind,
            "text_encoder": tower,
            "tokenizer": tokenizer,
            "null_text": self.text.null_text,
            "max_length": self.text.max_length,
        }


class ScratchText(TextCondition):
    """A CLIP-style tower of `text.scratch_config` trained with the model (`TextConditioned`): the step
    hands it tokens; its null is the tokens of "", run through the tower itself. `causal`: its
    attention; `pooled`: whether the network takes its pooled vector."""

    kind = "scratch_text"

    def __init__(self, text: TextConditioning, *, causal: bool, pooled: bool):
        super().__init__(text)
        self.causal, self.pooled = causal, pooled

    def model_kwargs(self) -> dict:
        return self.text.model_dims() | ({} if self.pooled else {"pooled_dim": 0})

    def build(self, make_net, key: jax.Array) -> TextConditioned:
        key_text, key_net = jax.random.split(key)
        null = self.null(None)
        net = make_net(key_net, **self.model_kwargs())
        tower = CLIPTextModel.from_config(self.text.scratch_config, key=key_text, causal=self.causal)
        return TextConditioned(tower, net, null["input_ids"][0], null["attention_mask"][0], pooled=self.pooled)

    def cond(self, batch: dict, frozen: dict | None) -> dict:
        return {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}

    def null(self, frozen: dict | None) -> dict:
        return self.text.tokens([""])

    def for_sampling(self, rows: Sequence | np.ndarray | None, per_row: int) -> tuple[dict, dict]:
        """`rows`: a prompt each."""
        return repeat_rows(self.text.tokens(list(rows)), per_row), self.null(None)

    def to_config(self) -> dict:
        return super().to_config() | {"tower": self.text.scratch_config, "causal": self.causal, "pooled": self.pooled}


class FrozenText(TextCondition):
    """A pretrained tower (`text.encoder`), frozen: the step takes it and `null_cond` (the encoded "",
    or zeros: `null`, host arrays of one row) as its frozen argument and encodes each batch's tokens."""

    kind = "frozen_text"

    def __init__(self, text: TextConditioning | None, null: TextCond):
        super().__init__(text)
        self.null_cond = null

    def frozen(self) -> dict:
        return {"text_encoder": self.text.encoder, "null_cond": self.null_cond}

    def to_config(self) -> dict:  # attend_padding only where on: earlier runs' configs stay as they were
        return super().to_config() | ({"attend_padding": True} if self.text.attend_padding else {})

    def pretrained(self) -> dict:
        return {"text_encoder": self.text.encoder}  # also where the step takes none (EncodedText: sample prompts)

    def cond(self, batch: dict, frozen: dict | None) -> TextCond:
        mask = self.mask(batch["attention_mask"])
        hidden, pooled = frozen["text_encoder"](batch["input_ids"], mask)
        return TextCond(hidden, mask, pooled)

    def mask(self, attention_mask: jax.Array | np.ndarray) -> jax.Array | np.ndarray:
        """The batch's tokenizer mask as the run reads it (`TextConditioning.read_mask`); as it is without text."""
        return attention_mask if self.text is None else self.text.read_mask(attention_mask)

    def null(self, frozen: dict | None) -> TextCond:
        return self.null_cond if frozen is None else frozen["null_cond"]

    def for_sampling(self, rows: Sequence | np.ndarray | None, per_row: int) -> tuple[TextCond, TextCond]:
        """`rows`: a prompt each, encoded by the tower on the host."""
        return repeat_rows(encode_tokens(self.text.encoder, self.text.tokens(list(rows))), per_row), self.null_cond


class EncodedText(FrozenText):
    """Captions encoded ahead of time by a frozen tower (train/encode.py --text_encoder): the records hold
    the condition (float16), the step takes only the null; the tower encodes sample prompts."""

    kind = "encoded_text"

    def frozen(self) -> dict:
        return {"null_cond": self.null_cond}

    def cond(self, batch: dict, frozen: dict | None) -> TextCond:
        f32 = lambda name: batch[name].astype(jnp.float32)  # noqa: E731 — stored as float16
        return TextCond(f32("context"), self.mask(batch["attention_mask"]), f32("pooled"))
