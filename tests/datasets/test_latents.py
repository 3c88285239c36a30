"""Pre-encoded latents: SpaceToDepth against numpy, train/encode.py's shards and meta.json read
back by LatentSource (digits through SpaceToDepth, the tiny AutoencoderKL fixture), resume after
an interruption, refusals of mixed or incomplete folders, and the autoencoder specs; captions
(--text_encoder): token ids against the tokenizer, encoded text and the null against the tower
run here, raw captions kept, missing captions and other text settings refused."""

import hashlib
import json
import shutil
from pathlib import Path

import equinox as eqx
import jax.numpy as jnp
import numpy as np
import pytest
from PIL import Image

from eqxdiff.data import ImageSource, TokenizedSource, describe_source, load_tokenizer, open_source, stack_records
from eqxdiff.data.captioned_digits import CaptionedDigitsSource, captioned_digits_tokenizer
from eqxdiff.data.latents import META, LatentSource, null_npz_bytes, shard_name, tokenizer_files_sha256
from eqxdiff.data.records import TextField
from eqxdiff.nn import AutoencoderKL, CLIPTextModel, SpaceToDepth, TextCond
from eqxdiff.run.open_condition import run_condition, sample_prompts

from eqxdiff.autoencoders import Autoencoder, check_autoencoder, describe_autoencoder, open_autoencoder

import train_scripts  # noqa: F401 — puts train/ on sys.path: a test of the scripts
import encode  # train/encode.py
import runs

SD_LIKE = Path(__file__).parents[1] / "data" / "autoencoder_kl" / "sd_like"
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
    assert meta["class_names"] is None and latents.class_names is None  # digits: bare label ids


def test_latents_keep_the_class_names_of_a_folder(tmp_path):
    """meta.json keeps a folder's sub-folder names, which grid rows and sample.py --classes use."""
    rng = np.random.default_rng(0)
    for name in ("dog", "cat"):
        (tmp_path / "images" / name).mkdir(parents=True)
        for i in range(4):
            Image.fromarray(rng.integers(0, 256, (8, 8), dtype=np.uint8)).save(tmp_path / "images" / name / f"{i}.png")
    run_encode(
        tmp_path / "latents",
        "--dataset",
        f"folder:{tmp_path / 'images'}",
        "--image_size",
        8,
        "--vae",
        "space_to_depth:2",
    )
    latents = open_source(f"latents:{tmp_path / 'latents'}")
    assert latents.meta["class_names"] == latents.class_names == ["cat", "dog"]  # sorted: labels 0, 1
    assert [latents[i]["label"] for i in (0, 7)] == [0, 1]
    assert "8 latents, classes 0=cat, 1=dog, model input 4×4×4" in describe_source(latents)


def test_the_scaled_latent_std_is_the_std_of_the_posterior_draws():
    """run_data.scaled_latent_std (train/main.py's start-up check against --sigma_data) against the std of
    many draws z ~ N(mean, exp(logvar)) per record, scaled as `prepare` scales them."""
    from run_data import scaled_latent_std  # train/run_data.py

    rng = np.random.default_rng(3)
    records = [
        {
            "mean": rng.normal(0.5, 2.0, (4, 4, 2)).astype(np.float16),
            "logvar": rng.normal(0.0, 0.5, (4, 4, 2)).astype(np.float16),
        }
        for _ in range(32)
    ]
    mean, logvar = (np.stack([r[k] for r in records]).astype(np.float64) for k in ("mean", "logvar"))
    z = mean + np.exp(logvar / 2) * rng.normal(size=(2000, *mean.shape))
    scale, shift = 0.25, 0.3
    want = ((z - shift) * scale).std()  # the posterior noise adds a quarter of the variance here
    np.testing.assert_allclose(scaled_latent_std(records, scale, shift, num=32), want, rtol=3e-3)
    # Each record four times over: the same pooled distribution, the same figure.
    assert scaled_latent_std(records * 4, scale, shift, num=128) == pytest.approx(want, rel=3e-3)


def test_a_latent_run_warns_at_start_up_when_the_std_is_far_from_sigma_data(digits_latents, tmp_path, capsys):
    """Digits pixels as latents have std 0.75: near the default --sigma_data 1.0, far from 5. The run stops
    after the check, at the missing FID statistics (before anything compiles)."""
    import main as train_main  # train/main.py

    for sigma, warned in (("0", False), ("5", True)):
        flags = [
            "--run_dir",
            str(tmp_path / sigma),
            "--dataset",
            f"latents:{digits_latents}",
            "--sigma_data",
            sigma,
            "--eval_every",
            "1",
            "--fid_ref",
            str(tmp_path / "none.npz"),
            "--inception",
            "unused",
        ]
        with pytest.raises(SystemExit, match="No statistics file"):
            train_main.main(train_main.parse_config(flags), features_fn=lambda images: images.reshape(len(images), -1))
        out = capsys.readouterr().out
        assert ("warning: the latents, scaled by meta.json's factors, have std 0.75" in out) == warned, out
        assert warned == ("far from --sigma_data 5: pass --sigma_data 0.75" in out)


def test_open_source_reads_latents(digits_latents):
    latents = open_source(f"latents:{digits_latents}")
    assert isinstance(latents, LatentSource) and isinstance(latents, ImageSource)
    assert {k: (f.shape, f.dtype) for k, f in latents.fields.items()} == {
        "mean": ((4, 4, 4), np.float16),
        "logvar": ((4, 4, 4), np.float16),
        "label": ((), np.int32),
    }
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
    with pytest.raises(SystemExit, match="another encode.*latent_shape.*vae") as refused:
        run_encode(out, *DIGITS_FLAGS[:3], "space_to_depth:4", *DIGITS_FLAGS[4:])
    said = refused.value.code  # the differing values, each a few words: one line a user reads (not ~600 characters)
    assert "latent_shape: [4, 4, 4] there, [2, 2, 16] now" in said and len(said) < 400, said


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
    encode.main(
        encode.parse_config(
            ["--dataset", f"npz:{tmp_path / 'rgb.npz'}", "--vae", str(SD_LIKE), "--out", str(out), "--batch_size", "8"]
        )
    )
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
    with pytest.raises(FileNotFoundError, match="nothing does not exist; the accepted forms are space_to_depth:F"):
        open_autoencoder(str(SD_LIKE.parent / "nothing"))
    with pytest.raises(FileNotFoundError, match="not a diffusers VAE folder.*space_to_depth:F"):
        open_autoencoder(str(SD_LIKE.parent))  # a folder, not a VAE's
    (tmp_path / "vae").symlink_to(SD_LIKE.resolve(), target_is_directory=True)  # a pipeline's folder: names its VAE
    with pytest.raises(FileNotFoundError, match=f"is a pipeline's folder; its VAE is {tmp_path}/vae\\.$"):
        open_autoencoder(f"{tmp_path}/")


def test_a_diffusers_autoencoder_is_read_by_the_port_its_class_names(tmp_path, monkeypatch):
    """A folder's config `_class_name` picks the port (one entry in DIFFUSERS_AUTOENCODERS); a class with
    no port is refused by name, by the check scripts make before their data as by the open."""
    import eqxdiff.autoencoders as autoencoders

    tiny = tmp_path / "vae"
    shutil.copytree(SD_LIKE, tiny)
    config = json.loads((tiny / "config.json").read_text())
    (tiny / "config.json").write_text(json.dumps(dict(config, _class_name="AutoencoderTiny")))
    for call in (open_autoencoder, check_autoencoder, describe_autoencoder):
        with pytest.raises(ValueError, match=r"holds a diffusers AutoencoderTiny, which eqxdiff has no port of"):
            call(str(tiny))

    read = []

    class TinyPort:  # the one edit a new autoencoder needs, beside its module
        @staticmethod
        def from_diffusers(folder, *, place=None):
            read.append((folder, place))
            return SpaceToDepth(2)  # any module with the Autoencoder protocol

    monkeypatch.setitem(autoencoders.DIFFUSERS_AUTOENCODERS, "AutoencoderTiny", TinyPort)
    check_autoencoder(str(tiny))
    assert read == []  # the check reads no weights
    assert open_autoencoder(str(tiny)) == SpaceToDepth(2) and read == [(tiny.resolve(), None)]
    with pytest.raises(SystemExit, match=r"space_to_depth:3 cannot encode the images of digits.*divisible by 3"):
        run_encode(tmp_path, "--dataset", "digits", "--vae", "space_to_depth:3")


@pytest.mark.slow
def test_two_processes_write_the_same_shards_as_one(digits_latents, tmp_path):
    from launch_local import free_port  # train/launch_local.py

    out = tmp_path / "latents"
    flags = [
        *DIGITS_FLAGS,
        "--out",
        out,
        "--batch_size",
        64,
        "--cpu_devices",
        2,
        "--coordinator",
        f"127.0.0.1:{free_port()}",
        "--num_processes",
        2,
    ]
    procs = [runs.start("encode.py", *flags, "--process_id", i) for i in range(2)]
    for proc in procs:
        code, output = proc.finish(timeout=300)
        assert code == 0, output[-4000:]
    names = [p.name for p in shard_paths(digits_latents)]
    assert [p.name for p in shard_paths(out)] == names
    for name in [*names, META]:
        assert (out / name).read_bytes() == (digits_latents / name).read_bytes(), name


# ---------------------------------------------------------------- captions: tokens and encoded text (issue 12 §3)
TOKENIZER = Path(__file__).parents[1] / "data" / "clip_tokenizer" / "sd1"  # 10,514 ids: bos 10512, eos = pad 10513
TOWER_CONFIG = {
    "model_type": "clip_text_model",
    "vocab_size": 10514,
    "max_position_embeddings": 16,
    "hidden_size": 32,
    "intermediate_size": 37,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "hidden_act": "quick_gelu",
    "eos_token_id": 10513,
}
CAPTIONS = {  # file stem -> its .txt (stored stripped); one longer than 16 tokens (truncated), one empty
    "a": "a photo of a cat",
    "b": "  Ünïcode “quotes”, and punctuation!!\n",
    "c": "",
    "d": "a very long caption that runs well past the sixteen positions of the tiny tower, so it is cut",
    "e": "two dogs",
    "f": "a red square",
}


def random_transformers_folder(folder: Path) -> Path:
    return runs.random_clip_folder(folder, TOWER_CONFIG)


def captioned_folder(folder: Path, captions: dict[str, str]) -> Path:
    """16×16 RGB PNGs, each with its caption in a .txt beside it."""
    folder.mkdir()
    rng = np.random.default_rng(1)
    for stem, caption in captions.items():
        Image.fromarray(rng.integers(0, 256, (16, 16, 3), dtype=np.uint8)).save(folder / f"{stem}.png")
        (folder / f"{stem}.txt").write_text(caption, encoding="utf-8")
    return folder


def text_flags(images: Path, encoder: Path) -> list:
    """The flags every text encode here shares: the folder's 6 images in 2 shards, one batch of 8."""
    return [
        "--dataset",
        f"folder:{images}",
        "--image_size",
        16,
        "--vae",
        "space_to_depth:2",
        "--shard_size",
        4,
        "--batch_size",
        8,
        "--text_encoder",
        encoder,
    ]


@pytest.fixture(scope="module")
def text_setup(tmp_path_factory) -> dict:
    """An SD-like checkpoint folder (text_encoder/ with a random tower matching the tokenizer fixture's
    vocabulary, tokenizer/ beside it), a captioned image folder, and its encode with --encode_text."""
    root = tmp_path_factory.mktemp("text")
    encoder = random_transformers_folder(root / "sd" / "text_encoder")
    tower = CLIPTextModel.from_transformers(encoder)
    shutil.copytree(TOKENIZER, root / "sd" / "tokenizer")
    images = captioned_folder(root / "images", CAPTIONS)
    out = root / "latents"
    run_encode(out, *text_flags(images, encoder), "--encode_text")  # tokenizer: the one beside the encoder
    return {"tower": tower, "encoder": encoder, "images": images, "out": out}


@eqx.filter_jit
def tower_outputs(tower: CLIPTextModel, ids, mask):
    return tower(ids, mask)


def within_float16(got: np.ndarray, want: np.ndarray) -> bool:
    """float16 keeps 11 significant bits: within half a unit in the last place, plus float32 noise."""
    error = np.abs(got.astype(np.float32) - want)
    return got.dtype == np.float16 and bool(np.all(error <= np.abs(want) * 2**-11 + 1e-5))


def test_encode_with_a_text_encoder_stores_tokens_and_the_encoded_captions(text_setup):
    out, tower = text_setup["out"], text_setup["tower"]
    latents = LatentSource(out, "latents:x")
    n, d = 16, 32
    # The raw caption is stored too, but declared only with captions=True: text cannot be batched.
    assert {k: (f.shape, np.dtype(f.dtype).name) for k, f in latents.fields.items()} == {
        "mean": ((8, 8, 12), "float16"),
        "logvar": ((8, 8, 12), "float16"),
        "input_ids": ((n,), "int32"),
        "attention_mask": ((n,), "int32"),
        "context": ((n, d), "float16"),
        "pooled": ((d,), "float16"),
    }
    got = stack_records([latents[i] for i in range(len(latents))], latents.fields)
    captions = [CAPTIONS[s].strip() for s in sorted(CAPTIONS)]  # the folder's order: sorted file names
    ids, mask = load_tokenizer(TOKENIZER)([*captions, ""], n)  # the last row: the null's ""
    np.testing.assert_array_equal(got["input_ids"], ids[:-1])
    np.testing.assert_array_equal(got["attention_mask"], mask[:-1])
    assert mask[3].all() and ids[3, -1] == 10513 and mask[2].sum() == 2  # truncated keeps eos; "" is bos, eos
    hidden, pooled = (np.asarray(x) for x in tower_outputs(tower, ids, mask))
    assert within_float16(got["context"], hidden[:-1]) and within_float16(got["pooled"], pooled[:-1])
    assert np.abs(pooled).mean() > 0.1 and np.abs(pooled[0] - pooled[4]).max() > 0.1  # not degenerate
    assert "6 latents, unlabeled, text-conditioned (captions encoded ahead of time)," in describe_source(latents)
    with_captions = LatentSource(out, "latents:x", captions=True)
    assert isinstance(with_captions.fields["caption"], TextField)
    assert [with_captions[i]["caption"] for i in range(len(latents))] == captions

    text = latents.meta["text"]
    null_file = out / text["null"]["file"]
    assert text == {
        "text_encoder": str(text_setup["encoder"].resolve()),
        "weights_sha256": hashlib.sha256((text_setup["encoder"] / "model.safetensors").read_bytes()).hexdigest(),
        "tokenizer": str((text_setup["encoder"].parent / "tokenizer").resolve()),
        "tokenizer_sha256": tokenizer_files_sha256(TOKENIZER),  # by content: the copy hashes as the original
        "max_length": n,
        "null_text": "empty",
        "encoded": True,
        "null": {"file": "null_text.npz", "sha256": hashlib.sha256(null_file.read_bytes()).hexdigest()},
    }
    null = latents.text_null()
    assert isinstance(null, TextCond)
    assert {k: (v.shape, v.dtype.name) for k, v in null.as_dict().items()} == {
        "context": ((1, n, d), "float32"),
        "mask": ((1, n), "int32"),
        "pooled": ((1, d), "float32"),
    }
    with np.load(null_file) as stored:  # the file keeps the dict-era names
        assert sorted(stored.files) == ["context", "mask", "pooled"]
    np.testing.assert_array_equal(null.mask, mask[-1:])
    np.testing.assert_allclose(null.context, hidden[-1:], atol=1e-5)
    np.testing.assert_allclose(null.pooled, pooled[-1:], atol=1e-5)
    null_file.write_bytes(null_file.read_bytes()[:-1] + b"x")
    with pytest.raises(ValueError, match="null_text.npz is not the file meta.json names"):
        latents.text_null()
    null_file.write_bytes(null_npz_bytes(null))  # the same arrays give the same bytes
    np.testing.assert_array_equal(latents.text_null().context, null.context)


def test_tokens_only_zeros_null_missing_captions_and_refusals(text_setup, tmp_path):
    images, encoder = text_setup["images"], text_setup["encoder"]
    missing = tmp_path / "images"
    shutil.copytree(images, missing)
    (missing / "e.txt").unlink()
    with pytest.raises(SystemExit, match=r"No caption for image .*e\.png"):  # one line, status 2 (train/startup.py)
        run_encode(tmp_path / "refused", *text_flags(missing, encoder))
    out = tmp_path / "tokens"
    run_encode(
        out, *text_flags(missing, encoder), "--tokenizer", TOKENIZER, "--null_text", "zeros", "--allow_uncaptioned"
    )
    latents = LatentSource(out, "latents:x")
    assert list(latents.fields) == ["mean", "logvar", "input_ids", "attention_mask"]
    assert ", text-conditioned (caption tokens), " in describe_source(latents)  # what train/main.py prints first
    full = LatentSource(text_setup["out"], "latents:x")
    for i in range(len(latents)):  # e (index 4) lost its caption: the tokens of ""
        want = full[2 if i == 4 else i]  # c (index 2) is ""
        for name in ("input_ids", "attention_mask"):
            np.testing.assert_array_equal(latents[i][name], want[name])
    text = latents.meta["text"]
    assert (text["tokenizer"], text["null_text"], text["encoded"]) == (str(TOKENIZER.resolve()), "zeros", False)
    null = latents.text_null()
    assert not null.context.any() and not null.pooled.any() and null.context.shape == (1, 16, 32)
    np.testing.assert_array_equal(null.mask, full.text_null().mask)

    copy = tmp_path / "copy"
    shutil.copytree(text_setup["out"], copy)
    with pytest.raises(SystemExit, match="another encode.*differs in fields, text"):
        run_encode(copy, *text_flags(images, encoder))  # without --encode_text
    with pytest.raises(SystemExit, match="another encode.*differs in text"):
        run_encode(copy, *text_flags(images, encoder), "--encode_text", "--null_text", "zeros")
    with pytest.raises(SystemExit, match="another encode.*differs in fields, text"):
        run_encode(copy, *text_flags(images, encoder)[:-2])  # no text encoder at all
    for flags in (["--encode_text"], ["--null_text", "zeros"], ["--tokenizer", TOKENIZER]):
        with pytest.raises(SystemExit):  # argparse: "... only with --text_encoder DIR"
            encode.parse_config(["--vae", "space_to_depth:2", "--out", str(copy), *map(str, flags)])


def test_captioned_digits_keep_their_raw_captions_without_a_text_encoder(tmp_path, monkeypatch):
    source = CaptionedDigitsSource(num_examples=100)  # the dataset's 20,000 examples would take seconds
    monkeypatch.setattr(encode, "open_dataset", lambda spec, *args, **kwargs: source)
    out = tmp_path / "latents"
    run_encode(out, "--dataset", "captioned_digits", "--vae", "space_to_depth:2", "--shard_size", 64)
    latents = LatentSource(out, "latents:x")
    assert list(latents.fields) == ["mean", "logvar"] and latents.meta["fields"]["caption"] == {"dtype": "text"}
    assert "text" not in latents.meta
    with pytest.raises(ValueError, match="encoded without a text encoder: it stores no null text condition"):
        latents.text_null()
    assert ", raw captions, " in describe_source(latents)
    with_captions = LatentSource(out, "latents:x", captions=True)
    for i in (0, 1, len(source) - 1):
        assert with_captions[i]["caption"] == source[i]["caption"]
    # Tokenized again later, with any tokenizer: the records hold the text itself.
    tokenized = TokenizedSource(with_captions, captioned_digits_tokenizer())
    want, _ = captioned_digits_tokenizer()([source[1]["caption"]])
    np.testing.assert_array_equal(tokenized[1]["input_ids"], want[0])
    with pytest.raises(
        SystemExit, match="swap what captioned_digits.s captions place left and right"
    ):  # the source says
        run_encode(tmp_path / "flipped", "--dataset", "captioned_digits", "--vae", "space_to_depth:2", "--hflip_copies")


def test_training_takes_the_text_side_the_latents_were_encoded_with(text_setup):
    """main.py on latents encoded with --encode_text: the tower and tokenizer of meta.json, no tower in
    the step (only the stored null), the stored float16 context read as the condition."""
    import main as train_main  # train/main.py
    from eqxdiff.run.conditions import EncodedText
    from eqxdiff.sharding import make_mesh

    spec = f"latents:{text_setup['out']}"
    source, mesh = open_source(spec), make_mesh(data=-1, fsdp=1)
    condition = run_condition(train_main.parse_config(["--dataset", spec]), source, mesh)
    encoder = text_setup["encoder"].resolve()
    assert isinstance(condition, EncodedText) and condition.text.encoder is not None
    assert condition.text.specs == (str(encoder), str(encoder.parent / "tokenizer"))
    frozen = condition.frozen()
    assert set(frozen) == {"null_cond"}  # captions encoded ahead of time: the step runs no tower
    assert isinstance(frozen["null_cond"], TextCond)
    for name, value in source.text_null().as_dict().items():
        np.testing.assert_array_equal(getattr(frozen["null_cond"], name), value)
    batch = stack_records([source[i] for i in range(2)], source.fields)
    cond = condition.cond(batch, frozen)
    assert isinstance(cond, TextCond) and cond.context.dtype == jnp.float32 and cond.pooled.dtype == jnp.float32
    np.testing.assert_array_equal(cond.context, batch["context"].astype(np.float32))
    np.testing.assert_array_equal(cond.pooled, batch["pooled"].astype(np.float32))
    np.testing.assert_array_equal(cond.mask, batch["attention_mask"])
    other = train_main.parse_config(["--dataset", spec, "--text_encoder", str(text_setup["images"])])
    with pytest.raises(SystemExit, match="was encoded with"):
        run_condition(other, source, mesh)
    # The records are read as encoded text, but the raw captions are still there for the grids' prompts.
    assert "caption" not in source.fields and source.caption(3) == CAPTIONS["d"]
    assert sample_prompts("", source) == [CAPTIONS[s].strip() for s in sorted(CAPTIONS)]  # all 6, in order


@pytest.mark.slow  # reason: a training step's and a sampler's compile (~10 s)
def test_the_readme_latent_text_command_trains_and_draws_grid_prompts_from_the_stored_captions(
    text_setup, tmp_path, capsys, monkeypatch
):
    """README's `train/main.py --dataset latents:DIR` on an encode with --text_encoder --encode_text, no text
    flag given: it trains, and its grid has a row per stored caption (6 here), decoded to 16×16 images. (main.py's
    own main in this process, on one of its devices: neither a process start nor a mesh adds anything checked here,
    and the step of an 8-device mesh compiles longer; main.py's processes and meshes are tests/scripts'.)"""
    import functools

    import jax
    import main as train_main  # train/main.py

    from eqxdiff.sharding import make_mesh

    monkeypatch.setattr(train_main, "make_mesh", functools.partial(make_mesh, devices=jax.devices()[:1]))
    run_dir = tmp_path / "run"
    runs.train_here(
        "--dataset",
        f"latents:{text_setup['out']}",
        "--run_dir",
        run_dir,
        *runs.TINY,
        "--batch_size",
        8,
        "--steps",
        2,
        "--sample_every",
        2,
        "--sample_steps",
        1,
    )
    said = capsys.readouterr()
    assert "text-conditioned (captions encoded ahead of time)" in said.out + said.err
    runs.assert_finite_training(runs.metric_rows(run_dir))
    with Image.open(run_dir / "samples" / "step_000002.png") as grid:
        assert grid.size == ((10 * 17 + 1) * 4, (6 * 17 + 1) * 4)  # 10 samples for each of the 6 captions
