"""The training step's host-side call, side by side in one process: `TrainStep`'s flat call (the state's arrays
as one list: one flatten and one unflatten of the state per step) vs the pytree call it replaced (the state
partitioned into arrays and static halves every step, the compiled step taking and returning the arrays as
the state's pytree, combined again after: Equinox's module flatten and unflatten, which run in Python, four
times per step). On a CPU the host's Python work shares the cores with the step it dispatches.

Workloads (benchmarks/xla_cpu_workloads.py): `digits` (the default job's step) and `flaxdiff_unet` (the FlaxDiff
comparison's), the shipped XLA:CPU switches. Each side builds its own state (the same seed, so the same
draws) and compiles the same step function; timed rounds alternate (at most 2 steps in flight, as
train/main.py runs them), and `dispatch_ms` is the median time a call takes to return with the previous step
done (the host's share). Both sides must end with the same loss: the same program on the same data.

    python benchmarks/bench_step_call.py [--workload digits --rounds 6 --steps 20]
    python benchmarks/bench_step_call.py --quick      # smoke: 2 rounds of 2 steps, batch 8
"""

import argparse
import itertools
import os
import statistics
import time
from types import SimpleNamespace

import equinox as eqx
import jax

from eqxdiff import xla_cpu
from eqxdiff.sharding import batch_sharding, is_array_like, make_mesh
from eqxdiff.training.step import _signature
from harness import alternate, report, steps_in_flight  # benchmarks/ is on sys.path when run as a script
from xla_cpu_workloads import WORKLOADS


class PytreeCall:
    """TrainStep's call path before the flat one (eqxdiff/training/step.py at 805f9be), over the same step function,
    shardings and compiler options as `flat`."""

    def __init__(self, flat, state, batch, frozen=None):
        arrays, self.static = eqx.partition(state, is_array_like)
        frozen_arrays, self.frozen_static = eqx.partition(frozen, is_array_like)
        step = flat._step

        def traced(arrays, batch, frozen_arrays):
            return step(arrays, self.static, batch, eqx.combine(frozen_arrays, self.frozen_static))

        jitted = jax.jit(
            traced,
            donate_argnums=0,
            in_shardings=(flat._state_shardings, flat.batch_sharding, flat._frozen_shardings),
            out_shardings=(flat._state_shardings, flat._metrics_sharding),
        )
        self.compiled = jitted.lower(arrays, batch, frozen_arrays).compile(flat.compiler_options)
        self.signatures = {_signature(batch, frozen_arrays): self.compiled}

    def __call__(self, state, batch, frozen=None):
        arrays, _ = eqx.partition(state, is_array_like)
        frozen_arrays, _ = eqx.partition(frozen, is_array_like)
        new_arrays, metrics = self.signatures[_signature(batch, frozen_arrays)](arrays, batch, frozen_arrays)
        return eqx.combine(new_arrays, self.static), metrics


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", default="digits", choices=["digits", "flaxdiff_unet"])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=0, help="steps per round (default: 40 digits, 4 flaxdiff_unet)")
    parser.add_argument("--batch", type=int, default=0, help="default: the workload's")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    workload = WORKLOADS[args.workload]
    steps = args.steps or (40 if args.workload == "digits" else 4)
    batch = args.batch or workload.batch
    rounds = args.rounds
    if args.quick:
        steps, batch, rounds = 2, 8, 2
    xla_cpu.enable()
    mesh = make_mesh(1, 1, jax.devices()[:1])
    build = SimpleNamespace(seed=0, batch=batch, quick=args.quick)
    total = 2 + rounds * steps + 2 * 5
    works = {"flat": workload.build(mesh, build, total), "pytree": workload.build(mesh, build, total)}
    batches = [jax.device_put(works["flat"].next_batch(), batch_sharding(mesh)) for _ in range(4)]
    calls, dispatch, losses = {}, {}, {}
    for side, work in works.items():
        start = time.perf_counter()
        calls[side] = work.step if side == "flat" else PytreeCall(work.step, work.state, batches[0], work.frozen)
        work.state, _ = steps_in_flight(calls[side], work.state, batches[:2], work.frozen)  # compiles, warms up
        compile_s = time.perf_counter() - start
        seconds = []
        for batch_ in batches[:5]:  # one call at a time: how long the host takes to hand a step over
            jax.block_until_ready(work.state)
            start = time.perf_counter()
            work.state, metrics = calls[side](work.state, batch_, work.frozen)
            seconds.append(time.perf_counter() - start)
            jax.block_until_ready(metrics)
        dispatch[side] = {"dispatch_ms": round(1000 * statistics.median(seconds), 2), "compile_s": round(compile_s, 2)}

    def run(side: str) -> float:
        work, start = works[side], time.perf_counter()
        work.state, metrics = steps_in_flight(
            calls[side], work.state, itertools.islice(itertools.cycle(batches), steps), work.frozen
        )
        losses[side] = float(metrics["loss"])
        return time.perf_counter() - start

    times = alternate({side: lambda side=side: run(side) for side in works}, rounds)
    assert losses["flat"] == losses["pytree"], losses  # the same program, state and data
    median = {side: statistics.median(t) for side, t in times.items()}
    report(
        "step_call",
        {
            "workload": args.workload,
            "batch": batch,
            "steps_per_round": steps,
            "rounds": rounds,
            "quick": args.quick,
            "xla_cpu_switches": sorted(xla_cpu.DEFAULT),
            "leaves": len(jax.tree.leaves(works["flat"].state)),
            "sides": {
                side: dispatch[side]
                | {
                    "rounds_s": [round(t, 3) for t in times[side]],
                    "step_time_ms": round(1000 * median[side] / steps, 2),
                }
                for side in works
            },
            "flat_over_pytree": round(median["flat"] / median["pytree"], 3),
            "last_loss": losses["flat"],
            "load_avg_1m_at_end": round(os.getloadavg()[0], 2),
        },
    )


if __name__ == "__main__":
    main()
