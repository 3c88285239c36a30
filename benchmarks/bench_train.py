"""Training speed: the eqxdiff step on FlaxDiff's simple UNet (2,141,379 params), 32×32×3, batch 32.

One device, fp32, EDM schedule + EDMPreconditioning, AdamW (`adamw_cosine`), the same
`prepare`/`loss_fn` shape as train/main.py, random images (the data does not change the speed).
Measures, in this process:

- `process_start_to_first_step_s`: from the top of this file (before `import jax`) to the first
  step's loss being ready, as train/main.py's `startup/time_to_first_step_s`;
- `first_step_s`: the rest of the compile (it starts in a thread during set-up, as in
  train/main.py) + first step (dispatch to loss ready);
- `samples_per_sec` / `step_time_ms`: steady state, after 2 warm-up steps, `--steps` steps with
  at most 2 in flight (after dispatching step i, block on step i-1's loss), plus a final block.

Prints one JSON line. FlaxDiff 0.2.11's own figures for this configuration, recorded on another day
(not side by side), are in BENCHMARKS.md, not here: a constant in a script reads as a measurement.

The side-by-side measurement (FlaxDiff 0.2.11's own trainer step and this step alternated in one
process, same config) is benchmarks/bench_train_vs_flaxdiff.py; it needs `flaxdiff==0.2.11`
installed (in a separate venv: see its docstring).

    python benchmarks/bench_train.py [--image_size 32 --channels 3 --batch 32 --steps 50]
    python benchmarks/bench_train.py --quick      # smoke run: 8×8, batch 4, 3 steps
"""

import time

PROCESS_START = time.perf_counter()  # before importing jax, as train/main.py

import argparse  # noqa: E402
import itertools  # noqa: E402
from concurrent.futures import ThreadPoolExecutor  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

from eqxdiff import xla_cpu  # noqa: E402
from eqxdiff.nn import UNet  # noqa: E402
from eqxdiff.sharding import batch_sharding, make_mesh  # noqa: E402
from eqxdiff.training import PRECISIONS, abstract_train_state, adamw_cosine, create_train_state, make_train_step  # noqa: E402
from harness import param_count, report, steps_in_flight  # noqa: E402  (benchmarks/ is on sys.path)
from unconditional_edm import unconditional_edm  # noqa: E402

xla_cpu.enable()  # XLA:CPU workarounds on, as in train/main.py (eqxdiff/xla_cpu.py)

IMPORTS_DONE = time.perf_counter()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--image_size", type=int, default=32)
    parser.add_argument("--channels", type=int, default=3)
    parser.add_argument("--batch", type=int, default=32, help="global batch (one device)")
    parser.add_argument("--steps", type=int, default=50, help="timed steady-state steps")
    parser.add_argument("--num_batches", type=int, default=4, help="distinct device batches, cycled")
    parser.add_argument("--precision", default="fp32", choices=sorted(PRECISIONS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="smoke run: 8x8 images, batch 4, 3 timed steps")
    args = parser.parse_args()
    if args.quick:
        args.image_size, args.batch, args.steps, args.num_batches = 8, 4, 3, 2

    warmup_steps = 2  # the first (compile) step + one more
    mesh = make_mesh(1, 1, jax.devices()[:1])
    optimizer, lr_schedule = adamw_cosine(2e-4, max(1000, warmup_steps + args.steps + 1), 10, 1e-4)

    def make_model(key):
        return UNet.flaxdiff_simple(args.channels, key=key)

    abstract, shardings = abstract_train_state(make_model, optimizer, mesh, 2**14)

    prepare, loss_fn = unconditional_edm()  # as train/main.py, without labels

    data_sharding = batch_sharding(mesh)
    train_step = make_train_step(
        prepare=prepare,
        loss_fn=loss_fn,
        optimizer=optimizer,
        lr_schedule=lr_schedule,
        ema_decay=0.995,
        state_shardings=shardings,
        batch_sharding=data_sharding,
        seed=args.seed,
        precision=args.precision,
    )

    shape = (args.batch, args.image_size, args.image_size, args.channels)
    # As train/main.py: the step compiles in a thread while the state is built.
    compiling = ThreadPoolExecutor(1).submit(
        train_step.compile, abstract, {"image": jax.ShapeDtypeStruct(shape, np.uint8)}
    )
    state, _ = create_train_state(make_model, optimizer, jax.random.key(args.seed), mesh, 2**14, shardings=shardings)
    params = param_count(state.model)

    rng = np.random.default_rng(args.seed)  # host data, as a loader gives; no JAX work in the set-up
    batches = [
        {"image": jax.device_put(rng.integers(0, 256, shape, dtype=np.uint8), data_sharding)}
        for _ in range(args.num_batches)
    ]
    jax.block_until_ready(batches)
    setup_done = time.perf_counter()

    # ---- first step: the rest of the compile + run ----
    start = time.perf_counter()
    compiling.result()
    state, metrics = train_step(state, batches[0])
    jax.block_until_ready(metrics["loss"])
    first_step_done = time.perf_counter()
    first_step_s = first_step_done - start
    process_start_to_first_step_s = first_step_done - PROCESS_START

    for i in range(1, warmup_steps):
        state, metrics = train_step(state, batches[i % len(batches)])
        jax.block_until_ready(metrics["loss"])

    # ---- steady state: at most 2 steps in flight ----
    start = time.perf_counter()
    state, metrics = steps_in_flight(train_step, state, itertools.islice(itertools.cycle(batches), args.steps))
    elapsed = time.perf_counter() - start

    last = jax.device_get(metrics)
    assert bool(last["finite"]) and int(state.step) == warmup_steps + args.steps, "a step was not finite"
    samples_per_sec = args.batch * args.steps / elapsed
    config = {
        "model": "UNet.flaxdiff_simple",
        "params": params,
        "image_size": args.image_size,
        "channels": args.channels,
        "batch": args.batch,
        "precision": args.precision,
        "devices": 1,
        "schedule": "edm",
        "parameterization": "edm",
        "optimizer": "adamw_cosine",
        "warmup_steps": warmup_steps,
        "timed_steps": args.steps,
        "max_in_flight": 2,
        "quick": args.quick,
    }
    report(
        "train",
        {
            "backend": jax.default_backend(),
            **config,
            "samples_per_sec": round(samples_per_sec, 2),
            "step_time_ms": round(1000 * elapsed / args.steps, 2),
            "first_step_s": round(first_step_s, 3),
            "process_start_to_first_step_s": round(process_start_to_first_step_s, 3),
            "imports_s": round(IMPORTS_DONE - PROCESS_START, 3),
            "setup_s": round(setup_done - IMPORTS_DONE, 3),
            "final_loss": round(float(last["loss"]), 5),
        },
    )


if __name__ == "__main__":
    main()
