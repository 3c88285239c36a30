"""Low-rank adapters (LoRA, Hu et al. 2021) as an Equinox wrapper around a model's linear (`Dense`) leaves.

`add_lora(model, rank, key=...)` wraps every `Dense` whose state_dict-style path matches `targets` (default:
the attention projections to_q/to_k/to_v/to_out.0, diffusers' training scripts' `target_modules`) in a
`LoRALinear`: y = base(x) + (alpha/r)·x Aᵀ Bᵀ, A [r, in], B [out, r], B zero so the model is unchanged at
init. Field names follow PEFT's (`base_layer`, `lora_A`, `lora_B`), so a wrapped leaf's path is
`...to_q.lora_A` (PEFT's state_dict key less `.weight`). `lora_filter` gives the trainable part (the
adapters only), `merge_lora` folds them into the base weights. Files in diffusers' format:
eqxdiff/nn/lora_files.py.
"""

import re
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, PRNGKeyArray

from eqxdiff.nn.layers import Dense, torch_uniform

# PEFT matches target_modules=["to_k", "to_q", "to_v", "to_out.0"] against a module name's last components.
DEFAULT_TARGETS = r"(^|\.)(to_q|to_k|to_v|to_out\.0)$"


class LoRALinear(eqx.Module):
    """`Dense` plus a low-rank update, `[..., in] -> [..., out]`: base(x) + (alpha/r)·(x Aᵀ) Bᵀ.

    A `[r, in]` and B `[out, r]` are in PyTorch's (PEFT's) layout; the base's weight is eqxdiff's `[in, out]`.
    """

    base_layer: Dense
    lora_A: Float[Array, "r i"]
    lora_B: Float[Array, "o r"]
    alpha: float = eqx.field(static=True)

    @property
    def scale(self) -> float:
        """alpha / r (PEFT's `scaling`; rsLoRA's alpha / sqrt(r) is not supported)."""
        return self.alpha / self.lora_A.shape[0]

    def __call__(self, x: Float[Array, "*batch i"]) -> Float[Array, "*batch o"]:
        low = x.astype(self.lora_A.dtype) @ self.lora_A.T  # the rank-r bottleneck first: r·(in + out) per token
        return self.base_layer(x) + (self.scale * (low @ self.lora_B.T)).astype(self.base_layer.weight.dtype)

    def merged(self) -> Dense:
        """The base `Dense` with W + (alpha/r)·(B A)ᵀ as its `[in, out]` weight."""
        delta = self.scale * (self.lora_A.T @ self.lora_B.T)
        weight = self.base_layer.weight
        return eqx.tree_at(lambda d: d.weight, self.base_layer, (weight + delta.astype(weight.dtype)))


def lora_init(base: Dense, rank: int, alpha: float | int, *, key: PRNGKeyArray) -> LoRALinear:
    """PEFT's default init (`LoraLayer.reset_lora_parameters`): A kaiming-uniform with a=√5, i.e.
    U(±1/√in) as nn.Linear's default; B zero."""
    n_in, n_out = base.weight.shape
    a = torch_uniform(key, (rank, n_in), n_in).astype(base.weight.dtype)
    return LoRALinear(base, a, jnp.zeros((n_out, rank), base.weight.dtype), float(alpha))


def module_name(path) -> str:
    """The state_dict-style name of a pytree path (`down_blocks.0.attentions.0...attn1.to_q`)."""
    return ".".join(str(getattr(k, "name", getattr(k, "idx", getattr(k, "key", k)))) for k in path)


def _is_linear(x) -> bool:
    return isinstance(x, (Dense, LoRALinear))


def map_linears(model, fn) -> Any:
    """`model` with every `Dense`/`LoRALinear` node replaced by `fn(name, node)`."""
    return jax.tree_util.tree_map_with_path(
        lambda path, x: fn(module_name(path), x) if _is_linear(x) else x, model, is_leaf=_is_linear
    )


def linear_names(model) -> list[str]:
    """Names of every `Dense`/`LoRALinear` node of `model`."""
    found = jax.tree_util.tree_flatten_with_path(model, is_leaf=_is_linear)[0]
    return [module_name(path) for path, x in found if _is_linear(x)]


def add_lora(
    model, rank: int, *, targets: str = DEFAULT_TARGETS, alpha: float | int | None = None, key: PRNGKeyArray
) -> Any:
    """`model` with each `Dense` whose name matches the regex `targets` (re.search) wrapped in a `LoRALinear`
    of rank `rank` and `alpha` (default: rank, scale 1). Raises naming the linears when nothing matches."""
    names = [n for n in linear_names(model) if re.search(targets, n)]
    if not names:
        some = ", ".join(linear_names(model)[:6])
        raise ValueError(f"add_lora: targets {targets!r} match no linear layer of the model (some names: {some})")
    if rank < 1:
        raise ValueError(f"add_lora: rank must be >= 1; got {rank}")
    keys = dict(zip(names, jax.random.split(key, len(names)), strict=True))

    def wrap(name: str, node):
        if name not in keys:
            return node
        if isinstance(node, LoRALinear):
            raise ValueError(f"add_lora: {name} already has an adapter (merge_lora first to stack another)")
        return lora_init(node, rank, rank if alpha is None else alpha, key=keys[name])

    return map_linears(model, wrap)


def lora_filter(model) -> Any:
    """A filter spec of `model`'s structure: True at the adapters' `lora_A`/`lora_B`, False everywhere else,
    for `eqx.partition(model, lora_filter(model))` -> (trainable adapters, frozen base)."""
    spec = jax.tree.map(lambda _: False, model)
    return map_linears(
        spec,
        lambda _, node: eqx.tree_at(lambda m: (m.lora_A, m.lora_B), node, (True, True))
        if isinstance(node, LoRALinear)
        else node,
    )


def partition_lora(model) -> tuple[Any, Any]:
    """(adapters, frozen rest): `eqx.partition` by `lora_filter`; `eqx.combine` puts them back together."""
    return eqx.partition(model, lora_filter(model))


def merge_lora(model) -> Any:
    """`model` with every `LoRALinear` folded into a plain `Dense` (W + (alpha/r)·(B A)ᵀ)."""
    return map_linears(model, lambda _, node: node.merged() if isinstance(node, LoRALinear) else node)


def lora_layers(model) -> dict[str, LoRALinear]:
    """`{module name: LoRALinear}` of every adapter in `model`."""
    found = jax.tree_util.tree_flatten_with_path(model, is_leaf=_is_linear)[0]
    return {module_name(path): x for path, x in found if isinstance(x, LoRALinear)}


def rank_of(layer: LoRALinear) -> int:
    return layer.lora_A.shape[0]

