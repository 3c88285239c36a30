"""Peak memory per image of the SD VAE's encode and decode at 256², 512², 1024², whole and tiled.

The SD VAE architecture (83.65M float32 parameters, random: memory does not depend on the values),
one image, on the CPU. Each configuration runs in a subprocess of its own, so nothing of another
leaks into its numbers. Two measures:

- `compiled`: XLA's `memory_analysis()` of each program the call runs, compiled as
  `eqx.filter_jit` compiles it (nothing allocated): `temp_mib` the program's scratch memory (the
  activations), and `peak_mib` = weights + the whole input and output + the largest program's
  scratch, input and output (tiled: the largest tile's; the blended tiles of one row are small beside
  it). Cheap enough for every size.
- `measured` (sizes up to `--run_max`): the call run once, the subprocess's `ru_maxrss` (resident
  peak, which includes JAX's runtime, the weights and the compiler's own memory) against its value
  just before the call (weights on the device).

Tiling is diffusers' (`eqxdiff.nn.vae_tiling`, tiles of the config's sample_size, 512): an image of
512² or less is not tiled, so `tiled` equals `whole` there. Prints one JSON line, the machine record
first (benchmarks/harness.py).

    python benchmarks/bench_vae_memory.py                    # 256 512 1024; runs up to 512
    python benchmarks/bench_vae_memory.py --run_max 0        # compiled figures only
"""

import argparse
import json
import resource
import subprocess
import sys
import time

from eqxdiff import xla_cpu

xla_cpu.enable()  # as train/encode.py and train/sample.py run (YNNPACK off)

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from eqxdiff.nn import AutoencoderKL  # noqa: E402
from eqxdiff.nn.vae_tiling import OVERLAP, decode_in_pieces, encode_in_pieces  # noqa: E402
from harness import report  # noqa: E402  (benchmarks/ is on sys.path)

SD_VAE = {
    "block_out_channels": [128, 256, 512, 512],
    "layers_per_block": 2,
    "latent_channels": 4,
    "norm_num_groups": 32,
    "sample_size": 512,
    "scaling_factor": 0.18215,
    "down_block_types": ["DownEncoderBlock2D"] * 4,
    "up_block_types": ["UpDecoderBlock2D"] * 4,
}
MIB = 2**20


def tile_sizes(size: int, tile: int) -> list[int]:
    """The tile extents diffusers' loop visits along one axis of `size` (stride tile·(1 - overlap))."""
    return sorted({min(tile, size - start) for start in range(0, size, int(tile * (1 - OVERLAP)))})


def programs(op: str, size: int, tiled: bool, tile: int, f: int) -> list[tuple[int, int]]:
    """The (height, width) of the inputs the call's programs see: the whole image or latent, or each tile shape."""
    whole = size if op == "encode" else size // f
    t = tile if op == "encode" else tile // f
    sides = tile_sizes(whole, t) if tiled and whole > t else [whole]
    return [(h, w) for h in sides for w in sides]


def child(op: str, size: int, tiled: bool, run: bool) -> dict:
    abstract = eqx.filter_eval_shape(AutoencoderKL, SD_VAE, key=jax.random.key(0))
    params, static = eqx.partition(abstract, lambda x: isinstance(x, jax.ShapeDtypeStruct))
    weights = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
    f, channels = abstract.downsample_factor, 3 if op == "encode" else 4

    def call(params, x):
        vae = eqx.combine(params, static)
        return vae.encode_moments(x) if op == "encode" else vae.decode(x)

    analyses = []
    for h, w in programs(op, size, tiled, abstract.tile_sample_size, f):
        x = jax.ShapeDtypeStruct((1, h, w, channels), jnp.float32)
        m = jax.jit(call).lower(params, x).compile().memory_analysis()
        analyses.append(
            {
                "shape": [h, w],
                "temp_mib": m.temp_size_in_bytes / MIB,
                "io_mib": (m.argument_size_in_bytes - weights + m.output_size_in_bytes) / MIB,
            }
        )
    side_in, side_out = (size, size // f) if op == "encode" else (size // f, size)
    whole_io = (side_in**2 * channels + side_out**2 * (8 if op == "encode" else 3)) * 4 / MIB
    largest = max(a["temp_mib"] + a["io_mib"] for a in analyses)
    out = {
        "op": op,
        "size": size,
        "tiled": tiled,
        "programs": len(analyses),
        "temp_mib": round(max(a["temp_mib"] for a in analyses), 1),
        "peak_mib": round(weights / MIB + whole_io + largest, 1),
    }
    if run:
        draw = np.random.default_rng(0).uniform(-0.05, 0.05, 2**20 + 7).astype(np.float32)
        vae = jax.tree.map(lambda s: jnp.asarray(np.resize(draw, s.shape)), abstract)
        x = jnp.asarray(np.random.default_rng(1).uniform(-1, 1, (1, side_in, side_in, channels)).astype(np.float32))
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        started = time.perf_counter()
        fn = encode_in_pieces if op == "encode" else decode_in_pieces
        result = fn(vae, x, tiling=tiled)
        jax.block_until_ready(result)
        out["seconds"] = round(time.perf_counter() - started, 1)  # compile included
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        out |= {"rss_before_mib": round(before), "rss_peak_mib": round(peak), "rss_call_mib": round(peak - before)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[256, 512, 1024])
    parser.add_argument("--run_max", type=int, default=512, help="run (and measure ru_maxrss) sizes up to this")
    parser.add_argument("--child", nargs=4, metavar=("OP", "SIZE", "TILED", "RUN"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        op, size, tiled, run = args.child
        print(json.dumps(child(op, int(size), tiled == "1", run == "1")))
        return
    rows = []
    for size in args.sizes:
        for op in ("encode", "decode"):
            for tiled in (False, True):
                run = size <= args.run_max and not (tiled and size <= SD_VAE["sample_size"])  # tiled = whole there
                cmd = [sys.executable, __file__, "--child", op, str(size), str(int(tiled)), str(int(run))]
                done = subprocess.run(cmd, capture_output=True, text=True, check=True)
                rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
                print(rows[-1], file=sys.stderr)
    report("vae_memory", {"vae": "SD (83.65M, float32, random)", "batch": 1, "rows": rows})


if __name__ == "__main__":
    main()
