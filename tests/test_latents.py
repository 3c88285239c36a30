"""Pre-encoded latents: SpaceToDepth against numpy, train/encode.py's shards and meta.json read
back by LatentSource (digits through SpaceToDepth, the tiny AutoencoderKL fixture), resume after
an interruption, refusals of mixed or incomplete folders, and the autoencoder specs."""

import hashlib
import json
import shutil
from pathlib import Path

import equinox as eqx
import jax.numpy as jnp
import numpy as np
import pytest
from jaxtyping import install_import_hook

from eqxdiff.data import ImageSource, open_source, stack_records
from eqxdiff.data.latents import META, LatentSource, shard_name
from eqxdiff.nn import AutoencoderKL, SpaceToDepth

with install_import_hook("eqxdiff", "beartype.beartype"):  # conftest's hook does not list this module
    from eqxdiff.autoencoders import Autoencoder, describe_autoencoder, open_autoencoder

import encode  # train/encode.py (conftest puts train/ on the path)
import runs

SD_LIKE = Path(__file__).parent / "data" / "autoencoder_kl" / "sd_like"
SHARD_SIZE = 500  # digits with their mirror images: 3,594 examples -> 8 shards
DIGITS_FLAGS = ["--dataset", "digits", "--vae", "space_to_depth:2", "--shard_size", SHARD_SIZE, "--hflip_copies"]
WEIGHTS = "diffusion_pytorch_model.safetensors"


def run_encode(out: Path, *flags) -> None:
    encode.main(encode.parse_config(["--out", str(out), "--batch_size", "64", *map(str, flags)]))


def unshuffle(x: np.ndarray, f: int) -> np.ndarray:
    """Space-to-depth written out index by index: channel (di*f + dj)*c + k of latent pixel (i, j)
    is input pixel (i*f + di, j*f + dj), channel k."""
    b, h, w, c = x.shape
    out = np.zeros((b, h // f, w // f, f * f * c), x.dtype)
    for di in range(f):
        for dj in range(f):
            out[..., (di * f + dj) * c : (di * f + dj + 1) * c] = x[:, di::f, dj::f, :]
    return out


def shard_paths(folder: Path) -> list[Path]:
    return sorted(folder.glob("shard-*"))


@pytest.fixture(scope="module")
def digits_latents(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("digits_latents")
    run_encode(out, *DIGITS_FLAGS)
    return out


def test_space_to_depth_is_exact_in_a_fixed_channel_order():
    x = np.random.default_rng(0).normal(size=(2, 6, 8, 3)).astype(np.float32)
    s2d = SpaceToDepth(2)
    mean, logvar = s2d.encode(jnp.asarray(x))
    np.testing.assert_array_equal(np.asarray(mean), unshuffle(x, 2))
    assert np.all(np.asarray(logvar) == -30.0)
    np.testing.assert_array_equal(np.asarray(s2d.decode(mean)), x)
    assert (s2d.scaling_factor, s2d.shift_factor, s2d.downsample_factor) == (1.0, 0.0, 2)
    assert isinstance(s2d, Autoencoder) and isinstance(AutoencoderKL.from_diffusers(SD_LIKE), Autoencoder)
    with pytest.raises(ValueError, match="divisible by 4"):
        SpaceToDepth(4).encode(jnp.zeros((1, 6, 8, 3)))


def test_encoded_digits_are_the_space_to_depth_of_the_digits(digits_latents):
    digits = open_source("digits")
    images = np.stack([digits[i]["image"] for i in range(len(digits))])
    labels = np.array([digits[i]["label"] for i in range(len(digits))])
    latents = LatentSource(digits_latents, "latents:x")
    n = len(digits)
    assert len(latents) == 2 * n and latents.meta["count"] == 2 * n
    assert len(shard_paths(digits_latents)) == 8 and not list(digits_latents.glob("*.tmp"))
    assert latents.image_shape == (4, 4, 4) and latents.num_classes == 10
    got = stack_records([latents[i] for i in range(2 * n)], latents.fields)
    assert got["mean"].dtype == np.float16 and got["label"].dtype == np.int32
    pixels = images.astype(np.float32) / 127.5 - 1
    mirrored = pixels[:, :, ::-1]  # examples n..2n-1: the hflip copies, in the same order
    want = unshuffle(np.concatenate([pixels, mirrored]), 2).astype(np.float16)
    np.testing.assert_array_equal(got["mean"], want)
    assert np.all(got["logvar"] == -30.0)
    np.testing.assert_array_equal(got["label"], np.concatenate([labels, labels]))
    meta = latents.meta
    assert meta["source"] == "digits" and meta["image_shape"] == [8, 8, 1] and meta["hflip_copies"] is True
    assert meta["vae"] == {"spec": "space_to_depth:2", "path": None, "weights_sha256": None}
    assert (meta["scaling_factor"], meta["shift_factor"], meta["latent_shape"]) == (1.0, 0.0, [4, 4, 4])


def test_open_source_reads_latents(digits_latents):
    latents = open_source(f"latents:{digits_latents}")
    assert isinstance(latents, LatentSource) and isinstance(latents, ImageSource)
    assert {k: (f.shape, f.dtype) for k, f in latents.fields.items()} == {
        "mean": ((4, 4, 4), np.float16), "logvar": ((4, 4, 4), np.float16), "label": ((), np.int32),
    }  # fmt: skip
    assert stack_records([latents[i] for i in range(5)], latents.fields)["mean"].shape == (5, 4, 4, 4)
    with pytest.raises(FileNotFoundError, match="not found"):
        open_source(f"latents:{digits_latents}/nothing")


def test_an_interrupted_encode_resumes_with_the_missing_shard_only(digits_latents, tmp_path):
    out = tmp_path / "latents"
    shutil.copytree(digits_latents, out)
    (out / META).unlink()  # the run stopped before the end ...
    lost = out / shard_name(3, 8)
    lost.unlink()  # ... with shard 3 unwritten, and shard 3 and 5 half-written under temporary names
    stale = [out / (shard_name(k, 8) + ".tmp") for k in (3, 5)]
    for path in stale:
        path.write_bytes(b"half a shard")
    before = {p.name: p.stat().st_mtime_ns for p in shard_paths(out) if p.suffix != ".tmp"}
    with pytest.raises(FileNotFoundError, match="encode.py"):
        LatentSource(out, "latents:x")
    run_encode(out, *DIGITS_FLAGS)
    assert not any(p.exists() for p in stale)
    after = {p.name: p.stat().st_mtime_ns for p in shard_paths(out)}
    assert {k: after[k] for k in before} == before and set(after) == set(before) | {lost.name}
    for name in after:
        assert (out / name).read_bytes() == (digits_latents / name).read_bytes(), name
    assert json.loads((out / META).read_text()) == json.loads((digits_latents / META).read_text())


def test_a_folder_of_another_encode_is_refused(digits_latents, tmp_path):
    out = tmp_path / "latents"
    shutil.copytree(digits_latents, out)
    with pytest.raises(SystemExit, match="another encode.*hflip_copies"):
        run_encode(out, *DIGITS_FLAGS[:-1])
    (out / META).unlink()  # unfinished: encode.json, written at the start, still guards it
    with pytest.raises(SystemExit, match="another encode.*latent_shape.*vae"):
        run_encode(out, *DIGITS_FLAGS[:3], "space_to_depth:4", *DIGITS_FLAGS[4:])


def test_incomplete_folders_are_refused(digits_latents, tmp_path):
    out = tmp_path / "latents"
    shutil.copytree(digits_latents, out)
    (out / shard_name(6, 8)).unlink()
    with pytest.raises(FileNotFoundError, match=r"lacks 1 of 8 shards.*encode\.py"):
        LatentSource(out, "latents:x")
    shutil.copy(digits_latents / shard_name(6, 8), out / shard_name(6, 8))
    meta = json.loads((out / META).read_text())
    (out / META).write_text(json.dumps({**meta, "count": meta["count"] + 1}))
    with pytest.raises(ValueError, match=r"holds 3594 records.*3595.*encode\.py"):
        LatentSource(out, "latents:x")


def test_encode_with_an_autoencoder_kl_folder_stores_its_moments(tmp_path):
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (6, 16, 16, 3), dtype=np.uint8)  # 6 < one batch of 8: padded
    labels = np.array([0, 1, 2, 0, 1, 2])
    np.savez(tmp_path / "rgb.npz", images=images, labels=labels)
    out = tmp_path / "latents"
    encode.main(encode.parse_config(
        ["--dataset", f"npz:{tmp_path / 'rgb.npz'}", "--vae", str(SD_LIKE), "--out", str(out), "--batch_size", "8"]
    ))  # fmt: skip
    latents = LatentSource(out, "latents:x")
    got = stack_records([latents[i] for i in range(len(latents))], latents.fields)
    vae = AutoencoderKL.from_diffusers(SD_LIKE)
    mean, logvar = eqx.filter_jit(lambda v, x: v.encode(x))(vae, jnp.asarray(images, jnp.float32) / 127.5 - 1)
    for name, want in (("mean", np.asarray(mean)), ("logvar", np.asarray(logvar))):
        assert got[name].dtype == np.float16 and got[name].shape == (6, 4, 4, 4)
        # float16 keeps 11 significant bits: within half a unit in the last place, plus float32 noise
        assert np.all(np.abs(got[name].astype(np.float32) - want) <= np.abs(want) * 2**-11 + 1e-5), name
    np.testing.assert_array_equal(got["label"], labels)
    meta = latents.meta
    assert meta["vae"]["path"] == str(SD_LIKE.resolve()) and meta["scaling_factor"] == vae.scaling_factor == 0.18215
    assert meta["vae"]["weights_sha256"] == hashlib.sha256((SD_LIKE / WEIGHTS).read_bytes()).hexdigest()


def test_autoencoder_specs(tmp_path):
    assert open_autoencoder("space_to_depth:4") == SpaceToDepth(4)
    weights = (SD_LIKE / WEIGHTS).read_bytes()
    described = describe_autoencoder(str(SD_LIKE))
    sha256 = hashlib.sha256(weights).hexdigest()  # the file read whole; describe_autoencoder reads it in chunks
    assert described == {"spec": str(SD_LIKE), "path": str(SD_LIKE.resolve()), "weights_sha256": sha256}
    assert json.loads(json.dumps(described)) == described
    for bad in ("space_to_depth:0", "space_to_depth:x"):
        with pytest.raises(ValueError, match="accepted forms are space_to_depth:F"):
            open_autoencoder(bad)
    with pytest.raises(FileNotFoundError, match="not a diffusers VAE folder.*space_to_depth:F"):
        open_autoencoder(str(SD_LIKE.parent / "nothing"))
    with pytest.raises(SystemExit, match=r"space_to_depth:3 cannot encode the images of digits.*divisible by 3"):
        run_encode(tmp_path, "--dataset", "digits", "--vae", "space_to_depth:3")


@pytest.mark.slow
def test_two_processes_write_the_same_shards_as_one(digits_latents, tmp_path):
    from launch_local import free_port  # train/launch_local.py

    out = tmp_path / "latents"
    flags = [*DIGITS_FLAGS, "--out", out, "--batch_size", 64, "--cpu_devices", 2,
             "--coordinator", f"127.0.0.1:{free_port()}", "--num_processes", 2]  # fmt: skip
    procs = [runs.start("encode.py", *flags, "--process_id", i) for i in range(2)]
    for proc in procs:
        code, output = proc.finish(timeout=300)
        assert code == 0, output[-4000:]
    names = [p.name for p in shard_paths(digits_latents)]
    assert [p.name for p in shard_paths(out)] == names
    for name in [*names, META]:
        assert (out / name).read_bytes() == (digits_latents / name).read_bytes(), name
