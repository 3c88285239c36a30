"""Which safetensors files of a diffusers/transformers model folder hold its weights.

A folder may hold the plain file (`diffusion_pytorch_model.safetensors`, `model.safetensors`), a
variant of it (`<stem>.<variant>.safetensors`, e.g. `fp16`), and shards listed by an index
(`<stem>.safetensors.index.json`, or `<stem>.safetensors.index.<variant>.json` for a variant's
shards), as diffusers' and transformers' `save_pretrained(variant=..., max_shard_size=...)` write
them (`_add_variant` in both). As in their `from_pretrained`, `variant=None` means the plain weights,
but for a folder that holds one variant alone (what `huggingface-cli download --include "*.fp16.*"` leaves):
its weights are the only ones there, read with a warning that names them (diffusers would refuse the folder,
and no script flag reaches `variant=`). A folder holding several variants and no plain weights names the choice.
"""

import json
import warnings
from pathlib import Path

from safetensors import safe_open

SUFFIX = ".safetensors"


def weight_files(folder: str | Path, weights_name: str, variant: str | None = None) -> list[Path]:
    """The files holding `folder`'s weights named `weights_name` (e.g. "model.safetensors") in
    `variant` (None: the plain ones): one file, or an index's shards in name order.

    Raises FileNotFoundError naming what the folder holds (and the variants to pass) when the asked
    weights are absent, and ValueError when they are there twice (one file and an index) or when an
    index does not match its shards' keys."""
    folder, stem = Path(folder), weights_name.removesuffix(SUFFIX)
    single = folder / (f"{stem}.{variant}{SUFFIX}" if variant else weights_name)
    index = folder / (f"{weights_name}.index.{variant}.json" if variant else f"{weights_name}.index.json")
    asked = f"variant {variant!r}" if variant else "plain weights (variant=None)"
    if single.is_file() and index.is_file():
        raise ValueError(f"{folder}: both {single.name} and the shards of {index.name} hold the {asked}; remove one")
    if single.is_file():
        return [single]
    if index.is_file():
        return _shards(index)
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder} {'is a file, not a folder' if folder.exists() else 'does not exist'}")
    found = sorted(p.name for p in folder.glob("*")) if folder.is_dir() else []
    others = sorted(v for v in variants(folder, weights_name) if v != variant)
    if variant is None and len(others) == 1:  # the only weights there: read them, and say so
        files = weight_files(folder, weights_name, others[0])
        warnings.warn(
            f"{folder} holds only its {others[0]!r} weights ({files[0].name}{', …' * (len(files) > 1)}): reading those",
            stacklevel=2,
        )
        return files
    hint = f"; pass variant= one of {others}" if others else ""
    raise FileNotFoundError(f"{single} does not exist, nor {index.name} (the folder holds {found}){hint}")


def variants(folder: Path, weights_name: str) -> set[str | None]:
    """The variants whose weights `folder` holds (None: the plain ones), from the file names."""
    stem, out = weights_name.removesuffix(SUFFIX), set()
    for path in folder.glob(f"{stem}*"):
        name = path.name
        if name in (weights_name, f"{weights_name}.index.json"):
            out.add(None)
        elif name.startswith(f"{weights_name}.index.") and name.endswith(".json"):
            out.add(name.removeprefix(f"{weights_name}.index.").removesuffix(".json"))
        elif name.startswith(f"{stem}.") and name.endswith(SUFFIX) and "-of-" not in name:
            out.add(name.removeprefix(f"{stem}.").removesuffix(SUFFIX))
    return out


def _shards(index: Path) -> list[Path]:
    """The shard files an index's `weight_map` names, each present and holding exactly its keys."""
    weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
    names = sorted(set(weight_map.values()))
    missing = [n for n in names if not (index.parent / n).is_file()]
    if missing:
        raise FileNotFoundError(f"{index}: shard files missing: {missing}")
    for name in names:
        with safe_open(str(index.parent / name), framework="numpy") as f:
            keys = set(f.keys())
        listed = {k for k, v in weight_map.items() if v == name}
        if keys != listed:
            wrong = sorted(keys ^ listed)
            raise ValueError(f"{index}: {name} does not hold the keys the index lists for it (differing: {wrong[:5]})")
    return [index.parent / n for n in names]
