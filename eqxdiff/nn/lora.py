"""Low-rank adapters (LoRA, Hu et al. 2021) as an Equinox wrapper around a model's linear (`Dense`) and
convolution (`Conv2d`) layers.

`add_lora(model, rank, key=...)` wraps every `Dense` or `Conv2d` whose state_dict-style path matches `targets`
(default: the attention projections to_q/to_k/to_v/to_out.0, diffusers' training scripts' `target_modules`) in
a `LoRALinear`: y = base(x) + (alpha/r)·x Aᵀ Bᵀ, A [r, in], B [out, r], or a `LoRAConv2d` (PEFT's: A a kxk
convolution to r channels with the base's stride and padding, B a 1x1 one); B zero so the model is unchanged
at init. Field names follow PEFT's (`base_layer`, `lora_A`, `lora_B`), so a wrapped leaf's path is
`...to_q.lora_A` (PEFT's state_dict key less `.weight`). `lora_filter` gives the trainable part (the
adapters only), `lora_frozen` the rest without drawing the adapters, `merge_lora` folds them into the base
weights. Files in diffusers' format:
eqxdiff/sd/lora_files.py.
"""

import re
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, PRNGKeyArray

from eqxdiff.nn.conv import conv2d
from eqxdiff.nn.layers import Conv2d, Dense, torch_uniform

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


class LoRAConv2d(eqx.Module):
    """`Conv2d` plus a low-rank update, NHWC: base(x) + (alpha/r)·B(A(x)), A a kxk convolution `[r, in, kh, kw]`
    (PyTorch's OIHW, the base's stride and padding) to r channels, B a 1x1 one `[out, r]` (PEFT's conv LoRA)."""

    base_layer: Conv2d
    lora_A: Float[Array, "r i kh kw"]
    lora_B: Float[Array, "o r"]
    alpha: float = eqx.field(static=True)

    @property
    def scale(self) -> float:
        """alpha / r, as `LoRALinear`."""
        return self.alpha / self.lora_A.shape[0]

    def __call__(self, x: Float[Array, "b h w i"]) -> Float[Array, "b h2 w2 o"]:
        base = self.base_layer
        low = conv2d(x.astype(self.lora_A.dtype), self.lora_A.transpose(2, 3, 1, 0), base.stride, base.padding)
        return base(x) + (self.scale * (low @ self.lora_B.T)).astype(base.weight.dtype)

    def merged(self) -> Conv2d:
        """The base `Conv2d` with W + (alpha/r)·B∘A as its HWIO kernel (B is 1x1: the product is exact)."""
        delta = self.scale * jnp.einsum("rihw,or->hwio", self.lora_A, self.lora_B)
        weight = self.base_layer.weight
        return eqx.tree_at(lambda c: c.weight, self.base_layer, weight + delta.astype(weight.dtype))


Adapted = LoRALinear | LoRAConv2d


def lora_init(base: Dense | Conv2d, rank: int, alpha: float | int, *, key: PRNGKeyArray) -> Adapted:
    """PEFT's default init (`LoraLayer.reset_lora_parameters`): A kaiming-uniform with a=√5, i.e.
    U(±1/√fan_in) as nn.Linear's and nn.Conv2d's default; B zero."""
    dtype = base.weight.dtype
    if isinstance(base, Conv2d):
        kh, kw, n_in, n_out = base.weight.shape
        a = torch_uniform(key, (rank, n_in, kh, kw), n_in * kh * kw).astype(dtype)
        return LoRAConv2d(base, a, jnp.zeros((n_out, rank), dtype), float(alpha))
    n_in, n_out = base.weight.shape
    a = torch_uniform(key, (rank, n_in), n_in).astype(dtype)
    return LoRALinear(base, a, jnp.zeros((n_out, rank), dtype), float(alpha))


def module_name(path) -> str:
    """The state_dict-style name of a pytree path (`down_blocks.0.attentions.0...attn1.to_q`)."""
    return ".".join(str(getattr(k, "name", getattr(k, "idx", getattr(k, "key", k)))) for k in path)


def _is_layer(x) -> bool:
    return isinstance(x, (Dense, Conv2d, LoRALinear, LoRAConv2d))


def map_layers(model, fn) -> Any:
    """`model` with every `Dense`/`Conv2d` node (adapted or not) replaced by `fn(name, node)`."""
    return jax.tree_util.tree_map_with_path(
        lambda path, x: fn(module_name(path), x) if _is_layer(x) else x, model, is_leaf=_is_layer
    )


def layer_names(model) -> list[str]:
    """Names of every `Dense`/`Conv2d` node (adapted or not) of `model`."""
    found = jax.tree_util.tree_flatten_with_path(model, is_leaf=_is_layer)[0]
    return [module_name(path) for path, x in found if _is_layer(x)]


def add_lora(
    model, rank: int, *, targets: str = DEFAULT_TARGETS, alpha: float | int | None = None, key: PRNGKeyArray
) -> Any:
    """`model` with each `Dense` / `Conv2d` whose name matches the regex `targets` (re.search) wrapped in a
    `LoRALinear` / `LoRAConv2d` of rank `rank` and `alpha` (default: rank, scale 1). Raises naming the layers
    when nothing matches."""
    names = [n for n in layer_names(model) if re.search(targets, n)]
    if not names:
        some = ", ".join(layer_names(model)[:6])
        raise ValueError(f"add_lora: targets {targets!r} match no linear or conv layer of the model (some: {some})")
    if rank < 1:
        raise ValueError(f"add_lora: rank must be >= 1; got {rank}")
    keys = dict(zip(names, jax.random.split(key, len(names)), strict=True))

    def wrap(name: str, node):
        if name not in keys:
            return node
        if isinstance(node, (LoRALinear, LoRAConv2d)):
            raise ValueError(f"add_lora: {name} already has an adapter (merge_lora first to stack another)")
        return lora_init(node, rank, rank if alpha is None else alpha, key=keys[name])

    return map_layers(model, wrap)


def lora_frozen(model, rank: int, *, targets: str = DEFAULT_TARGETS, alpha: float | int | None = None) -> Any:
    """The frozen rest of `add_lora(model, rank, ...)` (`partition_lora`'s second part: `model`'s own arrays in the
    adapted structure, None at the adapters) without drawing any adapter: `add_lora` is traced (eval_shape), not
    run, for a model whose adapters come from elsewhere (a checkpoint) or later. Raises as `add_lora`."""
    adapted = eqx.filter_eval_shape(
        lambda m: add_lora(m, rank, targets=targets, alpha=alpha, key=jax.random.key(0)), model
    )
    wrappers = lora_layers(partition_lora(adapted)[1])  # each adapted layer's wrapper, its base abstract

    def wrap(name: str, node):
        return eqx.tree_at(lambda m: m.base_layer, wrappers[name], node) if name in wrappers else node

    return map_layers(model, wrap)


def lora_filter(model) -> Any:
    """A filter spec of `model`'s structure: True at the adapters' `lora_A`/`lora_B`, False everywhere else,
    for `eqx.partition(model, lora_filter(model))` -> (trainable adapters, frozen base)."""
    spec = jax.tree.map(lambda _: False, model)
    return map_layers(
        spec,
        lambda _, node: (
            eqx.tree_at(lambda m: (m.lora_A, m.lora_B), node, (True, True))
            if isinstance(node, (LoRALinear, LoRAConv2d))
            else node
        ),
    )


def partition_lora(model) -> tuple[Any, Any]:
    """(adapters, frozen rest): `eqx.partition` by `lora_filter`; `eqx.combine` puts them back together."""
    return eqx.partition(model, lora_filter(model))


def merge_lora(model) -> Any:
    """`model` with every adapter folded into its base `Dense` / `Conv2d` (W + (alpha/r)·B A)."""
    return map_layers(model, lambda _, node: node.merged() if isinstance(node, (LoRALinear, LoRAConv2d)) else node)


def lora_layers(model) -> dict[str, Adapted]:
    """`{module name: LoRALinear or LoRAConv2d}` of every adapter in `model`."""
    found = jax.tree_util.tree_flatten_with_path(model, is_leaf=_is_layer)[0]
    return {module_name(path): x for path, x in found if isinstance(x, (LoRALinear, LoRAConv2d))}
