"""XLA:CPU workarounds (`eqxdiff.xla_cpu`) on vs off: the default digits job's training step.

Two copies of the job (`digits_job`: `UNet(1, (32, 64), 1, num_classes=10)`, 8×8×1 digits,
batch 64, one device, EDM, label dropout 0.1, AdamW) are built and compiled in one process,
one with the workarounds on (as train/main.py runs) and one inside `xla_cpu.disabled()` (plain
JAX: lax convs, plain remat, jax.random init draws, XLA's default compiler options). The switch
is read when the state is drawn, when the step is built and when it is traced, so after that
both compiled steps run side by side. Reported per side: state set-up (init draws included),
compile, first step; then, after warm-up, timed rounds of `--steps` steps over the same
device-resident batches alternate on, off, on, off, ... (at most 2 steps in flight), so drift
hits both alike. Both start from the same initial parameters (asserted bitwise). Prints one
JSON line; `off_over_on_*` > 1 means the workarounds make the step faster.

    python benchmarks/bench_xla_cpu.py [--batch 64 --steps 100 --rounds 4]
    python benchmarks/bench_xla_cpu.py --quick      # smoke run: batch 16, 2 rounds of 5 steps
"""

import argparse
import contextlib
import itertools
import os
import statistics
import time

import equinox as eqx
import jax
import numpy as np

from digits_job import MODEL, digits_job  # benchmarks/ is on sys.path when run as a script
from eqxdiff import xla_cpu
from eqxdiff.data import batch_stream
from eqxdiff.sharding import batch_sharding, make_mesh
from harness import alternate, report, steps_in_flight

SIDES = ("on", "off")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=100, help="steps per timed round")
    parser.add_argument("--rounds", type=int, default=4, help="timed rounds per side")
    parser.add_argument("--warmup", type=int, default=10, help="untimed steps per side after the first")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="smoke run: batch 16, 2 rounds of 5 steps")
    args = parser.parse_args()
    if args.quick:
        args.batch, args.steps, args.rounds, args.warmup = 16, 5, 2, 2

    xla_cpu.enable()  # as train/main.py; the "off" side runs inside xla_cpu.disabled()
    mesh = make_mesh(1, 1, jax.devices()[:1])
    data_sharding = batch_sharding(mesh)
    total_steps = 1 + args.warmup + args.rounds * args.steps

    jobs, startup, initial = {}, {}, {}
    batches = None
    for side in SIDES:
        with xla_cpu.disabled() if side == "off" else contextlib.nullcontext():
            start = time.perf_counter()
            job = digits_job(mesh, total_steps=total_steps, seed=args.seed)
            jax.block_until_ready(job.state)
            setup = time.perf_counter() - start
            initial[side] = [np.asarray(x) for x in jax.tree.leaves(eqx.filter(job.state.model, eqx.is_array))]
            if batches is None:
                host = batch_stream(job.digits, args.batch, args.seed)
                batches = [
                    jax.tree.map(lambda x: jax.make_array_from_process_local_data(data_sharding, x), next(host))
                    for _ in range(args.steps)
                ]
                jax.block_until_ready(batches)
            start = time.perf_counter()
            job.train_step.compile(job.state, batches[0])
            compile_s = time.perf_counter() - start
            start = time.perf_counter()
            job.state, metrics = job.train_step(job.state, batches[0])
            jax.block_until_ready(metrics["loss"])
            first = time.perf_counter() - start
        jobs[side] = job
        startup[side] = {
            "state_setup_s": round(setup, 2),
            "compile_s": round(compile_s, 2),
            "first_step_s": round(first, 3),
            "compiler_options": job.train_step.compiler_options,
        }

    assert all(np.array_equal(a, b) for a, b in zip(initial["on"], initial["off"], strict=True))

    losses = {}

    def run(side: str, steps: int) -> float:
        """Seconds of `steps` steps of one side."""
        job, start = jobs[side], time.perf_counter()
        cycled = itertools.islice(itertools.cycle(batches), steps)
        job.state, metrics = steps_in_flight(job.train_step, job.state, cycled)
        losses[side] = float(metrics["loss"])
        return time.perf_counter() - start

    for side in SIDES:
        run(side, args.warmup)
    times = alternate({side: lambda side=side: run(side, args.steps) for side in SIDES}, args.rounds)

    per_side = {}
    for side in SIDES:
        median = statistics.median(times[side])
        per_side[side] = startup[side] | {
            "rounds_s": [round(t, 3) for t in times[side]],
            "step_time_ms": round(1000 * median / args.steps, 2),
            "samples_per_sec": round(args.batch * args.steps / median, 1),
            "last_loss": round(losses[side], 4),
        }
    report(
        "xla_cpu_workarounds_on_vs_off",
        {
            "backend": jax.default_backend(),
            "model": MODEL,
            "batch": args.batch,
            "steps_per_round": args.steps,
            "rounds": args.rounds,
            "load_avg_1m_at_end": round(os.getloadavg()[0], 2),
            **{side: per_side[side] for side in SIDES},
            "off_over_on_step_time": round(per_side["off"]["step_time_ms"] / per_side["on"]["step_time_ms"], 3),
            # per adjacent (on, off) pair of rounds, then the median: less sensitive to drift
            "off_over_on_paired_median": round(statistics.median(o / n for n, o in zip(times["on"], times["off"])), 3),
        },
    )


if __name__ == "__main__":
    main()
