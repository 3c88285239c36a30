"""MetricsLogger: jsonl rows, non-finite values, truncation, disabled processes, offline wandb."""

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest

from eqxdiff.training import MetricsLogger


def _rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_rows_parse_in_order_with_nonfinite_as_null(tmp_path):
    with MetricsLogger(tmp_path, wandb_mode="disabled", config={"lr": 1e-4}) as log:
        for step in range(5):
            log.log(step, {"loss": 1.0 / (step + 1), "bad_steps": np.int32(step), "dev": jnp.float32(0.5)})
        log.log(5, {"loss": float("nan"), "gnorm": float("inf"), "neg": -np.inf})
    rows = _rows(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(6))
    assert rows[2] == {"step": 2, "loss": pytest.approx(1 / 3), "bad_steps": 2, "dev": 0.5}
    assert rows[5] == {"step": 5, "loss": None, "gnorm": None, "neg": None}  # JSON null, never a "nan" string
    assert "nan" not in (tmp_path / "metrics.jsonl").read_text().lower()


def test_log_once_merges_into_run_json(tmp_path):
    with MetricsLogger(tmp_path, wandb_mode="disabled", config={}) as log:
        log.log_once({"startup/time_to_first_step_s": 6.5})
        log.log_once({"startup/step_flops": 1.5e12, "startup/peak": float("nan")})
    facts = json.loads((tmp_path / "run.json").read_text())
    assert facts == {"startup/time_to_first_step_s": 6.5, "startup/step_flops": 1.5e12, "startup/peak": None}


def test_truncate_after_drops_later_rows_and_torn_lines(tmp_path):
    log = MetricsLogger(tmp_path, wandb_mode="disabled", config={})
    for step in range(0, 100, 10):
        log.log(step, {"loss": float(step)})
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 100, "lo')  # a crash mid-write
    log.truncate_after(40)
    assert [r["step"] for r in _rows(tmp_path / "metrics.jsonl")] == [0, 10, 20, 30, 40]
    log.log(50, {"loss": 5.0})  # resumed run appends after the cut
    assert [r["step"] for r in _rows(tmp_path / "metrics.jsonl")] == [0, 10, 20, 30, 40, 50]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]  # no temp files left
    log.close()


def test_disabled_process_writes_nothing(tmp_path, monkeypatch):
    import sys

    monkeypatch.delitem(sys.modules, "wandb", raising=False)
    run_dir = tmp_path / "run"
    with MetricsLogger(run_dir, wandb_mode="offline", config={"a": 1}, enabled=False) as log:
        log.log(0, {"loss": 1.0})
        log.log_once({"startup/x": 1.0})
        log.truncate_after(0)
    assert not run_dir.exists()
    assert "wandb" not in sys.modules


def test_wandb_disabled_creates_no_wandb_dir(tmp_path):
    with MetricsLogger(tmp_path, wandb_mode="disabled", config={}) as log:
        log.log(0, {"loss": 1.0})
    assert not (tmp_path / "wandb").exists()


def test_invalid_mode_lists_valid_ones(tmp_path):
    with pytest.raises(ValueError, match="online.*offline.*disabled"):
        MetricsLogger(tmp_path, wandb_mode="dryrun", config={})


def test_wandb_offline_writes_a_local_run(tmp_path, monkeypatch, capfd):
    """A local run, said in a few lines at its start and none at its end (wandb's history and summary of every
    metric: ~30 lines after each run, which metrics.jsonl holds)."""
    monkeypatch.delenv("WANDB_SILENT", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    # Anything wandb sent would go to a closed loopback port, never off the machine.
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")
    with MetricsLogger(tmp_path, wandb_mode="offline", config={"lr": 1e-4}) as log:
        log.log(0, {"loss": 1.0})
        log.log(1, {"loss": float("nan")})
        log.log_once({"startup/step_flops": 1e9})
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and any(runs[0].glob("*.wandb"))
    said = capfd.readouterr()
    assert "Run data is saved locally in" in said.err + said.out
    assert not {"Run history", "Run summary"} & set(
        line.removeprefix("wandb: ").rstrip(":") for line in (said.err + said.out).splitlines()
    ), said
    assert [r["step"] for r in _rows(tmp_path / "metrics.jsonl")] == [0, 1]


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_run_json_and_the_wandb_id_have_the_umasks_permissions(tmp_path, umask):
    """Written whole (a temporary file renamed in), they read as a file written in place would: 0o666 less the
    umask (mkstemp's own 0o600 kept a shared run's files from its group)."""
    before = os.umask(umask)
    try:
        with MetricsLogger(tmp_path, wandb_mode="disabled", config={}) as log:
            log.log_once({"startup/time_to_first_step_s": 6.5})
            log.wandb_run_id()
        (tmp_path / "in_place").write_text("")
    finally:
        os.umask(before)
    modes = {name: (tmp_path / name).stat().st_mode & 0o777 for name in ("run.json", "wandb_run_id", "in_place")}
    assert modes == dict.fromkeys(modes, 0o666 & ~umask)
