"""LoRA files in diffusers' format: `pytorch_lora_weights.safetensors` as `StableDiffusionPipeline.save_lora_weights`
writes and `load_lora_weights` reads.

Keys are PEFT's with the pipeline component's prefix (none in the UNet's own `save_lora_adapter` files, which
load too): `unet.<module>.lora_A.weight` [r, in] and `.lora_B.weight`
[out, r]; a convolution's `[r, in, kh, kw]` and `[out, r, 1, 1]` (SD 1.x's proj_in/proj_out are 1x1 convolutions
in diffusers and `Dense` here: the same map). The alpha is not
a tensor: diffusers keeps the `LoraConfig` (r, lora_alpha, rank_pattern, alpha_pattern, target_modules) as JSON
under the safetensors metadata key `lora_adapter_metadata`, keys prefixed `unet.`; a file without it means
alpha = r for every module (diffusers' `get_peft_kwargs` with no network alphas), a scale of 1.
"""

import json
import os
import re
from collections import Counter
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from eqxdiff.nn.layers import Conv2d
from eqxdiff.nn.lora import LoRAConv2d, LoRALinear, lora_layers, map_layers, module_name
from eqxdiff.sd.attention import Transformer2DModel
from eqxdiff.paths import new_file_mode

WEIGHT_NAME = "pytorch_lora_weights.safetensors"  # diffusers' LORA_WEIGHT_NAME_SAFE
METADATA_KEY = "lora_adapter_metadata"  # diffusers' LORA_ADAPTER_METADATA_KEY
PREFIX = "unet"


def _file(path: str | Path) -> Path:
    path = Path(path).expanduser()
    return path if path.suffix == ".safetensors" else path / WEIGHT_NAME


def conv1x1_names(model) -> set[str]:
    """Names of the `Dense` layers that diffusers holds as 1x1 convolutions: the proj_in/proj_out of SD 1.x's
    `Transformer2DModel`s (`use_linear_projection=False`)."""
    is_t2d = lambda x: isinstance(x, Transformer2DModel)  # noqa: E731  (a predicate, as torch_weights' is_layer)
    found = jax.tree_util.tree_flatten_with_path(model, is_leaf=is_t2d)[0]
    return {
        f"{module_name(p)}.{proj}"
        for p, x in found
        if is_t2d(x) and not x.use_linear_projection
        for proj in ("proj_in", "proj_out")
    }


def save_lora(model, path: str | Path, *, overwrite: bool = False) -> Path:
    """Write `model`'s adapters to `path` (a folder: `<path>/pytorch_lora_weights.safetensors`, or a
    `.safetensors` file) with the `LoraConfig` metadata diffusers reads; returns the file. An existing file is
    refused unless `overwrite` (then replaced atomically)."""
    layers = lora_layers(model)
    if not layers:
        raise ValueError("save_lora: the model has no LoRA adapters (eqxdiff.nn.lora.add_lora or load_lora adds them)")
    file = _file(path)
    if file.exists() and not overwrite:
        raise FileExistsError(f"save_lora: {file} exists; pass overwrite=True to replace it")
    conv = conv1x1_names(model)
    tensors = {}
    for name, layer in layers.items():
        a, b = (np.asarray(jnp.asarray(w, jnp.float32)) for w in (layer.lora_A, layer.lora_B))
        if name in conv or isinstance(layer, LoRAConv2d):
            a, b = (a if a.ndim == 4 else a[:, :, None, None]), b[:, :, None, None]
        tensors[f"{PREFIX}.{name}.lora_A.weight"], tensors[f"{PREFIX}.{name}.lora_B.weight"] = a, b
    ranks = {name: layer.lora_A.shape[0] for name, layer in layers.items()}
    alphas = {name: layer.alpha for name, layer in layers.items()}
    r, alpha = Counter(ranks.values()).most_common(1)[0][0], Counter(alphas.values()).most_common(1)[0][0]
    config = {
        "r": r,
        "lora_alpha": alpha,
        "target_modules": sorted(layers),
        "rank_pattern": {f"^{re.escape(n)}$": v for n, v in ranks.items() if v != r},
        "alpha_pattern": {f"^{re.escape(n)}$": v for n, v in alphas.items() if v != alpha},
    }
    metadata = {
        "format": "pt",
        METADATA_KEY: json.dumps({f"{PREFIX}.{k}": v for k, v in config.items()}, indent=2, sort_keys=True),
    }
    file.parent.mkdir(parents=True, exist_ok=True)
    tmp = file.with_name(file.name + ".tmp")
    save_file(tensors, str(tmp), metadata=metadata)
    os.chmod(tmp, new_file_mode())  # safetensors writes 0o600: the umask's, as diffusers' own file
    os.replace(tmp, file)
    return file


def _pattern_value(patterns: dict, name: str, default):
    """PEFT's `get_pattern_key`: the first pattern matching the end of the module name."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", name):
            return value
    return default


def read_lora(path: str | Path) -> dict[str, tuple[np.ndarray, np.ndarray, float]]:
    """`{module name: (A [r, in] or [r, in, kh, kw], B [out, r], alpha)}` of a diffusers/PEFT LoRA file (the
    UNet's part), float32. Refused by name: other formats (kohya's `lora_unet_*.lora_down`, diffusers' pre-PEFT
    `*_lora.down`), DoRA, rsLoRA, a LoRA bias and text-encoder adapters."""
    file = _file(path)
    if not file.is_file():
        raise FileNotFoundError(f"read_lora: no {file} (pass the folder save_lora_weights wrote, or the file)")
    with safe_open(str(file), framework="numpy") as f:
        keys, meta = list(f.keys()), f.metadata() or {}
        tensors = {k: f.get_tensor(k) for k in keys}
    if any(k.startswith(("lora_unet_", "lora_te")) or ".lora_down." in k or ".lora_up." in k for k in keys):
        raise ValueError(
            f"{file}: a kohya/A1111 LoRA (lora_unet_*.lora_down/lora_up); eqxdiff reads diffusers/PEFT "
            "files (unet.*.lora_A.weight): convert it with diffusers (load_lora_weights, then "
            "save_lora_weights)"
        )
    # A pipeline's file prefixes the UNet's keys and metadata with `unet.`; the UNet's own `save_lora_adapter` not.
    prefix = f"{PREFIX}." if any(k.startswith(f"{PREFIX}.") for k in keys) else ""
    others = sorted({k.split(".")[0] for k in keys if not k.startswith(prefix) or k.startswith("text_encoder")})
    if others:
        raise ValueError(
            f"{file}: adapters of {others}, not the UNet; eqxdiff loads the UNet's (unet.*) only - save "
            "the UNet's adapters alone (save_lora_weights(unet_lora_layers=...))"
        )
    config = {
        k.removeprefix(prefix): v for k, v in json.loads(meta.get(METADATA_KEY) or "{}").items() if k.startswith(prefix)
    }
    for flag in ("use_dora", "use_rslora", "lora_bias"):
        if config.get(flag):
            raise ValueError(f"{file}: a LoRA with {flag}=True, which eqxdiff's LoRALinear does not compute")
    names = {}
    for key in keys:
        name, _, kind = key.removeprefix(prefix).rpartition(".lora_")
        if kind not in ("A.weight", "B.weight"):
            raise ValueError(f"{file}: key {key!r} is not a PEFT LoRA weight (<module>.lora_A/lora_B.weight)")
        names.setdefault(name, {})[kind[0]] = tensors[key]
    out = {}
    for name, pair in names.items():
        if len(pair) != 2:
            raise ValueError(f"{file}: {name} has lora_{next(iter(pair))} without its pair")
        a, b = (np.asarray(w, np.float32) for w in (pair["A"], pair["B"]))
        if b.ndim == 4 and b.shape[2:] == (1, 1):
            b = b[:, :, 0, 0]  # a convolution's B is 1x1 (PEFT): a linear map of the r channels
        if a.ndim not in (2, 4) or b.ndim != 2 or b.shape[1] != a.shape[0]:
            raise ValueError(
                f"{file}: {name}: lora_A {a.shape} and lora_B {b.shape} are not [r, in(, kh, kw)] and [out, r(, 1, 1)]"
            )
        rank = a.shape[0]
        # No metadata: alpha = r (diffusers' convention); with it, lora_alpha or the module's alpha_pattern.
        alpha = _pattern_value(config.get("alpha_pattern") or {}, name, config.get("lora_alpha", rank))
        out[name] = (a, b, float(alpha))
    return out


def load_lora(model, path: str | Path) -> Any:
    """`model` with the adapters of a diffusers/PEFT LoRA file (see `read_lora`) wrapped around the named
    linears (an existing adapter there is replaced); a module of the file that the model lacks, or a shape that
    does not fit, raises naming it."""
    adapters = read_lora(path)
    seen = set()

    def attach(name: str, node):
        if name not in adapters:
            return node
        seen.add(name)
        base = node.base_layer if isinstance(node, (LoRALinear, LoRAConv2d)) else node
        a, b, alpha = adapters[name]
        if isinstance(base, Conv2d):
            kh, kw, n_in, n_out = base.weight.shape
            fits, kind, want = a.shape[1:] == (n_in, kh, kw), LoRAConv2d, f"[r, {n_in}, {kh}, {kw}]"
        else:
            n_in, n_out = base.weight.shape
            a = a[:, :, 0, 0] if a.ndim == 4 and a.shape[2:] == (1, 1) else a  # diffusers' 1x1 conv, our Dense
            fits, kind, want = a.shape[1:] == (n_in,), LoRALinear, f"[r, {n_in}]"
        if not fits or b.shape[0] != n_out:
            raise ValueError(
                f"load_lora: {name}: lora_A {a.shape} / lora_B {b.shape} do not fit it: want lora_A "
                f"{want} and lora_B [{n_out}, r]"
            )
        dtype = base.weight.dtype
        return kind(base, jnp.asarray(a, dtype), jnp.asarray(b, dtype), alpha)

    model = map_layers(model, attach)
    missing = sorted(set(adapters) - seen)
    if missing:
        raise ValueError(
            f"load_lora: {_file(path)} adapts {missing[:4]}{'...' if len(missing) > 4 else ''}, which "
            "are not linear or conv layers of this model (another architecture's LoRA?)"
        )
    return model
