"""How a text-to-image run turns captions into its model's condition, in training and in sampling.

Two towers, one condition. A pretrained tower (`CLIPTextModel.from_transformers`, e.g. SD's
`text_encoder/`) stays frozen: the training step takes it as an ARGUMENT and encodes each batch's
tokens in `prepare`, and the network sees `TextCond(context f32[b,n,d], mask int32[b,n], pooled
f32[b,d])`. A tower trained from scratch ("scratch", e.g. for `captioned_digits`) is part of the
model (`eqxdiff.nn.TextConditioned`), which takes the tokens themselves.

The null condition of classifier-free guidance is the run's, the same in training (caption dropout)
and sampling: the encoded empty caption "" (`null_text="empty"`, as Stable Diffusion trains), or
zeros in place of its hidden states and pooled vector (`"zeros"`, SDXL's
`force_zeros_for_empty_prompt`). A scratch tower always uses "", run through the tower itself.
"""

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from eqxdiff.data.tokenizer import TextTokenizer, load_tokenizer
from eqxdiff.local_copies import local_copy
from eqxdiff.nn import CLIPTextModel, TextCond
from eqxdiff.nn.clip_text import WEIGHTS_FILE
from eqxdiff.weights.weight_files import weight_files
from eqxdiff.paths import is_url
from eqxdiff.sharding import Rule, placement

NULL_TEXTS = ("empty", "zeros")
SCRATCH = "scratch"


@dataclasses.dataclass(frozen=True)
class TextConditioning:
    """A run's text side: its tokenizer, and either a frozen pretrained tower (`encoder`) or the
    configuration of a tower trained with the model (`scratch_config`, a CLIPTextConfig dict).

    `attend_padding`: the tower (and the network) read every one of the `max_length` tokens, padding included
    (an all-ones attention mask), as diffusers' Stable Diffusion pipelines and training scripts encode prompts:
    a fine-tune of their UNet (`train/main.py --init sd:`) sees the context it was trained on. False: the
    tokenizer's mask, padding masked out of the tower's attention and the network's cross-attention."""

    tokenizer: TextTokenizer
    max_length: int  # tokens per caption
    null_text: str  # "empty" | "zeros"
    encoder: CLIPTextModel | None = None
    scratch_config: dict | None = None
    specs: tuple[str, str] = ("", "")  # (tower, tokenizer) as a checkpoint names them, for the scripts
    attend_padding: bool = False

    def tokens(self, texts: list[str]) -> dict[str, np.ndarray]:
        """Captions -> {"input_ids", "attention_mask"}, int32[len(texts), max_length] each (the mask all ones
        with `attend_padding`)."""
        ids, mask = self.tokenizer(list(texts), self.max_length)
        return {"input_ids": ids, "attention_mask": self.read_mask(mask)}

    def read_mask(self, attention_mask):
        """The mask the tower and the network read for the tokenizer's `attention_mask` [b, n] (numpy or jax):
        itself, or all ones with `attend_padding`."""
        if not self.attend_padding:
            return attention_mask
        return (np if isinstance(attention_mask, np.ndarray) else jnp).ones_like(attention_mask)

    def model_dims(self) -> dict[str, int]:
        """The network's condition sizes: `context_dim` and `pooled_dim` (the tower's width)."""
        width = self.scratch_config["hidden_size"] if self.encoder is None else self.encoder_width
        return {"context_dim": width, "pooled_dim": width}

    @property
    def encoder_width(self) -> int:
        return self.encoder.final_layer_norm.weight.shape[-1]

    def encoded_null(self) -> TextCond:
        """TextCond(context f32[1,n,d], mask int32[1,n], pooled f32[1,d]): "" encoded, or zeros."""
        cond = encode_tokens(self.encoder, self.tokens([""]))
        if self.null_text == "zeros":
            cond = TextCond(np.zeros_like(cond.context), cond.mask, np.zeros_like(cond.pooled))
        return cond

    def sampling_condition(self, prompts: list[str]) -> tuple[Any, Any]:
        """(cond, null_cond) host arrays for `eqxdiff.generate.generate`: one row per prompt. For a
        scratch tower the tokens, and None (the model's own null, the tokens of ""), else the
        encoded prompts and the encoded null."""
        tokens = self.tokens(prompts)
        if self.encoder is None:
            return tokens, None
        return encode_tokens(self.encoder, tokens), self.encoded_null()


@eqx.filter_jit
def _encode(encoder: CLIPTextModel, input_ids: jax.Array, attention_mask: jax.Array) -> tuple:
    return encoder(input_ids, attention_mask)


def encode_tokens(encoder: CLIPTextModel, tokens: dict, batch_size: int = 64) -> TextCond:
    """Tokens {"input_ids", "attention_mask"} -> the network's condition as host (float32) arrays, in
    chunks of `batch_size` prompts."""
    hidden, pooled = [], []
    for i in range(0, len(tokens["input_ids"]), batch_size):
        h, p = _encode(encoder, tokens["input_ids"][i : i + batch_size], tokens["attention_mask"][i : i + batch_size])
        hidden.append(np.asarray(h, np.float32))
        pooled.append(np.asarray(p, np.float32))
    return TextCond(np.concatenate(hidden), tokens["attention_mask"], np.concatenate(pooled))


def tokenizer_location(text_encoder: str, tokenizer: str) -> str:
    """Where `tokenizer_folder`'s folder is, to be recorded: a URL as given (the `tokenizer/` beside a URL's
    `text_encoder`), a local folder absolute."""
    if not tokenizer and is_url(text_encoder):
        return f"{str(text_encoder).rstrip('/').rpartition('/')[0]}/tokenizer"
    return tokenizer if is_url(tokenizer) else str(tokenizer_folder(text_encoder, tokenizer).resolve())


def tokenizer_folder(text_encoder: str, tokenizer: str) -> Path:
    """`tokenizer`, or the `tokenizer/` folder beside `text_encoder` (a Stable Diffusion checkpoint's layout); a URL's
    folder is its local copy (eqxdiff.local_copies)."""
    if tokenizer:
        return local_copy(tokenizer)
    if is_url(text_encoder):
        sibling = tokenizer_location(text_encoder, "")
        try:
            return local_copy(sibling)
        except FileNotFoundError as e:
            raise FileNotFoundError(
                f"No tokenizer folder given and none beside {text_encoder} ({e}): pass "
                "--tokenizer DIR (SD's tokenizer/ folder)."
            ) from e
    sibling = Path(text_encoder).expanduser().resolve().parent / "tokenizer"
    if not sibling.is_dir():
        raise FileNotFoundError(
            f"No tokenizer folder given and none beside {text_encoder} (looked for {sibling}): pass --tokenizer DIR "
            "(SD's tokenizer/ folder: vocab.json + merges.txt, or a tokenizer.json)."
        )
    return sibling


def check_text_folders(text_encoder: str, tokenizer: str = "") -> None:
    """Raises FileNotFoundError (or ValueError) naming the folder and what it lacks, without reading
    weights, for a `text_encoder` that is not a transformers CLIP text folder (config.json + weights)
    or a tokenizer folder (given, or beside it) that is missing: scripts check these before their data."""
    if text_encoder != SCRATCH:
        wanted = f"a transformers CLIP text folder, config.json + {WEIGHTS_FILE}, e.g. SD's text_encoder/"
        try:
            folder = local_copy(text_encoder)  # a URL's: its local copy (eqxdiff.local_copies)
        except FileNotFoundError as e:
            raise FileNotFoundError(f"--text_encoder {text_encoder}: {e} ({wanted}).") from e
        if not folder.is_dir():
            state = "is a file, not a folder" if folder.exists() else "does not exist"
            raise FileNotFoundError(f"--text_encoder {text_encoder}: {folder} {state} ({wanted}).")
        if not (folder / "config.json").is_file():
            held = sorted(p.name for p in folder.iterdir())
            what = f"holds {', '.join(held[:10])}{', ...' if len(held) > 10 else ''}" if held else "is empty"
            raise FileNotFoundError(
                f"--text_encoder {text_encoder}: the folder {what}, with no config.json ({wanted})."
            )
        try:
            weight_files(folder, WEIGHTS_FILE)
        except FileNotFoundError as e:  # its message names what the folder holds
            raise FileNotFoundError(f"--text_encoder {text_encoder}: {e}") from e
    if text_encoder != SCRATCH or tokenizer:
        found = tokenizer_folder(text_encoder, tokenizer)
        if not found.is_dir():
            raise FileNotFoundError(
                f"--tokenizer {tokenizer}: {found} does not exist (a tokenizer folder: "
                "vocab.json + merges.txt, or a tokenizer.json)."
            )


def open_text_conditioning(
    text_encoder: str,
    tokenizer: TextTokenizer | str,
    *,
    null_text: str = "empty",
    scratch_config: dict | None = None,
    mesh: Mesh | None = None,
    min_size: int = 2**12,
    rules: Sequence[Rule] = (),
    attend_padding: bool = False,
) -> TextConditioning:
    """`text_encoder`: a transformers CLIP text folder (frozen; each weight read straight into its layout
    on `mesh`, `eqxdiff.sharding.state_shardings`'s for `(min_size, rules)`, its leaves named as in the
    training step's frozen argument: `text_encoder.<its path>`) or "scratch" (a tower of `scratch_config`
    trained with the model). `tokenizer`: a tokenizer, or a folder (default: beside `text_encoder`).
    `attend_padding`: `TextConditioning`'s (a pretrained tower only)."""
    if null_text not in NULL_TEXTS:
        raise ValueError(f"null_text must be one of {NULL_TEXTS}, got {null_text!r}")
    if not isinstance(tokenizer, TextTokenizer):
        tokenizer = load_tokenizer(tokenizer_folder(text_encoder, tokenizer))
    if text_encoder == SCRATCH:
        if null_text != "empty":
            raise ValueError(
                "--null_text zeros needs a pretrained --text_encoder: a tower trained from scratch learns its own "
                "encoding of the empty caption, which is its null condition."
            )
        max_length = tokenizer.check_length(None)
        ids, mask = tokenizer([""], max_length)
        eos = int(ids[0, mask[0].sum() - 1])  # "" is bos, eos: pooling reads the state at eos
        if eos == 2:  # CLIPTextModel would read id 2 as transformers' legacy "pool at the largest id"
            raise ValueError("A scratch text tower needs a tokenizer whose end-of-text id is not 2.")
        config = {
            **(scratch_config or {}),
            "vocab_size": tokenizer.tokenizer.get_vocab_size(),
            "max_position_embeddings": max_length,
            "eos_token_id": eos,
        }
        if attend_padding:
            raise ValueError("attend_padding encodes as a pretrained tower's pipeline does: not for a scratch tower.")
        return TextConditioning(tokenizer, max_length, null_text, scratch_config=config)
    # Named as in the training step's frozen argument, where the run's rules (SHARDING_RULES) see it too.
    place = None if mesh is None else placement(mesh, min_size, rules=rules, name="text_encoder")
    encoder = CLIPTextModel.from_transformers(local_copy(text_encoder), place=place)
    vocab, rows = tokenizer.tokenizer.get_vocab_size(), encoder.embeddings.token_embedding.weight.shape[0]
    if vocab > rows:  # an id past the table would be clamped inside jit, silently
        raise ValueError(
            f"The tokenizer has {vocab} ids but the text encoder {text_encoder} embeds {rows}: they are not a pair "
            "(pass the tokenizer/ folder of the same checkpoint as --tokenizer)."
        )
    positions = encoder.embeddings.position_embedding.weight.shape[0]
    max_length = min(tokenizer.model_max_length or positions, positions)
    return TextConditioning(tokenizer, max_length, null_text, encoder=encoder, attend_padding=attend_padding)
