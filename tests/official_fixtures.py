"""The fixtures tools/make_dit_fixtures.py and tools/make_sit_fixtures.py write from the official code:
a folder's config, its reference inputs and outputs, and how far a loaded model is from them."""

import json
from pathlib import Path

import equinox as eqx
import jax.numpy as jnp
import numpy as np
from safetensors import safe_open

call = eqx.filter_jit(lambda m, x, t, y: m(x, t, y))


def reference(folder: Path) -> tuple[dict, dict[str, np.ndarray]]:
    """(config.json, reference.npz's arrays: x, t, y and the official out) of a fixture folder."""
    with np.load(folder / "reference.npz") as ref:
        return json.loads((folder / "config.json").read_text()), dict(ref)


def relative_errors(model, ref: dict[str, np.ndarray], channels: int | None = None) -> np.ndarray:
    """Per example: max |ours[..., :channels] - official| / max |official| (`channels` None: all of them)."""
    out = np.asarray(call(model, jnp.asarray(ref["x"]), jnp.asarray(ref["t"]), jnp.asarray(ref["y"])))
    return np.abs(out[..., :channels] - ref["out"]).max(axis=(1, 2, 3)) / np.abs(ref["out"]).max()


def safetensors_state(path: Path) -> dict[str, np.ndarray]:
    with safe_open(str(path), framework="numpy") as f:
        return {k: f.get_tensor(k) for k in f.keys()}
