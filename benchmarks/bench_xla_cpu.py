"""XLA:CPU workarounds (`eqxdiff.xla_cpu`), each switch on its own: a training step's speed under
several sets of switches, side by side in one process.

Workloads (`--workload`): `digits`, the default digits job (`digits_job`: `UNet(1, (32, 64), 1,
num_classes=10)`, 8×8×1, batch 64, EDM, label dropout 0.1, AdamW); `flaxdiff_unet`, FlaxDiff's
simple UNet as bench_train.py and bench_train_vs_flaxdiff.py train it (`UNet.flaxdiff_simple(3)`,
32×32×3, batch 32, EDM, AdamW). One device.

Sides (`--sides`): `shipped` (every switch, as `--xla_cpu on`), `off` (plain JAX), and for each switch
a step reads, `without:NAME` (shipped less that one) and `only:NAME` (that one alone); `only:A+B` and
`without:A+B` name sets. Each side's
state, step and compile are built inside `xla_cpu.only(its switches)`: a switch is read when the state
is drawn, when the step is built and when it is traced, so the compiled steps then run side by side,
in timed rounds that alternate over the sides (at most 2 steps in flight), so drift hits all alike.
All sides start from the same parameters (asserted bitwise). YNNPACK is switched per compile (the
step's compiler options), not in XLA_FLAGS, so both settings can live in one process.

One JSON line: per side its switches, compile and first-step seconds, median step time and
samples/s, and `over_shipped`, its step time over the shipped side's (> 1: slower than shipped).

    python benchmarks/bench_xla_cpu.py [--workload flaxdiff_unet --rounds 4 --steps 20]
    python benchmarks/bench_xla_cpu.py --quick      # smoke run: batch 8, 2 rounds of 2 steps
"""

import argparse
import itertools
import os
import statistics
import time

import equinox as eqx
import jax
import numpy as np

from digits_job import digits_job  # benchmarks/ is on sys.path when run as a script
from eqxdiff import xla_cpu
from eqxdiff.data import batch_stream
from eqxdiff.nn import UNet
from eqxdiff.sharding import batch_sharding, make_mesh
from eqxdiff.training import adamw_cosine, create_train_state, make_train_step
from harness import alternate, report, steps_in_flight
from unconditional_edm import unconditional_edm

# What a training step without remat or accumulation reads (the others act elsewhere: remat_order
# under --remat, unrolled_accumulation under --grad_accum_steps, init_draws and host_finite
# outside the step).
STEP_SWITCHES = ("conv_grad_matmul", "llvm_o1", "memory_scheduler", "no_ynnpack")


def side_switches(side: str) -> frozenset[str]:
    if side in ("shipped", "off"):
        return xla_cpu.DEFAULT if side == "shipped" else frozenset()
    kind, _, names = side.partition(":")
    names = frozenset(names.split("+"))
    if kind not in ("without", "only") or not names <= xla_cpu.SWITCHES.keys():
        raise SystemExit(f"--sides: {side!r} is not shipped, off, without:NAMES or only:NAMES (NAMES: one or more "
                         f"of {', '.join(xla_cpu.SWITCHES)} joined by +).")  # fmt: skip
    return xla_cpu.DEFAULT - names if kind == "without" else names


def digits_workload(mesh, args, total_steps):
    job = digits_job(mesh, total_steps=total_steps, seed=args.seed)
    host = batch_stream(job.digits, args.batch, args.seed)
    return job.state, job.train_step, lambda: next(host)


def flaxdiff_unet_workload(mesh, args, total_steps):
    optimizer, lr_schedule = adamw_cosine(2e-4, max(1000, total_steps + 1), 10, 1e-4)
    make_model = lambda key: UNet.flaxdiff_simple(3, key=key)  # noqa: E731
    state, shardings = create_train_state(make_model, optimizer, jax.random.key(args.seed), mesh, 2**14)
    prepare, loss_fn = unconditional_edm()
    step = make_train_step(
        prepare=prepare, loss_fn=loss_fn, optimizer=optimizer, lr_schedule=lr_schedule, ema_decay=0.995,
        state_shardings=shardings, batch_sharding=batch_sharding(mesh), seed=args.seed,
    )  # fmt: skip
    rng = np.random.default_rng(args.seed)
    size = 8 if args.quick else 32
    return state, step, lambda: {"image": rng.integers(0, 256, (args.batch, size, size, 3), dtype=np.uint8)}


WORKLOADS = {"digits": (digits_workload, 64), "flaxdiff_unet": (flaxdiff_unet_workload, 32)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", default="digits", choices=sorted(WORKLOADS))
    parser.add_argument("--sides", default="", help="comma list (default: shipped, off, without:X and only:X per step switch)")
    parser.add_argument("--batch", type=int, default=0, help="default: the workload's (64 digits, 32 flaxdiff_unet)")
    parser.add_argument("--steps", type=int, default=20, help="steps per timed round")
    parser.add_argument("--rounds", type=int, default=4, help="timed rounds per side")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per side after the first")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="smoke run: batch 8, 2 rounds of 2 steps")
    args = parser.parse_args()
    build, default_batch = WORKLOADS[args.workload]
    args.batch = args.batch or default_batch
    if args.quick:
        args.batch, args.steps, args.rounds, args.warmup = 8, 2, 2, 1
    default_sides = ["shipped", "off", *(f"{k}:{s}" for s in STEP_SWITCHES for k in ("without", "only"))]
    sides = [s.strip() for s in args.sides.split(",") if s.strip()] or default_sides
    switches = {side: side_switches(side) for side in sides}

    xla_cpu.enable(xla_cpu.DEFAULT - {"no_ynnpack"})  # YNNPACK stays on in XLA_FLAGS; each step's options decide
    mesh = make_mesh(1, 1, jax.devices()[:1])
    data_sharding = batch_sharding(mesh)
    total_steps = 1 + args.warmup + args.rounds * args.steps

    states, steps, startup, initial, batches = {}, {}, {}, {}, None
    for side in sides:
        with xla_cpu.only(switches[side]):
            state, step, next_batch = build(mesh, args, total_steps)
            if batches is None:  # one list of device batches for every side
                batches = [jax.device_put(next_batch(), data_sharding) for _ in range(max(args.steps, 4))]
            start = time.perf_counter()
            step.compile(state, batches[0])
            compile_s = time.perf_counter() - start
            start = time.perf_counter()
            state, metrics = step(state, batches[0])
            jax.block_until_ready(metrics["loss"])
            first_s = time.perf_counter() - start
        initial[side] = [np.asarray(x) for x in jax.tree.leaves(eqx.filter(state.ema, eqx.is_array))]
        states[side], steps[side] = state, step
        startup[side] = {"switches": sorted(switches[side]), "compile_s": round(compile_s, 2),
                         "first_step_s": round(first_s, 3), "compiler_options": step.compiler_options}  # fmt: skip
    first = initial[sides[0]]
    for side in sides[1:]:  # same initial draw: the EMA after one step differs only by rounding
        assert all(np.allclose(a, b, rtol=1e-4, atol=1e-6) for a, b in zip(first, initial[side], strict=True)), side

    losses = {}

    def run(side: str, n: int) -> float:
        start = time.perf_counter()
        states[side], metrics = steps_in_flight(steps[side], states[side], itertools.islice(itertools.cycle(batches), n))
        losses[side] = float(metrics["loss"])
        return time.perf_counter() - start

    for side in sides:
        run(side, args.warmup)
    times = alternate({side: lambda side=side: run(side, args.steps) for side in sides}, args.rounds)
    median = {side: statistics.median(times[side]) for side in sides}
    reference = median.get("shipped", median[sides[0]])
    per_side = {
        side: startup[side] | {
            "rounds_s": [round(t, 3) for t in times[side]],
            "step_time_ms": round(1000 * median[side] / args.steps, 2),
            "samples_per_sec": round(args.batch * args.steps / median[side], 1),
            "over_shipped": round(median[side] / reference, 3),
            "last_loss": round(losses[side], 4),
        }
        for side in sides
    }  # fmt: skip
    report("xla_cpu_switches", {
        "backend": jax.default_backend(), "workload": args.workload, "batch": args.batch,
        "steps_per_round": args.steps, "rounds": args.rounds, "quick": args.quick,
        "load_avg_1m_at_end": round(os.getloadavg()[0], 2), "sides": per_side,
    })  # fmt: skip


if __name__ == "__main__":
    main()
