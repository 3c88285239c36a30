"""A 3×3 conv's weight gradient in several forms, each shape of the FlaxDiff-comparison UNet jitted alone.

Per shape (batch 32, NHWC/HWIO, stride 1, padding 1), side by side in one process, the same inputs:
- `forward`: the convolution itself (the rate the weight gradient is compared with);
- `input_grad`: XLA's input gradient (a transposed convolution);
- `xla`: XLA's weight gradient (`jax.vjp` of the conv; on XLA:CPU a convolution whose window is the whole
  feature map, batch and channels swapped);
- `offsets`: one [cin, cout] matmul per kernel offset, `eqxdiff.xla_cpu`'s `conv_grad_matmul` switch itself;
- `im2col`: the 9 shifted copies of the input side by side, `[b·h·w, 9·cin]`, then one matmul with dy;
- `im2col_per_image` / `offsets_per_image`: the same, batched over the images, then summed.
Every form's result is checked against `xla` (float32 rounding) before timing. Reported: each form's fastest
and median of `--rounds` rounds of `--calls` calls, and GFLOP/s (2·b·h·w·9·cin·cout per call).

    python benchmarks/bench_conv_weight_grad.py [--rounds 5 --calls 10]
    python benchmarks/bench_conv_weight_grad.py --quick
"""

import argparse
import statistics
import time

from eqxdiff import xla_cpu

xla_cpu.enable()  # before the backend starts, as the training scripts run

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from harness import report  # noqa: E402  (benchmarks/ is on sys.path as a script)

# (h = w, cin, cout) of the UNet's 3×3 convs
SHAPES = [(32, 32, 32), (32, 64, 32), (16, 64, 64), (16, 32, 64), (16, 128, 64), (8, 128, 128), (8, 64, 128)]
CONTRACT = (((0,), (0,)), ((), ()))  # over the rows
PER_IMAGE = (((1,), (1,)), ((0,), (0,)))  # over each image's rows


def conv(x, w):
    return jax.lax.conv_general_dilated(x, w, (1, 1), [(1, 1)] * 2, dimension_numbers=("NHWC", "HWIO", "NHWC"))


def shifted(x):
    """The 9 kernel offsets' views of the padded input, each [b, h, w, cin]."""
    b, h, w, _ = x.shape
    padded = jnp.pad(x, ((0, 0), (1, 1), (1, 1), (0, 0)))
    return [padded[:, i : i + h, j : j + w, :] for i in range(3) for j in range(3)]


def im2col(x, dy, per_image: bool):
    b, cin, cout = x.shape[0], x.shape[-1], dy.shape[-1]
    patches = jnp.concatenate(shifted(x), axis=-1)
    if per_image:
        dw = jax.lax.dot_general(patches.reshape(b, -1, 9 * cin), dy.reshape(b, -1, cout), PER_IMAGE).sum(0)
    else:
        dw = jax.lax.dot_general(patches.reshape(-1, 9 * cin), dy.reshape(-1, cout), CONTRACT)
    return dw.reshape(3, 3, cin, cout)


def offsets_per_image(x, dy):
    """`conv_grad_matmul`'s matmul per kernel offset, batched over the images, then summed."""
    b, cin, cout = x.shape[0], x.shape[-1], dy.shape[-1]
    rows = dy.reshape(b, -1, cout)
    dw = [jax.lax.dot_general(s.reshape(b, -1, cin), rows, PER_IMAGE).sum(0) for s in shifted(x)]
    return jnp.stack(dw).reshape(3, 3, cin, cout)


def switched_weight_grad(x, w, dy):
    """The weight gradient as `eqxdiff.xla_cpu`'s `conv_grad_matmul` switch computes it (its conv2d's custom
    backward; the input gradient it also returns is unused here, and XLA drops it)."""
    with xla_cpu.only({"conv_grad_matmul"}):
        return jax.vjp(lambda w: xla_cpu.conv2d(x, w, 1, 1), w)[1](dy)[0]


FORMS = {
    "forward": lambda x, w, dy: conv(x, w),
    "input_grad": lambda x, w, dy: jax.vjp(lambda x: conv(x, w), x)[1](dy)[0],
    "xla": lambda x, w, dy: jax.vjp(lambda w: conv(x, w), w)[1](dy)[0],
    "offsets": switched_weight_grad,
    "im2col": lambda x, w, dy: im2col(x, dy, False),
    "offsets_per_image": lambda x, w, dy: offsets_per_image(x, dy),
    "im2col_per_image": lambda x, w, dy: im2col(x, dy, True),
}


def measure(hw: int, cin: int, cout: int, args) -> dict:
    rng = np.random.default_rng(args.seed)
    x, dy = (jnp.asarray(rng.standard_normal((args.batch, hw, hw, c)), jnp.float32) for c in (cin, cout))
    w = jnp.asarray(0.05 * rng.standard_normal((3, 3, cin, cout)), jnp.float32)
    compiled = {name: jax.jit(f).lower(x, w, dy).compile(xla_cpu.compiler_options()) for name, f in FORMS.items()}
    reference = np.asarray(compiled["xla"](x, w, dy))
    for name in ("offsets", "im2col", "offsets_per_image", "im2col_per_image"):
        got = np.asarray(compiled[name](x, w, dy))
        assert np.allclose(got, reference, rtol=1e-3, atol=1e-3 * np.abs(reference).max()), name
    seconds = {name: [] for name in compiled}
    for _ in range(args.rounds):
        for name, f in compiled.items():
            jax.block_until_ready(f(x, w, dy))
            start = time.perf_counter()
            for _ in range(args.calls):
                out = f(x, w, dy)
            jax.block_until_ready(out)
            seconds[name].append((time.perf_counter() - start) / args.calls)
    gflop = 2 * args.batch * hw * hw * 9 * cin * cout / 1e9
    return {
        "hw": hw,
        "cin": cin,
        "cout": cout,
        "gflop": round(gflop, 3),
        **{
            name: {
                "ms_fastest": round(1000 * min(s), 3),
                "ms_median": round(1000 * statistics.median(s), 3),
                "gflops_fastest": round(gflop / min(s), 1),
            }
            for name, s in seconds.items()
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="smoke run: batch 2, the first two shapes, 1 round")
    args = parser.parse_args()
    shapes = SHAPES[:2] if args.quick else SHAPES
    if args.quick:
        args.batch, args.rounds, args.calls = 2, 1, 1
    rows = [measure(*shape, args) for shape in shapes]
    report(
        "conv_weight_grad",
        {
            "batch": args.batch,
            "rounds": args.rounds,
            "calls": args.calls,
            "compiler_options": xla_cpu.compiler_options(),
            "shapes": rows,
        },
    )


if __name__ == "__main__":
    main()
