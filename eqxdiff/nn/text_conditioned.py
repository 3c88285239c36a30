"""A diffusion network conditioned on token ids through a text tower that trains with it.

For a pretrained, frozen tower (CLIP from disk) the training step encodes the captions and the
network takes the encoded condition directly; this wrapper is for a tower learned from scratch
(e.g. `--dataset captioned_digits`), whose weights are then part of the model: its gradient,
optimizer state, EMA and checkpoint.
"""

from typing import Any

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, PRNGKeyArray

from eqxdiff.nn.clip_text import CLIPTextModel
from eqxdiff.nn.text_cond import TextCond


class TextConditioned(eqx.Module):
    """`model(x[b,h,w,c], t[b], {"input_ids": int32[b,n], "attention_mask": int32[b,n]})`: the text
    tower's (hidden states, pooled) become `net`'s condition `TextCond(hidden, attention_mask, pooled)`;
    with `pooled=False` its pooled is None (a net built with pooled_dim=0).

    `null_ids`/`null_mask` are the tokens of the empty caption "", the null condition of
    classifier-free guidance (`null_cond`): dropping a caption in training and the unconditional
    half of guided sampling both run the tower on "", so they cannot disagree.
    """

    text_encoder: CLIPTextModel
    net: Any
    null_ids: tuple[int, ...] = eqx.field(static=True)
    null_mask: tuple[int, ...] = eqx.field(static=True)
    pooled: bool = eqx.field(static=True)

    def __init__(self, text_encoder: CLIPTextModel, net: Any, null_ids, null_mask, *, pooled: bool = True):
        if len(null_ids) != len(null_mask):
            raise ValueError(f"null_ids has {len(null_ids)} tokens but null_mask {len(null_mask)}")
        self.text_encoder, self.net, self.pooled = text_encoder, net, pooled
        self.null_ids, self.null_mask = tuple(int(i) for i in null_ids), tuple(int(m) for m in null_mask)

    def null_cond(self, batch_size: int) -> dict:
        """The tokens of "" as one row (broadcast over the batch by guidance and dropout)."""
        del batch_size  # one row serves any batch
        return {
            "input_ids": jnp.asarray(self.null_ids, jnp.int32)[None],
            "attention_mask": jnp.asarray(self.null_mask, jnp.int32)[None],
        }

    def __call__(
        self,
        x: Float[Array, "b h w c"],
        t: Float[Array, " b"],
        cond: dict[str, Int[Array, "b n"]],
        *,
        key: PRNGKeyArray | None = None,
    ) -> Float[Array, "b h w c"]:
        if not isinstance(cond, dict) or set(cond) != {"input_ids", "attention_mask"}:
            got = sorted(cond) if isinstance(cond, dict) else type(cond).__name__
            raise ValueError(f"TextConditioned takes cond = {{'input_ids', 'attention_mask'}} (int32[b, n]); got {got}")
        hidden, pooled = self.text_encoder(cond["input_ids"], cond["attention_mask"])
        text = TextCond(hidden, cond["attention_mask"], pooled if self.pooled else None)
        return self.net(x, t, text, key=key)
