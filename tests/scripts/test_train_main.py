"""`python train/main.py` end to end: flags, outputs, the persistent compile cache, the NaN stop. Runs
that need no process of their own call the script's main here (runs.train_here)."""

import json
import re
import subprocess
import sys
from pathlib import Path

import equinox as eqx
import jax
import numpy as np
import pytest
from PIL import Image

from eqxdiff.data import open_source
from eqxdiff.images import add_row_labels
from eqxdiff.sharding import make_mesh
from runs import saved_arrays, train_here
import train_scripts  # noqa: F401 — puts train/ on sys.path: a test of the scripts

ROOT = Path(__file__).parents[2]
SMALL = ["--model", "unet_tiny", "--batch_size", "16", "--sample_steps", "2", "--wandb", "disabled"]


def run_main_script(script, *args, timeout=600):
    """`python train/<script> args`, under the jaxtyping import hook (tests/typechecked.py)."""
    cmd = [sys.executable, "tests/typechecked.py", f"train/{script}", *map(str, args)]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def run_main(*args, timeout=600):
    return run_main_script("main.py", *args, timeout=timeout)


def rows(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


NAMES = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]


def row_label_margin(labels: list[str], tile: int, mode: str, height: int) -> np.ndarray:
    """The black margin with each row's label that save_image_grid(row_labels=labels, upscale=4) puts left
    of a grid of `tile`-pixel tiles: what a grid labelled with `labels` must show there."""
    labeled = add_row_labels(Image.new(mode, (1, height)), labels, tile_height=tile * 4, pad=4)
    return np.asarray(labeled)[:, :-1]


def digits_folder(folder: Path, per_class: int = 20) -> Path:
    """The first `per_class` digits of each class as PNGs in class sub-folders named by `NAMES`."""
    digits = open_source("digits")
    for k, name in enumerate(NAMES):
        (folder / name).mkdir(parents=True)
        for i in np.flatnonzero(digits.labels == k)[:per_class]:
            Image.fromarray(digits.images[i, :, :, 0]).save(folder / name / f"{i}.png")
    return folder


@pytest.mark.slow
def test_main_trains_logs_profiles_and_writes_samples(tmp_path):
    run_dir, cache = tmp_path / "run", tmp_path / "cache"
    # Also the smoke run of ε-prediction with the EDM schedule (see SMOKE_CASES), on your own data: a
    # folder of 8×8 PNGs in class sub-folders (the digits' shapes: the same program as --dataset digits).
    folder = digits_folder(tmp_path / "digits")
    args = [
        *SMALL,
        "--steps",
        "6",
        "--log_every",
        "3",
        "--sample_every",
        "6",
        "--cpu_devices",
        "4",
        "--fsdp_size",
        "2",
        "--profile_steps",
        "2:4",
        "--compilation_cache_dir",
        str(cache),
        "--wandb",
        "offline",
        "--parameterization",
        "eps",
        "--dataset",
        f"folder:{folder}",
        "--image_size",
        "8",
    ]
    result = run_main("--run_dir", str(run_dir), *args)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "mesh {'data': 2, 'fsdp': 2}" in result.stderr + result.stdout
    classes = ", ".join(f"{k}={name}" for k, name in enumerate(sorted(NAMES)))  # labels: sorted folder names
    assert f"dataset folder:{folder}: 200 images, classes {classes[:40]}" in result.stderr + result.stdout

    logged = rows(run_dir)
    assert [r["step"] for r in logged] == [3, 6]
    for key in (
        "train/loss",
        "train/step_time_ms",
        "train/samples_per_sec",
        "train/mfu",
        "train/bad_steps",
        "train/grad_norm",
        "train/lr",
    ):
        assert key in logged[-1], key
    assert logged[-1]["train/bad_steps"] == 0 and 0 < logged[-1]["train/mfu"] < 1
    startup = json.loads((run_dir / "run.json").read_text())
    assert startup["startup/step_flops_per_device"] > 0
    with Image.open(run_dir / "samples" / "step_000006.png") as grid:
        margin = grid.width - (10 * 9 + 1) * 4  # each row labeled with its class folder's name on the left
        assert 20 < margin < 100 and grid.height == (10 * 9 + 1) * 4  # 10×10 tiles of 8×8, upscaled 4×
        labels = np.asarray(grid)[:, :margin]
        assert labels.max() > 128 and labels.min() == 0  # white text on black
    # train/sample.py on it: classes by folder name or index, a grid row each labelled with the name.
    import sample  # train/sample.py

    saved = json.loads((run_dir / "checkpoints" / "6" / "config" / "metadata").read_text())
    assert saved["class_names"] == sorted(NAMES)
    sample.main(
        sample.parse_args(
            [
                "--run_dir",
                str(run_dir),
                "--classes",
                "three,5",
                "--num",
                "6",
                "--steps",
                "1",
                "--out",
                str(tmp_path / "grid.png"),
            ]
        )
    )
    with Image.open(tmp_path / "grid.png") as grid:
        want = row_label_margin(["three", sorted(NAMES)[5]], 8, "L", grid.height)  # 5: "seven"
        assert grid.size == (want.shape[1] + (3 * 9 + 1) * 4, (2 * 9 + 1) * 4)  # 2 rows of 3 tiles
        np.testing.assert_array_equal(np.asarray(grid)[:, : want.shape[1]], want)
    assert list((run_dir / "profile").rglob("*.xplane.pb")), "no profiler trace"
    assert list((run_dir / "wandb").glob("offline-run-*")), "no offline wandb run"

    # The same run again: every program comes from the persistent cache (none is compiled and
    # written anew), and the first step comes sooner. (Logging and profiling change no program.)
    entries = sorted(p.name for p in cache.iterdir())
    assert len(entries) > 10, entries
    again = tmp_path / "again"
    result = run_main("--run_dir", str(again), *args, "--wandb", "disabled", "--profile_steps", "")
    assert result.returncode == 0, result.stderr[-3000:]
    assert sorted(p.name for p in cache.iterdir()) == entries
    second = json.loads((again / "run.json").read_text())
    first_s, second_s = startup["startup/time_to_first_step_s"], second["startup/time_to_first_step_s"]
    assert second_s < 0.8 * first_s, (first_s, second_s)


@pytest.mark.slow
def test_consecutive_nonfinite_steps_stop_with_the_documented_error(tmp_path):
    # lr = 1e38 sends the weights to inf after one update; every later step is non-finite.
    with pytest.raises(RuntimeError, match=r"consecutive non-finite steps .* raise --max_bad_steps"):
        train_here(
            "--run_dir",
            tmp_path,
            *SMALL,
            "--steps",
            12,
            "--log_every",
            6,
            "--lr",
            1e38,
            "--max_bad_steps",
            3,
            "--sample_every",
            1000,
        )
    assert rows(tmp_path)[-1]["train/bad_steps"] >= 3


def test_bad_flag_values_are_clear_errors(capsys):
    # In-process: the script's own parse_config and check_batch, without a process start each.
    import main as train_main
    from checks import check_batch  # train/checks.py

    with pytest.raises(SystemExit):
        train_main.parse_config(["--schedule", "cosine"])
    err = capsys.readouterr().err
    assert "invalid choice: 'cosine'" in err and "'vp_cosine'" in err
    with pytest.raises(SystemExit):
        train_main.parse_config(["--profile_steps", "5"])
    assert "--profile_steps must look like A:B" in capsys.readouterr().err
    with pytest.raises(SystemExit, match=r"must be a multiple of devices \(4\)"):
        check_batch(train_main.parse_config(["--batch_size", "10"]), 4)


def leaf_paths(tree) -> dict[tuple, np.ndarray]:
    """Arrays by path tokens, so a module tree and orbax's plain-dict restore compare."""
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return {tuple(re.findall(r"\w+", jax.tree_util.keystr(p))): np.asarray(x) for p, x in flat if hasattr(x, "shape")}


@pytest.mark.slow
def test_default_job_end_to_end_at_reduced_steps(tmp_path):
    """`python train/main.py` (model, data, schedule, sampler), only shorter (its grid too: 2 sampler steps of
    the default heun) and with the batch, warm-up and label dropout it shipped with before issue 14 (the stored
    args). Its losses are the stored trajectory of that job written before the record/conditioning redesign."""
    stored = json.loads((ROOT / "tests" / "data" / "default_job_20_steps.json").read_text())
    grid = ["--sample_every", "20", "--sample_steps", "2"]  # the later flag wins
    result = run_main("--run_dir", tmp_path, *stored["args"], *grid)
    assert result.returncode == 0, result.stderr[-3000:]
    losses = [r["train/loss"] for r in rows(tmp_path)]
    np.testing.assert_allclose(losses, stored["loss"], rtol=1e-4)  # same seed: same numbers to float rounding
    np.testing.assert_allclose([r["train/grad_norm"] for r in rows(tmp_path)], stored["grad_norm"], rtol=1e-3)
    assert np.mean(losses[-5:]) < 0.8 * np.mean(losses[:5])
    with Image.open(tmp_path / "samples" / "step_000020.png") as grid:
        assert grid.size == ((10 * 9 + 1) * 4, (10 * 9 + 1) * 4)
        assert np.asarray(grid).std() > 10, "a blank grid"
    assert (tmp_path / "checkpoints" / "20" / "commit_success.txt").exists()  # the final checkpoint
    saved = json.loads((tmp_path / "checkpoints" / "20" / "config" / "metadata").read_text())
    assert saved["model"] == "unet" and saved["num_classes"] == 10 and saved["image_shape"] == [8, 8, 1]

    # sample.py restores the EMA weights, not the raw model's (its runs: tests/scripts/test_multihost.py,
    # tests/scripts/test_latent_training.py).
    from eqxdiff.run.rebuild import load_run

    ema = load_run(tmp_path, mesh=make_mesh(data=-1, fsdp=1)).ema
    on_disk = leaf_paths(saved_arrays(tmp_path, 20))
    restored = leaf_paths(eqx.filter(ema, eqx.is_array))
    assert restored and all(np.array_equal(v, on_disk[("ema", *k)]) for k, v in restored.items())
    assert any(not np.array_equal(v, on_disk[("model", *k)]) for k, v in restored.items())


# Every schedule and every parameterization runs through this script: edm/edm (the default job above),
# edm/eps (the logging test above), vp_cosine/v (tests/scripts/test_latent_training.py's AutoencoderKL run),
# flow/flow (tests/scripts/test_text_training.py's CLIP run) and vp_linear/x0 here, with the script's other
# paths in the same run (each run is a step to compile: tens of seconds on 2 cores):
# npz images without labels (an unconditional model), bf16, remat, gradient accumulation, FID, and the DiT
# as dit_tiny (dit_s's code at 2 blocks of width 64; dit_s's 12-block step takes most of a minute to
# compile on a 2-core CPU).
SMOKE = [
    "--schedule",
    "vp_linear",
    "--parameterization",
    "x0",
    "--precision",
    "bf16",
    "--remat",
    "--grad_accum_steps",
    "2",
    "--model",
    "dit_tiny",
]


@pytest.mark.slow
def test_main_smoke_unlabeled_bf16_remat_accumulated_dit_with_fid(tmp_path, monkeypatch, capsys):
    """Also --eval_every: FID with a stand-in feature network (tests/eval/test_fid.py; InceptionV3's own
    compile would double this test) at step 2 and at the end, the end's equal to sample.py --fid's on
    the final checkpoint; and --hflip, seen in the batches main's data stream yields."""
    import main as train_main
    from tests.eval.test_fid import projection, stand_in_reference

    images = []  # every batch the run's stream yields (its prefetch reads a few ahead)

    def stream(*args, **kwargs):
        for batch in batch_stream(*args, **kwargs):
            images.extend(np.array(batch["image"]))
            yield batch

    batch_stream = train_main.batch_stream
    monkeypatch.setattr(train_main, "batch_stream", stream)
    stand_in_reference(tmp_path / "ref.npz", image_shape=(16, 16, 1))
    digits = open_source("digits")
    np.savez(tmp_path / "digits.npz", images=digits.images[:64])  # no labels: an unconditional model
    args = [
        *SMALL,
        "--steps",
        "3",
        "--log_every",
        "1",
        "--sample_every",
        "3",
        "--sample_steps",
        "1",
        *SMOKE,
        "--dataset",
        f"npz:{tmp_path / 'digits.npz'}",
        "--eval_every",
        2,
        "--eval_num",
        20,
        "--fid_ref",
        tmp_path / "ref.npz",
        "--inception",
        "unused",
        "--hflip",
    ]
    with pytest.warns(UserWarning, match="ref.npz holds statistics of 16×16×1 images, the samples are 8×8×1"):
        train_here("--run_dir", tmp_path / "run", *args, features_fn=projection)
    # --hflip: every image is a digit or its mirror image, and both kinds occur (p = 1/2 each).
    source = digits.images[:64]
    as_is = [any(np.array_equal(x, d) for d in source) for x in images]
    mirrored = [any(np.array_equal(x, d[:, ::-1]) for d in source) for x in images]
    assert len(images) >= 3 * 16 and all(a or m for a, m in zip(as_is, mirrored))
    assert any(m and not a for a, m in zip(as_is, mirrored)) and any(a and not m for a, m in zip(as_is, mirrored))
    logged = [r for r in rows(tmp_path / "run") if "train/loss" in r]
    assert [r["step"] for r in logged] == [1, 2, 3] and all(np.isfinite(r["train/loss"]) for r in logged)
    evals = [r for r in rows(tmp_path / "run") if "eval/fid" in r]  # 20 samples: a chunk of 16, one cut to 4
    assert [r["step"] for r in evals] == [2, 3]
    assert all(r["eval/fid"] > 0 and 0 <= r["eval/precision"] <= 1 and 0 <= r["eval/recall"] <= 1 for r in evals)
    printed = capsys.readouterr().out  # each FID on the console as well as in metrics.jsonl
    assert all(f"step {r['step']}: fid {r['eval/fid']:.4f}  precision " in printed for r in evals)
    saved = json.loads((tmp_path / "run" / "checkpoints" / "3" / "config" / "metadata").read_text())
    assert saved["num_classes"] == 0 and saved["model"] == "dit_tiny" and saved["schedule"] == "vp_linear"
    assert saved["precision"] == "bf16" and saved["remat"] and saved["grad_accum_steps"] == 2
    with Image.open(tmp_path / "run" / "samples" / "step_000003.png") as grid:
        assert grid.size == ((10 * 9 + 1) * 4,) * 2

    # sample.py --fid on the final checkpoint with the run's count, sampler steps, chunk and seed: the
    # FID --eval_every logged at that step (the same samples through the same network).
    import sample  # train/sample.py

    out = tmp_path / "fid.jsonl"
    with pytest.warns(UserWarning, match="holds statistics of 16×16×1 images"):
        sample.main(
            sample.parse_args(
                [
                    "--run_dir",
                    str(tmp_path / "run"),
                    "--num",
                    "20",
                    "--steps",
                    "1",
                    "--batch_size",
                    "16",
                    "--seed",
                    "0",
                    "--fid",
                    str(tmp_path / "ref.npz"),
                    "--inception",
                    "unused",
                    "--fid_out",
                    str(out),
                ]
            ),
            features_fn=projection,
        )
    (line,) = [json.loads(s) for s in out.read_text().splitlines()]
    assert line["step"] == 3 and line["num"] == 20 and line["guidance"] == train_main.Config().guidance  # the run's
    for key in ("fid", "precision", "recall"):
        assert line[key] == pytest.approx(evals[-1][f"eval/{key}"], rel=1e-6), key


@pytest.mark.slow
def test_sample_script_png_grid_classes_method_and_step(eight_device_run, tmp_path):
    """train/sample.py (in this process) --step 12 --classes 3,7 --method euler, as .npz and as .png: the
    samples are the library's generate of step 12's EMA (read from the checkpoint's files) with labels
    3 and 7 and the Euler sampler, and the PNG holds them as tiles, a row per class."""
    import sample  # train/sample.py
    from eqxdiff.run.rebuild import load_run

    from eqxdiff.diffusion import parameterization_by_name, schedule_by_name
    from eqxdiff.generate import generate
    from eqxdiff.images import to_uint8

    flags = [
        "--run_dir",
        str(eight_device_run),
        "--step",
        "12",
        "--classes",
        "3,7",
        "--num",
        "8",
        "--method",
        "euler",
        "--steps",
        "2",
    ]
    for out in ("s.npz", "s.png"):
        sample.main(sample.parse_args([*flags, "--out", str(tmp_path / out)]))
    with np.load(tmp_path / "s.npz") as saved:
        images, labels = saved["images"], saved["labels"]
    np.testing.assert_array_equal(labels, [3, 3, 3, 3, 7, 7, 7, 7])

    # Step 12's EMA from its files, in the structure of a restored model (step 24's, the newest).
    mesh = make_mesh(data=-1, fsdp=1)
    newest = load_run(eight_device_run, mesh=mesh).ema
    on_disk = leaf_paths(saved_arrays(eight_device_run, 12))
    assert any(not np.array_equal(v, on_disk[("ema", *k)]) for k, v in leaf_paths(newest).items())
    flat, treedef = jax.tree_util.tree_flatten_with_path(newest)
    ema = jax.tree_util.tree_unflatten(
        treedef,
        [
            jax.device_put(on_disk[("ema", *re.findall(r"\w+", jax.tree_util.keystr(p)))], x.sharding)
            if eqx.is_array(x)
            else x
            for p, x in flat
        ],
    )
    # The run's schedule, parameterization (σ_data 0.5: pixels) and guidance (--guidance 1.5); sample.py's seed 0.
    expected = generate(
        ema,
        schedule_by_name("edm"),
        parameterization_by_name("edm", 0.5),
        labels,
        8,
        (8, 8, 1),
        mesh=mesh,
        steps=2,
        method="euler",
        guidance=1.5,
        seed=0,
    )
    np.testing.assert_array_equal(images, to_uint8(expected))

    with Image.open(tmp_path / "s.png") as png:
        assert png.format == "PNG" and png.mode == "L"
        grid = np.asarray(png)
    # 2 rows × 4 tiles of 8×8, 1 px apart, upscaled 4×; anything left of them is row labels
    width, height = (4 * 9 + 1) * 4, (2 * 9 + 1) * 4
    assert grid.shape[0] == height and grid.shape[1] >= width
    tiles = grid[:, grid.shape[1] - width :][::4, ::4]
    for i, image in enumerate(images):
        r, c = divmod(i, 4)
        np.testing.assert_array_equal(tiles[1 + 9 * r : 9 + 9 * r, 1 + 9 * c : 9 + 9 * c], image[..., 0])
