"""InceptionV3 (FID features) against pytorch-fid's own network on seeded random weights
(tools/make_fid_fixtures.py): pool3 features at 299×299 and through the resize from 64×48,
bilinear resizes against `F.interpolate`, every state_dict key read once or skipped by name,
missing/unexpected/mis-shaped keys named, a zeroed conv caught, uint8 RGB input enforced, and
pytorch-fid's .pth read as its safetensors copy."""

import hashlib
import json
import re
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import save_file

from eqxdiff.eval import InceptionV3
from eqxdiff.eval.inception import IGNORED_KEYS, TORCH_LAYOUTS, BasicConv2d, skipped_keys
from eqxdiff.eval.resize import resize_bilinear
from eqxdiff.nn.torch_weights import leaf_layouts

DATA = Path(__file__).parents[1] / "data" / "inception"
TOLERANCE = 1e-4  # max abs difference / max abs reference; float32 pytorch-fid is 3e-7 from float64


def fid_weights() -> dict[str, np.ndarray]:
    """The fixture's random state_dict, replayed from weights.json as make_fid_fixtures.draw does
    (float32 entries drawn in order from one RandomState, int64 counters constant)."""
    meta = json.loads((DATA / "weights.json").read_text())
    rng = np.random.RandomState(meta["seed"])
    state = {}
    for key, shape, dtype, low, high in meta["entries"]:
        if dtype == "float32":
            state[key] = rng.uniform(low, high, size=shape).astype(np.float32)
        else:
            state[key] = np.full(shape, low, dtype=dtype)
    digest = hashlib.sha256()
    for key, value in state.items():
        digest.update(key.encode())
        digest.update(value.tobytes())
    assert digest.hexdigest() == meta["sha256"], "these are not the weights pytorch-fid's network ran with"
    return state


@pytest.fixture(scope="module")
def state() -> dict[str, np.ndarray]:
    return fid_weights()


@pytest.fixture(scope="module")
def net(state, tmp_path_factory) -> InceptionV3:
    """Loaded from a safetensors copy of the state_dict: every key, fc and counters too."""
    path = tmp_path_factory.mktemp("inception") / "fid_inception.safetensors"
    save_file(state, str(path))
    return InceptionV3.from_pytorch_fid(path)


@pytest.fixture(scope="module")
def ref() -> dict[str, np.ndarray]:
    with np.load(DATA / "reference.npz") as file:
        return dict(file)


@eqx.filter_jit
def features(net: InceptionV3, images):
    return net(images)


def relative_error(ours, expected: np.ndarray) -> float:
    return float(np.abs(np.asarray(ours) - expected).max() / np.abs(expected).max())


@pytest.mark.parametrize("size", ["299", "64x48"])
def test_pool3_matches_pytorch_fid(net, ref, size):
    """pytorch-fid's InceptionV3([3]) on the same uint8 images (299: its resize is a copy)."""
    ours = features(net, ref[f"images_{size}"])
    assert ours.shape == ref[f"pool3_{size}"].shape and ours.dtype == jnp.float32
    assert relative_error(ours, ref[f"pool3_{size}"]) < TOLERANCE


def test_bilinear_resize_matches_torch(ref):
    """F.interpolate(bilinear, align_corners=False) stretching to 299 (on a grid of rows and
    columns with both edges), shrinking one axis while stretching the other, and shrinking both;
    one compiled program."""
    unit = {name: ref[f"images_{name}"].astype(np.float32) / 255 for name in ("299", "64x48", "32x32")}
    sizes = {"64x48": (299, 299), "32x32": (299, 299), "64x48_to_23x71": (23, 71), "299_to_50x37": (50, 37)}
    ours = jax.jit(lambda x: {name: resize_bilinear(x[name.split("_")[0]], size) for name, size in sizes.items()})(unit)
    rows = ref["resize_index"]
    for name in sizes:
        out = np.asarray(ours[name])
        out = out[:, rows][:, :, rows] if out.shape[1:3] == (299, 299) else out
        np.testing.assert_allclose(out, ref[f"resized_{name}"], rtol=0, atol=1e-6, err_msg=name)
    # jax.image.resize antialiases when it shrinks: a different function, the reason for ours.
    jax_linear = np.asarray(jax.image.resize(jnp.asarray(unit["299"]), (2, 50, 37, 3), "linear"))
    assert np.abs(jax_linear - ref["resized_299_to_50x37"]).max() > 1e-2


def test_zeroed_conv_fails_parity(net, ref):
    """The parity test can fail: one zeroed 1×7 conv deep in Mixed_6d moves the features."""
    broken = eqx.tree_at(lambda n: n.Mixed_6d.branch7x7dbl_3.conv.weight, net, replace_fn=jnp.zeros_like)
    assert relative_error(features(broken, ref["images_64x48"]), ref["pool3_64x48"]) > 100 * TOLERANCE


def test_every_key_read_once_or_skipped_by_name(net, state):
    """The network's leaves and the skipped keys (fc, BatchNorm counters) split the file's keys."""
    leaves, skipped = set(leaf_layouts(net, TORCH_LAYOUTS)), skipped_keys(net)
    assert not leaves & skipped and leaves | skipped == set(state)
    assert {k for k in skipped if not k.endswith("num_batches_tracked")} == set(IGNORED_KEYS)
    assert len([x for x in jax.tree.leaves(net) if eqx.is_array(x)]) == len(leaves) == 94 * 5


MISSING, EXTRA = "Mixed_7c.branch_pool.bn.running_var", "Mixed_5b.branch1x1.conv.bias"
FIRST = "Conv2d_1a_3x3.conv.weight"


@pytest.mark.parametrize(
    "change, named",
    [
        (lambda s: s.pop(MISSING), f"missing keys (1): {MISSING}"),
        (lambda s: s.update({EXTRA: np.zeros(1, np.float32)}), f"unexpected keys (1): {EXTRA}"),
        (lambda s: s.update({FIRST: np.zeros((32, 3, 3, 1), np.float32)}), f"{FIRST}: shape (32, 3, 3, 1)"),
    ],
    ids=["missing", "unexpected", "shape"],
)
def test_key_errors_name_the_key(state, tmp_path, change, named):
    """Placeholders stand in for the other tensors: names are checked before any tensor is read,
    and Conv2d_1a_3x3's weight, the first leaf, before any other shape."""
    placeholders = {key: np.zeros(1, value.dtype) for key, value in state.items()}
    change(placeholders)
    save_file(placeholders, str(tmp_path / "w.safetensors"))
    with pytest.raises(ValueError, match=re.escape(named)):
        InceptionV3.from_pytorch_fid(tmp_path / "w.safetensors")


def pytorch_fid_legacy_pth(path: Path, state: dict[str, np.ndarray]) -> Path:
    """torch's legacy .pth of these weights (tools/make_torch_pickle_fixtures.py): its pickles as torch
    wrote them, then each storage (an int64 element count and the bytes) in torch's order."""
    pickles = Path(__file__).parents[1] / "data" / "torch_pickle"
    order = json.loads((pickles / "pytorch_fid_legacy_storages.json").read_text())
    with path.open("wb") as file:
        file.write((pickles / "pytorch_fid_legacy_head.pth").read_bytes())
        for key in order:
            file.write(np.int64(state[key].size).tobytes() + state[key].tobytes())
    return path


def test_pytorch_fids_pth_loads_as_its_safetensors_copy(net, state, tmp_path):
    """from_pytorch_fid reads pytorch-fid's .pth itself (eqxdiff.weights.torch_pickle): every leaf equals
    the one loaded from the safetensors copy of the same state_dict."""
    pth = pytorch_fid_legacy_pth(tmp_path / "pt_inception-2015-12-05-6726825d.pth", state)
    leaves = [jax.tree.leaves(eqx.filter(n, eqx.is_array)) for n in (InceptionV3.from_pytorch_fid(pth), net)]
    assert len(leaves[0]) == len(leaves[1]) == 94 * 5
    for a, b in zip(*leaves, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_bad_weights_files_named(tmp_path):
    (tmp_path / "pt_inception-2015-12-05-6726825d.pth").write_bytes(b"not unpickled")
    with pytest.raises(ValueError, match="not a torch.save file"):
        InceptionV3.from_pytorch_fid(tmp_path / "pt_inception-2015-12-05-6726825d.pth")
    with pytest.raises(FileNotFoundError, match="download pytorch-fid's weights"):
        InceptionV3.from_pytorch_fid(tmp_path / "missing.pth")
    with pytest.raises(ValueError, match="expected pytorch-fid's pt_inception"):
        InceptionV3.from_pytorch_fid(tmp_path / "weights.npz")


def test_uint8_rgb_input_enforced(net, ref):
    """FID is defined on 8-bit RGB images: floats and grey images raise before any compile."""
    with pytest.raises(TypeError, match="(?i)uint8"):
        net(ref["images_64x48"].astype(np.float32) / 255)
    with pytest.raises((TypeError, ValueError)):
        net(ref["images_64x48"][..., :1])


def test_random_init_is_the_loaded_network_with_he_weights(net):
    """InceptionV3(key=...) has the loaded network's structure and shapes (so one compiled program
    serves both); its convs are He-normal, std sqrt(2/fan_in), and its BatchNorms the identity.
    (Traced, not run: an eager init of all 94 layers costs seconds of per-shape compiles.)"""

    def shapes(tree):
        return jax.tree.map(lambda x: (x.shape, x.dtype), tree)

    abstract = eqx.filter_eval_shape(InceptionV3, key=jax.random.key(0))
    assert jax.tree.structure(abstract) == jax.tree.structure(net) and shapes(abstract) == shapes(net)
    layer = BasicConv2d(768, 192, (7, 1), padding=(3, 0), key=jax.random.key(1))  # Mixed_6e.branch7x7_3
    std = float(np.std(np.asarray(layer.conv.weight)))
    assert abs(std / np.sqrt(2 / (7 * 768)) - 1) < 0.02  # 1.0M draws: the sample std is within 0.1%
    bn = layer.bn
    x = jax.random.normal(jax.random.key(2), (1, 2, 2, 192))
    np.testing.assert_allclose(bn(x), x / np.sqrt(1 + bn.eps), rtol=1e-6)


@pytest.mark.usefixtures("optimised_compile")  # the network at 299²: its long fused loops
def test_real_network_through_the_fid_path(state, ref, tmp_path):
    """open_fid loads the weights file and checks it against a 2048-d statistics file; fid_of_samples
    takes grayscale 64×48 samples (padded to a batch over the 8 devices), repeats them to RGB and
    lets the network resize them. Against: the network called directly on the RGB-repeated images
    (its resize and 64×48 parity with pytorch-fid: the tests above), then the Fréchet distance of
    two low-rank Gaussians in float64, tr((Σx Σz)^½) = ‖Xc Zcᵀ‖_* / √((n-1)(m-1)) (the singular
    values of the centred cross-product), not the eigenvalue route of frechet_distance_of_few."""
    from eqxdiff.eval import fid_of_samples, open_fid, save_stats

    save_file(state, str(tmp_path / "fid_inception.safetensors"))
    z = np.concatenate([ref["pool3_299"], ref["pool3_64x48"]]).astype(np.float64)  # pytorch-fid's features
    save_stats(tmp_path / "ref.npz", z.mean(axis=0), np.cov(z, rowvar=False))
    gray = np.moveaxis(ref["images_64x48"][0], -1, 0)[..., None]  # the R, G and B planes: 3 gray images
    network, reference = open_fid(tmp_path / "fid_inception.safetensors", tmp_path / "ref.npz", gray.shape[1:])
    result = fid_of_samples(lambda start, size: gray[start : start + size], 3, network, reference, chunk_size=3)

    # The compiled `features` of the parity test: batch 1, 64×48×3.
    x = np.concatenate([np.asarray(features(network, np.repeat(g[None], 3, axis=-1))) for g in gray]).astype(np.float64)
    xc, zc = x - x.mean(axis=0), z - z.mean(axis=0)
    (n, _), (m, _) = x.shape, z.shape
    trace_sqrt = np.linalg.svd(xc @ zc.T, compute_uv=False).sum() / np.sqrt((n - 1) * (m - 1))
    expected = np.sum((x.mean(axis=0) - z.mean(axis=0)) ** 2) + (xc**2).sum() / (n - 1) + (zc**2).sum() / (m - 1)
    expected -= 2 * trace_sqrt
    assert result["num"] == 3 and result["fid"] == pytest.approx(expected, rel=1e-4)
