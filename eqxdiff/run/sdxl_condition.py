"""SDXL's condition for fine-tuning its UNet (train/main.py --init sd:SDXL_FOLDER), read from the pipeline folder:
both frozen towers (`text_encoder/`, `text_encoder_2/`) and tokenizers, the condition an `SDXLCond` as
`StableDiffusionXLPipeline` builds it (eqxdiff/sd/pipeline.py): the towers' penultimate states
concatenated, tower 2's projected `text_embeds` as the pooled vector, and the size/crop `time_ids`.

The images of a run are one fixed size, so every row's time_ids are original size = target size = the images'
size in pixels (the latents' size × the VAE's factor) and crop top-left (0, 0): what diffusers'
train_text_to_image_lora_sdxl.py gives images it resizes without a random crop (Podell et al. 2023, §2.2).
Sampling (the run's grids, train/sample.py --run_dir) asks for that size. The null condition of caption dropout and
guidance is the run's (--null_text): "" through both towers (diffusers' training scripts' empty prompt), or zeros
(the pipeline's force_zeros_for_empty_prompt); its time_ids are the same sizes.
"""

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from eqxdiff.run.conditions import TextCondition, repeat_rows
from eqxdiff.data.latents import LatentSource
from eqxdiff.data.records import TextField, describe_fields
from eqxdiff.nn import TextCond
from eqxdiff.sd import SDXLCond, sdxl_time_ids
from eqxdiff.sd.prompt_embeds import SDXLTextEncoders
from eqxdiff.sd.sdxl_prompts import SDXLPrompts
from eqxdiff.sharding import Rule, state_shardings
from eqxdiff.text.conditioning import NULL_TEXTS

SDXL_PIPELINE = "StableDiffusionXLPipeline"
STORED_TEXT = ("input_ids", "attention_mask", "context", "pooled")  # an SD 1.x encode's text fields, not read here


def is_sdxl_folder(path: str | Path) -> bool:
    """Whether `path` is an SDXL pipeline folder as diffusers saves it (its model_index.json says so)."""
    index = Path(path).expanduser() / "model_index.json"
    return bool(str(path)) and index.is_file() and json.loads(index.read_text()).get("_class_name") == SDXL_PIPELINE


def vae_factor(folder: str | Path) -> int:
    """The pipeline's pixels per latent, 2^(levels - 1) of its vae/config.json (diffusers' vae_scale_factor)."""
    return 2 ** (len(json.loads((Path(folder) / "vae" / "config.json").read_text())["block_out_channels"]) - 1)


class SDXLTokens:
    """`source` with its caption replaced by "input_ids" (tokenizer/) and "input_ids_2" (tokenizer_2/),
    int32[max_length] each, as the pipeline tokenizes a prompt; every other field and attribute the source's.
    Latents (train/encode.py) are read with their raw captions, without the text fields an encode stored."""

    def __init__(self, source: Any, prompts: SDXLPrompts, field: str = "caption"):
        if isinstance(source, LatentSource) and field not in source.fields:
            source = LatentSource(source.folder, source.spec, captions=True)
        if not isinstance(source.fields.get(field), TextField):
            raise ValueError(f"{source.spec} has no caption to tokenize (its fields: {describe_fields(source.fields)})")
        self.source, self.prompts, self.field = source, prompts, field
        tokens = jax.ShapeDtypeStruct((prompts.max_length,), np.int32)
        rest = {k: f for k, f in source.fields.items() if k not in (field, *STORED_TEXT)}
        self.kept, self.fields = tuple(rest), {**rest, "input_ids": tokens, "input_ids_2": tokens}
        self.spec = source.spec

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, i: int) -> dict:
        example = self.source[i]
        ids, ids_2 = self.prompts.token_ids([example[self.field]])
        return {**{k: example[k] for k in self.kept}, "input_ids": ids[0], "input_ids_2": ids_2[0]}

    def __getattr__(self, name: str):
        """image_shape, num_classes, ...: the wrapped source's (called only for names not set here)."""
        if name == "source":  # not set yet (e.g. while unpickling): no recursion through self.source
            raise AttributeError(name)
        return getattr(self.source, name)


class SDXLText(TextCondition):
    """SDXL's two frozen towers (`prompts.encoders`, the step's frozen `text_encoder` and `text_encoder_2`) read
    each batch's two token rows into `SDXLCond(TextCond(context [b, 77, d1 + d2], mask of ones, pooled [b, p]),
    time_ids [b, 6])` (module docstring). `folder`: the pipeline folder as the checkpoint names it; `size`:
    (height, width) of the images in pixels; `null_text` "empty" | "zeros"."""

    kind = "sdxl_text"

    def __init__(self, prompts: SDXLPrompts, *, folder: str, size: Sequence[int], null_text: str):
        super().__init__(None)
        self.prompts, self.folder, self.size, self.null_text = prompts, folder, tuple(size), null_text
        null = prompts.encode([""])
        if null_text == "zeros":
            null = TextCond(np.zeros_like(null.context), null.mask, np.zeros_like(null.pooled))
        self.null_cond = SDXLCond(null, self.time_ids(1))

    def time_ids(self, batch_size: int) -> np.ndarray:
        """float32[batch_size, 6]: (h, w, 0, 0, h, w), the images' size as original and target, no crop."""
        return sdxl_time_ids(self.size, (0, 0), self.size, batch_size)

    def model_kwargs(self) -> dict:
        encoders = self.prompts.encoders
        return {"context_dim": encoders.context_dim, "pooled_dim": encoders.pooled_dim}

    def records(self, source: Any) -> Any:
        return SDXLTokens(source, self.prompts)

    def frozen(self) -> dict:
        return self.pretrained() | {"null_cond": self.null_cond}

    def pretrained(self) -> dict:
        encoders = self.prompts.encoders
        return {"text_encoder": encoders.text_encoder, "text_encoder_2": encoders.text_encoder_2}

    def cond(self, batch: dict, frozen: dict | None) -> SDXLCond:
        encoders = SDXLTextEncoders(frozen["text_encoder"], frozen["text_encoder_2"])
        text = encoders(batch["input_ids"], batch["input_ids_2"])
        return SDXLCond(text, jnp.asarray(self.time_ids(text.context.shape[0])))

    def null(self, frozen: dict | None) -> SDXLCond:
        return self.null_cond if frozen is None else frozen["null_cond"]

    def for_sampling(self, rows: Sequence | np.ndarray | None, per_row: int) -> tuple[SDXLCond, SDXLCond]:
        """`rows`: a prompt each, encoded by the towers on the host."""
        cond = SDXLCond(self.prompts.encode(list(rows)), self.time_ids(len(rows)))
        return repeat_rows(cond, per_row), self.null_cond

    def to_config(self) -> dict:
        return {
            "kind": self.kind,
            "text_encoder": self.folder,
            "null_text": self.null_text,
            "size": list(self.size),
            "max_length": self.prompts.max_length,
        }


def open_sdxl_text(
    folder: str | Path,
    size: Sequence[int],
    null_text: str,
    *,
    mesh: Mesh | None = None,
    min_size: int = 2**12,
    rules: Sequence[Rule] = (),
) -> SDXLText:
    """The `SDXLText` of pipeline `folder` for images of `size` (height, width) pixels: both towers read straight
    into their layout on `mesh` by (`min_size`, `rules`), their leaves named as in the step's frozen argument
    (`text_encoder.…`, `text_encoder_2.text_model.…`)."""
    if null_text not in NULL_TEXTS:
        raise ValueError(f"null_text must be one of {NULL_TEXTS}, got {null_text!r}")
    if not (Path(folder) / "text_encoder").is_dir():
        raise ValueError(
            f"{folder} has no text_encoder/: SDXL's refiner (tower 2 alone, an aesthetic score in its "
            "time_ids) is not fine-tuned here; give the base model's folder"
        )
    place = (
        None if mesh is None else lambda abstract: state_shardings(abstract, mesh, min_size, rules=rules, strict=False)
    )
    prompts = SDXLPrompts.from_diffusers(folder, place=place)
    return SDXLText(prompts, folder=str(folder), size=size, null_text=null_text)
