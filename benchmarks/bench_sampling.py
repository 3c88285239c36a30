"""Sampling speed: `sample` (one jit, one lax.scan) against a Python loop of jitted denoiser calls.

Both run Euler with the same UNet, grid and starting noise, so they do the same NFE and must
give the same images; the ratio is the cost of dispatching every step from Python.
Prints one JSON line.

    python benchmarks/bench_sampling.py [--image_size 32 --channels 3 --batch 16 --steps 20]
"""

import argparse

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from eqxdiff import xla_cpu
from eqxdiff.diffusion import Denoiser, EDMPreconditioning, EDMSchedule, karras_sigmas, sample
from eqxdiff.nn import UNet
from harness import call_seconds, param_count, report  # benchmarks/ is on sys.path

xla_cpu.enable()  # XLA:CPU workarounds on, as in train/main.py (eqxdiff/xla_cpu.py)


def best_of(fn, repeats: int) -> float:
    """Fastest wall time of `repeats` runs, in seconds (after a warm-up run)."""
    jax.block_until_ready(fn())
    return min(call_seconds(1, fn) for _ in range(repeats))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--image_size", type=int, default=32)
    parser.add_argument("--channels", type=int, default=3)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    model = UNet.flaxdiff_simple(args.channels, key=jax.random.key(0))
    denoiser = Denoiser(model, EDMSchedule(), EDMPreconditioning())
    sigmas = karras_sigmas(args.steps)
    shape = (args.batch, args.image_size, args.image_size, args.channels)
    x_init = float(sigmas[0]) * jax.random.normal(jax.random.key(1), shape)

    scan = lambda: sample(denoiser, x_init, sigmas, "euler")  # noqa: E731
    denoise_jit = eqx.filter_jit(lambda d, x, s: d(x, s))
    grid = [jnp.asarray(s, jnp.float32) for s in sigmas]

    def per_step_dispatch():
        x = x_init
        for s, s_next in zip(grid[:-1], grid[1:]):
            x = x + (s_next - s) * (x - denoise_jit(denoiser, x, s)) / s
        return x

    np.testing.assert_allclose(np.asarray(scan()), np.asarray(per_step_dispatch()), rtol=1e-3, atol=1e-3)
    t_scan = best_of(scan, args.repeats)
    t_loop = best_of(per_step_dispatch, args.repeats)
    report(
        "sampling",
        {
            "model": "UNet.flaxdiff_simple",
            "params": param_count(model),
            "shape": list(shape),
            "method": "euler",
            "nfe": args.steps,
            "scan_s": round(t_scan, 4),
            "per_step_dispatch_s": round(t_loop, 4),
            "speedup_scan_vs_dispatch": round(t_loop / t_scan, 3),
            "images_per_s": round(args.batch / t_scan, 2),
        },
    )


if __name__ == "__main__":
    main()
