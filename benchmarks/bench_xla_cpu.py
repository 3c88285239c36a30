"""XLA:CPU workarounds (`eqxdiff.xla_cpu`), each switch on its own: a workload's speed under several
sets of switches, side by side in one process.

Workloads (`--workload`, benchmarks/xla_cpu_workloads.py): training steps `digits` (the default job),
`flaxdiff_unet` (the FlaxDiff comparison's UNet), `text_step` (text-conditioned, a frozen CLIP tower in
the step); forwards `vae_encode`, `vae_decode` (the SD VAE at 128²) and `inception` (FID's Inception,
16 images of 299²). One device.

Sides (`--sides`): `shipped` (every switch, as `--xla_cpu on`), `off` (plain JAX), and for each switch the workload
reads, `without:NAME` (shipped less that one) and `only:NAME` (that one alone); `only:A+B` and `without:A+B` name
sets. Two more kinds screen what is not a switch, each on top of the shipped set: `option:NAME=VALUE` (+ more) adds
XLA compile options to the side's compile (any of XLA:CPU's debug options: `option:xla_cpu_enable_fast_math=true`),
and `devices:N` (training only) runs the step data-parallel over N CPU devices, a batch split between them (the
process gets N devices: `--cpu_devices`). A training step reads conv_grad_matmul and channel_sum_matmul (traced
into the backward), llvm_o1, memory_scheduler and no_ynnpack (its compiler options); a forward reads only the three
compiler options (the two matmul switches change gradients, and a forward takes none: each side's `lowered_sha`,
the hash of its traced program, shows which sides compile the same program). remat_order and unrolled_accumulation
act only under --remat and --grad_accum_steps, init_draws and host_finite outside the compiled program.

Each side's program is built, traced and compiled inside `xla_cpu.only(its switches)`; training sides
also draw their state there (init_draws), all from the same parameters (asserted after one step).
Forward sides share one network (drawn once) and input. Then timed rounds alternate over the sides
(training: at most 2 steps in flight; forward: calls blocked on one by one), so drift hits all alike; each
round starts one side later than the one before, so that no side always runs first, right after the same other.
Process-level flags are the same for every side and every workload (printed as `xla_flags`): YNNPACK
is switched per compile (the compiler options), not in XLA_FLAGS, so both settings live in one process.
Each side also reports the minor page faults of its timed rounds per step or call (`minor_faults_per_step`:
XLA:CPU mallocs each execution's buffers, and glibc gives blocks that large back to the kernel, so they are
faulted in again every time), and the record the process's peak resident memory (`peak_rss_mib`).

One JSON line: the machine record (benchmarks/harness.py: date, CPU model and vector flags, the fp32
matmul rate), then per side its switches, compiler options, `lowered_sha`, compile (trace + lower +
compile) and first step/call seconds, its rounds, the median round's step/call time and samples/s
(training) or images/s (forward), `over_shipped` (its time over the shipped side's: > 1 slower),
`fastest_over_shipped` (the same of the fastest rounds: where a side's rounds fall in two modes, the median says
which mode, the fastest round what the program can do), and its
last loss (training) or `relative_diff_vs_<first side>` of its output (forward).

    python benchmarks/bench_xla_cpu.py --workload flaxdiff_unet [--rounds 3 --steps 3 --sides shipped,off]
    python benchmarks/bench_xla_cpu.py --workload all --out DIR     # each workload in a fresh process: DIR/NAME.json
    python benchmarks/bench_xla_cpu.py --workload inception --quick  # smoke run (--workload all --quick: every one)
"""

import argparse
import hashlib
import itertools
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import equinox as eqx
import jax
import numpy as np

from eqxdiff import xla_cpu
from eqxdiff.sharding import batch_sharding, make_mesh
from harness import alternate, call_seconds, report, steps_in_flight  # benchmarks/ is on sys.path as a script
from xla_cpu_workloads import WORKLOADS

STEP_SWITCHES = ("conv_grad_matmul", "channel_sum_matmul", "llvm_o1", "memory_scheduler", "no_ynnpack")
FORWARD_SWITCHES = ("llvm_o1", "memory_scheduler", "no_ynnpack")


def option_value(text: str):
    return {"true": True, "false": False}.get(text.lower(), int(text) if text.isdigit() else text)


def side_options(side: str) -> dict:
    """The compile options an `option:` side adds to the shipped set's ({} for any other side)."""
    kind, _, spec = side.partition(":")
    if kind != "option":
        return {}
    pairs = [item.partition("=") for item in spec.split("+")]
    if not all(name and eq for name, eq, _ in pairs):
        raise SystemExit(f"--sides: {side!r} is not option:NAME=VALUE[+NAME=VALUE...]")
    return {name: option_value(value) for name, _, value in pairs}


def side_devices(side: str) -> int:
    """The CPU devices a `devices:N` side's step runs data-parallel over (1 for any other side)."""
    kind, _, count = side.partition(":")
    if kind == "devices" and not (count.isdigit() and int(count) <= len(jax.devices())):
        raise SystemExit(f"--sides: {side!r} needs N <= the process's {len(jax.devices())} devices (--cpu_devices)")
    return int(count) if kind == "devices" else 1


def side_switches(side: str) -> frozenset[str]:
    if side in ("shipped", "off") or side.startswith(("option:", "devices:")):
        return frozenset() if side == "off" else xla_cpu.DEFAULT
    kind, _, names = side.partition(":")
    names = frozenset(names.split("+"))
    if kind not in ("without", "only") or not names <= xla_cpu.SWITCHES.keys():
        raise SystemExit(
            f"--sides: {side!r} is not shipped, off, without:NAMES or only:NAMES (NAMES: one or more "
            f"of {', '.join(xla_cpu.SWITCHES)} joined by +)."
        )
    return xla_cpu.DEFAULT - names if kind == "without" else names


def sha(lowered) -> str:
    return hashlib.sha256(lowered.as_text().encode()).hexdigest()[:12]


def train_sides(workload, sides, switches, args):
    """Per side: (run(n) -> seconds of n steps, its start-up record). Each side's state, step and compile
    under its switches; the same batches for all."""
    total_steps = 1 + args.warmup + args.rounds * args.steps
    runs, startup, initial, host_batches, losses = {}, {}, {}, None, {}
    for side in sides:
        mesh = make_mesh(side_devices(side), 1, jax.devices()[: side_devices(side)])
        with xla_cpu.only(switches[side]):
            work = workload.build(mesh, args, total_steps)
            work.step.compiler_options = work.step.compiler_options | side_options(side)
            if host_batches is None:  # one list of batches for every side
                host_batches = [work.next_batch() for _ in range(4)]
            batches = [jax.device_put(b, batch_sharding(mesh)) for b in host_batches]
            start = time.perf_counter()
            work.step.compile(work.state, batches[0], work.frozen)  # trace, lower and compile
            compile_s = time.perf_counter() - start
            lowered_sha = sha(work.step.lower(work.state, batches[0], work.frozen))  # the lowering compile() made
            start = time.perf_counter()
            work.state, metrics = work.step(work.state, batches[0], work.frozen)
            jax.block_until_ready(metrics["loss"])
            first_s = time.perf_counter() - start
        initial[side] = [np.asarray(x) for x in jax.tree.leaves(eqx.filter(work.state.ema, eqx.is_array))]
        startup[side] = {
            "switches": sorted(switches[side]),
            "compile_s": round(compile_s, 2),
            "first_step_s": round(first_s, 3),
            "compiler_options": work.step.compiler_options,
            "lowered_sha": lowered_sha,
        }

        def run(n: int, work=work, side=side, batches=batches) -> float:
            start = time.perf_counter()
            work.state, metrics = steps_in_flight(
                work.step, work.state, itertools.islice(itertools.cycle(batches), n), work.frozen
            )
            losses[side] = float(metrics["loss"])
            return time.perf_counter() - start

        runs[side] = run
    first = initial[sides[0]]
    for side in sides[1:]:  # same initial draw: the EMA after one step differs only by rounding
        assert all(np.allclose(a, b, rtol=1e-4, atol=1e-6) for a, b in zip(first, initial[side], strict=True)), side
    return runs, startup, lambda side: {"last_loss": round(losses[side], 4)}


def forward_sides(workload, sides, switches, args):
    """Per side: (run(n) -> seconds of n calls, its start-up record). One network and input for all; each
    side's forward traced and compiled under its switches (a fresh jit each: jit's trace cache does not see them)."""
    work = workload.build(args)
    arrays, static = eqx.partition(work.network, eqx.is_array)
    x = jax.device_put(work.input)
    runs, startup, outputs = {}, {}, {}
    for side in sides:
        with xla_cpu.only(switches[side]):
            if side_devices(side) > 1:
                raise SystemExit(f"--sides: {side} is for training workloads (a forward runs on one device here)")
            options = xla_cpu.compiler_options() | side_options(side)
            start = time.perf_counter()
            lowered = jax.jit(lambda arrays, x: work.forward(eqx.combine(arrays, static), x)).lower(arrays, x)
            compiled = lowered.compile(options)
            compile_s = time.perf_counter() - start
            start = time.perf_counter()
            outputs[side] = jax.block_until_ready(compiled(arrays, x))
            first_s = time.perf_counter() - start
        startup[side] = {
            "switches": sorted(switches[side]),
            "compile_s": round(compile_s, 2),
            "first_call_s": round(first_s, 3),
            "compiler_options": options,
            "lowered_sha": sha(lowered),
        }
        runs[side] = lambda n, compiled=compiled: call_seconds(n, compiled, arrays, x)

    def agreement(side: str) -> dict:  # switches change rounding only: max |difference| / the output's max |value|
        pairs = zip(jax.tree.leaves(outputs[sides[0]]), jax.tree.leaves(outputs[side]), strict=True)
        diff = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b)))) for a, b in pairs)
        scale = max(float(np.max(np.abs(np.asarray(a)))) for a in jax.tree.leaves(outputs[sides[0]]))
        return {f"relative_diff_vs_{sides[0]}": float(f"{diff / scale:.2e}")}

    return runs, startup, agreement


def run_workload(name: str, args) -> dict:
    workload = WORKLOADS[name]
    train = workload.kind == "train"
    default_sides = [
        "shipped",
        "off",
        *(f"{k}:{s}" for s in (STEP_SWITCHES if train else FORWARD_SWITCHES) for k in ("without", "only")),
    ]
    sides = [s.strip() for s in args.sides.split(",") if s.strip()] or default_sides
    switches = {side: side_switches(side) for side in sides}
    runs, startup, extra = (train_sides if train else forward_sides)(workload, sides, switches, args)

    for side in sides:
        if args.warmup:
            runs[side](args.warmup)
    faults = dict.fromkeys(sides, 0)

    def counted(side: str) -> float:  # a round's seconds; its minor page faults summed per side
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        seconds = runs[side](args.steps)
        faults[side] += resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
        return seconds

    times = alternate({side: lambda side=side: counted(side) for side in sides}, args.rounds, rotate=True)
    median = {side: statistics.median(times[side]) for side in sides}
    reference = median.get("shipped", median[sides[0]])
    fastest = {side: min(times[side]) for side in sides}
    fastest_reference = fastest.get("shipped", fastest[sides[0]])
    unit, items = ("step", "samples") if train else ("call", "images")
    per_side = {
        side: startup[side]
        | {
            "rounds_s": [round(t, 3) for t in times[side]],
            f"{unit}_time_ms": round(1000 * median[side] / args.steps, 2),
            f"{items}_per_sec": round(args.batch * args.steps / median[side], 2),
            "over_shipped": round(median[side] / reference, 3),
            "fastest_over_shipped": round(fastest[side] / fastest_reference, 3),
            f"minor_faults_per_{unit}": round(faults[side] / (args.rounds * args.steps)),
        }
        | extra(side)
        for side in sides
    }
    return report(
        "xla_cpu_switches",
        {
            "backend": jax.default_backend(),
            "workload": name,
            "kind": workload.kind,
            "what": workload.what,
            "batch": args.batch,
            f"{unit}s_per_round": args.steps,
            "rounds": args.rounds,
            "warmup": args.warmup,
            "quick": args.quick,
            "xla_flags": os.environ.get("XLA_FLAGS", ""),
            "peak_rss_mib": peak_rss_mib(),
            "switches_read": list(STEP_SWITCHES if train else FORWARD_SWITCHES),
            "load_avg_1m_at_end": round(os.getloadavg()[0], 2),
            "sides": per_side,
        },
    )


def peak_rss_mib() -> float:
    """The process's peak resident memory so far (ru_maxrss: KiB on Linux, bytes on macOS)."""
    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (1024 if sys.platform == "darwin" else 1)
    return round(kib / 1024, 1)


def run_all(args, argv: list[str]) -> None:
    """Each workload in a fresh process (its own backend and memory), its JSON line written to --out/NAME.json."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    failed = []
    for name in WORKLOADS:
        print(f"bench_xla_cpu: {name} ...", file=sys.stderr, flush=True)
        command = [sys.executable, __file__, *argv, "--workload", name, "--out", ""]  # the last flags win
        done = subprocess.run(command, stdout=subprocess.PIPE, text=True)
        lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
        if done.returncode or not lines:
            failed.append(name)
            continue
        (out / f"{name}.json").write_text(lines[-1] + "\n")
        print(lines[-1], flush=True)
    if failed:
        raise SystemExit(f"bench_xla_cpu: {', '.join(failed)} failed (errors above); the others are in {out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", default="digits", choices=["all", *WORKLOADS])
    parser.add_argument("--out", default="", help="a folder: the JSON line also goes to OUT/NAME.json")
    parser.add_argument(
        "--sides", default="", help="comma list (default: shipped, off, without:X and only:X per switch read)"
    )
    parser.add_argument("--batch", type=int, default=0, help="default: the workload's")
    parser.add_argument(
        "--steps", type=int, default=0, help="steps (forward: calls) per timed round; default: the workload's"
    )
    parser.add_argument("--rounds", type=int, default=0, help="timed rounds per side; default: the workload's")
    parser.add_argument(
        "--warmup",
        type=int,
        default=None,
        help="untimed steps or calls per side after the first; default: the workload's",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cpu_devices", type=int, default=0, help="simulate this many CPU devices (devices:N sides)")
    parser.add_argument("--quick", action="store_true", help="smoke run: small inputs, 2 rounds of 1 step or call")
    args = parser.parse_args()
    if args.workload == "all":
        if not args.out:
            raise SystemExit("--workload all writes one JSON file per workload: give --out DIR")
        argv = [a for a in sys.argv[1:] if a not in ("--workload", "all", "--workload=all")]
        return run_all(args, argv)
    workload = WORKLOADS[args.workload]
    args.batch, args.steps = args.batch or workload.batch, args.steps or workload.steps
    args.rounds = args.rounds or workload.rounds
    args.warmup = workload.warmup if args.warmup is None else args.warmup
    if args.quick:
        args.batch, args.steps, args.rounds, args.warmup = min(args.batch, 4), 1, 2, 0

    if args.cpu_devices:
        jax.config.update("jax_num_cpu_devices", args.cpu_devices)
    xla_cpu.enable(xla_cpu.DEFAULT - {"no_ynnpack"})  # YNNPACK stays on in XLA_FLAGS; each compile's options decide
    record = run_workload(args.workload, args)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / f"{args.workload}.json").write_text(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
