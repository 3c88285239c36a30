"""facebookresearch/DiT's published checkpoints as eqxdiff `DiT`s.

DiT's `models.py` computes exactly eqxdiff's `DiT(..., learn_sigma=True)`: the same patchify conv,
MAE sin-cos positions, ADM timestep embedding ([cos, sin], 256 frequencies), a label table with the
null row `num_classes`, adaLN-Zero blocks (shift, scale, gate for attention then MLP; LayerNorm
without affine, eps 1e-6; timm's qkv-biased attention; GELU(tanh) MLP), the final adaLN layer and
unpatchify. Only the parameter names differ (`OFFICIAL_NAMES`). Its `pos_embed` is a frozen
buffer, not a weight: it is checked equal to the embedding eqxdiff computes, not loaded.
"""

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from jax.typing import DTypeLike
from safetensors import safe_open

from eqxdiff.nn.abstract_network import abstract_network
from eqxdiff.nn.dit import DiT
from eqxdiff.nn.layers import sincos_pos_embed_2d
from eqxdiff.weights.tensor_readers import Tensors
from eqxdiff.weights.torch_pickle import TorchFileError, read_torch_file
from eqxdiff.nn.torch_weights import TORCH_SUFFIXES, Place, load_safetensors

# The official configurations (models.py's DiT_models): (depth, hidden size) -> (size name, heads).
OFFICIAL_SIZES = {(12, 384): ("S", 6), (12, 768): ("B", 12), (24, 1024): ("L", 16), (28, 1152): ("XL", 16)}


@dataclass(frozen=True)
class Family:
    """A published codebase whose `models.py` is DiT's network under DiT's state_dict names: what
    differs is only what its errors call it (the heads table and the names are the same)."""

    name: str  # "DiT", "SiT"
    repo: str  # where its models.py is


DIT = Family("DiT", "facebookresearch/DiT")
# Official state_dict name patterns -> eqxdiff DiT leaf names.
OFFICIAL_NAMES = [
    (r"x_embedder\.proj\.(weight|bias)", r"patch_embed.\1"),
    (r"t_embedder\.mlp\.0\.(weight|bias)", r"time_embed.fc1.\1"),
    (r"t_embedder\.mlp\.2\.(weight|bias)", r"time_embed.fc2.\1"),
    (r"y_embedder\.embedding_table\.weight", r"label_embed.weight"),
    (r"blocks\.(\d+)\.mlp\.(fc1|fc2)\.(weight|bias)", r"blocks.\1.\2.\3"),
    (r"blocks\.(\d+)\.adaLN_modulation\.1\.(weight|bias)", r"blocks.\1.ada.\2"),
    (r"final_layer\.adaLN_modulation\.1\.(weight|bias)", r"final_ada.\1"),
    (r"final_layer\.linear\.(weight|bias)", r"final_linear.\1"),
]
# train.py pickles its argparse.Namespace of flags as "args": read as an inert placeholder.
SKIPPED_GLOBALS = ("argparse.Namespace",)


def eqxdiff_name(key: str) -> str | None:
    """The eqxdiff leaf a DiT state_dict key loads into; None for the checked `pos_embed`; other keys
    unchanged (attention keys are the same; unknown ones are then named as unexpected)."""
    if key == "pos_embed":
        return None
    for pattern, name in OFFICIAL_NAMES:
        if re.fullmatch(pattern, key):
            return re.sub(pattern, name, key)
    return key


def dit_config(
    shapes: Mapping[str, Sequence[int]], num_heads: int | None = None, where: str = "", family: Family = DIT
) -> dict:
    """`DiT(**config)`'s arguments from an official state_dict's `{key: shape}`: depth, hidden
    size, patch, input size (the `pos_embed` grid × patch), channels, classes (label rows - 1),
    learn_sigma (out channels = 2 × in), MLP ratio; heads from `OFFICIAL_SIZES` or `num_heads`."""
    needed = [
        "x_embedder.proj.weight",
        "pos_embed",
        "y_embedder.embedding_table.weight",
        "final_layer.linear.weight",
        "blocks.0.mlp.fc1.weight",
    ]
    missing = [k for k in needed if k not in shapes]
    if missing:
        raise ValueError(
            f"{where}: not a {family.name} state_dict ({family.repo}'s): no {missing}; its keys begin "
            f"{list(shapes)[:5]}"
        )
    hidden, in_channels, p, pw = _shape(shapes, "x_embedder.proj.weight", 4, where)
    _, tokens, pos_hidden = _shape(shapes, "pos_embed", 3, where)
    grid = math.isqrt(tokens)
    if p != pw or grid * grid != tokens or pos_hidden != hidden:
        raise ValueError(
            f"{where}: patch kernel {p}×{pw} and pos_embed of {tokens} tokens × {pos_hidden} are not a "
            f"square DiT of width {hidden}"
        )
    blocks = sorted({int(m[1]) for k in shapes if (m := re.match(r"blocks\.(\d+)\.", k))})
    depth = len(blocks)
    if blocks != list(range(depth)):
        raise ValueError(f"{where}: blocks {blocks} are not numbered 0..{depth - 1}")
    num_classes = _shape(shapes, "y_embedder.embedding_table.weight", 2, where)[0] - 1
    out = _shape(shapes, "final_layer.linear.weight", 2, where)[0]
    if out not in (p * p * in_channels, 2 * p * p * in_channels) or num_classes < 1:
        raise ValueError(
            f"{where}: final_layer.linear gives {out} values per {p}×{p} patch of {in_channels} channels "
            f"(DiT gives {p * p * in_channels}, or twice that with learn_sigma), {num_classes + 1} label "
            "rows (classes + the null one)"
        )
    if num_heads is None:
        if (depth, hidden) not in OFFICIAL_SIZES:
            sizes = OFFICIAL_SIZES.items()
            table = ", ".join(f"{family.name}-{n} (depth {d}, width {w}): {h}" for (d, w), (n, h) in sizes)
            raise ValueError(
                f"{where}: depth {depth}, width {hidden} is none of the official {family.name}s, whose "
                f"heads are known ({table}); pass num_heads="
            )
        num_heads = OFFICIAL_SIZES[depth, hidden][1]
    if num_heads < 1 or hidden % num_heads:
        raise ValueError(f"{where}: num_heads={num_heads} does not divide the width {hidden}")
    mlp_ratio = _shape(shapes, "blocks.0.mlp.fc1.weight", 2, where)[0] / hidden
    return dict(
        image_size=grid * p,
        patch_size=p,
        in_channels=in_channels,
        hidden_size=hidden,
        depth=depth,
        num_heads=num_heads,
        mlp_ratio=mlp_ratio,
        num_classes=num_classes,
        learn_sigma=out == 2 * p * p * in_channels,
    )


def _shape(shapes: Mapping[str, Sequence[int]], key: str, ndim: int, where: str) -> tuple[int, ...]:
    shape = tuple(shapes[key])
    if len(shape) != ndim:
        raise ValueError(f"{where}: {key} has shape {shape}, DiT's has {ndim} dimensions")
    return shape


def official_state(path: str | Path, family: Family = DIT) -> Tensors | Path:
    """What to read a DiT from: a safetensors file as it is; a torch file's state_dict (its "ema"
    for a train.py checkpoint `{"model", "ema", "opt", "args"}`, as DiT's and SiT's `find_model`) as Tensors."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist")
    if path.suffix not in TORCH_SUFFIXES:
        return path
    obj = read_torch_file(path, skip=SKIPPED_GLOBALS)
    where = str(path)
    if isinstance(obj, dict) and "ema" in obj:
        obj, where = obj["ema"], f"{path}['ema']"
    if not isinstance(obj, dict) or not all(isinstance(v, np.ndarray) for v in obj.values()):
        kind = f"a dict with keys {list(obj)[:6]}" if isinstance(obj, dict) else f"a {type(obj).__name__}"
        raise TorchFileError(
            f'{where} holds {kind}, not {family.name}\'s state_dict or a train.py checkpoint with "ema"'
        )
    return Tensors(obj, where)


def load_dit(
    path: str | Path, num_heads: int | None = None, *, place: Place | None = None, dtype: DTypeLike = np.float32
) -> DiT:
    """An official DiT checkpoint (`DiT-XL-2-256x256.pt`, a train.py `*.pt` — its "ema" — or either
    as `.safetensors`, a flattened train.py checkpoint by its `ema.*` keys) as `DiT`:
    `model(x[b,h,w,c], t[b], labels[b]) -> [b,h,w,2c]` with learn_sigma (ε, then the variance
    interpolation: `DiT`'s docstring), equal to the official `forward(x, t, y)` in NHWC. `t` is
    DiT's timestep index (0..999), label `num_classes` the null class. Heads come from the official
    table (S 6, B 12, L 16, XL 16) unless `num_heads` is given; `place` as in `load_safetensors`
    (each leaf read into its sharding); `dtype` the leaves' (bfloat16: each cast as it is read)."""
    return load_official(path, DIT, num_heads, place=place, dtype=dtype)


def load_official(
    path: str | Path,
    family: Family,
    num_heads: int | None = None,
    *,
    place: Place | None = None,
    dtype: DTypeLike = np.float32,
) -> DiT:
    """`load_dit` for any `Family` (DiT's network and names): its errors name `family`."""
    source = official_state(path, family)
    with safe_open(str(source), framework="numpy") if isinstance(source, Path) else source as file:
        # A train.py checkpoint flattened into one safetensors file: its "ema." keys.
        prefix = "ema." if "ema.pos_embed" in file.keys() else ""
        keys = [k for k in file.keys() if k.startswith(prefix)]
        shapes = {k[len(prefix) :]: tuple(file.get_slice(k).get_shape()) for k in keys}
        where = f"{source}{' (its ema.* keys)' if prefix else ''}"
        config = dit_config(shapes, num_heads, where, family)
        fixed = sincos_pos_embed_2d(config["hidden_size"], config["image_size"] // config["patch_size"])
        stored = np.asarray(file.get_tensor(f"{prefix}pos_embed"), np.float32).reshape(fixed.shape)
    if not np.allclose(stored, fixed, rtol=0, atol=1e-5):
        raise ValueError(
            f"{where}: pos_embed is not {family.name}'s fixed sin-cos embedding (off by up to "
            f"{np.abs(stored - fixed).max():.3g}); eqxdiff's DiT computes that one"
        )
    abstract = abstract_network(DiT, **config)
    rename = lambda key: eqxdiff_name(key[len(prefix) :]) if key.startswith(prefix) else None  # noqa: E731
    return load_safetensors(abstract, source, rename=rename, place=place, dtype=dtype)
