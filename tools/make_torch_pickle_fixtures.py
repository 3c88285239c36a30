"""Write tests/data/torch_pickle/: torch files written by torch.save, for tests/weights/test_torch_pickle.py
(eqxdiff.weights.torch_pickle reads them without torch).

- `state_dict.pth` (zip format) and `state_dict_legacy.pth` (`_use_new_zipfile_serialization=False`):
  one OrderedDict holding a Conv2d's own state_dict (with its `_metadata`), float32 / float16 /
  bfloat16 / int64 / bool / uint16 (`_rebuild_tensor_v3`) tensors, an empty one, a 0-d counter, an
  nn.Parameter, a transposed view, a strided slice at an offset, two views of one storage and a
  nested OrderedDict (an "ema" copy); the legacy file has all but the uint16 one, which
  torch's legacy reader cannot load. `reference.npz` holds each tensor, by its dotted name, as
  torch gives it (`.contiguous()`; bfloat16 as float32, exact), `reference.json` the dtypes and
  the names whose tensors share one storage.
- `malicious_os_system.pth`, `malicious_eval.pth` and `malicious_os_system_legacy.pth`: a tensor next
  to an object whose `__reduce__` is `os.system(...)` / `eval(...)`; run, each would create the
  file `torch_pickle_ran` in the working directory.
- `pytorch_fid_legacy_head.pth` and `pytorch_fid_legacy_storages.json`: the
  random pytorch-fid state_dict of tests/data/inception/weights.json saved by torch in the legacy
  format, cut before its storages (the pickles only, ~40 kB instead of 95 MB), and the state_dict
  key whose tensor fills each storage, in the file's order; the test appends each storage (an
  int64 element count, then the bytes) from the weights it replays.

    tools/.venv/bin/python tools/make_torch_pickle_fixtures.py
"""

import json
import os
from collections import OrderedDict
from pathlib import Path

import numpy as np
import torch

DATA = Path(__file__).resolve().parent.parent / "tests" / "data"
OUT = DATA / "torch_pickle"


def state_dict() -> OrderedDict:
    gen = torch.Generator().manual_seed(0)
    conv = torch.nn.Conv2d(3, 4, 3)
    with torch.no_grad():
        conv.weight.copy_(torch.randn(conv.weight.shape, generator=gen))
        conv.bias.copy_(torch.randn(conv.bias.shape, generator=gen))
    state = conv.state_dict(prefix="conv.")  # an OrderedDict with `_metadata`, as module.state_dict() gives
    matrix = torch.randn(5, 7, generator=gen)
    shared = torch.randn(3, 6, generator=gen)
    big = torch.arange(60, dtype=torch.float32).reshape(6, 10) / 7
    state.update(
        {
            "half": torch.randn(9, generator=gen).half(),
            "bf16": torch.randn(2, 3, generator=gen).bfloat16(),
            "long": torch.arange(-3, 5, dtype=torch.int64) * 1_000_000_007,
            "counter": torch.tensor(12345, dtype=torch.int64),
            "mask": torch.tensor([True, False, True]),
            "u16": torch.tensor([1, 40000, 65535], dtype=torch.uint16),
            "empty": torch.zeros(0, 4),
            "param": torch.nn.Parameter(torch.randn(2, 2, generator=gen)),
            "transposed": matrix.t(),  # strides (1, 7)
            "slice": big[2:5, 1::3],  # offset 21, strides (10, 3)
            "row0": shared[0],  # two overlapping views of one storage
            "col1": shared[:, 1],
            "ema": OrderedDict(
                {
                    "weight": torch.randn(4, 3, generator=gen),
                    "inner": OrderedDict({"scale": torch.tensor([0.5, 2.0]).half()}),
                }
            ),
        }
    )
    return state


def flat(tree: dict, prefix: str = "") -> dict[str, torch.Tensor]:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


class Runs:
    """An object that, unpickled by plain pickle, calls `fn(arg)`."""

    def __init__(self, fn, arg):
        self.fn, self.arg = fn, arg

    def __reduce__(self):
        return self.fn, (self.arg,)


def write_state_dicts() -> None:
    state = state_dict()
    torch.save(state, OUT / "state_dict.pth")
    legacy = OrderedDict((k, v) for k, v in state.items() if k != "u16")  # torch's legacy load cannot read v3 tensors
    legacy._metadata = state._metadata
    torch.save(legacy, OUT / "state_dict_legacy.pth", _use_new_zipfile_serialization=False)
    tensors = flat(state)
    ref = {
        k: (v.detach().float() if v.dtype == torch.bfloat16 else v.detach()).contiguous().numpy()
        for k, v in tensors.items()
    }
    np.savez(OUT / "reference.npz", **ref)
    storages: dict[int, list[str]] = {}
    for key, value in tensors.items():
        storages.setdefault(value.untyped_storage().data_ptr(), []).append(key)
    meta = {
        "torch": torch.__version__,
        "dtypes": {k: str(v.dtype).removeprefix("torch.") for k, v in tensors.items()},
        "shared": [keys for keys in storages.values() if len(keys) > 1],
        "non_contiguous": [k for k, v in tensors.items() if not v.is_contiguous()],
    }
    (OUT / "reference.json").write_text(json.dumps(meta, indent=1) + "\n")
    for value in (
        torch.load(OUT / "state_dict.pth", weights_only=True),
        torch.load(OUT / "state_dict_legacy.pth", weights_only=True),
    ):
        for key, t in flat(value).items():  # torch's own reader gives the same tensors
            assert torch.equal(t, tensors[key]), key
        assert set(flat(value)) | {"u16"} == set(tensors)


def write_malicious() -> None:
    marker = "torch_pickle_ran"
    tensor = torch.ones(2)
    torch.save({"weight": tensor, "payload": Runs(os.system, f"echo ran > {marker}")}, OUT / "malicious_os_system.pth")
    torch.save({"weight": tensor, "payload": Runs(eval, f"open({marker!r}, 'w')")}, OUT / "malicious_eval.pth")
    torch.save(
        {"weight": tensor, "payload": Runs(os.system, f"echo ran > {marker}")},
        OUT / "malicious_os_system_legacy.pth",
        _use_new_zipfile_serialization=False,
    )


def write_inception_head() -> None:
    """The legacy .pth of the FID fixture's weights, cut before its storages."""
    meta = json.loads((DATA / "inception" / "weights.json").read_text())
    rng = np.random.RandomState(meta["seed"])
    state = OrderedDict()
    for key, shape, dtype, low, high in meta["entries"]:  # tests/eval/test_inception.py's fid_weights()
        if dtype == "float32":
            state[key] = torch.from_numpy(rng.uniform(low, high, size=shape).astype(np.float32))
        else:
            state[key] = torch.full(shape, low, dtype=getattr(torch, dtype))
    path = OUT / "pytorch_fid_legacy.pth"
    torch.save(state, path, _use_new_zipfile_serialization=False)
    by_storage = {str(t.untyped_storage()._cdata): key for key, t in state.items()}
    order = sorted(by_storage)  # torch's _legacy_save writes its storages in this order
    data = path.read_bytes()
    sizes = [8 + state[by_storage[k]].numel() * state[by_storage[k]].element_size() for k in order]
    head = data[: len(data) - sum(sizes)]
    rebuilt = bytearray(head)
    for k in order:
        t = state[by_storage[k]]
        rebuilt += np.int64(t.numel()).tobytes() + t.numpy().tobytes()
    assert bytes(rebuilt) == data, "the head plus the storages in this order is not torch's file"
    loaded = torch.load(path, weights_only=True)
    assert all(torch.equal(loaded[k], v) for k, v in state.items())
    path.unlink()
    (OUT / "pytorch_fid_legacy_head.pth").write_bytes(head)
    (OUT / "pytorch_fid_legacy_storages.json").write_text(json.dumps([by_storage[k] for k in order], indent=0) + "\n")


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    write_state_dicts()
    write_malicious()
    write_inception_head()
    for path in sorted(OUT.iterdir()):
        print(f"{path.relative_to(DATA.parent.parent)}: {path.stat().st_size:,} bytes")


if __name__ == "__main__":
    main()
