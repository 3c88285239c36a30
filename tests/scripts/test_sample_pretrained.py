"""train/sample_pretrained.py --pretrained dit:FILE | sit:FILE: a published checkpoint sampled by its paper's
protocol, decoded by the SD VAE and written as ADM's sample batch, as DiT's and SiT's sample_ddp.py
do; checked on the committed random-weight DiT and SiT (tests/data/dit, sit) and SD-like VAE."""

import functools
from pathlib import Path

import equinox as eqx
import jax
import numpy as np
import pytest

import train_scripts  # noqa: F401 — puts train/ on sys.path: a test of the scripts
import sample_pretrained  # train/sample_pretrained.py
from eqxdiff.eval.sample_batches import chunk_key
from sample_pretrained import to_uint8_official

from eqxdiff.nn import AutoencoderKL
from eqxdiff.pretrained import load_dit, load_sit, sample_dit, sample_sit

DATA = Path(__file__).parents[1] / "data"
DIT, SIT = DATA / "dit" / "ema.safetensors", DATA / "sit" / "ema.safetensors"
VAE = DATA / "autoencoder_kl" / "sd_like"


def run(*flags) -> None:
    flags = [*map(str, flags)]
    flags += ["--num_heads", "2"]  # the committed DiT and SiT are not of an official size
    sample_pretrained.main(sample_pretrained.parse_args(flags))


@functools.cache
def sd_like_vae() -> AutoencoderKL:
    return AutoencoderKL.from_diffusers(VAE)


# The VAE's decode as one program (both families' 8 latents: compiled once), not op by op (half of a case's time).
decode = eqx.filter_jit(lambda vae, latents: vae.decode(latents))


def decoded_as_sample_ddp(latents) -> np.ndarray:
    """DiT's sample_ddp.py: `vae.decode(samples / 0.18215).sample`, then clamp(127.5·x + 128) as uint8."""
    images = np.asarray(decode(sd_like_vae(), latents / 0.18215), np.float64)
    return np.clip(127.5 * images + 128.0, 0, 255).astype(np.uint8)


def test_official_uint8_conversion_is_sample_ddps():
    x = np.array([-1.0, -0.5, 0.0, 0.999, 1.0, 1.5])
    # 127.5·x + 128 = 0.5, 64.25, 128, 255.37, 255.5, 319.25 -> truncated, clamped
    assert to_uint8_official(x).tolist() == [0, 64, 128, 255, 255, 255]


@pytest.mark.slow  # the script end to end, its sampler and the VAE compiled again by hand
@pytest.mark.parametrize("family", ["dit", "sit"])
def test_a_batch_is_the_protocol_decoded_as_sample_ddp(family, tmp_path):
    out = tmp_path / f"{family}.npz"
    method = ["--method", "ddpm"] if family == "dit" else ["--method", "ode", "--sampler", "heun"]
    run(
        "--pretrained",
        f"{family}:{DIT if family == 'dit' else SIT}",
        "--vae",
        VAE,
        "--num",
        12,
        "--batch_size",
        8,
        "--steps",
        4,
        "--guidance",
        2.0,
        "--seed",
        3,
        *method,
        "--out",
        out,
    )
    with np.load(out) as f:
        images, labels = f["arr_0"], f["arr_1"]
    assert images.shape == (12, 32, 32, 3) and images.dtype == np.uint8  # 8² latents, the VAE's 4x
    assert sorted(np.bincount(labels, minlength=10)) == [1] * 8 + [2] * 2  # 10 classes, balanced
    # Chunk 0 (8 rows) by hand: its key split into x_T's and the sampler's, the family's sampler, decoded.
    noise_key, sampler_key = jax.random.split(chunk_key(3, 0))
    noise = jax.random.normal(noise_key, (8, 8, 8, 4))
    if family == "dit":
        latents = sample_dit(
            load_dit(DIT, 2),
            jax.numpy.asarray(labels[:8], jax.numpy.int32),
            noise,
            steps=4,
            method="ddpm",
            guidance=2.0,
            key=sampler_key,
        )
    else:
        latents = sample_sit(
            load_sit(SIT, 2),
            jax.numpy.asarray(labels[:8], jax.numpy.int32),
            noise,
            steps=4,
            method="ode",
            sampler="heun",
            guidance=2.0,
        )
    want = decoded_as_sample_ddp(latents)
    assert np.abs(images[:8].astype(int) - want).max() <= 1  # one level: sharded vs one-device rounding at .5
    assert np.mean(images[:8] == want) > 0.99


def test_pretrained_defaults_are_the_official_scripts(tmp_path, monkeypatch):
    seen = {}
    monkeypatch.setattr(sample_pretrained, "write_sample_batches", lambda *a, **k: seen.update(k["flags"]))
    run("--pretrained", f"dit:{DIT}", "--vae", VAE, "--out", tmp_path / "d.npz")
    assert (seen["--method"], seen["--steps"], seen["--guidance"]) == ("ddpm", 250, 1.5)  # DiT's sample_ddp.py
    run("--pretrained", f"sit:{SIT}", "--vae", VAE, "--out", tmp_path / "s.npz")
    assert (seen["--method"], seen["--sampler"], seen["--steps"], seen["--guidance"]) == ("ode", "dopri5", 250, 1.0)


@pytest.mark.parametrize(
    "flags, phrase",
    [
        (["--pretrained", "dot:x.pt"], "give dit:FILE or sit:FILE"),
        (["--pretrained", "dit:missing.pt"], "no file missing.pt: it does not exist"),
        (["--pretrained", f"dit:{VAE}"], "it is a model folder (config.json: AutoencoderKL); give dit:FILE"),
        (["--pretrained", f"dit:{DIT}"], "needs --vae FOLDER"),
        (["--pretrained", f"dit:{DIT}", "--vae", VAE, "--prompts", "a cat"], "--prompts, --negative_prompts and"),
        (["--pretrained", f"dit:{DIT}", "--vae", VAE, "--method", "ode"], "samples with ddpm or ddim"),
        (["--pretrained", f"dit:{DIT}", "--vae", VAE, "--sampler", "heun"], "--sampler chooses SiT's"),
        (["--pretrained", f"sit:{SIT}", "--vae", VAE, "--eval"], "train/evaluate.py"),
        (["--pretrained", f"dit:{DIT}", "--vae", VAE, "--classes", "10"], "indices in 0..9"),
        (["--pretrained", f"dit:{VAE / 'diffusion_pytorch_model.safetensors'}", "--vae", VAE], "not a DiT state_dict"),
    ],
)
def test_pretrained_refusals_name_the_fix(flags, phrase, tmp_path, capsys):
    with pytest.raises(SystemExit) as refused:
        run(*flags, "--out", tmp_path / "x.npz")
    assert phrase in f"{refused.value.code} {capsys.readouterr().err}"  # resolved's SystemExit, or the parser's line


def test_a_run_and_a_published_checkpoint_are_two_scripts(capsys):
    """train/sample.py samples a run, train/sample_pretrained.py a published checkpoint: each one's flags given to
    the other are one line naming the script that takes them."""
    import sample  # train/sample.py

    for parse, flags, said in [
        (sample.parse_args, ["--pretrained", f"dit:{DIT}"], "python train/sample_pretrained.py --pretrained dit:FILE"),
        (sample.parse_args, ["--run_dir", "r", "--vae", str(VAE)], "--vae: python train/sample_pretrained.py"),
        (sample.parse_args, ["--run_dir", "r", "--negative_prompts", "x"], "--negative_prompts: python train/sample_"),
        (
            sample_pretrained.parse_args,
            ["--pretrained", f"dit:{DIT}", "--run_dir", "r"],
            "python train/sample.py --run_dir",
        ),
    ]:
        with pytest.raises(SystemExit) as exited:
            parse(flags)
        err = capsys.readouterr().err.strip().splitlines()
        assert exited.value.code == 2 and len(err) == 1 and said in err[0], err
