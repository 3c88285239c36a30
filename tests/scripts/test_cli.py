"""The train/ scripts as a new user meets them: --help, the run directory, resuming with the flags a
checkpoint saved, one-line errors with status 2, read-only sampling, a data error mid-run. Most
checks call the scripts' own functions here; the CLI's wiring (status, no traceback, nothing
started) runs as processes."""

import dataclasses
import json
import logging
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from PIL import Image

import train_scripts  # noqa: F401 — puts train/ on sys.path: a test of the scripts
import main as train_main
import sample
from eqxdiff.checkpoint import Checkpoints
from eqxdiff.data import open_source
from eqxdiff.training import LogWindow, MetricsLogger, ProfileWindow
from eqxdiff.training.preemption import StopRequest
from runs import command
from startup import LeftoverAsyncErrors, exit_on_user_error

pytestmark = pytest.mark.quick  # the quick tier, the edit loop (tests/README.md)

ROOT = Path(__file__).parents[2]


def saved_run(run_dir: Path, step: int, **flags) -> dict:
    """A run directory holding one real orbax checkpoint at `step` whose saved config is Config(**flags)
    plus what train/main.py stores beside it; returns that config."""
    config = dict(dataclasses.asdict(train_main.Config(**flags)), image_shape=[8, 8, 1], num_classes=10)
    with Checkpoints(run_dir / "checkpoints", async_save=False) as checkpoints:
        assert checkpoints.save(step, {"w": jnp.ones(3)}, {"examples_consumed": 0}, config) == "saved"
    return config


def cli(script: str, *args, cwd=ROOT) -> subprocess.CompletedProcess:
    return subprocess.run(command(script, *args), cwd=cwd, capture_output=True, text=True, timeout=120)


def test_help_lists_every_flag_with_its_comment_and_default(capsys):
    with pytest.raises(SystemExit) as exit_info:
        train_main.parse_config(["--help"])
    assert exit_info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    from startup import field_comments  # train/startup.py

    comments = field_comments(train_main.Config)
    for field in dataclasses.fields(train_main.Config):
        assert f"--{field.name}" in text, field.name
        assert " ".join(comments[field.name].split())[:30] in text, field.name  # every flag has its one line
    assert "--steps STEPS optimizer updates in the whole run" in text and "(default: 900)" in text
    assert "--remat, --no-remat" in text and "(default: runs/DATASET-MODEL)" in text

    with pytest.raises(SystemExit):
        sample.parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--num NUM number of images (text-to-image: --per_prompt for each prompt) (default: 100)" in text
    assert "--steps STEPS sampler steps (the grids' --sample_steps are fewer, for speed) (default: 18)" in text
    assert "--per_prompt PER_PROMPT text-to-image runs: images per prompt (default: 10)" in text
    assert "default: the run's --guidance" in text  # the guidance of the run's own grids

    import sample_pretrained  # train/sample_pretrained.py: each family's own default, as each uses it

    text = " ".join(help_text(sample_pretrained.parse_args, capsys).split())
    assert "--steps STEPS sampler steps (default: dit:, sit: 250; sd: 30)" in text
    assert "--per_prompt PER_PROMPT sd: images per prompt (default 1, or --num / prompts)" in text


def help_text(parse, capsys) -> str:
    """What `parse(["--help"])` prints (it exits 0)."""
    with pytest.raises(SystemExit) as exit_info:
        parse(["--help"])
    assert exit_info.value.code == 0
    return capsys.readouterr().out


def test_help_shows_the_config_in_its_sections_and_every_script_the_same_launch_flags(capsys):
    import encode  # train/encode.py
    import fid_stats  # train/fid_stats.py
    import sample  # train/sample.py
    from startup import Launch, field_sections  # train/startup.py

    sections = field_sections(train_main.Config)
    assert set(sections) == {f.name for f in dataclasses.fields(train_main.Config)}  # no flag outside a section
    titles = [
        "data",
        "model",
        "diffusion",
        "meanflow",
        "text",
        "repa",
        "optimisation",
        "sampling",
        "evaluation",
        "run",
        "finetune",
        "launch",
    ]
    assert list(dict.fromkeys(title for title, _ in sections.values())) == titles
    text = help_text(train_main.parse_config, capsys)
    starts = [text.index(f"\n{title}:\n") for title in titles]  # each a group of --help, in this order
    assert starts == sorted(starts)
    for field in dataclasses.fields(train_main.Config):  # each flag under its own section's heading
        i = titles.index(sections[field.name][0])
        group = text[starts[i] : starts[i + 1] if i + 1 < len(titles) else len(text)]
        assert f"--{field.name}" in group, field.name
    assert "text-to-image, from captions" in text[starts[4] : starts[5]]  # the section's line describes it

    # One definition of the launch flags: the same group, word for word, in every script's --help.
    launch = text[starts[-1] :]
    assert all(f"--{f.name}" in launch for f in dataclasses.fields(Launch))
    import posthoc_ema  # train/posthoc_ema.py
    import sample_pretrained  # train/sample_pretrained.py

    for parse in (
        encode.parse_config,
        fid_stats.parse_config,
        sample.parse_args,
        sample_pretrained.parse_args,
        posthoc_ema.parse_args,
    ):
        other = help_text(parse, capsys)
        assert other[other.index("\nlaunch:\n") :] == launch, parse.__module__


def test_the_default_run_dir_is_named_by_dataset_and_model(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no runs/ of a developer's own here
    assert train_main.parse_config([]).run_dir == "runs/digits-unet"
    for dataset, model, expected in [
        ("folder:~/data/pets/", "dit_s", "runs/pets-dit_s"),
        ("npz:/x/faces64.npz", "unet", "runs/faces64-unet"),
        ("arrayrecord:/data/pets/train-*.arrayrecord", "unet", "runs/pets-unet"),
        ("latents:runs/pets_latents", "dit_s", "runs/pets_latents-dit_s"),
    ]:
        assert train_main.parse_config(["--dataset", dataset, "--model", model]).run_dir == expected
    assert train_main.parse_config(["--run_dir", "mine"]).run_dir == "mine"


def test_resuming_takes_left_off_flags_from_the_checkpoint(tmp_path, capsys):
    saved = saved_run(
        tmp_path,
        6,
        model="unet_tiny",
        steps=10,
        batch_size=16,
        guidance=2.5,
        coordinator="h:1",
        resume_step=4,
        remat=True,
    )
    cfg = train_main.parse_config(["--run_dir", str(tmp_path)])
    assert (cfg.model, cfg.steps, cfg.batch_size, cfg.guidance, cfg.remat) == ("unet_tiny", 10, 16, 2.5, True)
    assert (cfg.coordinator, cfg.resume_step) == ("", -1)  # how one command starts is never inherited
    assert capsys.readouterr().out == ""  # nothing changed, nothing echoed

    cfg = train_main.parse_config(["--run_dir", str(tmp_path), "--lr", "1e-3", "--steps", "20", "--no-remat"])
    assert (cfg.lr, cfg.steps, cfg.remat, cfg.model) == (1e-3, 20, False, "unet_tiny")
    out = capsys.readouterr().out
    assert f"--lr {saved['lr']} -> 0.001" in out and "--steps 10 -> 20" in out and "--remat True -> False" in out


def test_flags_that_define_a_run_cannot_change_on_resume(tmp_path, capsys):
    saved_run(tmp_path, 6, model="unet_tiny", image_size=32)
    with pytest.raises(SystemExit) as refused:
        train_main.parse_config(["--run_dir", str(tmp_path), "--model", "unet", "--image_size", "64", "--lr", "1"])
    message = refused.value.code
    assert "--model unet (saved: unet_tiny), --image_size 64 (saved: 32) cannot change" in message
    assert "new --run_dir" in message and "\n" not in message
    assert capsys.readouterr().out == ""  # refused before anything is echoed

    with pytest.raises(SystemExit, match=r"--dataset folder:elsewhere \(saved: digits\).*--allow_dataset_change"):
        train_main.parse_config(["--run_dir", str(tmp_path), "--dataset", "folder:elsewhere"])
    cfg = train_main.parse_config(
        ["--run_dir", str(tmp_path), "--dataset", "folder:elsewhere", "--allow_dataset_change"]
    )
    assert cfg.dataset == "folder:elsewhere" and "--dataset digits -> folder:elsewhere" in capsys.readouterr().out
    # The same data or tower written another way is no change: nothing refused, nothing echoed.
    folder_run = tmp_path / "folder_run"
    saved_run(folder_run, 6, dataset=f"folder:{tmp_path}/pets", text_encoder=f"{tmp_path}/clip")
    capsys.readouterr()
    cfg = train_main.parse_config(
        [
            "--run_dir",
            str(folder_run),
            "--dataset",
            f"folder:{tmp_path}/x/../pets/",
            "--text_encoder",
            f"{tmp_path}/clip/",
        ]
    )
    assert cfg.dataset == f"folder:{tmp_path}/x/../pets/" and capsys.readouterr().out == ""
    with pytest.raises(SystemExit, match=r"--resume_step 3: .* no checkpoint of step 3 \(saved: 6\)"):
        train_main.parse_config(["--run_dir", str(tmp_path), "--resume_step", "3"])


def test_a_finished_run_says_so_and_starts_nothing(tmp_path, capsys):
    saved_run(tmp_path / "run", 6, model="unet_tiny", steps=6, wandb="offline")
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    train_main.main(train_main.parse_config(["--run_dir", str(tmp_path / "run")]))  # returns: status 0
    said = capsys.readouterr()
    assert "is already at step 6 of --steps 6: nothing to train" in said.out + said.err
    assert "--steps 12" in said.out + said.err  # how to train longer
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before  # no wandb, no log, no file


def sample_refusal(*args) -> str:
    """The SystemExit message with which sample.py's own `main` refuses `args`, in this process."""
    with pytest.raises(SystemExit) as refused:
        sample.main(sample.parse_args([*map(str, args)]))
    assert isinstance(refused.value.code, str)
    return refused.value.code


def test_user_errors_are_one_line_with_status_2(tmp_path):
    saved_run(tmp_path / "run", 6, model="unet_tiny", steps=12)
    result = cli("main.py", "--run_dir", tmp_path / "run", "--model", "dit_s")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines() == [
        f"error: {tmp_path / 'run'} is a run of step 6 whose --model dit_s (saved: unet_tiny) cannot change: leave it "
        "off to continue that run, or pass a new --run_dir to start another."
    ]
    # sample.py's refusals in this process (its status-2 wiring: tests/scripts/test_script_errors.py).
    # Read-only: a mistyped run directory leaves nothing behind.
    assert f"No checkpoint under {tmp_path / 'typo' / 'checkpoints'}: train first" in sample_refusal(
        "--run_dir", tmp_path / "typo", "--out", tmp_path / "grid.png"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]
    # --eval on a run it cannot score: refused from the saved config alone, before the state (a stand-in
    # that fits no model here) is restored or anything sampled.
    saved_run(tmp_path / "pets", 6, dataset="folder:~/pets")
    assert sample_refusal("--run_dir", tmp_path / "pets", "--eval", "--out", tmp_path / "s.npz") == (
        "--eval scores class-conditional digits and captioned_digits runs with a digits classifier; this run "
        "trained on folder:~/pets: measure it with --fid STATS.npz (train/fid_stats.py)."
    )
    assert not (tmp_path / "s.npz").exists()


def test_sample_classes_by_name_or_index_and_a_labelled_row_block_each():
    names = ["1", "cat", "dog", "eel"]  # a folder's sorted sub-folders; a name wins over an index
    assert sample.class_indices("dog,3, 1", names, 4) == [2, 3, 0]
    assert sample.class_indices("", names, 4) == [0, 1, 2, 3]
    assert sample.class_indices("3,1", None, 10) == [3, 1]  # bare label ids (digits)
    with pytest.raises(
        SystemExit,
        match=r"^--classes: this run has no class 'cow'; its classes are 0=1, 1=cat, "
        r"2=dog, 3=eel\.$",
    ):
        sample.class_indices("cat,cow", names, 4)
    with pytest.raises(SystemExit, match=r"no class '10'; its classes are 0\.\.9\."):
        sample.class_indices("10", None, 10)
    with pytest.raises(SystemExit, match="not class-conditional"):
        sample.class_indices("1", None, 0)
    # 7 images of classes 1, 1, 1, 1, 3, 3, 3 (sorted) at most 3 a row: 2 columns leave one blank (-1), 3 two;
    # each row labelled with its class.
    tiles, ncols, labels = sample.grid_rows(np.array([1, 1, 1, 1, 3, 3, 3]), ["a", "b", "c", "d"], max_cols=3)
    assert ncols == 2 and labels == ["b", "b", "d", "d"]
    assert tiles.tolist() == [0, 1, 2, 3, 4, 5, 6, -1]
    # --classes 3,5 at the default --num 100: 50 a class in 5 full rows of 10 each (not rows of 20, 20 and 10)
    tiles, ncols, labels = sample.grid_rows(sample.balanced_labels(100, [3, 5]), [str(k) for k in range(10)])
    assert ncols == 10 and labels == ["3"] * 5 + ["5"] * 5 and tiles.tolist() == list(range(100))
    assert sample.balanced_labels(7, [3, 1]).tolist() == [3, 3, 3, 3, 1, 1, 1]  # in the order asked for


def test_edm_p_mean_is_refused_for_another_schedule(tmp_path):
    cfg = train_main.parse_config(["--run_dir", str(tmp_path / "run"), "--schedule", "flow", "--edm_p_mean", "-0.3"])
    with pytest.raises(SystemExit, match="--edm_p_mean sets the edm schedule's training σ; --schedule flow"):
        train_main.main(cfg)
    assert not (tmp_path / "run").exists()
    cfg = train_main.parse_config(["--run_dir", str(tmp_path / "run"), "--schedule", "flow", "--edm_p_std", "1.6"])
    with pytest.raises(SystemExit, match="--edm_p_std sets the edm schedule's training σ; --schedule flow"):
        train_main.main(cfg)


def test_edm_p_mean_and_p_std_reach_the_training_draw_of_sigma(tmp_path):
    """EDM2's img64 p(σ): ln σ ~ N(-0.8, 1.6²), the draw's moments within 3 standard errors (n = 20000)."""
    cfg = train_main.parse_config(["--run_dir", str(tmp_path / "run"), "--edm_p_mean", "-0.8", "--edm_p_std", "1.6"])
    log_sigma = np.log(np.asarray(train_main.training_schedule(cfg).sample_sigma(jax.random.key(0), (20000,))))
    assert abs(log_sigma.mean() + 0.8) < 3 * 1.6 / np.sqrt(20000) and abs(log_sigma.std() - 1.6) < 0.03


def test_a_missing_or_unreadable_dataset_stops_before_anything_compiles(tmp_path):
    config = lambda *args: train_main.parse_config(["--run_dir", str(tmp_path / "run"), *args])  # noqa: E731
    with pytest.raises(SystemExit, match=r"Dataset folder not found: .*nowhere"):
        train_main.main(config("--dataset", f"folder:{tmp_path / 'nowhere'}"))
    folder = tmp_path / "pets"
    for name in ("cat", "dog"):
        (folder / name).mkdir(parents=True)
        for i in range(3):
            Image.fromarray(np.full((8, 8, 3), 40 * i, np.uint8)).save(folder / name / f"{i}.png")
    (folder / "dog" / "3.png").write_bytes(b"not a png")
    good = (folder / "cat" / "0.png").read_bytes()
    (folder / "cat" / "3.png").write_bytes(good[: len(good) // 2])  # a valid header, cut pixels
    with pytest.raises(SystemExit) as bad:
        train_main.main(config("--dataset", f"folder:{folder}"))
    assert "2 of 8 image files" in bad.value.code and "cat/3.png" in bad.value.code and "dog/3.png" in bad.value.code
    assert not (tmp_path / "run").exists()

    said = []
    source = train_main.open_dataset(config("--dataset", f"folder:{folder}", "--skip_bad_images"), said.append)
    assert len(source) == 6
    assert said == [
        f"dataset folder:{folder}: 6 images, classes 0=cat, 1=dog, model input 32×32×3 after resizing, "
        "2 unreadable files skipped"
    ]


def test_a_data_error_mid_run_saves_the_state_first(tmp_path):
    """train/loop.py: a batch that cannot be read at step 4 saves step 3 (what SIGTERM would), then one line."""

    def batches():
        yield from range(3)
        raise ValueError("Could not decode image pets/cat/9.png: truncated.")

    def train_step(state, batch):
        metrics = dict(
            loss=jnp.float32(1),
            finite=jnp.bool_(True),
            grad_norm=jnp.float32(1),
            lr=jnp.float32(1),
            bad_steps=jnp.int32(0),
        )
        return state + 1, metrics

    saved = []
    cfg = train_main.Config(steps=10, log_every=2, sample_every=0, ckpt_every=100)
    with StopRequest() as stop, pytest.raises(SystemExit) as error:
        train_main.train_loop(
            cfg,
            0,
            train_step,
            iter(batches()),
            MetricsLogger(tmp_path, enabled=False),
            start_step=0,
            log_window=LogWindow(16, 1.0, 1.0),
            profile=ProfileWindow("", tmp_path),
            write_samples=None,
            save_checkpoint=lambda step, state: saved.append((step, state)),
            stop=stop,
        )
    assert saved == [(3, 3)]  # the state after 3 steps, saved as step 3
    assert error.value.code.startswith("data error at step 4 (saved step 3): Could not decode image pets/cat/9.png")
    assert "--allow_dataset_change" in error.value.code


def test_one_wandb_run_across_resumes(tmp_path):
    """Each start of a run directory logs under the id kept there (offline: one folder per start, one id)."""
    for _ in range(2):
        with MetricsLogger(tmp_path, wandb_mode="offline") as logger:
            logger.log(1, {"x": 1.0})
    run_id = (tmp_path / "wandb_run_id").read_text().strip()
    runs = sorted((tmp_path / "wandb").glob("offline-run-*"))
    # offline-run-DATE_TIME-ID; wandb adds -1 to the second folder when both starts fall in one second.
    named = [re.fullmatch(rf"offline-run-\d{{8}}_\d{{6}}-{run_id}(-1)?", r.name) for r in runs]
    assert len(runs) == 2 and all(named), runs


def test_eval_scorecard_says_what_each_row_means():
    from eqxdiff.eval import digits_sample_metrics, format_metrics

    digits = open_source("digits")
    table = format_metrics(digits_sample_metrics(digits.images[:200], digits.labels[:200]))
    rows = {line.split()[0]: line for line in table.splitlines()[1:]}
    assert set(rows) == {"class_accuracy", "diversity_ratio", "nn_distance", "copy_fraction", "fd"}
    assert "higher is better" in rows["class_accuracy"] and "lower is better" in rows["fd"]
    assert "lower is better" in rows["copy_fraction"] and "near 1" in rows["diversity_ratio"]


def test_scripts_have_json_readable_checkpoint_configs(tmp_path):
    """train/resume.py reads the config as JSON where orbax put it, without orbax (before JAX starts)."""
    from eqxdiff.run.run_dir import saved_config

    config = saved_run(tmp_path, 4, model="unet_tiny")
    assert saved_config(tmp_path) == (4, json.loads(json.dumps(config)))
    assert saved_config(tmp_path / "empty") is None
    assert sys.modules["resume"].checkpoint_steps(tmp_path) == [4]


def test_a_failed_restores_leftover_async_errors_are_dropped_and_no_other():
    """The records asyncio writes for a failed orbax restore's other reads (tests/scripts/test_resume.py's unreadable
    checkpoint: "Future exception was never retrieved", a callback on the closed loop) never reach stderr once a
    script runs under exit_on_user_error; asyncio's other reports do."""

    def record(message: str, error: Exception | None = None) -> logging.LogRecord:
        exc_info = (type(error), error, None) if error else None
        return logging.LogRecord("asyncio", logging.ERROR, __file__, 1, message, None, exc_info)

    keep = LeftoverAsyncErrors().filter
    assert not keep(record("Future exception was never retrieved", ValueError("OUT_OF_RANGE: Error reading")))
    assert not keep(record("Exception in callback Future.set_result()", RuntimeError("Event loop is closed")))
    assert keep(record("Exception in callback Future.set_result()", ValueError("a real one")))
    assert keep(record("Exception in callback read()", RuntimeError("Session is closed")))  # a client's, not the loop's
    assert keep(record("Unclosed client session")) and keep(record("Executing <Task> took 2.0 seconds"))
    exit_on_user_error(lambda: None)
    assert any(isinstance(f, LeftoverAsyncErrors) for f in logging.getLogger("asyncio").filters)


def test_every_documented_sampling_command_parses(monkeypatch):
    """Each `python train/sample.py ...` and `python train/sample_pretrained.py ...` command of README.md and docs/
    (continued lines joined) is taken by its script's parser and checks: no page gives a flag the script refuses
    (a renamed one, or one of the other script's). The published checkpoints' files are not here: only their flags."""
    import shlex

    import sample_pretrained  # train/sample_pretrained.py
    from docs_pages import all_pages

    monkeypatch.setattr(sample_pretrained, "resolved", lambda flags: flags)  # the files each names are not here
    scripts = {
        "python train/sample.py ": sample.parse_args,
        "python train/sample_pretrained.py ": sample_pretrained.parse_args,
    }
    text = "\n".join(all_pages().values()).replace("\\\n", " ")
    parsed = 0
    for line in text.splitlines():
        for start, parse in scripts.items():
            if start in line and "`" not in line:
                parse(shlex.split(line[line.index(start) + len(start) :].split("#")[0]))
                parsed += 1
    assert parsed >= 20


def test_a_checkpoint_of_the_old_flag_names_resumes_and_samples_by_the_new(tmp_path, capsys):
    """A run saved when --guidance was --cfg_scale (and --guidance_interval --cfg_interval) resumes with its own
    guidance and interval under their new names, and sample.py's rebuild reads them alike; the old flags on a
    command line are one line naming the new ones."""
    from eqxdiff.run.rebuild import stored_flags
    from eqxdiff.run.sampling import run_sampling

    config = dict(
        dataclasses.asdict(train_main.Config(guidance=4.0, guidance_interval="0.3,3")),
        image_shape=[8, 8, 1],
        num_classes=10,
    )
    config["cfg_scale"], config["cfg_interval"] = config.pop("guidance"), config.pop("guidance_interval")
    with Checkpoints(tmp_path / "checkpoints", async_save=False) as checkpoints:
        assert checkpoints.save(6, {"w": jnp.ones(3)}, {"examples_consumed": 0}, config) == "saved"
    cfg = train_main.parse_config(["--run_dir", str(tmp_path)])
    assert (cfg.guidance, cfg.guidance_interval) == (4.0, "0.3,3")
    sampling = run_sampling(stored_flags(config))
    assert (sampling.guidance, sampling.guidance_interval) == (4.0, (0.3, 3.0))
    for old, new in (("--cfg_scale", "--guidance"), ("--cfg_interval", "--guidance_interval")):
        with pytest.raises(SystemExit):
            train_main.parse_config(["--run_dir", str(tmp_path), old, "2"])
        assert capsys.readouterr().err.startswith(f"error: {old} is now {new} ")


def test_no_page_notebook_or_benchmark_gives_a_renamed_flag():
    """The flags renamed for one name per concept (train/flags.py's RENAMED: --cfg, --cfg_scale, --cfg_interval, now
    --guidance and --guidance_interval) appear in no command of the documentation, the notebooks, the benchmarks or
    the tests' runs (BENCHMARKS.md keeps the commands as they were run; three tests give them: refused, or an old run's)."""
    from docs_pages import ROOT, all_pages
    from flags import RENAMED  # train/flags.py

    texts = dict(all_pages()) | {
        str(p.relative_to(ROOT)): p.read_text()
        for p in [
            *ROOT.glob("notebooks/*.ipynb"),
            *ROOT.glob("benchmarks/*.py"),
            *ROOT.glob("train/*.py"),
            *ROOT.glob("tests/**/test_*.py"),
        ]
    }
    texts.pop("train/flags.py")  # the table itself
    old_flags = (
        "tests/scripts/test_cli.py",
        "tests/scripts/test_script_errors.py",
        "tests/run/test_legacy_checkpoint.py",
    )
    for refusing in old_flags:  # the tests that give the old names: refused, or read back from an old checkpoint
        texts.pop(refusing)
    for name, text in texts.items():
        for old in RENAMED:
            assert not re.search(rf"{old}(?![\w-])", text), f"{name} gives {old}; it is {RENAMED[old]} now"
