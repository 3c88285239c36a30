"""NVlabs/edm2's networks as eqxdiff denoisers: `load_edm2(path)` reads the safetensors state_dict and JSON
config that tools/convert_edm2.py writes from one of EDM2's published pickles (which embed code, so they are
converted in the torch venv, never unpickled here).

EDM2's `Precond` is `Denoiser(EDM2UNet, EDMSchedule(), EDMPreconditioning(sigma_data))` (eqxdiff/nn/edm2.py);
its state_dict keys are the UNet's under `unet.` with the blocks named by resolution (`unet.enc.8x8_conv`,
`unet.dec.4x4_in0`), which `EDM2UNet.enc_names`/`dec_names` keep, plus the logvar head's.
"""

import json
import re
from pathlib import Path

import numpy as np
from jax.typing import DTypeLike

from eqxdiff.diffusion.denoiser import Denoiser
from eqxdiff.diffusion.parameterization import EDMPreconditioning
from eqxdiff.diffusion.schedules import EDMSchedule
from eqxdiff.nn.abstract_network import abstract_network
from eqxdiff.nn.edm2 import EDM2UNet
from eqxdiff.nn.torch_weights import Place, load_safetensors

# Precond's constructor keywords -> EDM2UNet's; the rest of its keywords (UNet's, Block's) are EDM2UNet's own.
RENAMED = {"img_resolution": "image_size", "img_channels": "in_channels", "label_dim": "num_classes"}
NOT_NETWORK = ("class_name", "use_fp16", "sigma_data")  # the arithmetic of EDM2's run; the preconditioning's


def edm2_unet_kwargs(network: dict) -> dict:
    """`EDM2UNet(**kwargs)` from a Precond's recorded constructor keywords (convert_edm2's "network")."""
    kwargs = {RENAMED.get(k, k): v for k, v in network.items() if k not in NOT_NETWORK}
    return {k: tuple(v) if isinstance(v, list) else v for k, v in kwargs.items()}


def eqxdiff_name(key: str, model: EDM2UNet) -> str:
    """An EDM2 state_dict key -> the EDM2UNet leaf path (`unet.enc.4x4_down.conv_res0.weight` -> `enc.2...`)."""
    key = key.removeprefix("unet.")
    if m := re.fullmatch(r"(enc|dec)\.([^.]+)\.(.+)", key):
        names = model.enc_names if m[1] == "enc" else model.dec_names
        return f"{m[1]}.{names.index(m[2])}.{m[3]}" if m[2] in names else key
    return key


def load_edm2(path: str | Path, *, place: Place | None = None, dtype: DTypeLike = np.float32) -> Denoiser:
    """The denoiser D(x; σ, labels) of the EDM2 network in `path` (OUT.safetensors; its config OUT.json beside
    it), every tensor read once by name, as `dtype`. `D.model` is the `EDM2UNet` (its `logvar` head too);
    labels are int32[b], label `num_classes` (or None) meaning no class."""
    path = Path(path)
    config_path = path.with_suffix(".json")
    if not config_path.is_file():
        raise FileNotFoundError(f"load_edm2: no {config_path} beside {path}; tools/convert_edm2.py writes both")
    network = json.loads(config_path.read_text())["network"]
    abstract = abstract_network(EDM2UNet, **edm2_unet_kwargs(network))
    model = load_safetensors(abstract, path, rename=lambda k: eqxdiff_name(k, abstract), place=place, dtype=dtype)
    return Denoiser(model, EDMSchedule(), EDMPreconditioning(network.get("sigma_data", 0.5)))
