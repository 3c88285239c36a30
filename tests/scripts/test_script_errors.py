"""Expected mistakes in every train/ script, as a user meets them: one line on stderr, status 2, no
traceback, the key phrase, and nothing loaded first (each refusal comes before any dataset is read
or anything compiles). One case per script runs as its command line runs it (the wiring: its `__main__`, status 2,
one line, no traceback), all in one process (test_each_script_refuses_on_its_command_line_in_one_line: a process
start under the import hook costs ~3 s); the rest call the script's own `main` here, the same code up to the exit."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import train_scripts  # noqa: F401 — puts train/ on sys.path: a test of the scripts
import encode
import fid_stats
import main as train_main
import sample
import sample_pretrained
from offline import open_dataset

from runs import ROOT


# Each train/ script's `__main__` in turn, as `python train/SCRIPT ARGS` runs it (argv, train/ first on the path),
# in one process: what each wrote to stdout and stderr and the status its SystemExit carries (or the class of the
# exception it raised), as one JSON line.
IN_TURN = """import contextlib, io, json, os, runpy, sys
train, cases = sys.argv[1], json.loads(sys.argv[2])
sys.path.insert(0, train)
results = []
for script, args in cases:
    sys.argv = [os.path.join(train, script), *args]
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            runpy.run_path(sys.argv[0], run_name="__main__")
            status = 0
        except SystemExit as e:
            status = e.code
        except Exception as e:  # what a process would end with, a traceback: its class
            status = type(e).__name__
    results.append({"status": status, "stdout": out.getvalue(), "stderr": err.getvalue()})
print(json.dumps(results))
"""


def run_in_turn(folder: Path, cases: list[tuple[str, list]]) -> list[dict]:
    """IN_TURN's results for `cases` ((script, args) each), in one process under the import hook
    (tests/typechecked.py); the process itself exits 0 and writes nothing to stderr at exit (what a refused
    script leaves unfinished is finalised silently: exit_on_user_error)."""
    (folder / "in_turn.py").write_text(IN_TURN)
    cases = [(script, [*map(str, args)]) for script, args in cases]
    cmd = [sys.executable, str(ROOT / "tests" / "typechecked.py"), str(folder / "in_turn.py"), str(ROOT / "train")]
    result = subprocess.run([*cmd, json.dumps(cases)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stderr == "", result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def one_error_line(result: dict) -> str:
    lines = result["stderr"].strip().splitlines()
    assert result["status"] == 2 and len(lines) == 1 and lines[0].startswith("error: "), result
    return lines[0]


def fake_run(run_dir: Path, step: int = 6, **config) -> Path:
    """A run directory as sample.py first reads it: checkpoint `step`'s saved config, as plain JSON
    (nothing here gets as far as restoring arrays)."""
    folder = run_dir / "checkpoints" / str(step) / "config"
    folder.mkdir(parents=True)
    saved = {"dataset": "digits", "model": "unet_tiny", "num_classes": 10, "image_shape": [8, 8, 1], **config}
    (folder / "metadata").write_text(json.dumps(saved))
    return run_dir


def refusal(script_main, parse, *args) -> str:
    """The SystemExit message with which a script's own `main` refuses `args`, in this process."""
    with pytest.raises(SystemExit) as refused_here:
        script_main(parse([*map(str, args)]))
    assert isinstance(refused_here.value.code, str)
    return refused_here.value.code


def parse_refusal(parse, capsys, *args) -> str:
    """The one stderr line with which a script's own parser refuses `args` with status 2, in this process."""
    with pytest.raises(SystemExit) as exited:
        parse([*map(str, args)])
    lines = capsys.readouterr().err.strip().splitlines()
    assert exited.value.code == 2 and len(lines) == 1 and lines[0].startswith("error: "), lines
    return lines[0]


@pytest.fixture
def a_file(tmp_path) -> Path:
    """A plain file where a user's command expects a folder (an output path through it cannot be made)."""
    path = tmp_path / "notes"
    path.write_text("")
    return path


def test_an_output_that_cannot_be_written_is_refused_before_the_long_part(tmp_path, a_file):
    # fid_stats.py: before the dataset (which does not exist either) or the weights are read.
    message = refusal(
        fid_stats.main,
        fid_stats.parse_config,
        "--dataset",
        f"folder:{tmp_path / 'none'}",
        "--inception",
        tmp_path / "no.pth",
        "--out",
        a_file / "fid" / "stats.npz",
    )
    assert message == (
        f"--out {a_file / 'fid' / 'stats.npz'}: cannot write into {a_file}: it is a file, not a "
        "folder; pass another --out (or make that folder writable)."
    )  # as a process: test_each_script_refuses_on_its_command_line_in_one_line
    run_dir = fake_run(tmp_path / "run")
    message = refusal(sample.main, sample.parse_args, "--run_dir", run_dir, "--out", a_file / "grid.png")
    assert message.startswith(f"--out {a_file / 'grid.png'}: cannot write into {a_file}: it is a file")
    message = refusal(train_main.main, train_main.parse_config, "--run_dir", a_file / "run", "--model", "unet_tiny")
    assert message.startswith(f"--run_dir {a_file / 'run'}: cannot write into {a_file}: it is a file")
    message = refusal(
        encode.main,
        encode.parse_config,
        "--dataset",
        f"folder:{tmp_path / 'none'}",
        "--vae",
        "space_to_depth:2",
        "--out",
        a_file / "latents",
    )
    assert message.startswith(f"--out {a_file / 'latents'}: cannot write into {a_file}: it is a file")
    message = refusal(
        sample.main,
        sample.parse_args,
        "--run_dir",
        run_dir,
        "--fid",
        tmp_path / "ref.npz",
        "--inception",
        "x.pth",
        "--fid_out",
        a_file / "fid.jsonl",
    )
    assert message.startswith(f"--fid_out {a_file / 'fid.jsonl'}: cannot write into {a_file}: it is a file")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes", "run"]  # nothing made on the way


def test_a_read_only_folder_is_refused(tmp_path):
    """A folder whose bits forbid writing; as root (who writes whatever the bits say) sysfs, which
    refuses new files to root too: the probe file, not the permission bits, decides."""
    folder = tmp_path / "read_only"
    folder.mkdir()
    folder.chmod(0o500)
    if os.geteuid() == 0:
        folder = Path("/sys")
    try:
        message = refusal(train_main.main, train_main.parse_config, "--run_dir", folder / "eqxdiff_run")
    finally:
        (tmp_path / "read_only").chmod(0o700)
    assert f"cannot write into {folder}: Permission denied" in message


@pytest.mark.quick  # a one-line error: the quick tier
def test_the_folders_a_user_expects_are_made_before_the_long_part(tmp_path):
    """fid_stats.py makes --out's folders (the README writes to ~/fid/) before it reads the data: here a
    missing dataset stops it after they exist; a training run's directory waits for the run."""
    out = tmp_path / "fid" / "pets" / "stats.npz"
    message = refusal(
        fid_stats.main,
        fid_stats.parse_config,
        "--dataset",
        f"folder:{tmp_path / 'none'}",
        "--inception",
        "x.pth",
        "--out",
        out,
    )
    assert "Dataset folder not found" in message and out.parent.is_dir() and not out.exists()
    message = refusal(
        train_main.main,
        train_main.parse_config,
        "--run_dir",
        tmp_path / "runs" / "x",
        "--dataset",
        f"folder:{tmp_path / 'none'}",
    )
    assert "Dataset folder not found" in message and not (tmp_path / "runs").exists()


@pytest.mark.quick  # a one-line error: the quick tier
def test_a_mistyped_or_empty_model_folder_is_named_in_one_line(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()

    def encode_refusal(*args) -> str:
        return refusal(encode.main, encode.parse_config, "--out", tmp_path / "latents", *args)

    message = encode_refusal("--vae", tmp_path / "sd-vea")  # as a process: test_each_script_refuses_on_its_command_...
    assert message.startswith(f"--vae: Autoencoder '{tmp_path / 'sd-vea'}': {tmp_path / 'sd-vea'} does not exist;")

    def main_refusal(*args) -> str:
        return refusal(
            train_main.main,
            train_main.parse_config,
            "--dataset",
            "captioned_digits",
            "--run_dir",
            tmp_path / "run",
            *args,
        )

    assert main_refusal("--text_encoder", tmp_path / "nope").startswith(
        f"--text_encoder {tmp_path / 'nope'}: {tmp_path / 'nope'} does not exist (a transformers CLIP text folder"
    )
    message = encode_refusal("--vae", "space_to_depth:x")
    assert message.startswith("--vae: Bad autoencoder 'space_to_depth:x': the accepted forms are space_to_depth:F")
    message = encode_refusal("--vae", empty)
    assert message.startswith(f"--vae: Autoencoder '{empty}': {empty} is not a diffusers VAE folder (needs config.json")
    message = encode_refusal("--vae", "space_to_depth:2", "--text_encoder", tmp_path / "nope")
    assert message.startswith(f"--text_encoder {tmp_path / 'nope'}: {tmp_path / 'nope'} does not exist")
    assert main_refusal("--text_encoder", empty).startswith(
        f"--text_encoder {empty}: the folder is empty, with no config.json"
    )
    (empty / "config.json").write_text("{}")
    message = main_refusal("--text_encoder", empty)
    assert "model.safetensors does not exist" in message and "(the folder holds ['config.json'])" in message
    (empty / "model.safetensors").write_bytes(b"")
    message = main_refusal("--text_encoder", empty, "--tokenizer", tmp_path / "tok")
    assert message.startswith(f"--tokenizer {tmp_path / 'tok'}: {tmp_path / 'tok'} does not exist")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty"]  # no latents folder, no run directory


def test_sampling_a_class_the_run_does_not_have_is_named_with_the_classes_it_has(tmp_path):
    run_dir = fake_run(tmp_path / "run", num_classes=2, class_names=["cat", "cow"])
    out = tmp_path / "grid.png"
    message = refusal(sample.main, sample.parse_args, "--run_dir", run_dir, "--classes", "dog", "--out", out)
    assert message == "--classes: this run has no class 'dog'; its classes are 0=cat, 1=cow."  # as a process too:
    # test_each_script_refuses_on_its_command_line_in_one_line
    assert not (tmp_path / "grid.png").exists()


@pytest.mark.quick  # a one-line error: the quick tier
def test_a_text_tower_moved_since_training_is_named_when_sampling(tmp_path):
    import dataclasses

    import jax.numpy as jnp

    from eqxdiff.checkpoint import Checkpoints

    tower = tmp_path / "sd" / "text_encoder"
    config = dict(
        dataclasses.asdict(train_main.Config(dataset="folder:~/pets", model="unet_tiny")),
        image_shape=[8, 8, 3],
        num_classes=0,
        text={
            "text_encoder": str(tower),
            "tokenizer": str(tower.parent / "tokenizer"),
            "null_text": "empty",
            "max_length": 16,
        },
    )
    with Checkpoints(tmp_path / "run" / "checkpoints", async_save=False) as checkpoints:
        assert checkpoints.save(6, {"w": jnp.ones(3)}, {"examples_consumed": 0}, config) == "saved"
    message = refusal(
        sample.main,
        sample.parse_args,
        "--run_dir",
        tmp_path / "run",
        "--prompts",
        "a cat",
        "--out",
        tmp_path / "grid.png",
    )
    assert message.startswith(f"{tmp_path / 'run'} trained with the text tower {tower}, which cannot be read now (")
    assert message.endswith("); put it back there.")


@pytest.mark.quick  # a one-line error: the quick tier
def test_a_mistyped_run_dir_on_the_short_resume_form_is_refused_naming_the_close_run(tmp_path, capsys, monkeypatch):
    """`main.py --run_dir runs/X` alone (docs/training.md's resume form) on a folder that does not exist beside a run
    of a close name: refused, not a fresh default digits run; a command giving what to train, or a folder
    made first, starts the new run and says so."""
    (tmp_path / "runs" / "pets-dit_s" / "checkpoints" / "500").mkdir(parents=True)
    (tmp_path / "runs" / "pets-dit_s" / "checkpoints" / "1000").mkdir()
    typo = Path("runs") / "pets-dti_s"
    monkeypatch.chdir(tmp_path)
    message = refusal(train_main.main, train_main.parse_config, "--run_dir", typo)
    assert message == (
        f"--run_dir {typo} does not exist; did you mean runs/pets-dit_s (a run at step 1000)? To "
        f"start a new run there anyway, give its --dataset (or make the folder first: mkdir -p {typo})."
    )
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["pets-dit_s"]  # nothing started or made
    message = refusal(sample.main, sample.parse_args, "--run_dir", tmp_path / typo, "--out", tmp_path / "g.png")
    assert f"did you mean {tmp_path / 'runs' / 'pets-dit_s'}? Else train first" in message

    def start_line(*args) -> str:
        """What main.py says first, for a command stopped right after (a refused --edm_p_mean)."""
        with pytest.raises(SystemExit, match="--edm_p_mean sets the edm schedule"):
            train_main.main(train_main.parse_config([*map(str, args), "--schedule", "flow", "--edm_p_mean", "-0.3"]))
        return capsys.readouterr().out.splitlines()[0]

    given = tmp_path / typo
    assert start_line("--run_dir", given, "--dataset", "digits") == f"new run in {given}: unet on digits"
    cats = tmp_path / "runs" / "cats"  # no run of a close name beside it
    assert start_line("--run_dir", cats) == f"new run in {cats}: unet on digits"
    given.mkdir()
    assert start_line("--run_dir", given) == f"new run in {given}: unet on digits"
    resumed = fake_run(tmp_path / "runs" / "dogs", step=6, schedule="flow", steps=12)
    assert start_line("--run_dir", resumed) == f"resuming {resumed} from step 6"


@pytest.mark.quick  # a one-line error: the quick tier
def test_latents_whose_vae_folder_moved_are_named_before_anything_compiles(tmp_path):
    """meta.json names the VAE's folder, which decodes grids: a folder moved since the encode is one line."""
    import shutil

    import numpy as np

    vae = shutil.copytree(ROOT / "tests" / "data" / "autoencoder_kl" / "sd_like", tmp_path / "vae")
    images = np.random.default_rng(0).integers(0, 256, (2, 16, 16, 3), dtype=np.uint8)
    np.savez(tmp_path / "rgb.npz", images=images)
    encode.main(
        encode.parse_config(
            [
                "--dataset",
                f"npz:{tmp_path / 'rgb.npz'}",
                "--vae",
                str(vae),
                "--out",
                str(tmp_path / "latents"),
                "--batch_size",
                "8",
            ]
        )
    )
    shutil.rmtree(vae)
    message = refusal(
        train_main.main,
        train_main.parse_config,
        "--dataset",
        f"latents:{tmp_path / 'latents'}",
        "--run_dir",
        tmp_path / "run",
    )
    assert message.startswith(f"latents:{tmp_path / 'latents'}: the VAE its meta.json names cannot be read (")
    assert f"{vae} does not exist" in message and message.endswith("put it back there.")


@pytest.mark.quick  # a one-line error: the quick tier
def test_a_user_error_is_its_one_line_even_when_the_failed_work_leaves_cleanup_behind(tmp_path):
    # A failed orbax restore leaves its other concurrent reads unfinished; Python finalises them at exit and
    # prints each one's traceback through sys.unraisablehook. Stood in for by an object whose finaliser raises.
    program = tmp_path / "script.py"
    program.write_text(
        "import sys\n"
        f"sys.path.insert(0, {str(ROOT / 'train')!r})\n"
        "from startup import exit_on_user_error\n"
        "class Leftover:\n"
        "    def __del__(self):\n"
        "        raise RuntimeError('a read that never finished')\n"
        "left = []\n"
        "def main():\n"
        "    left.append(Leftover())\n"
        "    raise SystemExit('the checkpoint cannot be restored: use another step')\n"
        "exit_on_user_error(main)\n"
    )
    result = subprocess.run([sys.executable, str(program)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert result.stderr == "error: the checkpoint cannot be restored: use another step\n"


def test_an_unreadable_dataset_is_one_line():
    """train/encode.py's and train/fid_stats.py's dataset (train/offline.py)."""
    with pytest.raises(SystemExit, match="npz"):
        open_dataset("npz:no/such/file.npz", 8)


@pytest.mark.quick  # a one-line error: the quick tier
def test_a_mistyped_flag_is_one_line_naming_the_closest_and_no_prefix_is_taken(tmp_path, capsys):
    """argparse's mistakes without its usage block: one line, status 2, the closest flag named; `--step 3` is not
    taken as main.py's `--steps 3` (no prefix matching), nor anything written."""
    assert parse_refusal(train_main.parse_config, capsys, "--run_dir", tmp_path / "run", "--step", 3) == (
        "error: unrecognized arguments: --step 3 (did you mean --steps?)"
    )  # main.py on its command line: the --fsdp_size refusal below
    assert not (tmp_path / "run").exists()
    for parse, args, said in (
        (sample.parse_args, ["--run_dir", "r", "--stepz", "3"], "arguments: --stepz 3 (did you mean --step?)"),
        (encode.parse_config, ["--vae", "v", "--out", "o", "--image_sise", "8"], "(did you mean --image_size?)"),
        (fid_stats.parse_config, ["--inception", "i", "--out", "o", "--zzz"], "--zzz (--help lists the flags)"),
        (train_main.parse_config, ["--model", "unet_tin"], "argument --model: invalid choice: 'unet_tin'"),
        (train_main.parse_config, ["--lr_ref", "5"], "--lr_ref 5 (did you mean --lr_ref_steps?)"),
    ):
        with pytest.raises(SystemExit) as exited:
            parse(args)
        err = capsys.readouterr().err.strip().splitlines()
        assert exited.value.code == 2 and len(err) == 1 and err[0].startswith("error: ") and said in err[0], err


def test_a_renamed_or_moved_flag_is_one_line_naming_the_new_one(capsys):
    """`--cfg` and the flags of a published checkpoint, as the scripts took them before: one line naming what to run
    now (the flag's new name, or the script that takes it), status 2, nothing started. Both scripts' parsers here
    (sample_pretrained.py's --cfg also on its command line: test_each_script_refuses_on_its_command_line_in_one_line)."""
    assert parse_refusal(sample.parse_args, capsys, "--run_dir", "r", "--cfg", 2) == (
        "error: --cfg is now --guidance (one name for it in every script and in the library)"
    )
    assert parse_refusal(sample_pretrained.parse_args, capsys, "--pretrained", "dit:x.pt", "--cfg", 2).startswith(
        "error: --cfg is now --guidance"
    )
    said = parse_refusal(sample.parse_args, capsys, "--pretrained", "sd:folder", "--prompts", "a cat")
    assert said.startswith("error: --pretrained: python train/sample_pretrained.py --pretrained dit:FILE|sit:FILE|sd:")


@pytest.mark.quick  # a one-line error: the quick tier
def test_each_script_refuses_on_its_command_line_in_one_line(tmp_path):
    """One refusal per train/ script through its `__main__`, as `python train/SCRIPT ...` runs it: status 2, one line
    on stderr, no traceback, nothing made (each one's other cases: in this process, above). main.py's: --fsdp_size
    larger than the devices (a CPU's one: the process's own) names the flag and how a CPU simulates more (its
    mistyped flags: tests/scripts/test_cli.py). The launcher (which starts no JAX) parses as every script does:
    `--num_proc 2` is not taken as --num_processes, and nothing starts. The process is tests/typechecked.py's, as
    every script test's: a wrong shape passed to eqxdiff there fails (the import hook checks them)."""
    a_file = tmp_path / "notes"  # a plain file where a folder is expected
    a_file.write_text("")
    run_dir = fake_run(tmp_path / "run", num_classes=2, class_names=["cat", "cow"])
    fid_out = a_file / "fid" / "stats.npz"
    cases = {
        "fid_stats.py": [
            "--dataset",
            f"folder:{tmp_path / 'none'}",
            "--inception",
            tmp_path / "no.pth",
            "--out",
            fid_out,
        ],
        "encode.py": ["--vae", tmp_path / "sd-vea", "--out", tmp_path / "latents"],
        "sample.py": ["--run_dir", run_dir, "--classes", "dog", "--out", tmp_path / "grid.png"],
        "sample_pretrained.py": ["--pretrained", "dit:x.pt", "--cfg", 2],
        "launch_local.py": ["--num_proc", 2, "--", "--steps", 1],
        "evaluate.py": [tmp_path / "none.npz", tmp_path / "samples.npz"],
        "main.py": ["--run_dir", tmp_path / "new_run", "--fsdp_size", 8, "--steps", 2],
        str(tmp_path / "wrong_shape.py"): [],
    }
    (tmp_path / "wrong_shape.py").write_text(
        "import numpy as np\nfrom eqxdiff.diffusion.denoiser import per_example\n"
        "per_example(np.zeros((2, 3)), np.zeros((2, 3)))\nprint('unchecked')\n"
    )
    results = dict(zip(cases, run_in_turn(tmp_path, list(cases.items())), strict=True))
    unchecked = results.pop(str(tmp_path / "wrong_shape.py"))
    assert unchecked["status"] == "TypeCheckError" and "unchecked" not in unchecked["stdout"], unchecked
    line = {script: one_error_line(result) for script, result in results.items()}
    assert line["fid_stats.py"] == (
        f"error: --out {fid_out}: cannot write into {a_file}: it is a file, not a folder; pass another --out (or make "
        "that folder writable)."
    )
    sd_vea = tmp_path / "sd-vea"
    assert line["encode.py"].startswith(f"error: --vae: Autoencoder '{sd_vea}': {sd_vea} does not exist;")
    assert line["sample.py"] == "error: --classes: this run has no class 'dog'; its classes are 0=cat, 1=cow."
    assert line["sample_pretrained.py"].startswith("error: --cfg is now --guidance")
    assert line["launch_local.py"] == "error: unrecognized arguments: --num_proc (did you mean --num_processes?)"
    assert results["launch_local.py"]["stdout"] == ""
    assert line["evaluate.py"].startswith(f"error: No batch file {tmp_path / 'samples.npz'}: ADM's batches are .npz")
    assert line["main.py"].startswith("error: --fsdp_size 8: fsdp=8 must be >= 1 and divide the 1 devices.")
    assert "--cpu_devices N simulates N devices" in line["main.py"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "in_turn.py",
        "notes",
        "run",
        "wrong_shape.py",
    ]  # nothing made
