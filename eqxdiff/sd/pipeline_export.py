"""A Stable Diffusion pipeline written as the folder diffusers' `save_pretrained` writes (the inverse of `load_sd`).

`save_pipeline(pipeline_or_parts, folder)`: `unet/` and `vae/` (export.py), `text_encoder[_2]/`
(clip_export.py), `tokenizer[_2]/` (the tokenizer files, copied: eqxdiff's tokenizer does not keep them),
`scheduler/scheduler_config.json` and `model_index.json`, which names each part's library and class as
diffusers does; `StableDiffusionPipeline.from_pretrained` / `StableDiffusionXLPipeline.from_pretrained` and
`load_sd` read it. model_index.json is written last: a folder cut short by an error has none, and loaders refuse it.
"""

import json
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
from jax.typing import DTypeLike

from eqxdiff.nn.autoencoder_kl import AutoencoderKL
from eqxdiff.nn.clip_text import CLIPTextModel
from eqxdiff.nn.clip_text_projection import CLIPTextModelWithProjection
from eqxdiff.sd.clip_export import save_transformers
from eqxdiff.sd.export import save_diffusers
from eqxdiff.sd.pipeline import SDPipeline
from eqxdiff.sd.unet import SDUNet
from eqxdiff.weights.model_folder import check_writable, write_json

# The parts each pipeline class holds, with the type each must be (tokenizers: folders of tokenizer files).
PARTS = {
    "StableDiffusionPipeline": {
        "unet": SDUNet,
        "vae": AutoencoderKL,
        "text_encoder": CLIPTextModel,
        "tokenizer": Path,
        "scheduler": dict,
    },
    "StableDiffusionXLPipeline": {
        "unet": SDUNet,
        "vae": AutoencoderKL,
        "text_encoder": CLIPTextModel,
        "tokenizer": Path,
        "text_encoder_2": CLIPTextModelWithProjection,
        "tokenizer_2": Path,
        "scheduler": dict,
    },
}
LIBRARY = {"unet": "diffusers", "vae": "diffusers", "scheduler": "diffusers"}  # the rest: transformers
CLASS = {
    SDUNet: "UNet2DConditionModel",
    AutoencoderKL: "AutoencoderKL",
    CLIPTextModel: "CLIPTextModel",
    CLIPTextModelWithProjection: "CLIPTextModelWithProjection",
}
UNUSED = {
    "StableDiffusionPipeline": ("feature_extractor", "image_encoder", "safety_checker"),
    "StableDiffusionXLPipeline": ("feature_extractor", "image_encoder"),
}


def class_name(part: Any, kind: type) -> str:
    """The class model_index.json names for a part: a scheduler config's own, a tokenizer folder's
    `tokenizer_class` (CLIPTokenizer if it names none), a model's transformers/diffusers counterpart."""
    if kind is dict:
        return part["_class_name"]
    if kind is Path:
        config = Path(part) / "tokenizer_config.json"
        return (json.loads(config.read_text()) if config.is_file() else {}).get("tokenizer_class", "CLIPTokenizer")
    return CLASS[kind]


def pipeline_parts(pipeline: SDPipeline, tokenizers: str | Path) -> dict[str, Any]:
    """The parts of a loaded (or fine-tuned) `SDPipeline`, its tokenizers taken from the pipeline folder
    `tokenizers` (the one it was loaded from: its `tokenizer[_2]/`)."""
    parts = {"unet": pipeline.unet, "vae": pipeline.vae, "scheduler": pipeline.scheduler_config}
    tokenizers = Path(tokenizers).expanduser()
    if pipeline.family == "sd":
        return parts | {"text_encoder": pipeline.prompts.encoder, "tokenizer": tokenizers / "tokenizer"}
    encoders = pipeline.prompts.encoders
    return parts | {
        "text_encoder": encoders.text_encoder,
        "text_encoder_2": encoders.text_encoder_2,
        "tokenizer": tokenizers / "tokenizer",
        "tokenizer_2": tokenizers / "tokenizer_2",
        "force_zeros_for_empty_prompt": pipeline.prompts.force_zeros_for_empty_prompt,
    }


def check_parts(parts: Mapping[str, Any]) -> str:
    """The pipeline class `parts` make (text_encoder_2 present: SDXL), after checking each part's type and that
    each tokenizer folder exists; raises naming what is wrong, before anything is written."""
    name = "StableDiffusionXLPipeline" if "text_encoder_2" in parts else "StableDiffusionPipeline"
    wanted = PARTS[name]
    extra = sorted(set(parts) - set(wanted) - {"force_zeros_for_empty_prompt"})
    missing = sorted(set(wanted) - set(parts))
    if missing or extra:
        raise ValueError(
            f"save_pipeline: a {name} takes the parts {sorted(wanted)}; missing {missing}, unknown {extra}"
        )
    for part, kind in wanted.items():
        value = Path(parts[part]) if kind is Path and isinstance(parts[part], str) else parts[part]
        if kind is Path:
            if not isinstance(value, Path) or not value.is_dir():
                raise ValueError(
                    f"save_pipeline: {part} must be a folder of tokenizer files (a pipeline's "
                    f"{part}/), got {parts[part]!r}"
                )
        elif type(value) is not kind:
            raise ValueError(f"save_pipeline: {part} must be an eqxdiff {kind.__name__}, got {type(value).__name__}")
    if "_class_name" not in parts["scheduler"]:
        raise ValueError(
            "save_pipeline: scheduler must be a diffusers scheduler config with its _class_name "
            "(e.g. a pipeline's scheduler/scheduler_config.json, read)"
        )
    return name


def save_pipeline(
    pipeline_or_parts: SDPipeline | Mapping[str, Any],
    folder: str | Path,
    *,
    tokenizers: str | Path | None = None,
    dtype: DTypeLike | str = np.float32,
    overwrite: bool = False,
) -> Path:
    """An SD 1.x/2.x or SDXL pipeline as diffusers' pipeline folder at `folder`, weights as `dtype`.

    `pipeline_or_parts`: an `SDPipeline` (from `load_sd`, its unet perhaps replaced by a fine-tuned one), whose
    tokenizer files are copied from the pipeline folder `tokenizers`; or a dict of parts: "unet" (SDUNet), "vae"
    (AutoencoderKL), "text_encoder" (CLIPTextModel), "tokenizer" (a folder of tokenizer files), "scheduler" (a
    diffusers scheduler config dict), and for SDXL "text_encoder_2" (CLIPTextModelWithProjection), "tokenizer_2"
    and optionally "force_zeros_for_empty_prompt" (default true). LoRA-wrapped models are merged. A non-empty
    `folder` is refused unless `overwrite`. Returns `folder`."""
    if isinstance(pipeline_or_parts, SDPipeline):
        if tokenizers is None:
            raise ValueError(
                "save_pipeline: pass tokenizers=<the pipeline folder it was loaded from>, whose "
                "tokenizer files are copied (an SDPipeline keeps no tokenizer files)"
            )
        parts = pipeline_parts(pipeline_or_parts, tokenizers)
    else:
        parts = dict(pipeline_or_parts)
    name = check_parts(parts)
    folder = check_writable(folder, overwrite)
    index: dict[str, Any] = {"_class_name": name} | {unused: [None, None] for unused in UNUSED[name]}
    for part, kind in PARTS[name].items():
        target = folder / part
        if kind is Path:
            shutil.copytree(parts[part], target, dirs_exist_ok=True)
        elif kind is dict:
            target.mkdir(parents=True, exist_ok=True)
            write_json(target / "scheduler_config.json", dict(parts[part]))
        elif part.startswith("text_encoder"):
            save_transformers(parts[part], target, dtype=dtype, overwrite=True)
        else:
            save_diffusers(parts[part], target, dtype=dtype, overwrite=True)
        index[part] = [LIBRARY.get(part, "transformers"), class_name(parts[part], kind)]
    if name == "StableDiffusionPipeline":
        index["requires_safety_checker"] = False
    else:
        index["force_zeros_for_empty_prompt"] = bool(parts.get("force_zeros_for_empty_prompt", True))
    write_json(folder / "model_index.json", index)
    return folder
