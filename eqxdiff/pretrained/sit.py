"""willisma/SiT's published checkpoints as eqxdiff `DiT`s.

SiT's `models.py` is DiT's network line for line under DiT's state_dict names (`SiTBlock` is
`DiTBlock`; the same heads table, S 6, B 12, L 16, XL 16), so it loads through `load_dit`'s
machinery (`eqxdiff.pretrained.dit.load_official`). Two differences are in how it is called, not in
the weights: `t` is the interpolant's time in [0, 1], fed to the same sinusoidal embedding
unscaled (DiT feeds the step index 0..999), and with learn_sigma (SiT-XL-2-256x256.pt; the 512²
models have none) the official `forward` drops the second c channels, which SiT's loss never
reaches (they stay at their zero init in a trained checkpoint).
"""

from pathlib import Path

import numpy as np
from jax.typing import DTypeLike

from eqxdiff.nn.dit import DiT
from eqxdiff.nn.torch_weights import Place
from eqxdiff.pretrained.dit import Family, load_official

SIT = Family("SiT", "willisma/SiT")


def load_sit(
    path: str | Path, num_heads: int | None = None, *, place: Place | None = None, dtype: DTypeLike = np.float32
) -> DiT:
    """An official SiT checkpoint (`SiT-XL-2-256x256.pt`, a train.py `*.pt` — its "ema", as SiT's
    `find_model` — or either as `.safetensors`) as `DiT`: `model(x[b,h,w,c], t[b], labels[b])`
    with t in [0, 1] (SiT's time: noise at 0, data at 1 on its linear path x_t = t·x1 + (1 - t)·x0)
    and label `num_classes` the null class. Its `[..., :c]` is the official `forward(x, t, y)` (the velocity,
    NHWC); with learn_sigma the output has 2c channels, the last c the unused variance head. Heads,
    `place` and `dtype` as in `load_dit`."""
    return load_official(path, SIT, num_heads, place=place, dtype=dtype)
