"""Autoencoders for latent diffusion, chosen by a spec string (`train/encode.py --vae`, meta.json).

Specs (`open_autoencoder`):

- `space_to_depth:F`: `eqxdiff.nn.SpaceToDepth(F)`, exact and weightless (scale 1, shift 0);
- `PATH`: a diffusers AutoencoderKL folder (config.json + diffusion_pytorch_model.safetensors, or
  the shards its `.safetensors.index.json` lists), e.g. the `vae/` folder of a Stable Diffusion
  checkpoint. A folder holding only a variant (`.fp16.safetensors`) is named as such: load it with
  `AutoencoderKL.from_diffusers(folder, variant="fp16")`, or save it plainly.

A diffusion model sees `(mean + exp(logvar / 2)·ε - shift_factor) · scaling_factor`; samples are
decoded with `decode(z / scaling_factor + shift_factor)`.
"""

import hashlib
from pathlib import Path
from typing import Protocol, runtime_checkable

from jax.sharding import Mesh

from eqxdiff.nn import AutoencoderKL, SpaceToDepth
from eqxdiff.nn.autoencoder_kl import WEIGHTS_FILE
from eqxdiff.nn.weight_files import weight_files

SPEC_FORMS = f"space_to_depth:F (F an integer >= 1), or a diffusers AutoencoderKL folder (config.json + {WEIGHTS_FILE})"
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


def _folder(spec: str) -> Path:
    """The absolute diffusers folder a spec names; raises if it does not hold a VAE."""
    path = Path(spec).expanduser().resolve()
    if not path.exists():  # most often a typo: said plainly, before what a folder should hold
        raise FileNotFoundError(f"Autoencoder {spec!r}: {path} does not exist; the accepted forms are {SPEC_FORMS}.")
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"Autoencoder {spec!r}: {path} is not a diffusers VAE folder (needs config.json and {WEIGHTS_FILE}); "
            f"the accepted forms are {SPEC_FORMS}."
        )
    try:
        weight_files(path, WEIGHTS_FILE)
    except (FileNotFoundError, ValueError) as e:  # no plain weights (a variant's only), or them twice
        raise type(e)(f"Autoencoder {spec!r}: {path} is not a diffusers VAE folder ({e}); "
                      f"the accepted forms are {SPEC_FORMS}.") from e  # fmt: skip
    return path


def check_autoencoder(spec: str) -> None:
    """Raises, as `open_autoencoder` would, for a spec that names no autoencoder, without reading any
    weights: scripts check `--vae` before their data."""
    if _space_to_depth_factor(spec) is None:
        _folder(spec)


def open_autoencoder(spec: str, *, mesh: Mesh | None = None) -> Autoencoder:
    """The autoencoder a spec names; AutoencoderKL weights load into `mesh`'s layout (see
    `AutoencoderKL.from_diffusers`), else onto the first device."""
    factor = _space_to_depth_factor(spec)
    if factor is not None:
        return SpaceToDepth(factor)
    return AutoencoderKL.from_diffusers(_folder(spec), mesh=mesh)


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
    path = _folder(spec)
    return {"spec": spec, "path": str(path), "weights_sha256": sha256_file(weight_files(path, WEIGHTS_FILE))}
