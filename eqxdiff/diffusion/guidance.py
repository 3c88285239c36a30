"""Classifier-free guidance (Ho & Salimans 2022) as a denoiser wrapper, and its condition dropout.

A condition is any pytree whose leaves are batch-first arrays: class labels `int32[b]`, a text
condition (`eqxdiff.nn.TextCond`: context `[b, n, d]`, mask `[b, n]`, pooled `[b, d]` or None), or a
researcher's own. Its null
condition has the same structure, each leaf with b rows or one row (broadcast over the batch).
"""

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, PRNGKeyArray


def _batch_size(cond: Any) -> int:
    leaves = jax.tree.leaves(cond)
    if not leaves:
        raise ValueError("A condition needs at least one array leaf with a batch axis.")
    return leaves[0].shape[0]


def _null_like(cond: Any, null_cond: Any) -> Any:
    """`null_cond` with every leaf broadcast to the shape and dtype of `cond`'s."""
    try:
        return jax.tree.map(lambda c, n: jnp.broadcast_to(jnp.asarray(n, c.dtype), c.shape), cond, null_cond)
    except (ValueError, TypeError) as e:
        raise ValueError(
            f"The null condition must have the condition's structure with leaves of 1 or b rows: {e}"
        ) from e


def drop_condition(key: PRNGKeyArray, cond: Any, p: float, null_cond: Any) -> Any:
    """Replace each example's whole condition by `null_cond` with probability p, so one network
    learns the conditional and the unconditional denoiser (Ho & Salimans 2022, Alg. 1).
    One draw per example, shared by every leaf; `cond=None` stays None."""
    if cond is None:
        return None
    return condition_where(jax.random.bernoulli(key, p, (_batch_size(cond),)), null_cond, cond)


def condition_where(mask: Bool[Array, " b"], null_cond: Any, cond: Any) -> Any:
    """`null_cond` for the examples where `mask`, `cond` elsewhere: one choice per example, shared by every leaf."""
    where = lambda c, n: jnp.where(mask.reshape(mask.shape + (1,) * (c.ndim - 1)), n, c)  # noqa: E731
    return jax.tree.map(where, cond, _null_like(cond, null_cond))


class ClassifierFreeGuidance(eqx.Module):
    """D = D_u + w·(D_c - D_u), from ONE network call on the concatenated cond/uncond batch.

    `denoiser(x, sigma, cond)` is a conditional denoiser (e.g. `Denoiser`); `cond` a condition
    pytree for the b samples; `null_cond` the one the model was trained with for "no condition"
    (the model's `null_cond(b)`). With `scale == 1` (a Python number) only the conditional half
    is evaluated. The result is a `denoise(x, sigma)` callable for `sample`. `channels`: guide only
    the first `channels` output channels and take the rest from the conditional half, as DiT's
    `forward_with_cfg` guides 3 of its 4 latent channels and never its learned variance (None: all).
    `interval` (σ_lo, σ_hi): guide only for σ in (σ_lo, σ_hi] and return the conditional model
    elsewhere, from one call on the b conditional rows there (Kynkäänniemi et al. 2024); σ must then
    be one scalar per call, as every sampler here passes it (None: guide at every σ).
    """

    denoiser: Callable
    cond: Any
    scale: float | Float[Array, ""]
    null_cond: Any
    channels: int | None = eqx.field(static=True, default=None)
    interval: tuple[float, float] | None = eqx.field(static=True, default=None)

    def __check_init__(self):
        if self.interval is not None and not 0 <= self.interval[0] < self.interval[1]:
            raise ValueError(f"interval must be (sigma_lo, sigma_hi), 0 <= sigma_lo < sigma_hi; got {self.interval}")

    def __call__(
        self, x: Float[Array, "b *dims"], sigma: Float[Array, ""], *, sigma_end: Float[Array, ""] | None = None
    ) -> Float[Array, "b *out"]:
        end = {} if sigma_end is None else {"sigma_end": sigma_end}  # a network of two times' (`Denoiser`'s)
        if isinstance(self.scale, (int, float)) and self.scale == 1:
            return self.denoiser(x, sigma, self.cond, **end)
        if self.interval is None:
            return self._guided(x, sigma, end)
        if jnp.ndim(sigma) != 0:
            raise ValueError(f"A guidance interval needs one σ per call (a scalar), got shape {jnp.shape(sigma)}.")
        lo, hi = self.interval
        inside = (sigma > lo) & (sigma <= hi)
        # lax.cond runs one branch: outside the interval the network sees only the b conditional rows.
        conditional = lambda x, s: self.denoiser(x, s, self.cond, **end)  # noqa: E731
        return jax.lax.cond(inside, lambda x, s: self._guided(x, s, end), conditional, x, sigma)

    def _guided(self, x: Float[Array, "b *dims"], sigma: Float[Array, ""], end: dict) -> Float[Array, "b *out"]:
        b = x.shape[0]
        both = jax.tree.map(lambda c, n: jnp.concatenate([c, n]), self.cond, _null_like(self.cond, self.null_cond))
        out = self.denoiser(jnp.concatenate([x, x]), sigma, both, **end)
        cond, uncond = out[:b], out[b:]
        guided = uncond + self.scale * (cond - uncond)
        if self.channels is None:
            return guided
        return jnp.concatenate([guided[..., : self.channels], cond[..., self.channels :]], axis=-1)
