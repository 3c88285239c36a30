"""Model folders as diffusers' and transformers' `save_pretrained(variant=..., max_shard_size=...)`
write them, made from a state_dict in tests (no torch)."""

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file


def save_sharded(
    folder: Path, state: dict[str, np.ndarray], weights_name: str, shards: int, variant: str | None = None
) -> list[Path]:
    """`state` split into `shards` files `<stem>[.<variant>]-0000i-of-0000n.safetensors` plus the index
    `<weights_name>.index[.<variant>].json` mapping each key to its file; the shard paths, in order."""
    stem = weights_name.removesuffix(".safetensors") + (f".{variant}" if variant else "")
    keys, weight_map, paths = sorted(state), {}, []
    for i, part in enumerate(np.array_split(np.arange(len(keys)), shards)):
        name = f"{stem}-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file({keys[j]: state[keys[j]] for j in part}, str(folder / name))
        weight_map |= {keys[j]: name for j in part}
        paths.append(folder / name)
    index = f"{weights_name}.index.{variant}.json" if variant else f"{weights_name}.index.json"
    total = sum(v.nbytes for v in state.values())
    (folder / index).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    return paths
