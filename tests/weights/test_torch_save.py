"""eqxdiff.weights.torch_save: numpy state_dicts in torch's zip format, read back by eqxdiff's torch reader
(torch itself reads them in tools/check_dit_export.py, which torch.load-s save_dit's .pt files)."""

import pickle
import struct
import zipfile

import ml_dtypes
import numpy as np
import pytest

from eqxdiff.weights.torch_pickle import read_torch_file
from eqxdiff.weights.torch_save import ALIGNMENT, _int, save_torch_state_dict


def test_a_state_dict_comes_back_as_written(tmp_path):
    rng = np.random.default_rng(0)
    state = {
        "w": rng.normal(size=(3, 4)).astype(np.float32),
        "transposed": rng.normal(size=(4, 5)).astype(np.float32).T,  # written contiguous, read the same values
        "half": rng.normal(size=(2, 1, 3)).astype(np.float16),
        "bf16": rng.normal(size=(5,)).astype(ml_dtypes.bfloat16),
        "step": np.array(7, np.int64),  # 0-d
        "empty": np.zeros((0, 4), np.float32),
        "flags": np.array([True, False]),
    }
    path = save_torch_state_dict(state, tmp_path / "s.pt")
    back = read_torch_file(path)
    assert list(back) == list(state)  # an OrderedDict, in order
    for key, array in state.items():
        assert back[key].dtype == array.dtype and back[key].shape == array.shape, key
        np.testing.assert_array_equal(back[key], array, err_msg=key)


def test_records_are_torchs_layout_with_storages_aligned(tmp_path):
    path = save_torch_state_dict({"a": np.ones(3, np.float32), "b": np.ones(7, np.float16)}, tmp_path / "s.pt")
    with zipfile.ZipFile(path) as zf, open(path, "rb") as f:
        assert zf.namelist() == [
            "archive/data.pkl",
            "archive/byteorder",
            "archive/data/0",
            "archive/data/1",
            "archive/version",
        ]
        assert zf.read("archive/byteorder") == b"little" and zf.read("archive/version") == b"3\n"
        for info in zf.infolist():
            assert info.compress_type == zipfile.ZIP_STORED
            f.seek(info.header_offset)
            name_len, extra_len = struct.unpack("<26xHH", f.read(30))
            assert (info.header_offset + 30 + name_len + extra_len) % ALIGNMENT == 0, info.filename


def test_a_dtype_torch_has_no_storage_for_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"no torch storage for \{'s': dtype\('<U1'\)\}"):
        save_torch_state_dict({"s": np.array(["a"])}, tmp_path / "s.pt")


def test_sizes_past_32_bits_are_written_as_long_ints():
    """A storage of 2^31 elements or more (8 GiB of float32) has a numel BININT cannot hold."""
    for n in (0, -1, 2**31 - 1, 2**31, 3 * 2**40):
        assert pickle.loads(_int(n) + pickle.STOP) == n
