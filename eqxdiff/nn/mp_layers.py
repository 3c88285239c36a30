"""EDM2's magnitude-preserving layers (Karras et al. 2024, "Analyzing and Improving the Training Dynamics of
Diffusion Models", App. B; NVlabs/edm2 training/networks_edm2.py), channels-last.

Each keeps unit-variance inputs at unit variance: `mp_silu` (eq. 81), `mp_sum` (eq. 88), `mp_cat` (eq. 103),
`MPFourier` (eq. 75) and `MPConv`, a convolution or linear layer without bias whose weight is normalised to
unit norm per output channel in every forward pass (eq. 47) and, during training, also in storage after
every optimizer step (forced weight normalisation, eq. 66: `force_weight_normalization`).
"""

import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, PRNGKeyArray


def normalize(x: Array, axis: int | tuple[int, ...] | None = None, eps: float = 1e-4) -> Array:
    """x / (eps + ‖x‖/sqrt(n)) over `axis` (default: all but the first), n the elements per norm: unit RMS.
    The norm is taken in float32 whatever x's dtype (networks_edm2.py's `normalize`)."""
    axis = tuple(range(1, x.ndim)) if axis is None else axis
    axis = (axis,) if isinstance(axis, int) else axis
    norm = jnp.sqrt(jnp.sum(jnp.square(x.astype(jnp.float32)), axis=axis, keepdims=True))
    n = math.prod(x.shape[a] for a in axis)
    return x / (eps + norm / math.sqrt(n)).astype(x.dtype)


def mp_silu(x: Array) -> Array:
    """SiLU scaled back to unit variance for unit-normal input (eq. 81)."""
    return jax.nn.silu(x) / 0.596


def mp_sum(a: Array, b: Array, t: float = 0.5) -> Array:
    """(1 - t)·a + t·b, rescaled to unit variance for independent unit-variance a, b (eq. 88)."""
    return (a + t * (b - a)) / math.sqrt((1 - t) ** 2 + t**2)


def mp_cat(a: Array, b: Array, t: float = 0.5) -> Array:
    """[a, b] along channels, weighted (1 - t) : t and scaled to keep unit variance (eq. 103)."""
    na, nb = a.shape[-1], b.shape[-1]
    c = math.sqrt((na + nb) / ((1 - t) ** 2 + t**2))
    return jnp.concatenate([c / math.sqrt(na) * (1 - t) * a, c / math.sqrt(nb) * t * b], axis=-1)


class MPFourier(eqx.Module):
    """cos(2π(f·x) + φ)·sqrt(2) with fixed random frequencies f ~ N(0, bandwidth²) and phases φ ~ U[0, 1)
    (eq. 75): float[b] -> float[b, n]. `freqs` and `phases` are constants (EDM2's buffers): no gradient
    reaches them, so Adam without weight decay (EDM2's, --lr_ref_steps) never moves them; AdamW's decoupled
    decay would shrink them by lr·wd a step."""

    freqs: Float[Array, " n"]  # 2π·f
    phases: Float[Array, " n"]  # 2π·φ

    def __init__(self, num_channels: int, bandwidth: float = 1.0, *, key: PRNGKeyArray):
        key_f, key_p = jax.random.split(key)
        self.freqs = 2 * np.pi * jax.random.normal(key_f, (num_channels,)) * bandwidth
        self.phases = 2 * np.pi * jax.random.uniform(key_p, (num_channels,))

    def __call__(self, x: Float[Array, " b"]) -> Float[Array, "b n"]:
        freqs, phases = jax.lax.stop_gradient((self.freqs, self.phases))
        y = x.astype(jnp.float32)[:, None] * freqs.astype(jnp.float32) + phases.astype(jnp.float32)
        return (jnp.cos(y) * math.sqrt(2)).astype(x.dtype)


class MPConv(eqx.Module):
    """A magnitude-preserving convolution (weight [out, in, k, k], "same" padding, NHWC input) or linear layer
    (weight [out, in]): the weight normalised per output channel, times gain/sqrt(fan-in) (eq. 47), no bias.
    The weight keeps PyTorch's layout, so EDM2's state_dict loads as it is."""

    weight: Float[Array, "out in *kernel"]

    def __init__(self, in_channels: int, out_channels: int, kernel: tuple[int, ...], *, key: PRNGKeyArray):
        # Stored normalised from the start: EDM2 normalises it in storage at its first training forward.
        self.weight = normalize(jax.random.normal(key, (out_channels, in_channels, *kernel)))

    def __call__(self, x: Array, gain: float | Array = 1.0) -> Array:
        w = normalize(self.weight.astype(jnp.float32))  # traditional weight normalisation
        w = (w * (gain / math.sqrt(math.prod(w.shape[1:])))).astype(x.dtype)  # magnitude-preserving scale
        if w.ndim == 2:
            return x @ w.T
        pad = w.shape[-1] // 2
        return jax.lax.conv_general_dilated(
            x, w, (1, 1), [(pad, pad), (pad, pad)], dimension_numbers=("NHWC", "OIHW", "NHWC")
        )


def force_weight_normalization(tree):
    """`tree` (a model, or any pytree holding them) with every `MPConv` weight replaced by `normalize(weight)`:
    EDM2's forced weight normalisation (eq. 66), applied after each optimizer step (make_train_step's
    `after_update`), so the stored weights stay on the unit sphere and Adam's steps shrink relative to them
    as training proceeds. Leaves everything else as it is (a network without MPConv: unchanged)."""
    is_mp = lambda x: isinstance(x, MPConv)  # noqa: E731
    return jax.tree.map(lambda m: eqx.tree_at(lambda c: c.weight, m, normalize(m.weight)) if is_mp(m) else m,
                        tree, is_leaf=is_mp)  # fmt: skip
