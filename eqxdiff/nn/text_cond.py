"""The text condition a text-conditioned network reads, as one typed pytree: the tower that made it
(frozen, encoded ahead of time, trained with the model) and the null of guidance all hand the network
this, so a network checks what it got by its type, not by dict keys."""

import equinox as eqx
import numpy as np
from jaxtyping import Array, Bool, Float, Int


class TextCond(eqx.Module):
    """`context` float[b, n, d]: a text tower's last hidden states, one row per token; `mask` int32 (or
    bool)[b, n]: 1 = token, 0 = padding; `pooled` float[b, p]: the tower's pooled vector, or None for a
    network built without one (pooled_dim=0). Leaves are device arrays in the step, host (numpy) arrays
    from encoding on the host; guidance and condition dropout map over them like any pytree. Files keep
    the names "context", "mask", "pooled" (`as_dict`, `from_dict`)."""

    context: Float[Array | np.ndarray, "b n d"]
    mask: Int[Array | np.ndarray, "b n"] | Bool[Array | np.ndarray, "b n"]
    pooled: Float[Array | np.ndarray, "b p"] | None = None

    def as_dict(self) -> dict:
        """{"context", "mask"[, "pooled"]}: the names files store."""
        return {"context": self.context, "mask": self.mask} | ({} if self.pooled is None else {"pooled": self.pooled})

    @classmethod
    def from_dict(cls, arrays) -> "TextCond":
        """From a mapping with "context", "mask" and optionally "pooled" (an npz file's arrays)."""
        return cls(arrays["context"], arrays["mask"], arrays["pooled"] if "pooled" in arrays else None)
