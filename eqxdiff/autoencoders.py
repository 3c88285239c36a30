"""Autoencoders for latent diffusion, chosen by a spec string (`train/encode.py --vae`, meta.json).

Specs (`open_autoencoder`):

- `space_to_depth:F`: `eqxdiff.nn.SpaceToDepth(F)`, exact and weightless (scale 1, shift 0);
- `PATH`: a diffusers autoencoder folder (config.json + diffusion_pytorch_model.safetensors, or
  the shards its `.safetensors.index.json` lists), e.g. the `vae/` folder of a Stable Diffusion
  checkpoint, read by the port its config's `_class_name` names in DIFFUSERS_AUTOENCODERS. A folder
  holding one variant alone (`.fp16.safetensors`) is read from it, with a warning naming the file
  (eqxdiff/weights/weight_files.py); several variants and no plain weights are named as the choice.

A new autoencoder is a module with the `Autoencoder` protocol's members and a `from_diffusers(folder,
*, place)`, and one entry in DIFFUSERS_AUTOENCODERS.

A diffusion model sees `(mean + exp(logvar / 2)·ε - shift_factor) · scaling_factor`; samples are
decoded with `decode(z / scaling_factor + shift_factor)`.

Sizes that follow the image (`train/encode.py --batch_size 0 --vae_tiling auto`, `decode_latents`):
`auto_batch_size` gives about PIXELS_PER_BATCH pixels per VAE call, and `use_tiling("auto", ...)` tiles
an AutoencoderKL's images above TILING_ABOVE pixels (diffusers' tiling, `eqxdiff.nn.vae_tiling`).
The peak memory behind both numbers is in BENCHMARKS.md ("VAE memory per image").
"""

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol, runtime_checkable

from jax.sharding import Mesh

from eqxdiff.local_copies import canonical, local_copy
from eqxdiff.nn import AutoencoderKL, SpaceToDepth
from eqxdiff.nn.autoencoder_kl import WEIGHTS_FILE
from eqxdiff.weights.weight_files import weight_files
from eqxdiff.sharding import Rule, placement

PIXELS_PER_BATCH = 512 * 512  # auto batch: one 512² image, four 256² ones, 256 of 32² per VAE call
MAX_AUTO_BATCH = 256  # small images: more rows per call buy little and pad a small dataset's last batch
TILING_ABOVE = 768 * 768  # auto tiling: 1024² and larger images go tile by tile, 512² and smaller whole
TILING_MODES = ("auto", "on", "off")
# A diffusers folder's config.json `_class_name` -> the port that reads it: `from_diffusers(folder, *, place)`,
# `place(abstract module) -> its shardings` (eqxdiff.sharding.placement) or None.
DIFFUSERS_AUTOENCODERS = {"AutoencoderKL": AutoencoderKL}
SPEC_FORMS = (
    f"space_to_depth:F (F an integer >= 1), or a diffusers autoencoder folder (config.json + {WEIGHTS_FILE}) "
    f"of a class in eqxdiff.autoencoders.DIFFUSERS_AUTOENCODERS ({', '.join(DIFFUSERS_AUTOENCODERS)})"
)
_HASH_CHUNK = 1 << 20  # bytes read at a time: a large VAE file is never held whole


@runtime_checkable
class Autoencoder(Protocol):
    """What latent diffusion needs from an autoencoder (AutoencoderKL and SpaceToDepth have it):
    `encode(x[b,h,w,c] in [-1, 1]) -> (mean, logvar)` each `[b, h/f, w/f, latent]`,
    `decode(z[b, h/f, w/f, latent]) -> [b, h, w, c]` for an unscaled latent, f = downsample_factor."""

    scaling_factor: float
    shift_factor: float
    downsample_factor: int

    def encode(self, x): ...

    def decode(self, z): ...


def _space_to_depth_factor(spec: str) -> int | None:
    """F for `space_to_depth:F`; None for any other spec; a malformed F raises."""
    kind, _, arg = spec.partition(":")
    if kind != "space_to_depth":
        return None
    if not arg.isdigit() or int(arg) < 1:
        raise ValueError(f"Bad autoencoder {spec!r}: the accepted forms are {SPEC_FORMS}.")
    return int(arg)


def _folder(spec: str) -> tuple[Path, type]:
    """(the absolute diffusers folder a spec names, the port that reads it); raises if it does not hold an
    autoencoder of DIFFUSERS_AUTOENCODERS. A URL's folder is read from its local copy (eqxdiff.local_copies)."""
    try:
        path = local_copy(spec).resolve()
    except FileNotFoundError as e:  # a URL that names nothing in its bucket
        raise FileNotFoundError(f"Autoencoder {spec!r}: {e}; the accepted forms are {SPEC_FORMS}.") from e
    if not path.exists():  # most often a typo: said plainly, before what a folder should hold
        raise FileNotFoundError(f"Autoencoder {spec!r}: {path} does not exist; the accepted forms are {SPEC_FORMS}.")
    if not (path / "config.json").is_file() and (path / "vae" / "config.json").is_file():
        vae = f"{spec.rstrip('/')}/vae"
        raise FileNotFoundError(f"Autoencoder {spec!r}: {path} is a pipeline's folder; its VAE is {vae}.")
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"Autoencoder {spec!r}: {path} is not a diffusers VAE folder (needs config.json and {WEIGHTS_FILE}); "
            f"the accepted forms are {SPEC_FORMS}."
        )
    try:
        kind = json.loads((path / "config.json").read_text()).get("_class_name", "AutoencoderKL")
    except (json.JSONDecodeError, AttributeError) as e:  # not JSON, or not an object
        raise ValueError(f"Autoencoder {spec!r}: {path / 'config.json'} is not a diffusers config ({e}).") from e
    if kind not in DIFFUSERS_AUTOENCODERS:
        raise ValueError(
            f"Autoencoder {spec!r}: {path} holds a diffusers {kind}, which eqxdiff has no port of; "
            f"the accepted forms are {SPEC_FORMS}."
        )
    try:
        weight_files(path, WEIGHTS_FILE)
    except (FileNotFoundError, ValueError) as e:  # no plain weights (a variant's only), or them twice
        raise type(e)(
            f"Autoencoder {spec!r}: {path} is not a diffusers VAE folder ({e}); the accepted forms are {SPEC_FORMS}."
        ) from e
    return path, DIFFUSERS_AUTOENCODERS[kind]


def check_autoencoder(spec: str) -> None:
    """Raises, as `open_autoencoder` would, for a spec that names no autoencoder, without reading any
    weights: scripts check `--vae` before their data."""
    if _space_to_depth_factor(spec) is None:
        _folder(spec)


def open_autoencoder(
    spec: str, *, mesh: Mesh | None = None, min_size: int = 2**12, rules: Sequence[Rule] = ()
) -> Autoencoder:
    """The autoencoder a spec names; AutoencoderKL weights load into `mesh`'s layout (see
    `AutoencoderKL.from_diffusers`), else onto the first device: each weight read straight into
    `eqxdiff.sharding.state_shardings`'s layout for `(min_size, rules)`, its leaves named
    `autoencoder.<its path>` (`autoencoder.decoder.conv_out.weight`) for the rules."""
    factor = _space_to_depth_factor(spec)
    if factor is not None:
        return SpaceToDepth(factor)
    path, port = _folder(spec)
    place = None if mesh is None else placement(mesh, min_size, rules=rules, name="autoencoder")
    return port.from_diffusers(path, place=place)


def sha256_file(path: Path | list[Path]) -> str:
    """Hex SHA-256 of a file, or of several files' bytes one after another (shards), read in chunks."""
    digest = hashlib.sha256()
    for one in [path] if isinstance(path, Path) else path:
        with open(one, "rb") as f:
            while chunk := f.read(_HASH_CHUNK):
                digest.update(chunk)
    return digest.hexdigest()


def describe_autoencoder(spec: str) -> dict:
    """`{"spec", "path", "weights_sha256"}` (json-able, for meta.json): the absolute folder and
    the hash of its weights file (of its shards' bytes in order), both None for a weightless autoencoder."""
    if _space_to_depth_factor(spec) is not None:
        return {"spec": spec, "path": None, "weights_sha256": None}
    path, _ = _folder(spec)
    return {"spec": spec, "path": canonical(spec), "weights_sha256": sha256_file(weight_files(path, WEIGHTS_FILE))}


def auto_batch_size(image_hw: tuple[int, int], multiple: int = 1, count: int | None = None) -> int:
    """Images per VAE call for an image of `image_hw` (height, width) pixels: PIXELS_PER_BATCH / (h·w),
    at least 1 and at most MAX_AUTO_BATCH and `count` (the images there are), rounded up to a
    multiple of `multiple` (the devices)."""
    rows = max(1, min(MAX_AUTO_BATCH, count or MAX_AUTO_BATCH, PIXELS_PER_BATCH // (image_hw[0] * image_hw[1])))
    return -(-rows // multiple) * multiple


def use_tiling(mode: str, autoencoder: Autoencoder, image_hw: tuple[int, int]) -> bool:
    """Whether to encode/decode `image_hw` images tile by tile: `mode` "on" (diffusers' `enable_tiling`:
    images larger than the VAE's sample_size), "off", or "auto" (images of more than TILING_ABOVE
    pixels). Only an AutoencoderKL tiles; a weightless autoencoder never needs to."""
    if mode not in TILING_MODES:
        raise ValueError(f"vae tiling {mode!r}: one of {TILING_MODES}")
    if not isinstance(autoencoder, AutoencoderKL) or mode == "off":
        return False
    return mode == "on" or image_hw[0] * image_hw[1] > TILING_ABOVE
