"""The contract every eqxdiff model keeps, written once.

A model is called `model(x, t, cond, *, key=None)`:

- `x`: `float[b, h, w, c]`, the network input (the denoiser has already scaled it by c_in);
- `t`: `float[b]`, the schedule's time for each example (`Schedule.sigma_to_t`);
- `cond`: any pytree of arrays with batch-first leaves, or None — class labels `int32[b]`, a
  text condition (context `[b, n, d]`, mask `[b, n]`, pooled `[b, d]`), or a researcher's own;
- `key`: a PRNG key for dropout, None at inference;

and returns `float[b, h, w, c]`. A conditional model also says what "no condition" is, for
condition dropout and classifier-free guidance: `model.null_cond(b)`, the same structure as
`cond` with b (or 1) rows. An unconditional model needs no `null_cond`.

A network of two times (MeanFlow's, `interval_embedding=True` in UNet and DiT) also takes the keyword
`interval`: `float[b]`, t − r in the units of t; without it, it is the network at r = t.

Nothing else is required: an `eqx.Module` (or any callable) with this signature trains,
samples and checkpoints. A model written the Equinox way, for one example, is wrapped in
`eqxdiff.nn.Batched`.
"""

from typing import Any, Protocol, runtime_checkable

from jaxtyping import Array, Float, PRNGKeyArray


@runtime_checkable
class DiffusionModel(Protocol):
    """`model(x[b,h,w,c], t[b], cond, *, key=None) -> [b,h,w,c]`; see the module docstring."""

    def __call__(
        self, x: Float[Array, "b h w c"], t: Float[Array, " b"], cond: Any, *, key: PRNGKeyArray | None = None
    ) -> Float[Array, "b h w c"]: ...


@runtime_checkable
class ConditionalModel(DiffusionModel, Protocol):
    """A `DiffusionModel` that knows its null condition."""

    def null_cond(self, batch_size: int) -> Any:
        """The condition meaning "none" for `batch_size` examples (leaves with b or 1 rows)."""
        ...


def null_cond_of(model: Any, batch_size: int) -> Any:
    """`model.null_cond(batch_size)`, or None for a model without one (an unconditional model)."""
    null_cond = getattr(model, "null_cond", None)
    return None if null_cond is None else null_cond(batch_size)
