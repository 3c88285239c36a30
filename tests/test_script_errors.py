"""Expected mistakes in every train/ script, as a user meets them: one line on stderr, status 2, no
traceback, the key phrase, and nothing loaded first (each refusal comes before any dataset is read
or anything compiles: every case here is a process start and a few checks)."""

import json
import os
import subprocess
from pathlib import Path

import pytest

from runs import ROOT, command


def refused(script: str, *args, cwd=ROOT) -> str:
    """The one stderr line of a script that must refuse `args` with status 2."""
    result = subprocess.run(command(script, *args), cwd=cwd, capture_output=True, text=True, timeout=120)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), result.stderr[-3000:]
    return lines[0]


def fake_run(run_dir: Path, step: int = 6, **config) -> Path:
    """A run directory as sample.py first reads it: checkpoint `step`'s saved config, as plain JSON
    (nothing here gets as far as restoring arrays)."""
    folder = run_dir / "checkpoints" / str(step) / "config"
    folder.mkdir(parents=True)
    saved = {"dataset": "digits", "model": "unet_tiny", "num_classes": 10, "image_shape": [8, 8, 1], **config}
    (folder / "metadata").write_text(json.dumps(saved))
    return run_dir


@pytest.fixture
def a_file(tmp_path) -> Path:
    """A plain file where a user's command expects a folder (an output path through it cannot be made)."""
    path = tmp_path / "notes"
    path.write_text("")
    return path


def test_an_output_that_cannot_be_written_is_refused_before_the_long_part(tmp_path, a_file):
    # fid_stats.py: before the dataset (which does not exist either) or the weights are read.
    line = refused("fid_stats.py", "--dataset", f"folder:{tmp_path / 'none'}", "--inception", tmp_path / "no.pth",
                   "--out", a_file / "fid" / "stats.npz")  # fmt: skip
    assert line == (f"error: --out {a_file / 'fid' / 'stats.npz'}: cannot write into {a_file}: it is a file, not a "
                    "folder; pass another --out (or make that folder writable).")  # fmt: skip
    line = refused("encode.py", "--dataset", f"folder:{tmp_path / 'none'}", "--vae", "space_to_depth:2",
                   "--out", a_file / "latents")  # fmt: skip
    assert line.startswith(f"error: --out {a_file / 'latents'}: cannot write into {a_file}: it is a file")
    run_dir = fake_run(tmp_path / "run")
    line = refused("sample.py", "--run_dir", run_dir, "--out", a_file / "grid.png")
    assert line.startswith(f"error: --out {a_file / 'grid.png'}: cannot write into {a_file}: it is a file")
    line = refused("sample.py", "--run_dir", run_dir, "--fid", tmp_path / "ref.npz", "--inception", "x.pth",
                   "--fid_out", a_file / "fid.jsonl")  # fmt: skip
    assert line.startswith(f"error: --fid_out {a_file / 'fid.jsonl'}: cannot write into {a_file}: it is a file")
    line = refused("main.py", "--run_dir", a_file / "run", "--model", "unet_tiny")
    assert line.startswith(f"error: --run_dir {a_file / 'run'}: cannot write into {a_file}: it is a file")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes", "run"]  # nothing made on the way


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a folder whatever its permission bits")
def test_a_read_only_folder_is_refused(tmp_path):
    folder = tmp_path / "read_only"
    folder.mkdir()
    folder.chmod(0o500)
    try:
        line = refused("main.py", "--run_dir", folder / "run", "--model", "unet_tiny")
    finally:
        folder.chmod(0o700)
    assert f"cannot write into {folder}: Permission denied" in line


def test_the_folders_a_user_expects_are_made_before_the_long_part(tmp_path):
    """fid_stats.py makes --out's folders (the README writes to ~/fid/) before it reads the data: here a
    missing dataset stops it after they exist; a training run's directory waits for the run."""
    out = tmp_path / "fid" / "pets" / "stats.npz"
    line = refused("fid_stats.py", "--dataset", f"folder:{tmp_path / 'none'}", "--inception", "x.pth", "--out", out)
    assert "Dataset folder not found" in line and out.parent.is_dir() and not out.exists()
    line = refused("main.py", "--run_dir", tmp_path / "runs" / "x", "--dataset", f"folder:{tmp_path / 'none'}")
    assert "Dataset folder not found" in line and not (tmp_path / "runs").exists()
