"""An eqxdiff `DiT` saved as facebookresearch/DiT's own checkpoints are laid out (the inverse of `load_dit`).

The state_dict names are `dit.OFFICIAL_NAMES` read backwards (each pattern's groups carried over), the
layouts those of `load_safetensors` undone (a Dense weight back to (out, in), a conv kernel to OIHW), and
`pos_embed`, a frozen buffer eqxdiff computes, written as models.py sets it. As `.pt` (torch's zip format,
written without torch) the file is what DiT's `sample.py --ckpt` / `sample_ddp.py --ckpt` read (its
`find_model`: `torch.load`); as `.safetensors`, `model.load_state_dict(safetensors.torch.load_file(path))`
loads it into `DiT_models[...]` (or `DiT(...)` with the sizes); eqxdiff reads both with `load_dit(path)`. So a
model trained here (`--model dit_*`) compares with, and samples like, theirs (tools/check_dit_export.py
runs the official forward on such files).
"""

import re
from pathlib import Path

import jax
import numpy as np
from safetensors.numpy import save_file

from eqxdiff.nn.dit import DiT
from eqxdiff.nn.layers import sincos_pos_embed_2d
from eqxdiff.weights.torch_save import save_torch_state_dict
from eqxdiff.nn.torch_weights import is_array_like, leaf_layouts
from eqxdiff.pretrained.dit_checkpoints import OFFICIAL_NAMES, OFFICIAL_SIZES, eqxdiff_name


def _backwards(pattern: str, name: str) -> tuple[str, str]:
    """One `OFFICIAL_NAMES` row read backwards: (a regex of the eqxdiff name, the official name's template);
    each group `(...)` of the official pattern becomes the named group its backreference `\\N` stands for."""
    groups = re.findall(r"\(([^()]*)\)", pattern)
    pieces = re.split(r"\\(\d)", name)  # literal, group number, literal, ...
    regex = "".join(re.escape(p) if i % 2 == 0 else f"(?P<g{p}>{groups[int(p) - 1]})" for i, p in enumerate(pieces))
    numbers = iter(range(1, len(groups) + 1))
    template = re.sub(r"\([^()]*\)", lambda _: rf"\g<g{next(numbers)}>", pattern).replace(r"\.", ".")
    return regex, template


BACKWARDS = [_backwards(pattern, name) for pattern, name in OFFICIAL_NAMES]


def official_name(name: str) -> str:
    """The official state_dict key of the eqxdiff `DiT` leaf `name` (attention's are the same)."""
    for regex, template in BACKWARDS:
        if match := re.fullmatch(regex, name):
            key = match.expand(template)
            break
    else:
        key = name
    assert eqxdiff_name(key) == name, (name, key)  # the table read both ways agrees
    return key


def check_exportable(model: DiT) -> None:
    """Raise a ValueError naming what DiT's models.py cannot hold: a text DiT, an unconditional one (its
    `forward(x, t, y)` always adds a label embedding; load_dit reads classes from its rows), heads other
    than the official table's for an official size (the file does not store heads: every reader takes the table's)."""
    if not isinstance(model, DiT):
        raise ValueError(f"save_dit writes an eqxdiff.nn.DiT, not a {type(model).__name__}")
    if model.context_dim:
        raise ValueError(
            f"save_dit: a text DiT (context_dim={model.context_dim}) has no place in DiT's models.py, "
            "which conditions on class labels only"
        )
    if not model.num_classes:
        raise ValueError(
            "save_dit: an unconditional DiT (num_classes=0) has no place in DiT's models.py, whose "
            "forward(x, t, y) always adds a class embedding; train with labels (num_classes > 0)"
        )
    depth, heads = len(model.blocks), model.blocks[0].attn.num_heads
    size = OFFICIAL_SIZES.get((depth, model.hidden_size))
    if size and size[1] != heads:
        raise ValueError(
            f"save_dit: depth {depth}, width {model.hidden_size} is DiT-{size[0]}, whose {size[1]} heads "
            f"every reader of the file assumes (it stores no heads); this model has {heads}"
        )


def official_state(model: DiT) -> dict[str, np.ndarray | jax.ShapeDtypeStruct]:
    """`{official key: tensor in torch's layout}` for `model` (float32 host arrays; for an abstract model,
    from `eqx.filter_eval_shape`, ShapeDtypeStructs of those shapes), `pos_embed` [1, tokens, width] included."""
    check_exportable(model)
    leaves = [x for x in jax.tree.leaves(model, is_leaf=is_array_like) if is_array_like(x)]
    grid = model.image_size // model.patch_size
    state: dict = {"pos_embed": sincos_pos_embed_2d(model.hidden_size, grid)[None]}
    for (name, perm), leaf in zip(leaf_layouts(model).items(), leaves, strict=True):
        back = tuple(np.argsort(perm))  # ours = transpose(torch's, perm), so torch's = transpose(ours, argsort(perm))
        if isinstance(leaf, jax.ShapeDtypeStruct):
            state[official_name(name)] = jax.ShapeDtypeStruct(tuple(leaf.shape[p] for p in back), np.float32)
        elif not leaf.is_fully_addressable:
            raise ValueError(
                f"save_dit: {name} is spread over several processes; gather the model first "
                "(jax.experimental.multihost_utils.process_allgather)"
            )
        else:
            state[official_name(name)] = np.ascontiguousarray(np.transpose(np.asarray(leaf, np.float32), back))
    return state


def save_dit(model: DiT, path: str | Path) -> Path:
    """`model` (an eqxdiff `DiT`: trained with `--model dit_*`, or from `load_dit`) as facebookresearch/DiT's
    state_dict at `path`, float32, torch's layouts, `pos_embed` included: a `.pt`/`.pth` is a bare state_dict
    in torch's zip format (as DiT-XL-2-256x256.pt), a `.safetensors` the same tensors with metadata `format`
    "pt" (as safetensors.torch writes) and the heads, which the tensors do not tell (load_dit needs
    `num_heads=` outside the official sizes). What models.py cannot hold raises (`check_exportable`).
    Returns `path`."""
    path = Path(path)
    if path.suffix not in (".safetensors", ".pt", ".pth"):
        raise ValueError(f"save_dit writes .pt (torch.load's, as DiT's checkpoints) or .safetensors, not {path.name!r}")
    state = official_state(model)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".safetensors":
        save_file(state, str(path), metadata={"format": "pt", "num_heads": str(model.blocks[0].attn.num_heads)})
    else:
        save_torch_state_dict(state, path)
    return path
