"""Where each training step's time goes, per op: eqxdiff's step and FlaxDiff 0.2.11's, the same UNet and
flags, traced with `jax.profiler` in one process, the trace's XLA op events grouped by kind and phase.

The two steps are bench_train_vs_flaxdiff.py's sides (its EqxdiffSide and FlaxdiffSide: FlaxDiff's simple
UNet topology, 32×32×3, batch 32, fp32, EDM, the same AdamW transform; eqxdiff's `make_train_step` with
at most 2 steps in flight, FlaxDiff's jitted step through its own `train_loop`), warmed up, then `--steps`
steps of each traced on its own (eqxdiff first unless --flaxdiff_first). Both get the same process-level
XLA flags (`--xla_cpu`, as the train scripts read it, default on; printed).

Each side's compiled step is read (`compiled.as_text()`): every HLO instruction gets a kind (conv fwd,
conv input-grad, conv weight-grad, matmul, fusion/elementwise, reduce, copy/transpose, ...) and a phase
(forward, backward, optimizer, EMA/guard/metrics, prepare/other) from its opcode, shapes and JAX's
metadata (benchmarks/hlo_ops.py says how). The trace's events named like the step's instructions are
summed per instruction (XLA:CPU runs independent ops on several threads at once, so the summed op time
can exceed the wall time: `op_time_over_wall`). Events of other programs (FlaxDiff's per-step host
checks, eqxdiff's nothing) are reported as a total only.

One JSON line on stdout: per side the traced wall time per step, op time per step by kind, by phase,
by phase and kind, the top ops; a table of the shares side by side goes to stderr. Needs the peer venv
(bench_train_vs_flaxdiff.py's docstring) with eqxdiff first on the path:

    PYTHONPATH=$PWD /tmp/peer/bin/python benchmarks/profile_steps.py [--steps 5 --xla_cpu on --trace_dir DIR]
    PYTHONPATH=$PWD /tmp/peer/bin/python benchmarks/profile_steps.py --quick   # smoke: 8×8, batch 4, 2 steps

The traces and each step's compiled HLO (NAME/step.hlo.txt) stay in --trace_dir when given (TensorBoard's
profile plugin or xprof opens the traces), else in a temporary folder removed at the end.
"""

import argparse
import contextlib
import os
import shutil
import sys
import tempfile
import time
import warnings
from pathlib import Path

from bench_train_vs_flaxdiff import PACKAGES, EqxdiffSide, FlaxdiffSide  # exits naming the fix without flaxdiff
import jax  # noqa: E402
import numpy as np  # noqa: E402

from eqxdiff import xla_cpu  # noqa: E402
from eqxdiff.training import adamw_cosine  # noqa: E402
from harness import report  # noqa: E402
from hlo_ops import instructions, module_name, op_events, summarise  # noqa: E402

STEP_FILES = {  # the step's own file(s): ops there outside the gradient are the EMA, the NaN guard, the metrics
    "eqxdiff": ("eqxdiff/training/step.py",),
    "flaxdiff": ("flaxdiff/trainer/general_diffusion_trainer.py", "flaxdiff/trainer/diffusion_trainer.py"),
}


def compiled_text(name: str, side) -> str:
    """The optimized HLO of the step the side runs (the same program: one compile per signature)."""
    if name == "eqxdiff":
        return side.train_step.compile(side.state, side.batches[0]).as_text()
    # train_loop passes local_device_index 0 (a Python int), and each batch as host numpy.
    return side.train_step.lower(side.state, side.rng_state, side.host_batches[0], 0).compile().as_text()


def traced(side, steps: int, folder: Path) -> tuple[float, Path]:
    """(wall seconds of `steps` steps, the trace file) with the profiler on."""
    jax.profiler.start_trace(str(folder))
    try:
        seconds = side.run(steps)
    finally:
        jax.profiler.stop_trace()
    files = sorted(folder.rglob("*.xplane.pb"))
    if not files:
        raise SystemExit(f"jax.profiler wrote no .xplane.pb under {folder}")
    return seconds, files[-1]


def table_lines(results: dict) -> list[str]:
    """Shares of op time by phase and by kind, the two sides side by side."""
    lines = []
    for group in ("by_phase", "by_kind"):
        keys = list(dict.fromkeys(k for r in results.values() for k in r[group]))
        lines.append(f"{group:<34}" + "".join(f"{n:>22}" for n in results))
        for key in keys:
            cells = [r[group].get(key, {"ms_per_step": 0.0, "share": 0.0}) for r in results.values()]
            cell = lambda c: f"{c['ms_per_step']:>10.1f} ms {100 * c['share']:>6.1f}%"  # noqa: E731
            lines.append(f"  {key:<32}" + "".join(cell(c) for c in cells))
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--image_size", type=int, default=32)
    parser.add_argument("--channels", type=int, default=3)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=5, help="traced steps per side")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps before the trace, after the first")
    parser.add_argument("--num_batches", type=int, default=4, help="distinct batches, cycled")
    parser.add_argument("--top", type=int, default=15, help="top ops listed per side")
    parser.add_argument("--xla_cpu", default="on", help="the XLA:CPU switches, as the train scripts' flag (both sides)")
    parser.add_argument("--flaxdiff_first", action="store_true")
    parser.add_argument("--trace_dir", default="", help="keep the traces here (default: a temporary folder)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="smoke run: 8×8 images, batch 4, 2 traced steps")
    args = parser.parse_args()
    if args.quick:
        args.image_size, args.batch, args.steps, args.warmup, args.num_batches = 8, 4, 2, 1, 2
    xla_cpu.enable(xla_cpu.named_switches(args.xla_cpu))  # before JAX's backend starts: both sides get these flags

    rng = np.random.default_rng(args.seed)
    shape = (args.batch, args.image_size, args.image_size, args.channels)
    images_u8 = [rng.integers(0, 256, shape, dtype=np.uint8) for _ in range(args.num_batches)]
    optimizer, lr_schedule = adamw_cosine(2e-4, 10_000, 10, 1e-4)
    warnings.filterwarnings("ignore", message="Some donated buffers were not usable")  # FlaxDiff's uint8 batch
    checkpoint_dir = tempfile.mkdtemp(prefix="profile_steps_ckpt_")  # FlaxDiff's orbax manager's; nothing saved
    trace_root = Path(args.trace_dir or tempfile.mkdtemp(prefix="profile_steps_"))
    order = ["flaxdiff", "eqxdiff"] if args.flaxdiff_first else ["eqxdiff", "flaxdiff"]
    results = {}
    try:
        for name in order:
            with contextlib.redirect_stdout(sys.stderr):  # FlaxDiff prints as it builds and trains
                side = (
                    EqxdiffSide(args, images_u8, optimizer, lr_schedule)
                    if name == "eqxdiff"
                    else FlaxdiffSide(args, images_u8, optimizer, checkpoint_dir)
                )
                side.first_step()
                side.run(args.warmup)
                text = compiled_text(name, side)
                wall_s, trace = traced(side, args.steps, trace_root / name)
                (trace_root / name / "step.hlo.txt").write_text(text)  # what the kinds and phases were read from
            events, others_ns = op_events(trace, module_name(text))
            if not events:
                raise SystemExit(f"{name}: no op event of its step's module {module_name(text)} in {trace}")
            summary = summarise(events, instructions(text, STEP_FILES[name]), args.steps, args.top)
            results[name] = {
                "wall_ms_per_step": round(1000 * wall_s / args.steps, 2),
                "op_time_over_wall": round(summary["op_ms_per_step"] / (1000 * wall_s / args.steps), 3),
                "other_programs_op_ms_per_step": {m: round(ns / 1e6 / args.steps, 2) for m, ns in others_ns.items()},
                **summary,
            }
            del side  # its state's memory, before the other side's
    finally:
        shutil.rmtree(checkpoint_dir, ignore_errors=True)
        if not args.trace_dir:
            shutil.rmtree(trace_root, ignore_errors=True)
    print("\n".join(table_lines(results)), file=sys.stderr)
    report(
        "profile_steps",
        {
            "backend": jax.default_backend(),
            "image_size": args.image_size,
            "channels": args.channels,
            "batch": args.batch,
            "traced_steps": args.steps,
            "order": order,
            "quick": args.quick,
            "xla_cpu_switches": sorted(xla_cpu.switched_on()),
            "xla_flags": os.environ.get("XLA_FLAGS", ""),
            "trace_dir": args.trace_dir or None,
            "date_utc": time.strftime("%Y-%m-%d %H:%M"),
            **results,
            "note": "proportions of summed op time; op time can exceed wall time (ops run concurrently)",
        },
        (*PACKAGES, "flax", "flaxdiff", "optax"),
    )


if __name__ == "__main__":
    main()
