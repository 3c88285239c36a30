"""Sampling speed, side by side in one process: eqxdiff's `sample` vs FlaxDiff 0.2.11's own sampler.

The same network on both sides (FlaxDiff's simple UNet and eqxdiff's `UNet.flaxdiff_simple(3)`,
2,141,379 params; random weights, the speed does not depend on them), 64 images of 32×32×3, fp32, one
device, Euler, 50 network evaluations each:
- eqxdiff: `eqxdiff.diffusion.sample(..., method="euler")` over `karras_sigmas(50)` with EDM's
  preconditioning: one jit, one `lax.scan` (the last step, to σ = 0, is one Euler step);
- FlaxDiff: its `EulerSampler.generate_samples(params, 64, 32, diffusion_steps=50)` with
  `KarrasVENoiseScheduler(1000, sigma_max=80, rho=7)` + `KarrasPredictionTransform(0.5)`: a Python
  loop over its jitted model call and its step arithmetic (49 steps, then one final model call: 50
  evaluations), as its trainer's validation and its inference pipeline call it.

Reported per side: compile + first call (`first_call_s`), then steady `images_per_sec` over rounds
that alternate eqxdiff, FlaxDiff, eqxdiff, ... (both orders with --flaxdiff_first). Same process,
same XLA_FLAGS (printed), eqxdiff's switches as `--xla_cpu` says (they do not touch a forward pass
but for YNNPACK in XLA_FLAGS). Needs flaxdiff installed: see bench_train_vs_flaxdiff.py.

    /tmp/peer/bin/python benchmarks/bench_sampling_vs_flaxdiff.py [--rounds 3]
    /tmp/peer/bin/python benchmarks/bench_sampling_vs_flaxdiff.py --quick   # 8 images of 8×8, 5 steps
"""

import argparse
import contextlib
import os
import sys
import time

try:
    import flaxdiff  # noqa: F401
except ImportError as error:  # pragma: no cover - depends on the environment
    sys.exit(f"flaxdiff is not importable ({error}); see benchmarks/bench_train_vs_flaxdiff.py's docstring.")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from eqxdiff import xla_cpu  # noqa: E402
from eqxdiff.diffusion import Denoiser, EDMPreconditioning, EDMSchedule, karras_sigmas, sample  # noqa: E402
from eqxdiff.nn import UNet  # noqa: E402
from flaxdiff_peer import UNET, input_config, simple_unet  # noqa: E402
from harness import alternate, param_count, report  # noqa: E402


class EqxdiffSide:
    def __init__(self, args):
        model = UNet.flaxdiff_simple(3, key=jax.random.key(args.seed))
        self.params = param_count(model)
        denoiser = Denoiser(model, EDMSchedule(), EDMPreconditioning())
        sigmas = jnp.asarray(karras_sigmas(args.steps), jnp.float32)
        shape = (args.num, args.image_size, args.image_size, 3)
        self.noise = jax.random.normal(jax.random.key(args.seed + 1), shape) * sigmas[0]
        self.run_once = jax.jit(
            lambda d, x: sample(lambda x, s: d(x, jnp.full(x.shape[:1], s), None), x, sigmas, method="euler")
        )
        self.denoiser = denoiser

    def __call__(self) -> float:
        start = time.perf_counter()
        jax.block_until_ready(self.run_once(self.denoiser, self.noise))
        return time.perf_counter() - start


class FlaxdiffSide:
    def __init__(self, args):
        from flaxdiff.predictors import KarrasPredictionTransform
        from flaxdiff.samplers import EulerSampler
        from flaxdiff.schedulers import KarrasVENoiseScheduler
        from flaxdiff.utils import RandomMarkovState

        model = simple_unet(3)
        size = args.image_size
        self.variables = model.init(
            jax.random.PRNGKey(args.seed), jnp.zeros((1, size, size, 3)), jnp.zeros((1,)), jnp.zeros((1, 1, 1))
        )
        self.params = param_count(self.variables)
        schedule = KarrasVENoiseScheduler(1000, sigma_max=80, rho=7, sigma_data=0.5)
        self.sampler = EulerSampler(
            model, schedule, KarrasPredictionTransform(sigma_data=0.5), input_config((size, size, 3))
        )
        self.args, self.state = args, RandomMarkovState(jax.random.PRNGKey(args.seed + 1))
        self.context = (jnp.zeros((args.num, 1, 1), jnp.float32),)  # the null context the UNet reads the shape of

    def __call__(self) -> float:
        start = time.perf_counter()
        with contextlib.redirect_stdout(sys.stderr), contextlib.redirect_stderr(open(os.devnull, "w")):  # its tqdm bar
            images = self.sampler.generate_samples(
                self.variables,
                self.args.num,
                self.args.image_size,
                diffusion_steps=self.args.steps,
                rngstate=self.state,
                model_conditioning_inputs=self.context,
            )
        jax.block_until_ready(images)
        return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num", type=int, default=64, help="images per call")
    parser.add_argument("--image_size", type=int, default=32)
    parser.add_argument("--steps", type=int, default=50, help="network evaluations per image")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--flaxdiff_first", action="store_true")
    parser.add_argument("--xla_cpu", default="on", help="eqxdiff's XLA:CPU switches, as the train scripts' flag")
    parser.add_argument("--quick", action="store_true", help="smoke run: 8 images of 8x8, 5 steps, 2 rounds")
    args = parser.parse_args()
    if args.quick:
        args.num, args.image_size, args.steps, args.rounds = 8, 8, 5, 2
    xla_cpu.enable(xla_cpu.named_switches(args.xla_cpu))  # before the backend starts: XLA_FLAGS hold for both sides

    order = ["flaxdiff", "eqxdiff"] if args.flaxdiff_first else ["eqxdiff", "flaxdiff"]
    builders = {"eqxdiff": EqxdiffSide, "flaxdiff": FlaxdiffSide}
    sides, first_call_s = {}, {}
    for name in order:
        sides[name] = builders[name](args)
        first_call_s[name] = sides[name]()  # compile + one call
    seconds = alternate({name: sides[name] for name in order}, args.rounds)
    rate = {name: args.num * args.rounds / sum(seconds[name]) for name in order}
    report(
        "sampling_vs_flaxdiff",
        {
            "backend": jax.default_backend(),
            "images": args.num,
            "image_size": args.image_size,
            "network_evaluations": args.steps,
            "rounds": args.rounds,
            "order": order,
            "quick": args.quick,
            "xla_flags_both_sides": os.environ.get("XLA_FLAGS", ""),
            "xla_cpu_switches": sorted(xla_cpu.switched_on()),
            **{
                name: {
                    "params": sides[name].params,
                    "first_call_s": round(first_call_s[name], 3),
                    "images_per_sec": round(rate[name], 2),
                    "round_s": [round(t, 3) for t in seconds[name]],
                }
                for name in order
            },
            "models": {"eqxdiff": "UNet.flaxdiff_simple(3)", "flaxdiff": UNET},
            "ratio_eqxdiff_over_flaxdiff": {
                "images_per_sec": round(rate["eqxdiff"] / rate["flaxdiff"], 3),
                "first_call_s": round(first_call_s["eqxdiff"] / first_call_s["flaxdiff"], 3),
            },
        },
        ("jax", "jaxlib", "equinox", "eqxdiff", "flax", "flaxdiff"),
    )


if __name__ == "__main__":
    main()
