"""What a run directory and data in a bucket cost, against local disk, side by side in one process.

The bucket is a local GCS emulator (tests/bucket.py's fake-gcs-server on 127.0.0.1, objects in memory): no
network, so this measures the client stacks (gcsfs, tensorstore's GCS driver, HTTP on loopback), not GCS.

- checkpoints: the default digits job's state and step (bench_checkpoint.py's), rounds alternating disk and
  bucket: a plain window of `--steps` steps, then a window that starts with `Checkpoints.save` and ends with
  `wait()`; stall = saving / plain. Then the newest checkpoint restored `--restores` times from each.
- data: an npz of `--images` random 32×32×3 images as `npz:PATH` and `npz:gs://...` (read whole at open: the
  open includes the download), `--batches` batches of 64 from `batch_stream`: open seconds and images/s.

    python benchmarks/bench_bucket.py [--steps 20 --rounds 2 --restores 2 --images 20000 --batches 200]

Prints one JSON line (with the load average: the box is shared).
"""

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))  # tests/bucket.py: the emulator


def checkpoint_sides(args, run_dirs: dict[str, str]) -> dict:
    import equinox as eqx

    from digits_job import digits_job  # benchmarks/ is on sys.path when run as a script
    from harness import steps_in_flight

    from eqxdiff.checkpoint import Checkpoints
    from eqxdiff.data import batch_stream
    from eqxdiff.sharding import batch_sharding, make_mesh
    from eqxdiff.training import abstract_train_state

    mesh = make_mesh(data=-1, fsdp=1)
    job = digits_job(mesh, total_steps=10_000)
    stream = batch_stream(job.digits, args.batch, 0)
    batches = [
        jax.tree.map(lambda x: jax.make_array_from_process_local_data(batch_sharding(mesh), x), next(stream))
        for _ in range(args.steps)
    ]
    state = steps_in_flight(job.train_step, job.state, batches)[0]  # compiles the step
    checkpoints = {side: Checkpoints(run_dir, keep=2) for side, run_dir in run_dirs.items()}
    for c in checkpoints.values():  # orbax's first-save set-up, outside the timed windows
        c.save(int(state.step), state, {"examples_consumed": 0}, {})
        c.wait()
    out = {side: {"plain_s": [], "saving_s": [], "blocking_s": [], "restore_s": []} for side in run_dirs}
    for _ in range(args.rounds):
        for side, c in checkpoints.items():
            start = time.perf_counter()
            state = steps_in_flight(job.train_step, state, batches)[0]
            out[side]["plain_s"].append(time.perf_counter() - start)
            start = time.perf_counter()
            c.save(int(state.step), state, {"examples_consumed": 0}, {})
            out[side]["blocking_s"].append(time.perf_counter() - start)
            state = steps_in_flight(job.train_step, state, batches)[0]
            c.wait()
            out[side]["saving_s"].append(time.perf_counter() - start)
    abstract, shardings = abstract_train_state(job.make_model, job.optimizer, mesh, 2**12)
    for _ in range(args.restores):
        for side, c in checkpoints.items():
            start = time.perf_counter()
            restored, _, _ = c.restore(c.latest(), abstract, shardings)
            jax.block_until_ready(eqx.filter(restored, eqx.is_array))
            out[side]["restore_s"].append(time.perf_counter() - start)
    for side, c in checkpoints.items():
        c.close()
        times = out[side]
        times["stall_ratio"] = round(sum(times["saving_s"]) / sum(times["plain_s"]), 4)
        for k in ("plain_s", "saving_s", "blocking_s", "restore_s"):
            times[k] = [round(t, 4) for t in times[k]]
    state_bytes = sum(x.nbytes for x in jax.tree.leaves(eqx.filter(state, eqx.is_array)))
    return {"state_mib": round(state_bytes / 2**20, 2), **out}


def data_sides(args, paths: dict[str, str]) -> dict:
    from eqxdiff.data import batch_stream, open_source

    out = {}
    for side, path in paths.items():
        start = time.perf_counter()
        source = open_source(f"npz:{path}")
        opened = time.perf_counter() - start
        stream = batch_stream(source, 64, 0)
        next(stream)  # the workers' start
        start = time.perf_counter()
        for _ in range(args.batches):
            next(stream)
        seconds = time.perf_counter() - start
        out[side] = {"open_s": round(opened, 3), "images_per_s": round(64 * args.batches / seconds, 1)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=20, help="training steps per timed window")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--restores", type=int, default=2)
    parser.add_argument("--images", type=int, default=20_000, help="images in the npz")
    parser.add_argument("--batches", type=int, default=200)
    args = parser.parse_args()

    from bucket import local_gcs_server, make_bucket  # tests/bucket.py
    from harness import report

    from eqxdiff import xla_cpu
    from eqxdiff.local_copies import upload

    xla_cpu.enable()  # as train/main.py
    with tempfile.TemporaryDirectory() as tmp, local_gcs_server(f"{tmp}/cache") as server:
        bucket = make_bucket(server)
        load_before = os.getloadavg()
        checkpoints = checkpoint_sides(args, {"disk": f"{tmp}/run", "bucket": f"{bucket}/run"})
        rng = np.random.default_rng(0)
        npz = Path(tmp) / "images.npz"
        np.savez(
            npz,
            images=rng.integers(0, 256, (args.images, 32, 32, 3), np.uint8),
            labels=rng.integers(0, 10, args.images),
        )
        upload(npz, f"{bucket}/images.npz")
        data = data_sides(args, {"disk": str(npz), "bucket": f"{bucket}/images.npz"})
        report(
            "bucket",
            {
                "server": "fake-gcs-server (local emulator, in memory, loopback)",
                "load_avg_before": load_before,
                "load_avg_after": os.getloadavg(),
                "batch": args.batch,
                "steps_per_window": args.steps,
                "rounds": args.rounds,
                "checkpoints": checkpoints,
                "npz_mib": round(npz.stat().st_size / 2**20, 1),
                "data_batches": args.batches,
                "data": data,
            },
        )


if __name__ == "__main__":
    main()
