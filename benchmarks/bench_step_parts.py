"""What eqxdiff's training step does that FlaxDiff's does not, each part's cost side by side in one process.

The FlaxDiff comparison's step (`UNet.flaxdiff_simple(3)`, 32×32×3, batch 32, EDM, AdamW, EMA 0.995,
one device, as bench_train_vs_flaxdiff.py) as shipped, and without each part in turn:

- `shipped`: `eqxdiff.training.make_train_step` (the library's step), at most 2 steps in flight.
- `replica`: the same step rebuilt here (`step_body` below, every part on, donated, 2 in flight): the
  baseline of the variants built here, so a part's cost is not confused with how the step is jitted.
  Its state after one step is asserted equal to the library step's (`replica_max_abs_diff`).
- `no_guard`: no NaN guard (no finiteness check, no `lax.cond` between the new and the old state, no
  bad-step count): the update applied unconditionally, as FlaxDiff's fp32 step does.
- `no_ema`: the EMA left as it is (FlaxDiff's step has an EMA too: this is the EMA's own cost).
- `no_donation`: the state not donated (FlaxDiff donates only the batch): new buffers every step.
- `one_in_flight`: the library's step, blocking on each step's loss before the next is dispatched
  (FlaxDiff's `train_loop` reads the loss on the host every step).
- `flaxdiff_like`: no guard, no donation, one in flight, EMA on: eqxdiff's step without all it adds.

None of the parts can be switched off by an argument of `make_train_step`, so the variants are built
here, not in the library. Every side starts from the same parameters and batches; timed rounds
alternate over the sides (rounds of `--steps` steps), so drift hits all alike. XLA:CPU switches:
`--xla_cpu` (as the train scripts read it, default on), the same for every side, printed with XLA_FLAGS.

One JSON line: per side its median step time and samples/s, and per part `over_baseline` = the
variant's step time / its baseline's (replica for the variants built here, shipped for one_in_flight):
< 1 means the part costs (1 - ratio) of the step; `flaxdiff_like` over shipped is all of them together.

    python benchmarks/bench_step_parts.py [--rounds 4 --steps 5 --xla_cpu on]
    python benchmarks/bench_step_parts.py --quick      # smoke: 8×8 images, batch 4, 2 rounds of 2 steps
"""

import argparse
import itertools
import os
import statistics
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec

from eqxdiff import xla_cpu
from eqxdiff.nn import UNet
from eqxdiff.sharding import batch_sharding, is_array_like, make_mesh
from eqxdiff.training import TrainState, adamw_cosine, cast_for_compute, create_train_state, make_train_step
from eqxdiff.training.step import _select, _updates_applied
from harness import alternate, report, steps_in_flight  # benchmarks/ is on sys.path when run as a script
from unconditional_edm import unconditional_edm  # puts train/ on sys.path

EMA_DECAY = 0.995
VARIANTS = {  # side -> (guard, ema, donate) of the step built here
    "replica": (True, True, True),
    "no_guard": (False, True, True),
    "no_ema": (True, False, True),
    "no_donation": (True, True, False),
    "flaxdiff_like": (False, True, False),
}
BASELINE = {
    "no_guard": "replica",
    "no_ema": "replica",
    "no_donation": "replica",
    "one_in_flight": "shipped",
    "flaxdiff_like": "shipped",
    "replica": "shipped",
}


def step_body(prepare, loss_fn, optimizer, lr_schedule, data_sharding, seed: int, *, guard: bool, ema: bool):
    """`make_train_step`'s step (fp32, no accumulation, no frozen towers, no power EMAs) with the NaN guard
    and the EMA each optional: `step(state_arrays, static, batch) -> (state_arrays, metrics)`."""
    grad_fn = eqx.filter_value_and_grad(lambda model, batch, key: loss_fn(cast_for_compute(model, "fp32"), batch, key))

    def step(state_arrays, static, batch):
        state = eqx.combine(state_arrays, static)
        key_prepare, key_loss = jax.random.split(jax.random.fold_in(jax.random.key(seed), state.step))
        batch = eqx.filter_shard(prepare(batch, key_prepare), data_sharding)
        loss, grads = grad_fn(state.model, batch, key_loss)
        grad_norm = optax.tree.norm(grads)
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        updates, opt_state = optimizer.update(grads, state.opt_state, eqx.filter(state.model, eqx.is_inexact_array))
        model = eqx.apply_updates(state.model, updates)
        new_ema = state.ema
        if ema:
            move = lambda e, p: e + (1 - EMA_DECAY) * (p - e)  # noqa: E731
            params = jax.tree.map(move, *(eqx.filter(m, eqx.is_inexact_array) for m in (state.ema, model)))
            new_ema = eqx.combine(params, state.ema)
        updated = TrainState(model, new_ema, opt_state, state.step, state.bad_steps)
        bad_steps = state.bad_steps
        if guard:
            kept = TrainState(state.model, state.ema, state.opt_state, state.step, bad_steps)
            updated = _select(finite, updated, kept)
            bad_steps = jnp.where(finite, 0, bad_steps + 1).astype(bad_steps.dtype)
        new_state = TrainState(updated.model, updated.ema, updated.opt_state, state.step + 1, bad_steps, state.phema)
        lr = jnp.asarray(lr_schedule(_updates_applied(state.opt_state, state.step)), jnp.float32)
        metrics = dict(loss=loss, grad_norm=grad_norm, lr=lr, finite=finite, bad_steps=bad_steps)
        return eqx.filter(new_state, eqx.is_array), metrics

    return step


class BuiltStep:
    """A `step_body` jitted over the state's array half as `TrainStep` does (same shardings), donated or not,
    compiled ahead of time with the switches' compiler options: `step(state, batch) -> (state, metrics)`."""

    def __init__(self, body, state, batch, shardings, data_sharding, donate: bool):
        arrays, self.static = eqx.partition(state, is_array_like)
        replicated = NamedSharding(data_sharding.mesh, PartitionSpec())
        jitted = jax.jit(
            lambda arrays, batch: body(arrays, self.static, batch),
            donate_argnums=(0,) if donate else (),
            in_shardings=(shardings, data_sharding),
            out_shardings=(shardings, replicated),
        )
        self.compiled = jitted.lower(arrays, batch).compile(xla_cpu.compiler_options())

    def __call__(self, state, batch):
        arrays, _ = eqx.partition(state, is_array_like)
        new_arrays, metrics = self.compiled(arrays, batch)
        return eqx.combine(new_arrays, self.static), metrics


def one_in_flight(step, state, batches):
    """Each step's loss waited for before the next is dispatched (a host read per step, as FlaxDiff's loop)."""
    for batch in batches:
        state, metrics = step(state, batch)
        jax.block_until_ready(metrics["loss"])
    jax.block_until_ready(state)
    return state, metrics


def arrays_of(state) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree.leaves(eqx.filter(state, eqx.is_array))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--image_size", type=int, default=32)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per round and side")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps per side after the first")
    parser.add_argument("--sides", default="", help="comma list (default: all of " + ", ".join(BASELINE) + ", shipped)")
    parser.add_argument("--xla_cpu", default="on", help="the XLA:CPU switches, as the train scripts' flag")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="smoke run: 8×8 images, batch 4, 2 rounds of 2 steps")
    args = parser.parse_args()
    if args.quick:
        args.batch, args.image_size, args.steps, args.rounds, args.warmup = 4, 8, 2, 2, 0
    sides = [s.strip() for s in args.sides.split(",") if s.strip()] or ["shipped", *BASELINE]
    if unknown := set(sides) - {"shipped", *BASELINE}:
        raise SystemExit(f"--sides: unknown {sorted(unknown)}; choose from shipped, {', '.join(BASELINE)}")
    sides = list(dict.fromkeys(["shipped", "replica", *sides]))  # the baselines always run
    xla_cpu.enable(xla_cpu.named_switches(args.xla_cpu))  # before JAX's backend starts, as train/main.py

    mesh = make_mesh(1, 1, jax.devices()[:1])
    data_sharding = batch_sharding(mesh)
    optimizer, lr_schedule = adamw_cosine(2e-4, 10_000, 10, 1e-4)
    prepare, loss_fn = unconditional_edm()
    make_model = lambda key: UNet.flaxdiff_simple(3, key=key)  # noqa: E731
    rng = np.random.default_rng(args.seed)
    shape = (args.batch, args.image_size, args.image_size, 3)
    batches = [jax.device_put({"image": rng.integers(0, 256, shape, dtype=np.uint8)}, data_sharding) for _ in range(4)]

    steps, states, startup = {}, {}, {}
    for side in sides:  # each its own state (the steps donate it), all from one draw
        states[side], shardings = create_train_state(make_model, optimizer, jax.random.key(args.seed), mesh, 2**14)
        start = time.perf_counter()
        if side in VARIANTS:
            guard, ema, donate = VARIANTS[side]
            body = step_body(prepare, loss_fn, optimizer, lr_schedule, data_sharding, args.seed, guard=guard, ema=ema)
            steps[side] = BuiltStep(body, states[side], batches[0], shardings, data_sharding, donate)
        elif side == "one_in_flight":  # the shipped step itself, run one step at a time
            steps[side] = steps["shipped"]
        else:
            steps[side] = make_train_step(
                prepare=prepare,
                loss_fn=loss_fn,
                optimizer=optimizer,
                lr_schedule=lr_schedule,
                ema_decay=EMA_DECAY,
                state_shardings=shardings,
                batch_sharding=data_sharding,
                seed=args.seed,
            )
            steps[side].compile(states[side], batches[0])
        compile_s = time.perf_counter() - start
        start = time.perf_counter()
        states[side], metrics = steps[side](states[side], batches[0])
        jax.block_until_ready(metrics["loss"])
        startup[side] = {"compile_s": round(compile_s, 2), "first_step_s": round(time.perf_counter() - start, 3)}
    after_one = {side: arrays_of(states[side]) for side in ("shipped", "replica")}
    replica_diff = max(float(np.max(np.abs(a - b), initial=0)) for a, b in zip(*after_one.values(), strict=True))
    assert replica_diff <= 1e-6, f"the step rebuilt here is not the library's: max abs diff {replica_diff}"

    def run(side: str, n: int) -> float:
        start = time.perf_counter()
        loop = one_in_flight if side in ("one_in_flight", "flaxdiff_like") else steps_in_flight
        batches_n = itertools.islice(itertools.cycle(batches), n)
        states[side], _ = loop(steps[side], states[side], batches_n)
        return time.perf_counter() - start

    if args.warmup:
        for side in sides:
            run(side, args.warmup)
    times = alternate({side: lambda side=side: run(side, args.steps) for side in sides}, args.rounds)
    median = {side: statistics.median(t) for side, t in times.items()}
    per_side = {
        side: startup[side]
        | {
            "rounds_s": [round(t, 3) for t in times[side]],
            "step_time_ms": round(1000 * median[side] / args.steps, 2),
            "samples_per_sec": round(args.batch * args.steps / median[side], 2),
        }
        for side in sides
    }
    parts = {
        side: {"baseline": BASELINE[side], "over_baseline": round(median[side] / median[BASELINE[side]], 3)}
        for side in sides
        if side in BASELINE
    }
    report(
        "step_parts",
        {
            "backend": jax.default_backend(),
            "model": "UNet.flaxdiff_simple(3)",
            "image_size": args.image_size,
            "batch": args.batch,
            "steps_per_round": args.steps,
            "rounds": args.rounds,
            "quick": args.quick,
            "xla_cpu_switches": sorted(xla_cpu.switched_on()),
            "xla_flags": os.environ.get("XLA_FLAGS", ""),
            "compiler_options": steps["shipped"].compiler_options,
            "replica_max_abs_diff": replica_diff,
            "load_avg_1m_at_end": round(os.getloadavg()[0], 2),
            "sides": per_side,
            "parts": parts,
            "note": "over_baseline < 1: the part removed cost (1 - over_baseline) of its baseline's step time",
        },
    )


if __name__ == "__main__":
    main()
