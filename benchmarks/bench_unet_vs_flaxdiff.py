"""The two networks alone, side by side in one process: eqxdiff's `UNet.flaxdiff_simple(3)` vs FlaxDiff
0.2.11's simple UNet (the pair bench_train_vs_flaxdiff.py trains), no optimizer, no step around them.

Two programs per side, each one jit of the bare network, compiled with eqxdiff's shipped XLA:CPU
options on both sides (`xla_cpu.compiler_options()`; the process's XLA_FLAGS are the same for both):
- `forward`: the network on a batch of 32×32×3 images and their noise levels (what a sampler calls);
- `gradient`: `jax.value_and_grad` of mean((network(x) - x)²) with respect to the parameters (the
  part of a training step that is the network's).
Random weights and inputs (the speed does not depend on them). Each side's programs' FLOPs (XLA's
cost analysis) are reported beside their times: the same network, where eqxdiff runs its two upsampling
convs on the small map (eqxdiff/nn/upsample.py: 4/9 of their FLOPs, the same values to float32 rounding).
Timed rounds of `--calls` back-to-back calls alternate over the four programs, each round starting one
program later (rotated), after one untimed call each.

What it answers (issue 35 §2): how much of the training-step ratio to FlaxDiff is the network's
own program on this box, and how much the step around it.

    /tmp/peer/bin/python benchmarks/bench_unet_vs_flaxdiff.py [--batch 32 --rounds 6]
    /tmp/peer/bin/python benchmarks/bench_unet_vs_flaxdiff.py --quick   # 8x8, batch 4, 2 rounds
"""

import argparse
import statistics
import sys
import time

try:
    import flaxdiff  # noqa: F401
except ImportError as error:  # pragma: no cover - depends on the environment
    sys.exit(f"flaxdiff is not importable ({error}); see benchmarks/bench_train_vs_flaxdiff.py's docstring.")

from eqxdiff import xla_cpu  # noqa: E402

xla_cpu.enable()  # before the backend starts: YNNPACK off in XLA_FLAGS for both sides, as the scripts run

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from eqxdiff.nn import UNet  # noqa: E402
from flaxdiff_peer import UNET, simple_unet  # noqa: E402
from harness import alternate, param_count, report  # noqa: E402


def programs(args) -> dict:
    """{name: (compiled, parameters)} for the four programs; each compiled takes (parameters, x, sigma)."""
    rng = np.random.default_rng(args.seed)
    x = jnp.asarray(rng.standard_normal((args.batch, args.size, args.size, 3)), jnp.float32)
    sigma = jnp.asarray(rng.uniform(0.1, 80.0, args.batch), jnp.float32)
    arrays, static = eqx.partition(UNet.flaxdiff_simple(3, key=jax.random.key(args.seed)), eqx.is_array)
    peer = simple_unet(3)
    context = jnp.zeros((args.batch, 1, 1), jnp.float32)  # the null context its UNet reads the shape of
    variables = peer.init(jax.random.PRNGKey(args.seed), x, sigma, context)
    networks = {
        "eqxdiff": (lambda p, x, s: eqx.combine(p, static)(x, s), arrays),
        "flaxdiff": (lambda p, x, s: peer.apply(p, x, s, context), variables),
    }
    options = xla_cpu.compiler_options()
    out = {}
    for side, (network, params) in networks.items():
        loss = lambda p, x, s, network=network: jnp.mean(jnp.square(network(p, x, s) - x))  # noqa: E731
        for kind, fn in (("forward", network), ("gradient", jax.value_and_grad(loss))):
            out[f"{side}_{kind}"] = (jax.jit(fn).lower(params, x, sigma).compile(options), params)
    return out, x, sigma


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--size", type=int, default=32)
    parser.add_argument("--calls", type=int, default=4, help="calls per timed round")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.batch, args.size, args.calls, args.rounds = 4, 8, 1, 2

    compiled, x, sigma = programs(args)

    def run(name: str) -> float:
        fn, params = compiled[name]
        start = time.perf_counter()
        for _ in range(args.calls):
            out = fn(params, x, sigma)
        jax.block_until_ready(out)
        return (time.perf_counter() - start) / args.calls

    for name in compiled:
        run(name)  # one untimed round: first-call costs out of the timed ones
    seconds = alternate({name: (lambda name=name: run(name)) for name in compiled}, args.rounds, rotate=True)
    per_program = {
        name: {
            "ms_median": round(1000 * statistics.median(s), 2),
            "ms_fastest": round(1000 * min(s), 2),
            "gflop": round(compiled[name][0].cost_analysis()["flops"] / 1e9, 2),
            "rounds_ms": [round(1000 * t, 2) for t in s],
        }
        for name, s in seconds.items()
    }
    ratio = {
        kind: round(per_program[f"flaxdiff_{kind}"]["ms_median"] / per_program[f"eqxdiff_{kind}"]["ms_median"], 3)
        for kind in ("forward", "gradient")
    }
    report(
        "unet_vs_flaxdiff",
        {
            "batch": args.batch,
            "image_size": args.size,
            "calls_per_round": args.calls,
            "rounds": args.rounds,
            "params": {
                "eqxdiff": param_count(compiled["eqxdiff_forward"][1]),
                "flaxdiff": param_count(compiled["flaxdiff_forward"][1]),
            },
            "peer": UNET,
            "compiler_options": xla_cpu.compiler_options(),
            "programs": per_program,
            "speedup_eqxdiff_over_flaxdiff": ratio,  # FlaxDiff's median time / eqxdiff's: > 1 favours eqxdiff
        },
    )


if __name__ == "__main__":
    main()
