"""eqxdiff.weights.torch_pickle against files torch.save wrote (tools/make_torch_pickle_fixtures.py): every
tensor equal to torch's own, in both formats, with views and shared storages kept; files that name
code (os.system, eval) refused by name without running it; tensors that point outside their storage
refused. (InceptionV3 from pytorch-fid's .pth: tests/eval/test_inception.py.)"""

import io
import json
import pickle
import re
import zipfile
from pathlib import Path

import numpy as np
import pytest

from eqxdiff.weights.torch_pickle import TorchFileError, read_state_dict, read_torch_file
import train_scripts  # noqa: F401 — puts train/ on sys.path: a test of the scripts

DATA = Path(__file__).parents[1] / "data" / "torch_pickle"
REF = json.loads((DATA / "reference.json").read_text())


@pytest.mark.parametrize("name", ["state_dict.pth", "state_dict_legacy.pth"])
def test_state_dict_equals_torchs(name):
    """float32/16, bfloat16, int64, bool, uint16 (zip only), empty, 0-d, a Parameter, a transpose, a
    strided slice at an offset, overlapping views of one storage and nested OrderedDicts: each
    tensor as torch.load gives it, in the file's order, with torch's dtype."""
    with np.load(DATA / "reference.npz") as file:
        ref = dict(file)
    state = read_state_dict(DATA / name)
    expected = [k for k in ref if name == "state_dict.pth" or k != "u16"]
    assert list(state) == expected
    for key, value in state.items():
        assert value.dtype.name == REF["dtypes"][key], key
        assert value.shape == ref[key].shape and not value.flags.writeable, key
        np.testing.assert_array_equal(np.asarray(value, ref[key].dtype), ref[key], err_msg=key)
    assert state["bf16"].dtype.itemsize == 2 and np.abs(state["long"]).max() > 2**31  # bf16 bits, int64 range
    for keys in REF["shared"]:  # views of one storage share memory, as in torch
        assert all(np.shares_memory(state[keys[0]], state[k]) for k in keys[1:])
    assert REF["non_contiguous"] and all(not state[k].flags.c_contiguous for k in REF["non_contiguous"])
    tree = read_torch_file(DATA / name)  # containers as pickled: a module state_dict keeps its metadata
    assert type(tree).__name__ == "OrderedDict" and tree._metadata == {"conv": {"version": 1}}
    assert set(tree["ema"]) == {"weight", "inner"}


@pytest.mark.parametrize(
    "name, named",
    [
        ("malicious_os_system.pth", "posix.system"),
        ("malicious_eval.pth", "builtins.eval"),
        ("malicious_os_system_legacy.pth", "posix.system"),
    ],
)
def test_code_in_the_file_is_refused_by_name_and_not_run(name, named, tmp_path, monkeypatch):
    """Each file's payload would create `torch_pickle_ran` in the working directory."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(TorchFileError, match=re.escape(f"refused the global {named}")):
        read_state_dict(DATA / name)
    assert not (tmp_path / "torch_pickle_ran").exists()


def zip_with_pickle(path: Path, data_pkl: bytes, storage: bytes, compression=zipfile.ZIP_STORED) -> Path:
    with zipfile.ZipFile(path, "w", compression) as archive:
        archive.writestr("archive/data.pkl", data_pkl)
        archive.writestr("archive/data/0", storage)
    return path


def tensor_pickle(size: tuple, stride: tuple, offset: int, numel: int, build: bytes = b"") -> bytes:
    """A protocol-2 pickle of `_rebuild_tensor_v2` on one FloatStorage of `numel` elements, the
    opcodes written out (torch.save never writes a tensor outside its storage)."""

    def s(text):
        return b"X" + len(text).to_bytes(4, "little") + text.encode()

    def ints(values):
        return b"(" + b"".join(b"J" + v.to_bytes(4, "little", signed=True) for v in values) + b"t"

    storage_id = b"(" + s("storage") + b"ctorch\nFloatStorage\n" + s("0") + s("cpu") + ints([numel])[1:-1] + b"tQ"
    args = (
        b"("
        + storage_id
        + ints([offset])[1:-1]
        + ints(size)
        + ints(stride)
        + b"\x89"
        + b"ccollections\nOrderedDict\n)R"
        + b"t"
    )
    return b"\x80\x02" + b"}" + s("w") + b"ctorch._utils\n_rebuild_tensor_v2\n" + args + b"R" + build + b"s."


def test_tensor_outside_its_storage_is_refused(tmp_path):
    """A stride or offset that reads past the storage raises instead of reading other memory, and so
    does a BUILD that would change a checked tensor; the same pickle inside its storage reads the
    values; a storage shorter than its tensors say is named."""
    storage = np.arange(6, dtype=np.float32).tobytes()
    for compression in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):  # memory-mapped, or read whole
        inside = zip_with_pickle(tmp_path / "in.pth", tensor_pickle((2, 2), (3, 1), 1, 6), storage, compression)
        np.testing.assert_array_equal(read_state_dict(inside)["w"], [[1, 2], [4, 5]])
    for size, stride, offset in [((2, 2), (3, 1), 2), ((2, 4), (3, 1), 0), ((3,), (3,), 0)]:
        path = zip_with_pickle(tmp_path / "out.pth", tensor_pickle(size, stride, offset, 6), storage)
        with pytest.raises(TorchFileError, match="reads past its storage"):
            read_state_dict(path)
    # BUILD on the rebuilt tensor, (None, {"shape": (8,)}): would resize it past the storage after the check.
    build = b"N}" + b"X" + (5).to_bytes(4, "little") + b"shape" + b"(J" + (8).to_bytes(4, "little") + b"t" + b"s\x86b"
    resized = zip_with_pickle(tmp_path / "build.pth", tensor_pickle((6,), (1,), 0, 6, build), storage)
    with pytest.raises(TorchFileError, match="set the state of a _Tensor"):
        read_state_dict(resized)
    short = zip_with_pickle(tmp_path / "short.pth", tensor_pickle((2, 2), (3, 1), 1, 6), storage[:-4])
    with pytest.raises(TorchFileError, match="holds 20 bytes"):
        read_state_dict(short)


def test_not_a_torch_file_is_refused(tmp_path):
    (tmp_path / "text.pth").write_bytes(b"not a torch file")
    pickled = io.BytesIO()
    pickle.dump({"w": [1.0]}, pickled, protocol=2)  # a plain pickle: no magic number
    (tmp_path / "plain.pth").write_bytes(pickled.getvalue())
    for name in ("text.pth", "plain.pth"):
        with pytest.raises(TorchFileError, match="not a torch.save file"):
            read_state_dict(tmp_path / name)


def test_fid_stats_refuses_a_malicious_inception_in_one_line(tmp_path, monkeypatch, capsys):
    """train/fid_stats.py --inception FILE.pth: a file that names code is one line, status 2, before
    any image is read; nothing runs and nothing is written."""
    import fid_stats  # train/fid_stats.py
    from startup import exit_on_user_error

    monkeypatch.chdir(tmp_path)
    out = tmp_path / "stats.npz"
    cfg = fid_stats.parse_config(["--inception", str(DATA / "malicious_os_system.pth"), "--out", str(out)])
    with pytest.raises(SystemExit) as stopped:
        exit_on_user_error(lambda: fid_stats.main(cfg))
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and err.count("\n") == 1
    assert err.startswith("error: --inception: ") and "refused the global posix.system" in err
    assert not out.exists() and not (tmp_path / "torch_pickle_ran").exists()
