"""Loop overhead: train/main.py's full loop against a bare loop over the same jitted step.

Both drive the same `train_step` (the digits job: `UNet(1, (32, 64), 1, num_classes=10)` on
8×8×1 digits, batch 64, one device, EDM, label dropout 0.1) on the same data stream:

- bare: `for b in device_batches: state, m = step(state, b)` over batches transferred to the
  device before timing, at most 2 steps in flight;
- full: train/main.py's `train_loop` itself — host batches from the grain `batch_stream` through
  `Prefetch(..., to_device=make_array_from_process_local_data, depth=2)`, its LogWindow read
  every `--log_every` steps into a `MetricsLogger` row (wandb disabled) and the tqdm bar, at
  most 2 steps in flight (sampling and checkpoints off).

One Prefetch, logger and log directory serve every full round (as one run has one); each full
round opens its own tqdm bar, as the loop does. After warm-up, rounds alternate bare, full,
bare, full, ... so drift hits both alike. Prints one JSON line with samples/s of each and
full/bare (target >= 0.95).

    python benchmarks/bench_loop.py [--batch 64 --steps 100 --rounds 2 --log_every 50]
    python benchmarks/bench_loop.py --quick      # smoke run: 10-step rounds, batch 16
"""

import argparse
import tempfile
import time
from pathlib import Path

import jax

from digits_job import MODEL, digits_job  # benchmarks/ is on sys.path when run as a script
from eqxdiff import xla_cpu
from eqxdiff.data import Prefetch, batch_stream
from eqxdiff.sharding import batch_sharding, make_mesh
from eqxdiff.training import LogWindow, MetricsLogger, ProfileWindow, peak_flops_per_device, step_flops
from eqxdiff.training.preemption import StopRequest
from harness import param_count, report, steps_in_flight
from unconditional_edm import train_main  # train/main.py, whose loop (train/loop.py) this times

xla_cpu.enable()  # XLA:CPU workarounds on, as in train/main.py (eqxdiff/xla_cpu.py)

TARGET = 0.95


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=100, help="steps per timed round")
    parser.add_argument("--rounds", type=int, default=2, help="timed (bare, full) pairs")
    parser.add_argument("--warmup", type=int, default=10, help="untimed steps of each loop first")
    parser.add_argument("--log_every", type=int, default=50)
    parser.add_argument("--label_dropout", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="smoke run: batch 16, 2 rounds of 10 steps, log every 5")
    args = parser.parse_args()
    if args.quick:
        args.batch, args.steps, args.rounds, args.warmup, args.log_every = 16, 10, 2, 2, 5

    mesh = make_mesh(1, 1, jax.devices()[:1])
    total_steps = 2 * (args.warmup + args.rounds * args.steps)
    job = digits_job(mesh, total_steps=total_steps, seed=args.seed, label_dropout=args.label_dropout, min_size=2**14)
    digits, state, train_step = job.digits, job.state, job.train_step
    params = param_count(state.model)
    data_sharding = batch_sharding(mesh)
    to_global = lambda b: jax.tree.map(lambda x: jax.make_array_from_process_local_data(data_sharding, x), b)  # noqa: E731

    def host_stream():
        return batch_stream(digits, args.batch, args.seed)

    # bare loop's data: the same stream's first `steps` batches, on the device before timing
    stream = host_stream()
    device_batches = [to_global(next(stream)) for _ in range(args.steps)]
    jax.block_until_ready(device_batches)

    def bare(state, batches):
        return steps_in_flight(train_step, state, batches)[0]

    flops_per_device = step_flops(train_step, state, device_batches[0]) / mesh.size  # lowering only
    peak, _ = peak_flops_per_device(dtype="fp32")

    def full(state, batches, logger, steps):
        """train/main.py's own loop (train/loop.py), without sampling, checkpoints or profiling."""
        cfg = train_main.Config(steps=steps, log_every=args.log_every, sample_every=0, ckpt_every=10**9)
        with StopRequest() as stop:
            state = train_main.train_loop(
                cfg,
                state,
                train_step,
                batches,
                logger,
                start_step=0,
                log_window=LogWindow(args.batch, flops_per_device, peak),
                profile=ProfileWindow("", Path(".")),
                write_samples=lambda step, state: None,
                save_checkpoint=lambda step, state: None,
                stop=stop,
            )
        jax.block_until_ready(state)
        return state

    times = {"bare": [], "full": []}
    with (
        tempfile.TemporaryDirectory() as run_dir,
        Prefetch(host_stream(), to_global, depth=2) as batches,
        MetricsLogger(run_dir, wandb_mode="disabled") as logger,
    ):
        state = bare(state, device_batches[: args.warmup])  # compiles the step
        state = full(state, batches, logger, args.warmup)
        for _ in range(args.rounds):
            start = time.perf_counter()
            state = bare(state, device_batches)
            times["bare"].append(time.perf_counter() - start)
            start = time.perf_counter()
            state = full(state, batches, logger, args.steps)
            times["full"].append(time.perf_counter() - start)
        logged_rows = len((Path(run_dir) / "metrics.jsonl").read_text().splitlines())

    expected_steps = 2 * (args.warmup + args.rounds * args.steps)
    assert int(state.step) == expected_steps, (int(state.step), expected_steps)
    assert int(state.bad_steps) == 0
    samples = args.batch * args.steps * args.rounds
    bare_sps = samples / sum(times["bare"])
    full_sps = samples / sum(times["full"])
    report(
        "loop",
        {
            "backend": jax.default_backend(),
            "model": MODEL,
            "params": params,
            "data": "digits 8x8x1",
            "batch": args.batch,
            "devices": 1,
            "precision": "fp32",
            "steps_per_round": args.steps,
            "rounds": args.rounds,
            "order": "after warm-up: " + " ".join(["bare full"] * args.rounds),
            "warmup_steps_each": args.warmup,
            "log_every": args.log_every,
            "prefetch_depth": 2,
            "max_in_flight": 2,
            "metrics_rows_written": logged_rows,
            "quick": args.quick,
            "bare_samples_per_sec": round(bare_sps, 2),
            "full_samples_per_sec": round(full_sps, 2),
            "bare_round_s": [round(t, 4) for t in times["bare"]],
            "full_round_s": [round(t, 4) for t in times["full"]],
            "ratio_full_vs_bare": round(full_sps / bare_sps, 4),
            "target_ratio": TARGET,
            "meets_target": full_sps / bare_sps >= TARGET,
        },
    )


if __name__ == "__main__":
    main()
