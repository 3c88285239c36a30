"""Sizes that follow the image: `auto_batch_size` (`train/encode.py --batch_size 0`, `decode_latents`),
`--vae_tiling auto|on|off` (`use_tiling`), and tiling wired through `decode_latents` and encode.py
(there against diffusers' tiled moments, tests/data/autoencoder_kl/tiled)."""

import json
import shutil
from pathlib import Path

import equinox as eqx
import jax
import numpy as np
import pytest

import train_scripts  # noqa: F401 — puts train/ on sys.path: a test of the scripts
import encode  # train/encode.py
from eqxdiff.autoencoders import MAX_AUTO_BATCH, PIXELS_PER_BATCH, auto_batch_size, use_tiling
from eqxdiff.data import stack_records
from eqxdiff.data.latents import LatentSource
import eqxdiff.generate as generate_module
from eqxdiff.generate import decode_latents
from eqxdiff.nn import AutoencoderKL, SpaceToDepth
from eqxdiff.nn.vae_tiling import decode_in_pieces
from eqxdiff.sharding import make_mesh

DATA = Path(__file__).parents[1] / "data" / "autoencoder_kl"


def vae_folder(folder: Path, sample_size: int = 32) -> Path:
    """sd_like's weights with `sample_size` (tiles of 32² pixels, 8² latents)."""
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copy(DATA / "sd_like" / "diffusion_pytorch_model.safetensors", folder)
    config = json.loads((DATA / "sd_like" / "config.json").read_text()) | {"sample_size": sample_size}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize(
    "hw, multiple, count, expected",
    [
        ((512, 512), 1, None, 1),
        ((256, 256), 1, None, 4),
        ((256, 256), 8, None, 8),
        ((1024, 1024), 8, None, 8),
        ((32, 32), 1, None, 256),
        ((8, 8), 1, None, MAX_AUTO_BATCH),
        ((100, 100), 1, None, PIXELS_PER_BATCH // 10_000),
        ((32, 32), 8, 6, 8),
        ((32, 32), 1, 6, 6),
        ((1024, 1024), 1, None, 1),
        ((128, 512), 1, None, 4),
    ],
)
def test_auto_batch_size_follows_the_pixels(hw, multiple, count, expected):
    assert auto_batch_size(hw, multiple, count) == expected


def test_tiling_modes():
    vae = eqx.filter_eval_shape(AutoencoderKL, {"sample_size": 512}, key=jax.random.key(0))
    assert [use_tiling("auto", vae, (s, s)) for s in (256, 512, 768, 769, 1024)] == [False] * 3 + [True] * 2
    assert use_tiling("on", vae, (64, 64)) and not use_tiling("off", vae, (2048, 2048))
    assert not use_tiling("on", SpaceToDepth(2), (2048, 2048))  # weightless: nothing to tile
    with pytest.raises(ValueError, match=r"vae tiling 'yes': one of \('auto', 'on', 'off'\)"):
        use_tiling("yes", vae, (64, 64))


def test_decode_latents_passes_the_unscaled_latents_to_the_tiled_decode(monkeypatch):
    """The wiring, cheaply (a stand-in decode): "on" and "auto" above 768² go through decode_in_pieces with
    z / scaling_factor + shift_factor, in chunks of the auto batch size; "off" does not."""
    config = {
        "sample_size": 32,
        "shift_factor": 0.5,
        "block_out_channels": [8] * 4,
        "norm_num_groups": 4,
        "down_block_types": ["DownEncoderBlock2D"] * 4,
        "up_block_types": ["UpDecoderBlock2D"] * 4,
    }  # f = 8
    vae = eqx.filter_eval_shape(AutoencoderKL, config, key=jax.random.key(0))
    calls = []

    def stand_in(autoencoder, z):
        calls.append(np.asarray(z))
        return jax.numpy.zeros((z.shape[0], z.shape[1] * 8, z.shape[2] * 8, 3))

    monkeypatch.setattr(generate_module, "decode_in_pieces", stand_in)
    mesh = make_mesh(1, 1, jax.devices()[:1])
    latents = np.random.default_rng(0).standard_normal((3, 128, 128, 4)).astype(np.float32)  # 1024² images
    for mode in ("on", "auto"):
        calls.clear()
        assert decode_latents(vae, latents, mesh=mesh, tiling=mode).shape == (3, 1024, 1024, 3)
        assert len(calls) == 3  # auto batch size: one 1024² image per call
        np.testing.assert_allclose(np.concatenate(calls), latents / 0.18215 + 0.5, rtol=0, atol=1e-5)
    calls.clear()
    with pytest.raises(TypeError):  # "off": the abstract VAE itself is called (and cannot run)
        decode_latents(vae, latents, mesh=mesh, tiling="off")
    assert not calls


@pytest.mark.slow  # 4 VAE decode compiles: ~15 s on a shared 2-core box
def test_decode_latents_tiles_as_asked(tmp_path):
    """Latents 4×12 (16×48 images, wider than a 32² tile: one row of two tiles): "on" is diffusers'
    tiled decode, "auto" (far below 768²) the whole latent; the scaling is undone before either."""
    vae = AutoencoderKL.from_diffusers(vae_folder(tmp_path))
    mesh = make_mesh(1, 1, jax.devices()[:1])
    z = np.random.default_rng(0).standard_normal((2, 4, 12, 4)).astype(np.float32)
    scaled = (z - vae.shift_factor) * vae.scaling_factor
    tiled = decode_latents(vae, scaled, mesh=mesh, tiling="on")
    np.testing.assert_allclose(tiled, decode_in_pieces(vae, z), rtol=0, atol=1e-5)
    whole = decode_latents(vae, scaled, mesh=mesh, tiling="auto")
    np.testing.assert_allclose(whole, decode_in_pieces(vae, z, tiling=False), rtol=0, atol=1e-5)
    assert np.abs(tiled - whole).max() > 0.05


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--batch_size", "-1"], "--batch_size >= 0"),
        (["--vae_tiling", "yes"], "invalid choice: 'yes'"),
    ],
)
def test_bad_size_flags_are_refused(flags, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        encode.parse_config(["--vae", "space_to_depth:2", "--out", "x", *flags])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.slow  # diffusers' 6 tile shapes of the fixture, compiled at the auto batch of 8 rows: ~15 s
def test_encode_py_tiles_as_diffusers(tmp_path):
    """encode.py --vae_tiling on (auto batch size) stores diffusers' tiled posterior, float16-rounded;
    --vae_tiling auto leaves these small images whole."""
    with np.load(DATA / "tiled" / "reference.npz") as f:
        ref = dict(f)
    np.savez(tmp_path / "images.npz", images=ref["x_uint8"], labels=np.array([0, 1]))
    folder = vae_folder(tmp_path / "vae")
    stored = {}
    for mode in ("on", "auto"):
        out = tmp_path / mode
        encode.main(
            encode.parse_config(
                [
                    "--dataset",
                    f"npz:{tmp_path / 'images.npz'}",
                    "--vae",
                    str(folder),
                    "--out",
                    str(out),
                    "--vae_tiling",
                    mode,
                ]
            )
        )
        latents = LatentSource(out, "latents:x")
        stored[mode] = stack_records([latents[i] for i in range(len(latents))], latents.fields)
    for name in ("mean", "logvar"):
        got = stored["on"][name].astype(np.float32)
        assert np.all(np.abs(got - ref[name]) <= np.abs(ref[name]) * 2**-11 + 2e-5), name
    assert np.abs(stored["auto"]["mean"].astype(np.float32) - ref["mean"]).max() > 0.05
