"""A run survives SIGKILL and SIGTERM: restarted with the same command it ends bitwise equal to an
uninterrupted run, its data continuing mid-epoch and metrics.jsonl holding every step once."""

import shutil
import signal
import subprocess
import time

import pytest

from runs import (
    REFERENCE,
    REFERENCE_STEPS,
    ROOT,
    TINY,
    assert_bitwise_equal,
    command,
    committed,
    kill,
    last_logged_step,
    metric_rows,
    run,
    saved_arrays,
    start,
    wait_for,
)

STEPS = REFERENCE_STEPS
ARGS = [*REFERENCE, "--cpu_devices", 8]  # conftest's eight_device_run: the uninterrupted run


def assert_each_step_logged_once(run_dir):
    assert [r["step"] for r in metric_rows(run_dir)] == list(range(1, STEPS + 1))


@pytest.mark.slow
def test_sigkill_then_sigterm_and_each_restart_resumes_exactly(tmp_path, eight_device_run):
    """One run stopped twice: SIGKILL right after its first checkpoint (a lost node), then SIGTERM
    in the middle of the restarted run (a preemption). The same command each time."""
    args = ["--run_dir", tmp_path, *ARGS]
    proc = start("main.py", *args)
    wait_for(lambda: committed(tmp_path), proc)
    kill(proc)
    killed_at = committed(tmp_path)[-1]
    assert killed_at < STEPS, "the run finished before the kill; nothing was resumed"

    proc = start("main.py", *args)
    # "train:" is the progress bar, drawn once the loop (and its signal handlers) started; the
    # killed run's rows past its checkpoint are dropped by then, so these rows are new.
    wait_for(lambda: "train:" in proc.output() and last_logged_step(tmp_path) >= killed_at + 3, proc)
    proc.send_signal(signal.SIGTERM)
    sent = time.monotonic()
    returncode, output = proc.finish(timeout=30)
    assert returncode == 0 and time.monotonic() - sent < 30, output[-3000:]
    assert f"resumed from {tmp_path / 'checkpoints' / str(killed_at)} ({killed_at * 16} examples consumed)" in output
    stopped_at = committed(tmp_path)[-1]
    assert f"SIGTERM received: saved step {stopped_at}, exiting" in output
    assert killed_at + 3 <= stopped_at < STEPS

    result = run("main.py", *args)
    assert f"resumed from {tmp_path / 'checkpoints' / str(stopped_at)}" in result.stdout + result.stderr
    assert_bitwise_equal(saved_arrays(tmp_path, STEPS), saved_arrays(eight_device_run, STEPS))
    assert_each_step_logged_once(tmp_path)


@pytest.mark.slow
def test_ctrl_c_during_start_up_is_one_line(tmp_path, monkeypatch):
    """SIGINT before the loop's handler is installed (here as JAX starts, after the run's first line, with the
    backend, the data, the state and the step's compile still ahead): the one line, status 130 (a shell's for
    SIGINT), no traceback, nothing saved. Without the session's compile cache, so that the step compiles for a
    while rather than loading at once. The child gets SIGINT's default action back: pytest started as a
    background job of a script (`cmd &` without job control) ignores SIGINT, and a child inherits that, so the
    run would never see the signal and exit 0."""
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
    # A handler (not SIG_IGN) while the child starts: exec resets a handled signal to its default action.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        proc = start("main.py", "--run_dir", tmp_path, *TINY, "--steps", 5)
    finally:
        signal.signal(signal.SIGINT, previous)
    wait_for(lambda: "new run in" in proc.output(), proc)
    proc.send_signal(signal.SIGINT)
    returncode, output = proc.finish(timeout=120)
    assert returncode == 130 and "Traceback" not in output and "KeyboardInterrupt" not in output, output[-3000:]
    assert output.strip().splitlines()[-1] == (
        "SIGINT received: stopped without saving; the same command starts again (or resumes from the newest "
        "checkpoint, if any)"
    )
    assert committed(tmp_path) == []


@pytest.mark.slow
def test_an_unreadable_checkpoint_stops_the_run_and_is_kept(tmp_path, eight_device_run):
    run_dir, step = tmp_path / "run", STEPS - 6
    shutil.copytree(eight_device_run, run_dir)
    files = [p for p in (run_dir / "checkpoints" / str(step) / "state").rglob("*") if p.is_file()]
    data = max(files, key=lambda p: p.stat().st_size)
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    before = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    # The run's own command from that step: the step the process compiles alongside the restore
    # loads from the session's compile cache. A user error: one line, status 2.
    result = subprocess.run(
        command("main.py", "--run_dir", run_dir, *ARGS, "--resume_step", step),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert f"error: Checkpoint step {step} in {run_dir / 'checkpoints'} cannot be restored" in result.stderr
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == before  # nothing new, nothing removed
    assert [r["step"] for r in metric_rows(run_dir)] == list(range(1, STEPS + 1))  # the log is untouched
