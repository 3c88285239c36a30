"""eqxdiff's CLIP text towers written back as transformers model folders (the inverse of `from_transformers`).

`save_transformers(tower, folder)` writes a `CLIPTextModel` (SD's `text_encoder/`) or a
`CLIPTextModelWithProjection` (SDXL's `text_encoder_2/`): `config.json` (a `clip_text_model` config read off the
module: sizes from its shapes, activation, LayerNorm eps, eos id) and `model.safetensors` with the hub's
`text_model.*` keys (and `text_projection.weight`), Linear weights as [out, in], which transformers 4 and 5 read.
A tower built with `causal=False` (trained from scratch here) has no transformers counterpart and is refused.
"""

from pathlib import Path

import equinox as eqx
import numpy as np
from jax.typing import DTypeLike

from eqxdiff.nn.clip_text import PREFIX, WEIGHTS_FILE, CLIPTextModel
from eqxdiff.nn.clip_text_projection import CLIPTextModelWithProjection
from eqxdiff.nn.lora import merge_lora
from eqxdiff.nn.torch_state import file_dtype, torch_state_dict
from eqxdiff.weights.model_folder import check_writable, write_model_folder


def clip_text_config(tower: CLIPTextModel | CLIPTextModelWithProjection, dtype: DTypeLike | str = "float32") -> dict:
    """transformers' `CLIPTextConfig` (as config.json) that builds `tower` again."""
    text = tower.text_model if isinstance(tower, CLIPTextModelWithProjection) else tower
    if not text.causal:
        raise ValueError(
            "a CLIP text tower built with causal=False (every token sees every other) has no "
            "transformers counterpart, whose CLIP attention is always causal; train with a causal "
            "tower to export it"
        )
    layer = text.encoder.layers[0]
    token, position = text.embeddings.token_embedding.weight.shape, text.embeddings.position_embedding.weight.shape
    config = {
        "architectures": [type(tower).__name__],
        "model_type": "clip_text_model",
        "vocab_size": token[0],
        "hidden_size": token[1],
        "intermediate_size": layer.mlp.fc1.weight.shape[1],
        "num_hidden_layers": text.num_layers,
        "num_attention_heads": layer.self_attn.num_heads,
        "max_position_embeddings": position[0],
        "hidden_act": layer.mlp.hidden_act,
        "layer_norm_eps": text.final_layer_norm.eps,
        "eos_token_id": text.eos_token_id,
        "dtype": file_dtype(dtype).name,
    }
    if isinstance(tower, CLIPTextModelWithProjection):
        config["projection_dim"] = tower.text_projection.weight.shape[1]
    return config


def save_transformers(
    tower: eqx.Module,
    folder: str | Path,
    *,
    dtype: DTypeLike | str = np.float32,
    variant: str | None = None,
    overwrite: bool = False,
) -> Path:
    """`tower` (a `CLIPTextModel` or `CLIPTextModelWithProjection`) as the folder transformers'
    `CLIPTextModel[WithProjection].from_pretrained` reads: config.json and `model[.<variant>].safetensors` as
    `dtype` (float32, float16, bfloat16). LoRA adapters are merged first; a non-empty `folder` is refused unless
    `overwrite`. Returns `folder`."""
    if not isinstance(tower, (CLIPTextModel, CLIPTextModelWithProjection)):
        raise ValueError(
            f"save_transformers writes an eqxdiff CLIPTextModel or CLIPTextModelWithProjection, "
            f"not a {type(tower).__name__}"
        )
    folder = check_writable(folder, overwrite)
    tower = merge_lora(tower)
    config = clip_text_config(tower, dtype)
    prefix = "" if isinstance(tower, CLIPTextModelWithProjection) else PREFIX  # its leaves start with text_model.
    return write_model_folder(
        folder, config, torch_state_dict(tower, dtype=dtype, prefix=prefix), WEIGHTS_FILE, variant=variant
    )
