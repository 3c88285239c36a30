"""train/main.py --init sd:FOLDER (eqxdiff/run/finetune.py) on the tiny random SD 1.x pipeline of tests/data/sd_pipeline
(its unet/ at one level, `ONE_LEVEL`): the whole UNet fine-tuned from the folder's weights; --lora_rank trains
adapters alone (the checkpointed state and the optimizer hold adapter-sized leaves only, the base stays the
folder's), resumes bitwise, and writes a diffusers LoRA file that loads back into the base as the trained model; a
folder without vae/ trains in pixels; the flags and data the folder decides are refused in one line."""

import contextlib
import io
import json
import re
import shutil
from pathlib import Path

import train_scripts  # noqa: F401 — puts train/ on sys.path: a test of the scripts
import encode as train_encode  # train/encode.py
import equinox as eqx
import fsspec
import jax
import main as train_main  # train/main.py
import numpy as np
import pytest
from PIL import Image
from eqxdiff.run.rebuild import load_run
from eqxdiff.run.run_dir import saved_config
from runs import assert_bitwise_equal, metric_rows, saved_arrays, train_here
from safetensors import safe_open
from eqxdiff.run.open_condition import condition_from_config, run_condition
from tests.scripts.test_script_errors import refusal
from tests.sd.test_sd_pipeline import PROMPTS, assemble, reference, relative

from eqxdiff.run.conditions import EncodedText
from eqxdiff.data.latents import LatentSource
from eqxdiff.diffusion import EpsilonPrediction, VPSchedule
from eqxdiff.local_copies import local_copy
from eqxdiff.sd import SDUNet
from eqxdiff.nn.lora import lora_layers, partition_lora
from eqxdiff.sd.lora_files import load_lora
from eqxdiff.paths import as_path
from eqxdiff.sd import save_diffusers
from eqxdiff.sharding import make_mesh

# A few small steps: batch 8 over the test's 8 devices, 4×4×4 latents of 16×16 images, the UNet of 8/16 channels.
STEPS = [
    "--batch_size",
    8,
    "--warmup_steps",
    1,
    "--lr",
    1e-2,
    "--sample_every",
    0,
    "--log_every",
    1,
    "--wandb",
    "disabled",
    "--ema_decay",
    0.5,
    "--no-ema_warmup",
]
# remat: the base and adapters agree; alpha 3 ≠ rank 2: the adapters' scale 1.5, which the run must keep
LORA = ["--lora_rank", 2, "--lora_alpha", 3, "--steps", 4, "--ckpt_every", 2, "--remat"]


# The fixture's sd1 UNet cut to its first level (cross-attention down, mid and up; no down- or upsampling): what the
# fine-tunes here assert (the folder's weights at the start or as the frozen base, what trains, the LoRA file, the
# resume) holds at any depth, and their step programs (traced layer by layer) have 9 resnet and transformer blocks
# to trace, not 12 and two samplers. Two levels train under adapters in tests/run/test_finetune_sdxl.py; the
# fixture's UNet against diffusers: tests/sd/test_sd_pipeline.py (an SD 1.x UNet's: tests/sd/test_sd_unet.py).
ONE_LEVEL = dict(
    block_out_channels=[8], down_block_types=["CrossAttnDownBlock2D"], up_block_types=["CrossAttnUpBlock2D"]
)


@pytest.fixture(scope="module")
def sd_data(tmp_path_factory) -> tuple[Path, Path]:
    """(the sd1 pipeline folder, its unet/ a random `ONE_LEVEL` one; latents of 16 captioned 16×16 images encoded with
    its VAE and tokenizer)."""
    root = tmp_path_factory.mktemp("finetune")
    folder = assemble("sd1", root / "sd1")
    config = json.loads((folder / "unet" / "config.json").read_text()) | ONE_LEVEL
    shutil.rmtree(folder / "unet")
    save_diffusers(SDUNet.from_config(config, key=jax.random.key(2)), folder / "unet")
    return folder, captioned_latents(root, folder, 16, [f"a photo of {['a cat', 'a dog'][i % 2]}" for i in range(16)])


def captioned_latents(root: Path, folder: Path, size: int, captions: list[str], *flags, name: str = "latents") -> Path:
    """ROOT/NAME: random size² RGB images (in ROOT/NAME_images), one per caption, encoded by train/encode.py (and
    its `flags`) with the pipeline `folder`'s vae/ and text_encoder/ (the raw captions kept beside the tokens)."""
    rng, images = np.random.default_rng(0), root / f"{name}_images"
    images.mkdir()
    for i, caption in enumerate(captions):
        Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)).save(images / f"{i:02d}.png")
        (images / f"{i:02d}.txt").write_text(caption)
    latents = root / name
    train_encode.main(
        train_encode.parse_config(
            [
                str(a)
                for a in (
                    "--dataset",
                    f"folder:{images}",
                    "--image_size",
                    size,
                    "--vae",
                    folder / "vae",
                    "--text_encoder",
                    folder / "text_encoder",
                    "--out",
                    latents,
                    "--batch_size",
                    len(captions),
                    *flags,
                )
            ]
        )
    )
    return latents


def train(run_dir: Path, sd_data, *flags) -> None:
    folder, latents = sd_data
    train_here("--run_dir", run_dir, "--init", f"sd:{folder}", "--dataset", f"latents:{latents}", *STEPS, *flags)


@pytest.fixture(scope="module")
def lora_run(sd_data, tmp_path_factory) -> tuple[Path, str]:
    """(the LoRA run's directory, what it printed)."""
    run_dir, said = tmp_path_factory.mktemp("lora_run"), io.StringIO()
    with contextlib.redirect_stdout(said):
        train(run_dir, sd_data, *LORA)
    return run_dir, said.getvalue()


@pytest.mark.slow  # a fine-tuning run end to end
def test_lora_trains_the_adapters_alone(lora_run, sd_data):
    lora_run, said = lora_run
    assert "--sigma_data" not in said  # the folder's scheduler has none, and the run refuses the flag
    rows = metric_rows(lora_run)
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and all(np.isfinite(r["train/loss"]) for r in rows)
    arrays = saved_arrays(lora_run, 4)
    trained = {k: v for k, v in arrays.items() if k.startswith(("['model']", "['ema']"))}
    assert trained and all(k.endswith(("['lora_A']", "['lora_B']")) for k in trained)  # no base weight in the state
    # Adam's moments: the adapters' shapes, twice; the rest scalars (counts).
    adapter_shapes = sorted(v.shape for k, v in arrays.items() if k.startswith("['model']"))
    moments = sorted(v.shape for k, v in arrays.items() if k.startswith("['opt_state']") and v.ndim)
    assert moments == sorted(adapter_shapes * 2)
    assert all(np.abs(v).max() > 0 for k, v in trained.items() if k.endswith("['lora_B']"))  # B starts at 0: trained

    # Rebuilt for sampling: the EMA's adapters in the base re-read from --init, whose weights are the folder's.
    run = load_run(lora_run, mesh=make_mesh(data=-1, fsdp=1))
    assert isinstance(run.schedule, VPSchedule) and isinstance(run.parameterization, EpsilonPrediction)
    folder = SDUNet.from_diffusers(sd_data[0] / "unet")
    adapters, base = partition_lora(run.ema)
    unadapted = jax.tree.leaves(eqx.filter(base, eqx.is_array))
    assert len(unadapted) == len(jax.tree.leaves(folder))
    assert all(np.array_equal(a, b) for a, b in zip(unadapted, jax.tree.leaves(folder), strict=True))
    ema_adapters = {k: v for k, v in arrays.items() if k.startswith("['ema']")}
    assert sorted(np.asarray(x).tobytes() for x in jax.tree.leaves(adapters)) == sorted(
        v.tobytes() for v in ema_adapters.values()
    )

    # The LoRA file of the last checkpoint (the EMA's adapters) loaded into the folder's UNet is that model: the
    # same structure, adapters (alpha among the static fields) and weights.
    host = lambda model: jax.tree.map(np.asarray, model)  # noqa: E731 — one device and the mesh's compare as values
    assert eqx.tree_equal(host(load_lora(folder, lora_run / "lora")), host(run.ema)) is True
    # --lora_alpha 3: every adapter of the trained and rebuilt model at alpha 3 (scale 3/2), and the file says so
    assert {layer.alpha for layer in lora_layers(run.ema).values()} == {3.0}
    assert json.loads(lora_file(lora_run)[1]["lora_adapter_metadata"])["unet.lora_alpha"] == 3


@pytest.mark.slow  # a fine-tuning run end to end
def test_a_lora_run_resumed_in_a_bucket_is_bitwise_the_uninterrupted_one(lora_run, sd_data, tmp_path, bucket):
    """Resumed from its checkpoint 2 copied into a bucket (gs://, tests/bucket.py's server): the checkpoints and
    the LoRA file it writes there are the local run's."""
    lora_run, _ = lora_run
    copied = tmp_path / "copied"
    shutil.copytree(lora_run, copied, ignore=shutil.ignore_patterns("4", "lora"))  # up to checkpoint 2
    resumed = as_path(f"{bucket}/resumed")
    fsspec.filesystem("gs").put(f"{copied}/", str(resumed).removeprefix("gs://"), recursive=True)
    assert not (resumed / "lora").exists()
    train(resumed, sd_data, *LORA)
    assert_bitwise_equal(saved_arrays(resumed, 4), saved_arrays(lora_run, 4))
    assert lora_file(resumed) == lora_file(lora_run)  # its LoRA file too (safetensors orders metadata at random)


def lora_file(run_dir) -> tuple[dict, dict]:
    with safe_open(str(local_copy(run_dir / "lora" / "pytorch_lora_weights.safetensors")), framework="numpy") as f:
        return {k: f.get_tensor(k).tobytes() for k in f.keys()}, f.metadata()


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--lora_rank", "4"], "--lora_rank/--lora_targets/--lora_alpha adapt a pretrained UNet: add --init"),
        (["--init", "sd:FOLDER", "--schedule", "vp_linear"], "decides the network and its noise .* drop --schedule"),
        (["--init", "sd:FOLDER", "--text_encoder", "OTHER"], "conditions on its own .*text_encoder; drop"),
        (["--init", "sd:FOLDER", "--lora_targets", "to_q"], "need --lora_rank R >= 1"),
        (["--init", "sd:nowhere"], "is neither a diffusers pipeline folder .*: it does not exist"),
        # what was given, named: a pipeline folder without sd:, a VAE folder, a file
        (["--init", "FOLDER"], "pipeline folder or its unet/ \\(did you mean --init sd:FOLDER\\?\\)"),
        (["--init", "sd:FOLDER/vae"], "nor a UNet folder .*: it is a model folder \\(config.json: AutoencoderKL\\)"),
        (["--init", "sd:FOLDER/model_index.json"], "nor a UNet folder .*: it is a file"),
    ],
)
def test_flags_the_folder_decides_are_refused(sd_data, tmp_path, flags, message):
    flags = [f.replace("FOLDER", str(sd_data[0])).replace("OTHER", str(tmp_path)) for f in flags]
    message = message.replace("FOLDER", re.escape(str(sd_data[0])))
    with pytest.raises(SystemExit, match=message):
        train_main.parse_config(["--run_dir", str(tmp_path / "run"), *flags])


def test_a_bare_unet_folder_takes_the_parts_beside_it(sd_data, tmp_path):
    cfg = train_main.parse_config(["--run_dir", str(tmp_path / "run"), "--init", f"sd:{sd_data[0] / 'unet'}"])
    assert Path(cfg.text_encoder) == (sd_data[0] / "text_encoder").resolve()


def test_captions_are_encoded_as_the_pipeline_encodes_them(sd_data, tmp_path):
    """An --init run's condition of PROMPTS is StableDiffusionPipeline.encode_prompt's (the fixture's reference.npz):
    the tower reads the padding tokens too, whatever mask the records carry; its null is "" encoded alike; the run's
    config says so, and the condition rebuilt from it encodes alike. The same latents without --init: the padding
    masked (as before), which the pipeline's embeddings do not match."""
    folder, latents = sd_data
    source, mesh, ref = LatentSource(latents, f"latents:{latents}"), make_mesh(data=-1, fsdp=1), reference("sd1")
    args = ["--run_dir", str(tmp_path / "run"), "--dataset", f"latents:{latents}"]
    condition = run_condition(train_main.parse_config([*args, "--init", f"sd:{folder}"]), source, mesh)
    ids, mask = condition.text.tokenizer(PROMPTS, condition.text.max_length)  # as the records hold them
    assert mask.min() == 0 and mask.max() == 1  # padding to read
    batch = {"input_ids": ids, "attention_mask": mask}
    cond = eqx.filter_jit(condition.cond)(batch, condition.frozen())
    assert relative(cond.context, ref["prompt_embeds"]) < 1e-5 and np.all(np.asarray(cond.mask) == 1)
    assert relative(condition.null(None).context[0], ref["negative_embeds"][1]) < 1e-5  # NEGATIVE[1] is ""
    assert relative(condition.for_sampling(PROMPTS, 1)[0].context, ref["prompt_embeds"]) < 1e-5
    config = condition.to_config()
    assert config["attend_padding"] is True
    assert (
        relative(condition_from_config(config, mesh=mesh).for_sampling(PROMPTS, 1)[0].context, ref["prompt_embeds"])
        < 1e-5
    )

    masked = run_condition(
        train_main.parse_config(args + ["--text_encoder", str(folder / "text_encoder")]), source, mesh
    )
    assert "attend_padding" not in masked.to_config()  # a run of before keeps its config
    assert relative(eqx.filter_jit(masked.cond)(batch, masked.frozen()).context, ref["prompt_embeds"]) > 1e-3


def test_captions_encoded_ahead_of_time_are_read_as_they_were_encoded(sd_data, tmp_path):
    """train/encode.py --encode_text --attend_padding stores the pipeline's embeddings, which an --init run reads;
    contexts encoded with the padding masked are refused there, naming the fix, and the other way round."""
    folder, _ = sd_data
    mesh, ref = make_mesh(data=-1, fsdp=1), reference("sd1")
    attended = captioned_latents(
        tmp_path, folder, 16, PROMPTS * 4, "--encode_text", "--attend_padding", name="attended"
    )
    masked = captioned_latents(tmp_path, folder, 16, PROMPTS * 4, "--encode_text", name="masked")
    parse = lambda latents, *flags: train_main.parse_config(  # noqa: E731
        ["--run_dir", str(tmp_path / "run"), "--dataset", f"latents:{latents}", *flags]
    )
    source = LatentSource(attended, f"latents:{attended}")
    condition = run_condition(parse(attended, "--init", f"sd:{folder}"), source, mesh)
    assert isinstance(condition, EncodedText) and condition.to_config()["attend_padding"] is True
    records = [source[i] for i in range(2)]
    assert min(r["attention_mask"].min() for r in records) == 0  # the tokenizer's mask is what is stored
    batch = {k: np.stack([r[k] for r in records]) for k in ("context", "pooled", "attention_mask")}
    assert relative(condition.cond(batch, None).context, ref["prompt_embeds"]) < 2e-3  # stored in float16
    assert relative(condition.null(None).context[0], ref["negative_embeds"][1]) < 2e-3
    with pytest.raises(
        SystemExit, match="encoded with the padding masked: encode again with train/encode.py --attend_padding"
    ):
        run_condition(parse(masked, "--init", f"sd:{folder}"), LatentSource(masked, f"latents:{masked}"), mesh)
    with pytest.raises(SystemExit, match="encoded with --attend_padding.*pass --init, or encode again without"):
        run_condition(parse(attended), source, mesh)


def test_images_are_refused_naming_the_encode(sd_data, tmp_path):
    with pytest.raises(
        SystemExit,
        match=r"trains on latents of its VAE: encode the images first \(python "
        r"train/encode.py --dataset captioned_digits --image_size 32 --vae .*vae --text_encoder "
        r".*text_encoder --out DIR\)",
    ):
        train_here("--run_dir", tmp_path / "run", "--init", f"sd:{sd_data[0]}", "--dataset", "captioned_digits", *STEPS)


def test_the_refusals_encode_command_writes_the_latents_a_fine_tune_reads(sd_data, tmp_path):
    """Images for --init: refused by train/main.py's main (one line, no RUN_DIR: the script prints it with status 2,
    tests/scripts/test_script_errors.py; a subprocess here cost ~3 s of start) with an encode command that,
    run as given (DIR named), writes latents of the asked --image_size with the captions the folder's tower reads:
    what the fine-tunes here train on."""
    folder, latents = sd_data
    images, run_dir = latents.parent / "latents_images", tmp_path / "run"
    line = refusal(
        train_main.main,
        train_main.parse_config,
        "--run_dir",
        run_dir,
        "--init",
        f"sd:{folder}",
        "--dataset",
        f"folder:{images}",
        "--image_size",
        16,
        *STEPS,
    )
    assert "\n" not in line and not run_dir.exists()
    suggested = re.search(r"\(python train/encode.py (.*) --out DIR\)", line)
    assert suggested and f"--text_encoder {folder / 'text_encoder'}" in line and "--image_size 16" in line, line
    encoded = tmp_path / "encoded"
    train_encode.main(train_encode.parse_config([*suggested.group(1).split(), "--out", str(encoded)]))
    ours, fixture = LatentSource(encoded, "latents:"), LatentSource(latents, "latents:")
    assert ours.image_shape == fixture.image_shape == (4, 4, 4)
    assert ours.record_fields.keys() == fixture.record_fields.keys() and "caption" in ours.record_fields
    assert ours.meta["text"] == fixture.meta["text"]


def test_uncaptioned_latents_are_refused_before_anything_is_written(sd_data, tmp_path):
    """Latents of images without captions cannot condition SD's text-conditioned UNet: one line from train/main.py's
    main, naming the encode that keeps captions, before RUN_DIR/checkpoints/ or anything else is made."""
    folder, latents = sd_data
    bare = tmp_path / "bare"
    bare.mkdir()
    for png in sorted((latents.parent / "latents_images").glob("*.png")):
        shutil.copy(png, bare / png.name)
    uncaptioned, run_dir = tmp_path / "uncaptioned", tmp_path / "run"
    train_encode.main(
        train_encode.parse_config(
            [
                "--dataset",
                f"folder:{bare}",
                "--image_size",
                "16",
                "--vae",
                str(folder / "vae"),
                "--out",
                str(uncaptioned),
            ]
        )
    )
    line = refusal(
        train_main.main,
        train_main.parse_config,
        "--run_dir",
        run_dir,
        "--init",
        f"sd:{folder}",
        "--dataset",
        f"latents:{uncaptioned}",
        "--sample_prompts",
        "a cat",
        *STEPS,
    )
    assert (
        "\n" not in line
        and "holds latents without captions" in line
        and f"--dataset folder:{bare} --image_size 16" in line
    ), line
    assert f"--text_encoder {folder / 'text_encoder'}" in line
    assert not run_dir.exists()


@pytest.fixture(scope="module")
def pixel_data(sd_data, tmp_path_factory) -> tuple[Path, Path]:
    """(a pixel-space folder: a random 1-channel unet/ of sd_data's config with its text_encoder/, tokenizer/ and
    scheduler/ beside it, no vae/; an npz of 16 captioned 8×8 grey images)."""
    root = tmp_path_factory.mktemp("pixels")
    folder = root / "sd1_pixels"
    shutil.copytree(sd_data[0], folder, ignore=shutil.ignore_patterns("vae", "unet", "model_index.json"))
    config = json.loads((sd_data[0] / "unet" / "config.json").read_text()) | {"in_channels": 1, "out_channels": 1}
    save_diffusers(SDUNet.from_config(config, key=jax.random.key(1)), folder / "unet")
    rng = np.random.default_rng(0)
    images, captions = rng.integers(0, 256, (16, 8, 8, 1), dtype=np.uint8), [f"a photo of {c}" for c in "ab" * 8]
    np.savez(root / "grey.npz", images=images, captions=np.array(captions))
    np.savez(root / "rgb.npz", images=np.repeat(images, 3, axis=-1), captions=np.array(captions))
    return folder, root


@pytest.mark.slow  # a fine-tuning run end to end
def test_a_folder_without_vae_fine_tunes_its_whole_unet_in_pixels_from_its_weights(pixel_data, tmp_path, capsys):
    """Without --lora_rank the whole UNet trains, starting from the folder's weights; a folder without vae/ trains in
    pixels. Whole or LoRA, pixels or latents: independent choices (eqxdiff/run/finetune.py's kinds never see the
    codec), so this run (whole, pixels) and the LoRA run above (adapters, latents) cover all four (a third step
    program, whole on latents, cost ~20 s of CI for no new code path)."""
    folder, data = pixel_data
    run_dir = tmp_path / "run"
    dataset = f"npz:{data / 'grey.npz'}"
    train_here(
        "--run_dir",
        run_dir,
        "--init",
        f"sd:{folder / 'unet'}",
        "--dataset",
        dataset,
        *STEPS,
        "--steps",
        1,
        "--ema_decay",
        1.0,  # the EMA stays the start
    )
    assert f"new run in {run_dir}: the UNet of sd:{folder / 'unet'} on {dataset}" in capsys.readouterr().out
    assert np.isfinite(metric_rows(run_dir)[0]["train/loss"])
    config = saved_config(run_dir, 1)[1]
    assert config["codec"] == {"kind": "pixels"} and config["image_shape"] == [8, 8, 1]
    arrays = saved_arrays(run_dir, 1, parts=("model", "ema"))  # not Adam's moments: half the state's arrays
    unet = SDUNet.from_diffusers(folder / "unet")
    flat = jax.tree_util.tree_flatten_with_path(unet)[0]
    paths = [re.sub(r"\.(\w+)", r"['\1']", jax.tree_util.keystr(p)) for p, _ in flat]  # as saved_arrays names them
    for path, weight in zip(paths, jax.tree.leaves(unet), strict=True):
        assert np.array_equal(arrays["['ema']" + path], weight), path
    assert any(not np.array_equal(arrays["['model']" + p], w) for p, w in zip(paths, jax.tree.leaves(unet)))
    # The checkpoint says what the network is: SDUNet of the folder's config (eqxdiff/run/models.py's CONSTRUCTORS).
    unet_config = json.loads((folder / "unet" / "config.json").read_text())
    assert config["model_args"] == {"constructor": "SDUNet", "kwargs": {"config": unet_config}}


@pytest.mark.parametrize(
    "dataset, message",
    [
        (
            "latents",
            r"has no vae/: its UNet works in pixels; train it on images of its in_channels \(1\), not "
            r"--dataset latents:",
        ),
        ("rgb.npz", r"holds 3-channel images; --init .*'s pixel-space UNet \(no vae/\) takes in_channels 1"),
    ],
)
def test_a_pixel_space_folder_refuses_other_data(pixel_data, sd_data, tmp_path, dataset, message):
    folder, data = pixel_data
    dataset = f"latents:{sd_data[1]}" if dataset == "latents" else f"npz:{data / dataset}"
    with pytest.raises(SystemExit, match=message):
        train_here("--run_dir", tmp_path / "run", "--init", f"sd:{folder / 'unet'}", "--dataset", dataset, *STEPS)


def edit_h_example() -> str:
    """The code block of edit (h), a new kind of fine-tuning, on docs/edits.md (the README's edits table points there)."""
    edits = (Path(__file__).parents[2] / "docs" / "edits.md").read_text()
    section = edits[edits.index("**(h) A new kind of fine-tuning**") :]
    block = section[section.index("```python\n") + len("```python\n") :]
    return block[: block.index("\n```")]


def test_the_edits_fine_tuning_kind_trains_its_part_alone_and_samples_whole(tmp_path, monkeypatch, capsys):
    """Edit (h) as written (docs/edits.md): `--finetune bitfit` trains the biases alone (the checkpointed state holds
    1-D leaves only), the rest of the network stays the draw from --seed, and train/sample.py's rebuild samples the
    whole network; a --finetune no FINETUNE_KINDS entry names is one line naming the table."""
    import dataclasses

    import sample  # train/sample.py
    from eqxdiff.run import finetune
    from eqxdiff.run.models import build_model
    from runs import TINY

    run_dir = tmp_path / "bitfit"
    # the grid at 2 Euler steps (2 network calls; a program of one), not Heun's 18 (35): the whole network is sampled
    flags = [
        *("--run_dir", run_dir, *TINY, "--steps", 3, "--ckpt_every", 3, "--sample_every", 3, "--sample_steps", 2),
        *("--sample_method", "euler"),
        *("--finetune", "bitfit"),
    ]
    kinds = {}
    monkeypatch.setattr(finetune, "FINETUNE_KINDS", kinds)
    with pytest.raises(
        SystemExit, match="--finetune bitfit: no such kind in FINETUNE_KINDS of eqxdiff/run/finetune.py"
    ):
        train_here(*flags)
    scope = {name: getattr(finetune, name) for name in ("Scratch", "Training")}
    scope |= {"eqx": eqx, "jax": jax, "dataclasses": dataclasses, "FINETUNE_KINDS": kinds}
    exec(edit_h_example(), scope)
    assert kinds == {"bitfit": scope["BitFit"]}
    train_here(*flags)
    assert (run_dir / "samples" / "step_000003.png").exists()  # the grid of the whole EMA
    state = saved_arrays(run_dir, 3)  # model, EMA, Adam's moments: biases all; counters
    assert all(a.ndim <= 1 for a in state.values()), {k: a.shape for k, a in state.items() if a.ndim > 1}

    run = load_run(run_dir, mesh=make_mesh(data=-1, fsdp=1))  # the whole network, as sample.py rebuilds it
    drawn = build_model(run.stored["model_args"], False, jax.random.key(0), run.condition)
    pairs = list(
        zip(jax.tree.leaves(eqx.filter(run.ema, eqx.is_array)), jax.tree.leaves(eqx.filter(drawn, eqx.is_array)))
    )
    assert any(ours.ndim > 1 for ours, _ in pairs)
    for ours, theirs in pairs:
        if ours.ndim > 1:  # frozen: the draw from --seed
            np.testing.assert_array_equal(np.asarray(ours), np.asarray(theirs))
    assert any(ours.ndim == 1 and not np.array_equal(ours, theirs) for ours, theirs in pairs)  # the biases trained
    out = tmp_path / "s.npz"
    # the grid's sampler program again (its 100 images, ten of each label, 2 steps, guidance): no second compile
    sample.main(sample.parse_args(["--run_dir", str(run_dir), "--num", "100", "--steps", "2", "--out", str(out)]))
    assert np.load(out)["images"].shape == (100, 8, 8, 1)
