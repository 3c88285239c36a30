"""A training run's text side from its flags and its data: which tower and tokenizer, the step's
frozen argument, what a checkpoint stores to rebuild it, and the prompts of its sample grids.
train/main.py and train/sample.py call these; what they build is `conditioning.TextConditioning`.
"""

import dataclasses
from pathlib import Path

import numpy as np
from jax.sharding import Mesh

from eqxdiff.data.captioned_digits import captioned_digits_prompts, captioned_digits_tokenizer
from eqxdiff.data.latents import LatentSource
from eqxdiff.text.conditioning import SCRATCH, TextConditioning, open_text_conditioning, tokenizer_folder

CAPTIONED_DIGITS = "captioned_digits"  # the dataset, and its built-in word-level tokenizer


def wants_captions(text_encoder: str, dataset: str) -> bool:
    """Whether a run reads captions: a text tower is named, or the dataset is captioned_digits."""
    return bool(text_encoder) or dataset == CAPTIONED_DIGITS


def run_text(
    dataset: str, source, *, text_encoder: str, tokenizer: str, null_text: str, scratch_config: dict, mesh: Mesh,
    min_size: int,
) -> TextConditioning | None:  # fmt: skip
    """A run's text side, None for a run without captions: a frozen CLIP tower from `text_encoder`
    (a folder), the one latents were encoded with (their meta.json), or a tower trained with the
    model ("scratch", the default for captioned_digits, whose word-level tokenizer is built in)."""
    encoded = source.meta.get("text") if isinstance(source, LatentSource) else None
    if encoded is not None:  # train/encode.py --text_encoder: its tower and tokenizer
        if text_encoder and Path(text_encoder).expanduser().resolve() != Path(encoded["text_encoder"]):
            raise SystemExit(f"--text_encoder {text_encoder}: {dataset} was encoded with "
                             f"{encoded['text_encoder']}; drop the flag to use that one.")  # fmt: skip
        tower, tokenizer = encoded["text_encoder"], encoded["tokenizer"]
    else:
        tower = text_encoder or (SCRATCH if dataset == CAPTIONED_DIGITS else "")
        builtin = tower == SCRATCH and dataset == CAPTIONED_DIGITS  # else a pretrained tower's own
        tokenizer = tokenizer or (CAPTIONED_DIGITS if builtin else "")
    if not tower:
        return None
    if tower == SCRATCH and not tokenizer:
        raise SystemExit("--text_encoder scratch needs --tokenizer DIR (tokenizer.json, or vocab.json + merges.txt).")
    return open_text(tower, tokenizer, null_text, scratch_config=scratch_config, mesh=mesh, min_size=min_size)


def open_text(
    tower: str, tokenizer: str, null_text: str, *, scratch_config: dict, mesh: Mesh, min_size: int
) -> TextConditioning:
    """`tower` "scratch" (of `scratch_config`) or a folder; `tokenizer` "captioned_digits" (that
    dataset's word-level tokenizer), a folder, or "" (the tokenizer/ beside `tower`). The result
    keeps both as absolute specs, for checkpoints (`text_config`)."""
    if tokenizer == CAPTIONED_DIGITS:
        tokenizer_spec, tokenizer = tokenizer, captioned_digits_tokenizer()
    else:
        tokenizer_spec = tokenizer = str(tokenizer_folder(tower, tokenizer).resolve())
    text = open_text_conditioning(
        tower, tokenizer, null_text=null_text, scratch_config=scratch_config, mesh=mesh, min_size=min_size
    )
    tower_spec = tower if tower == SCRATCH else str(Path(tower).expanduser().resolve())
    return dataclasses.replace(text, specs=(tower_spec, tokenizer_spec))


def frozen_modules(text: TextConditioning | None, source) -> dict | None:
    """The step's frozen argument: a pretrained tower and its null condition (the one stored with
    latents encoded by train/encode.py, else its encoded "" or zeros); only the null when the
    captions were encoded ahead of time. None without a pretrained tower."""
    if text is None or text.encoder is None:
        return None
    stored = source.text_null() if isinstance(source, LatentSource) else None
    null = stored if stored is not None and source.meta["text"]["null_text"] == text.null_text else text.encoded_null()
    if "context" in source.fields:
        return {"null_cond": null}
    return {"text_encoder": text.encoder, "null_cond": null}


def text_config(text: TextConditioning | None) -> dict:
    """What a checkpoint stores of the run's text side, so train/sample.py rebuilds it (`open_text`):
    absolute folders (or "scratch" / "captioned_digits"), the null text, the token count."""
    if text is None:
        return {}
    tower, tokenizer = text.specs
    return {"text": {"text_encoder": tower, "tokenizer": tokenizer, "null_text": text.null_text,
                     "max_length": text.max_length}}  # fmt: skip


def sample_prompts(given: str, dataset: str, source) -> list[str]:
    """Sample-grid prompts: `given` ("|"-separated), else captioned_digits' own, else ten of the source's
    captions spread evenly over it (a sorted folder's first ten are often all of one class)."""
    if given:
        return given.split("|")
    if dataset == CAPTIONED_DIGITS:
        return captioned_digits_prompts(10, seed=0)[0]
    if "caption" in source.fields:
        caption = lambda i: str(source[i]["caption"])  # noqa: E731
    elif isinstance(source, LatentSource) and "caption" in source.record_fields:
        caption = source.caption  # latents whose records are read as tokens or encoded text keep the raw caption too
    else:
        raise SystemExit(f"{dataset} holds no captions to draw sample prompts from: pass --sample_prompts 'a|b|...'.")
    rows = np.unique(np.linspace(0, len(source) - 1, min(10, len(source))).round().astype(int))
    return [caption(int(i)) for i in rows]
