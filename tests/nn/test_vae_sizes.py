"""Sizes that follow the image: `auto_batch_size` (`train/encode.py --batch_size 0`, `decode_latents`),
`--vae_tiling auto|on|off` (`use_tiling`), and tiling wired through `decode_latents`, cheaply (tiling through
decode_latents and encode.py against diffusers' tiled fixture: test_vae_tiling.py, which compiles the tiles)."""

import equinox as eqx
import jax
import numpy as np
import pytest

import train_scripts  # noqa: F401 — puts train/ on sys.path: a test of the scripts
import encode  # train/encode.py
from eqxdiff.autoencoders import MAX_AUTO_BATCH, PIXELS_PER_BATCH, auto_batch_size, use_tiling
import eqxdiff.generate as generate_module
from eqxdiff.generate import decode_latents
from eqxdiff.nn import AutoencoderKL, SpaceToDepth
from eqxdiff.sharding import make_mesh


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
