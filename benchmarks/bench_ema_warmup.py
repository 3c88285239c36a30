"""What the EMA's decay warm-up costs a step: the default job's step (benchmarks/digits_job.py) with a
constant decay (a constant of the program) and with `ema_warmup` (a decay computed from the step
count inside the step), timed in alternating rounds in one process. One JSON line.

    python benchmarks/bench_ema_warmup.py [--batch 128 --steps 60 --rounds 3] [--quick]
"""

import argparse
import json
import platform
import statistics
import time

import jax
import numpy as np

from digits_job import digits_job  # benchmarks/ is on sys.path when run as a script
from eqxdiff import xla_cpu
from eqxdiff.sharding import batch_sharding, make_mesh
from eqxdiff.training import ema_warmup

xla_cpu.enable()  # as train/main.py


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--steps", type=int, default=60, help="steps per timed round")
    parser.add_argument("--rounds", type=int, default=3, help="timed (constant, warm-up) pairs")
    parser.add_argument("--quick", action="store_true", help="smoke run: batch 16, 2 rounds of 5 steps")
    args = parser.parse_args()
    if args.quick:
        args.batch, args.steps, args.rounds = 16, 5, 2
    mesh = make_mesh(data=-1, fsdp=1)
    jobs = {name: digits_job(mesh, total_steps=1000, ema_decay=decay)
            for name, decay in (("constant", 0.995), ("warmup", ema_warmup(0.995)))}  # fmt: skip
    digits = jobs["constant"].digits
    rng = np.random.default_rng(0)
    idx = rng.choice(len(digits), (args.steps, args.batch))
    batches = [jax.device_put({"image": digits.images[i], "label": digits.labels[i]}, batch_sharding(mesh)) for i in idx]
    states = {name: job.state for name, job in jobs.items()}
    times = {name: [] for name in jobs}

    def run(name: str, timed: bool) -> None:
        state, step = states[name], jobs[name].train_step
        start = time.perf_counter()
        for batch in batches:
            state, metrics = step(state, batch)
        jax.block_until_ready(state)
        if timed:
            times[name].append((time.perf_counter() - start) / len(batches) * 1e3)
        states[name] = state

    for name in jobs:
        run(name, timed=False)  # compile and warm up
    for _ in range(args.rounds):
        for name in jobs:
            run(name, timed=True)
    ms = {name: statistics.median(t) for name, t in times.items()}
    print(json.dumps({
        "bench": "ema_warmup", "batch": args.batch, "steps_per_round": args.steps, "rounds": args.rounds,
        "step_ms_constant": round(ms["constant"], 2), "step_ms_warmup": round(ms["warmup"], 2),
        "rounds_ms": {k: [round(x, 1) for x in v] for k, v in times.items()},
        "warmup_over_constant": round(ms["warmup"] / ms["constant"], 4),
        "machine": platform.machine(), "devices": jax.device_count(), "jax": jax.__version__,
    }))  # fmt: skip


if __name__ == "__main__":
    main()
