"""Classifier-free guidance (Ho & Salimans 2022) as a denoiser wrapper, and its label dropout."""

from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, PRNGKeyArray


class ClassifierFreeGuidance(eqx.Module):
    """D = D_u + w·(D_c - D_u), from ONE network call on the concatenated cond/uncond batch.

    `denoiser(x, sigma, labels)` is a conditional denoiser (e.g. `Denoiser`); `null_label` is
    the class index the model was trained with for "no label" (the model's `null_label`).
    With `scale == 1` (a Python number) only the conditional half is evaluated.
    The result is a `denoise(x, sigma)` callable for `sample`.
    """

    denoiser: Callable
    labels: Int[Array, " b"]
    scale: float | Float[Array, ""]
    null_label: int = eqx.field(static=True)

    def __call__(self, x: Float[Array, "b *dims"], sigma: Float[Array, ""]) -> Float[Array, "b *dims"]:
        if isinstance(self.scale, (int, float)) and self.scale == 1:
            return self.denoiser(x, sigma, self.labels)
        b = x.shape[0]
        labels = jnp.concatenate([self.labels, jnp.full_like(self.labels, self.null_label)])
        both = self.denoiser(jnp.concatenate([x, x]), sigma, labels)
        cond, uncond = both[:b], both[b:]
        return uncond + self.scale * (cond - uncond)


def drop_labels(
    key: PRNGKeyArray, labels: Int[Array, " b"], p: float, null_label: int
) -> Int[Array, " b"]:
    """Replace each label by `null_label` with probability p, so one network learns both the
    conditional and the unconditional denoiser (Ho & Salimans 2022, Alg. 1)."""
    drop = jax.random.bernoulli(key, p, labels.shape)
    return jnp.where(drop, null_label, labels)
