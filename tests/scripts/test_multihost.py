"""Multi-host on one machine: 2 processes x 4 CPU devices through train/launch_local.py train like
1 process x 8 devices, resume bitwise from a mid-run checkpoint in a bucket (gs://, tests/bucket.py's server)
and write one there that restores in 1 process, and their checkpoint on local disk restores in 1 process
(sample.py; main.py onto another mesh, --steps and --batch_size); the launcher stops the others when one
process fails."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import fsspec
import numpy as np
import pytest
from runs import (
    ROOT,
    TINY,
    assert_bitwise_equal,
    assert_finite_training,
    committed,
    last_logged_step,
    metric_rows,
    run,
    saved_arrays,
    start,
    wait_for,
)

from eqxdiff.paths import as_path

# Six steps of the reference job (tests/runs.py): its learning rate up to step 6 does not depend on
# the run's length (warm-up over 4 steps, then cosine from the peak), so these steps' losses are
# the 24-step eight_device_run's first six.
STEPS = 6
ARGS = [*TINY, "--steps", STEPS, "--ckpt_every", 3, "--fsdp_size", 2]


def two_processes(run_dir):
    return ["--num_processes", 2, "--", "--run_dir", run_dir, *ARGS, "--cpu_devices", 4]


@pytest.fixture(scope="module")
def two_process_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("two_processes")
    result = run("launch_local.py", *two_processes(run_dir))
    assert "[p0]" in result.stdout and "[p1]" in result.stdout
    assert "Gloo" not in result.stdout and "connected peer ranks" not in result.stdout  # the launcher's filter
    assert committed(run_dir) == [3, 6]
    return run_dir


def losses(run_dir):
    rows = metric_rows(run_dir)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))  # only process 0 writes, each step once
    return np.array([r["train/loss"] for r in rows])


@pytest.mark.slow
def test_two_processes_train_like_one(two_process_run, eight_device_run):
    one_process = np.array([r["train/loss"] for r in metric_rows(eight_device_run)][:STEPS])
    np.testing.assert_allclose(losses(two_process_run), one_process, rtol=1e-5)


@pytest.mark.slow
def test_two_process_run_in_a_bucket_resumes_bitwise_and_restores_in_one_process(tmp_path, two_process_run, bucket):
    """The finished run as a kill right after its step-3 checkpoint leaves it (its later rows in
    metrics.jsonl, dropped on resume), put in a bucket (tests/bucket.py's server, whose variables the
    launcher's processes inherit) and restarted there on 2 processes: they restore step 3 from the bucket
    and write step 6 to it, which this one process restores bitwise equal to the local run's. (A SIGKILL
    and restart of a live run: tests/scripts/test_resume.py, on one process; the same run on local disk: the
    module's other tests.)"""
    shutil.copytree(two_process_run, tmp_path / "run")
    shutil.rmtree(tmp_path / "run" / "checkpoints" / str(STEPS))
    run_dir = as_path(f"{bucket}/run")
    fsspec.filesystem("gs").put(f"{tmp_path / 'run'}/", str(run_dir).removeprefix("gs://"), recursive=True)
    assert committed(run_dir) == [3]
    result = run("launch_local.py", *two_processes(run_dir))
    assert f"resumed from {run_dir}/checkpoints/3" in result.stdout
    assert committed(run_dir) == [3, STEPS]
    assert_bitwise_equal(saved_arrays(run_dir, STEPS), saved_arrays(two_process_run, STEPS))
    losses(run_dir)


@pytest.mark.slow
def test_resume_on_one_process_another_mesh_steps_and_batch_then_ctrl_c(tmp_path, two_process_run):
    """The 2-process run's last checkpoint (step 6) continued by train/main.py on one process of 4
    devices with FSDP over all 4 (another process count and mesh), to --steps 24 (the cosine stretched
    to it) at --batch_size 32 (the data continuing from the 96 examples consumed), then Ctrl-C
    (SIGINT): the step is finished, saved, and the process exits 0. (SIGTERM: tests/scripts/test_resume.py.)"""
    shutil.copytree(two_process_run, tmp_path, dirs_exist_ok=True)
    proc = start(
        "main.py", "--run_dir", tmp_path, "--cpu_devices", 4, "--fsdp_size", 4, "--steps", 24, "--batch_size", 32
    )
    wait_for(lambda: "train:" in proc.output() and last_logged_step(tmp_path) >= STEPS + 2, proc)
    proc.send_signal(signal.SIGINT)
    returncode, output = proc.finish(timeout=60)
    assert returncode == 0 and "Traceback" not in output, output[-3000:]
    assert f"resumed from {tmp_path / 'checkpoints' / str(STEPS)} ({STEPS * 16} examples consumed)" in output
    assert "mesh {'data': 1, 'fsdp': 4}" in output
    stopped = committed(tmp_path)[-1]
    assert STEPS + 2 <= stopped < 24
    assert any("SIGINT" in line and f"step {stopped}" in line for line in output.splitlines()), output[-3000:]
    position = json.loads((tmp_path / "checkpoints" / str(stopped) / "data" / "metadata").read_text())
    assert position["examples_consumed"] == STEPS * 16 + (stopped - STEPS) * 32
    rows = metric_rows(tmp_path)
    assert [r["step"] for r in rows] == list(range(1, stopped + 1))
    assert_finite_training(rows[STEPS:])
    for r in rows[STEPS:]:  # --lr 2e-3 (the default) warmed up over 4 steps, cosine to 0 at --steps 24
        t = r["step"] - 1  # the updates applied before the step
        assert r["train/lr"] == pytest.approx(2e-3 * 0.5 * (1 + np.cos(np.pi * (t - 4) / (24 - 4))), rel=1e-5), r


@pytest.mark.slow
def test_two_process_checkpoint_restores_in_one_process(tmp_path, two_process_run, capsys):
    """train/sample.py's main in this one process (its 8 devices: the run's 2 x 4 as one mesh; a process start
    would add nothing to what is checked: sample.py as processes is tests/eval/test_sample_batches.py's)."""
    import train_scripts  # noqa: F401 — train/ on sys.path: a test of the scripts
    import sample  # train/sample.py

    out = tmp_path / "samples.npz"
    sample.main(
        sample.parse_args(
            [*map(str, ["--run_dir", two_process_run, "--num", 20, "--steps", 4, "--out", out, "--eval"])]
        )
    )
    said = capsys.readouterr().out
    with np.load(out) as saved:
        images, labels = saved["images"], saved["labels"]
    assert images.dtype == np.uint8 and images.shape == (20, 8, 8, 1)
    images = images.astype(np.float32)
    assert images.std() > 10 and np.abs(images[:10] - images[10:]).mean() > 5  # varied, not one image repeated
    np.testing.assert_array_equal(labels, np.repeat(np.arange(10), 2))  # balanced by default
    assert f"step {STEPS}: 20 samples -> {out}" in said and "class_accuracy" in said
    # --eval says what it scored: the sampler, its steps, the guidance (the run's own) and the seed
    assert f"{two_process_run} step {STEPS}: 20 samples, heun 4 steps, guidance 1.5, seed 0" in said


# What each process of the launcher's test runs: process 1 fails (status 3) once process 0 is up;
# process 0 would sleep for a minute and then leave a file.
FAILING_PEER = """import os, sys, time
from pathlib import Path
out, rank = Path(sys.argv[1]), sys.argv[sys.argv.index("--process_id") + 1]
(out / f"p{rank}.pid").write_text(str(os.getpid()))
if rank == "1":
    while not (out / "p0.pid").exists():
        time.sleep(0.01)
    print("process 1 fails", flush=True)
    sys.exit(3)
time.sleep(60)
(out / "p0.finished").write_text("")
"""


def test_launcher_stops_the_others_when_one_process_fails(tmp_path):
    (tmp_path / "peer.py").write_text(FAILING_PEER)
    cmd = [
        sys.executable,
        str(ROOT / "train" / "launch_local.py"),
        "--num_processes",
        "2",
        "--script",
        str(tmp_path / "peer.py"),
        "--",
        str(tmp_path),
    ]
    started = time.monotonic()
    try:
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    finally:
        alive = False
        if (tmp_path / "p0.pid").exists():
            pid = int((tmp_path / "p0.pid").read_text())
            try:
                os.kill(pid, signal.SIGKILL)  # the launcher left it running: end it, then fail below
                alive = True
            except ProcessLookupError:
                pass
    assert result.returncode == 3, result.stdout + result.stderr  # the failed process's status
    assert "[p1] process 1 fails" in result.stdout
    assert time.monotonic() - started < 30 and not alive and not (tmp_path / "p0.finished").exists()
