"""A run's directory as train/main.py writes it: the steps it holds a checkpoint of, the config saved with each (plain
JSON, read before JAX starts), and the runs beside it a mistyped name most likely meant."""

import difflib
import json
import os
from pathlib import Path

from eqxdiff.paths import as_path, is_url

# Flags train/main.py renamed (one name per concept): an older checkpoint's config stores the old name.
RENAMED_FLAGS = {"cfg_scale": "guidance", "cfg_interval": "guidance_interval"}


def current_names(config: dict) -> dict:
    """A saved config with each renamed flag (RENAMED_FLAGS) under its current name."""
    return {RENAMED_FLAGS.get(k, k): v for k, v in config.items()}


def checkpoint_steps(run_dir: str | os.PathLike) -> list[int]:
    """The saved steps under RUN_DIR/checkpoints, oldest first. On disk orbax writes a step under a temporary
    name and renames it when complete, so a numeric folder is a committed one; in a bucket, which cannot
    rename, it writes the step in place and commit_success.txt into it last."""
    folder = as_path(run_dir) / "checkpoints"
    if not folder.is_dir():
        return []
    committed = (lambda d: (d / "commit_success.txt").exists()) if is_url(folder) else Path.is_dir
    return sorted(int(d.name) for d in folder.iterdir() if d.name.isdigit() and committed(d))


def saved_config(run_dir: str | os.PathLike, step: int = -1) -> tuple[int, dict] | None:
    """(step, its saved config, each flag by its current name) of checkpoint `step` of the run (-1: the newest),
    None when the run has no checkpoint yet."""
    steps = checkpoint_steps(run_dir)
    if step >= 0 and step not in steps:
        saved = ", ".join(map(str, steps)) or "none"
        raise SystemExit(f"--resume_step {step}: {run_dir} holds no checkpoint of step {step} (saved: {saved}).")
    if not steps:
        return None
    step = steps[-1] if step < 0 else step
    path = as_path(run_dir) / "checkpoints" / str(step) / "config" / "metadata"
    try:
        return step, current_names(json.loads(path.read_text()))
    except (OSError, ValueError) as e:
        raise SystemExit(
            f"Checkpoint step {step} of {run_dir}: cannot read its config {path} ({e}); pass "
            f"--resume_step with an older step, or a new --run_dir."
        ) from e


def close_runs(run_dir: str | os.PathLike) -> list[Path]:
    """Runs beside `run_dir` (folders holding checkpoints/) whose names are close to its name: what a
    mistyped --run_dir most likely meant."""
    if is_url(run_dir):  # suggestions from the local disk only: a bucket's listing is a request
        return []
    run_dir = Path(run_dir).expanduser()
    parent = run_dir.parent if run_dir.parent.is_dir() else None
    if parent is None:
        return []
    runs = {d.name: d for d in parent.iterdir() if (d / "checkpoints").is_dir()}
    return [runs[name] for name in difflib.get_close_matches(run_dir.name, list(runs), n=3, cutoff=0.75)]
