"""Large images through the VAE: diffusers' `enable_tiling()` reproduced on a committed fixture
(tools/make_vae_tiling_fixture.py: 40×76 images in 32² tiles, two rows of four, edge tiles cut short), also through
`decode_latents` and train/encode.py's `--vae_tiling`; `enable_slicing()` equal to the whole batch, and the
mid-block attention taken a block of queries at a time, equal to the softmax over all keys (a float64 reference)
with no n×n matrix in the program."""

import json
import shutil
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import train_scripts  # noqa: F401 — puts train/ on sys.path: a test of the scripts
import encode  # train/encode.py
from eqxdiff.autoencoders import open_autoencoder
from eqxdiff.data import stack_records
from eqxdiff.data.latents import LatentSource
from eqxdiff.data.offline import pad_rows
from eqxdiff.generate import decode_latents
from eqxdiff.images import from_uint8
from eqxdiff.nn import AutoencoderKL
from eqxdiff.nn import vae_blocks
from eqxdiff.nn.vae_blocks import Attention, chunked_attention
from eqxdiff.nn.vae_tiling import blend_h, blend_v, decode_in_pieces, encode_in_pieces, tiled
from eqxdiff.sharding import batch_sharding, make_mesh

DATA = Path(__file__).parents[1] / "data" / "autoencoder_kl"
TOL = 2e-5  # the VAE parity bound of test_autoencoder_kl.py


@pytest.fixture(scope="module")
def ref() -> dict[str, np.ndarray]:
    with np.load(DATA / "tiled" / "reference.npz") as f:
        return dict(f)


@pytest.fixture(scope="module")
def tiled_vae_folder(tmp_path_factory) -> Path:
    """sd_like's weights (the fixture's VAE) with sample_size 32: tiles of 32² pixels, 8² latents."""
    folder = tmp_path_factory.mktemp("tiled_vae")
    shutil.copy(DATA / "sd_like" / "diffusion_pytorch_model.safetensors", folder)
    config = json.loads((DATA / "sd_like" / "config.json").read_text()) | {"sample_size": 32}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def vae(tiled_vae_folder) -> AutoencoderKL:
    return AutoencoderKL.from_diffusers(tiled_vae_folder)


def images(ref) -> np.ndarray:
    return ref["x_uint8"].astype(np.float32) / 127.5 - 1


@pytest.mark.slow  # 6 edge-tile shapes per direction (diffusers'): 15 VAE compiles, 2 whole decodes, ~20 s on 2 cores
def test_tiled_encode_and_decode_match_diffusers(vae, tiled_vae_folder, ref):
    """encode_in_pieces as train/encode.py calls it (its rows and weights over the 8 devices: the test below then
    compiles no tile of its own), and decode_in_pieces as decode_latents calls it (the scripts' grids and sample.py,
    on one device): with --vae_tiling "on" the latents as the diffusion model sees them, unscaled, decode to
    diffusers' tiled images; "auto" leaves these small images whole, the untiled decode (one test: the decode's 6 tile
    programs compiled once for both)."""
    assert vae.tile_sample_size == 32
    devices = make_mesh(devices=jax.local_devices())  # encode.py's batch of 8: the 2 images, the last repeated
    rows = jax.device_put(pad_rows(ref["x_uint8"], 8), batch_sharding(devices))
    mean, logvar = encode_in_pieces(open_autoencoder(str(tiled_vae_folder), mesh=devices), from_uint8(rows))
    np.testing.assert_allclose(mean[:2], ref["mean"], rtol=0, atol=TOL)
    np.testing.assert_allclose(logvar[:2], ref["logvar"], rtol=0, atol=TOL)
    mesh = make_mesh(1, 1, jax.devices()[:1])
    scaled = (ref["z"] - vae.shift_factor) * vae.scaling_factor
    decoded = decode_latents(vae, scaled, mesh=mesh, tiling="on")
    assert decoded.shape == (2, 40, 76, 3)
    np.testing.assert_allclose(decoded, ref["decoded"], rtol=0, atol=TOL)
    whole = decode_latents(vae, scaled, mesh=mesh, tiling="auto")
    np.testing.assert_allclose(whole, decode_in_pieces(vae, ref["z"], tiling=False), rtol=0, atol=1e-5)
    # The tiles are seen: the untiled VAE is far from the tiled reference.
    untiled_mean, _ = encode_in_pieces(vae, images(ref), tiling=False)
    assert np.abs(np.asarray(untiled_mean) - ref["mean"]).max() > 0.05
    assert np.abs(whole - ref["decoded"]).max() > 0.05


@pytest.mark.slow  # encode.py twice; its tiles' programs are the test above's (on its own: 6 tile compiles, ~5 s)
def test_encode_py_tiles_as_diffusers(tiled_vae_folder, ref, tmp_path):
    """encode.py --vae_tiling on (auto batch size) stores diffusers' tiled posterior, float16-rounded;
    --vae_tiling auto leaves these small images whole."""
    np.savez(tmp_path / "images.npz", images=ref["x_uint8"], labels=np.array([0, 1]))
    stored = {}
    for mode in ("on", "auto"):
        out = tmp_path / mode
        flags = ["--dataset", f"npz:{tmp_path / 'images.npz'}", "--vae", str(tiled_vae_folder), "--out", str(out)]
        encode.main(encode.parse_config([*flags, "--vae_tiling", mode]))
        latents = LatentSource(out, "latents:x")
        stored[mode] = stack_records([latents[i] for i in range(len(latents))], latents.fields)
    for name in ("mean", "logvar"):
        got = stored["on"][name].astype(np.float32)
        assert np.all(np.abs(got - ref[name]) <= np.abs(ref[name]) * 2**-11 + 2e-5), name
    assert np.abs(stored["auto"]["mean"].astype(np.float32) - ref["mean"]).max() > 0.05


def test_slicing_is_the_whole_batch_one_image_at_a_time(vae, ref):
    """At one tile's size, whose one-image program test_small_inputs_are_not_tiled then reuses."""
    x = images(ref)[:, :32, :32]
    whole = eqx.filter_jit(lambda vae, x: vae.encode(x))(vae, x)
    sliced = encode_in_pieces(vae, x, tiling=False, slicing=True)
    for a, b in zip(sliced, whole, strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)
    assert np.abs(np.asarray(sliced[0][0] - sliced[0][1])).max() > 0.1  # two different images, in order


def diffusers_tiled(run_tile, x: np.ndarray, tile: int, tile_out: int, overlap: float = 0.25) -> np.ndarray:
    """diffusers 0.42.1's `tiled_decode` transcribed in float64 numpy, NHWC: every tile run first, then
    blended IN PLACE row by row (`blend_v`, `blend_h` mutate the tile), then cropped and concatenated."""
    stride, extent = int(tile * (1 - overlap)), int(tile_out * overlap)
    keep = tile_out - extent
    rows = [
        [np.array(run_tile(x[:, i : i + tile, j : j + tile]), np.float64) for j in range(0, x.shape[2], stride)]
        for i in range(0, x.shape[1], stride)
    ]
    result_rows = []
    for i, row in enumerate(rows):
        result_row = []
        for j, t in enumerate(row):
            if i > 0:
                a, e = rows[i - 1][j], min(rows[i - 1][j].shape[1], t.shape[1], extent)
                for y in range(e):
                    t[:, y] = a[:, -e + y] * (1 - y / e) + t[:, y] * (y / e)
            if j > 0:
                a, e = row[j - 1], min(row[j - 1].shape[2], t.shape[2], extent)
                for y in range(e):
                    t[:, :, y] = a[:, :, -e + y] * (1 - y / e) + t[:, :, y] * (y / e)
            result_row.append(t[:, :keep, :keep])
        result_rows.append(np.concatenate(result_row, axis=2))
    return np.concatenate(result_rows, axis=1)


@pytest.mark.parametrize(
    "shape, tile, tile_out", [((2, 40, 76, 3), 32, 8), ((1, 10, 19, 2), 8, 32)], ids=["encode_like", "decode_like"]
)
def test_tile_loop_is_diffusers_in_place_blend(shape, tile, tile_out):
    """The tile geometry and blend order of the VAE fixture, with a cheap tile function that, like a
    VAE, depends on the whole tile (its mean is taken off) and changes the size (by `tile_out / tile`)."""

    def run_tile(t):
        scale = tile_out / tile
        t = t - t.mean(axis=(1, 2), keepdims=True) + t[:, :1, :1] ** 2
        if scale > 1:
            return np.repeat(np.repeat(t, int(scale), axis=1), int(scale), axis=2)
        return t[:, :: int(1 / scale), :: int(1 / scale)]

    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    out = tiled(lambda t: jnp.asarray(run_tile(np.asarray(t))), jnp.asarray(x), tile, tile_out)
    expected = diffusers_tiled(run_tile, x, tile, tile_out)
    assert out.shape == expected.shape
    np.testing.assert_allclose(out, expected, rtol=0, atol=1e-5)
    assert np.abs(expected - diffusers_tiled(run_tile, x, tile, tile_out, overlap=0.5)).max() > 0.1


def test_small_inputs_are_not_tiled(vae, ref):
    """diffusers tiles only what exceeds a tile: a 32² image and a 8² latent go whole."""
    x = images(ref)[:1, :32, :32]
    np.testing.assert_array_equal(encode_in_pieces(vae, x)[0], encode_in_pieces(vae, x, tiling=False)[0])
    z = ref["z"][:1, :8, :8]
    np.testing.assert_array_equal(decode_in_pieces(vae, z), decode_in_pieces(vae, z, tiling=False))


def test_blends_are_diffusers_linear_ramps():
    a, b = np.full((1, 5, 3, 1), 2.0, np.float32), np.zeros((1, 4, 3, 1), np.float32)
    out = np.asarray(blend_v(a, b, 3))[0, :, 0, 0]
    np.testing.assert_allclose(out, [2.0, 2 * (1 - 1 / 3), 2 * (1 - 2 / 3), 0.0], rtol=1e-6)
    out = np.asarray(blend_h(a.swapaxes(1, 2), b.swapaxes(1, 2), 8))[0, 0, :, 0]  # extent shrinks to 4
    np.testing.assert_allclose(out, [2.0, 1.5, 1.0, 0.5], rtol=1e-6)


def test_a_tile_the_vae_cannot_cut_is_named(vae, ref):
    with pytest.raises(ValueError, match="tile 30 with overlap 0.25.*multiples of the VAE's downsampling factor 4"):
        encode_in_pieces(vae, images(ref), tile=30)


def attention_float64(q, k, v):
    """softmax(q kᵀ / sqrt(d)) v per head, in float64 numpy."""
    q, k, v = (np.asarray(t, np.float64) for t in (q, k, v))
    logits = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
    weights = np.exp(logits - logits.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    return np.einsum("bhqk,bkhd->bqhd", weights, v)


@pytest.mark.parametrize("n, chunk", [(37, 8), (32, 8), (20, 64)], ids=["padded", "whole_blocks", "one_block"])
def test_chunked_attention_is_attention(n, chunk):
    q, k, v = np.random.default_rng(n).standard_normal((3, 2, n, 1, 8)).astype(np.float32) * 2
    out = jax.jit(chunked_attention, static_argnums=3)(q, k, v, chunk)
    np.testing.assert_allclose(out, attention_float64(q, k, v), rtol=0, atol=1e-5)


def test_mid_block_attention_has_no_full_matrix(monkeypatch):
    """40×40 latents = 1600 tokens > QUERY_CHUNK: the program holds [1024, 1600] logits, not [1600, 1600],
    and equals the unchunked attention."""
    block = Attention(8, 2, key=jax.random.key(0))
    x = np.random.default_rng(0).standard_normal((1, 40, 40, 8)).astype(np.float32)
    chunked = eqx.filter_jit(block)(x)
    program = str(jax.make_jaxpr(block)(x))
    assert "1600,1600" not in program and "1024,1600" in program
    monkeypatch.setattr(vae_blocks, "QUERY_CHUNK", 4096)
    assert "1600,1600" in str(jax.make_jaxpr(block)(x))
    np.testing.assert_allclose(chunked, eqx.filter_jit(block)(x), rtol=0, atol=1e-5)
