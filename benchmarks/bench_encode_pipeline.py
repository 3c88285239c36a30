"""train/encode.py end to end vs the bare jitted encode: does the pipeline keep up with the VAE?

The real SD VAE architecture (block_out_channels [128, 256, 512, 512], 83,653,863 params) with
random weights, written without torch as a diffusers folder (config.json + float32
diffusion_pytorch_model.safetensors, keys and shapes from tests/data/autoencoder_kl/
full_size_shapes.json), and N random uint8 images in an `npz:` source, in a temporary folder.

    python benchmarks/bench_encode_pipeline.py                 # 64², 128 images, batch 16
    python benchmarks/bench_encode_pipeline.py --sizes 64,256  # also 256² (16 images, batch 4)
    python benchmarks/bench_encode_pipeline.py --quick         # smoke: 16 images at 64², batch 8

Per size, in one process, one device:
- bare: train/encode.py's own jitted `encode_uint8` (uint8 -> [-1, 1] -> `vae.encode` -> float16
  moments) on the same images, already on the device in batches of `--batch`; each call blocks
  on its output; compiled and warmed up first. images/s = N / wall time of the pass.
- encode.py: its `main(parse_config([...]))` called in-process with `--dataset npz:FILE --vae
  FOLDER --out <fresh dir> --image_size S --batch_size B --shard_size N/4`. A first (cold) run
  compiles `encode_uint8` and is not counted; later runs hit that compile cache (the same
  function, same shapes). Two figures per warm run: `loop` = the rate encode.py itself reports
  (images / seconds from its first batch read to its last shard written: host reads, device_put
  prefetch, encode, float16 copy back, record serialisation, shard writes; timed here, unrounded,
  by wrapping its progress bar, which opens and closes right next to its own clock), and `main` = N /
  wall time of the whole `main()` call (adds the VAE load from disk, the sha256 of its weights for
  meta.json, the source open and meta.json writes: fixed costs that shrink with N).
Passes alternate: bare, encode.py, bare, encode.py, ... (`--rounds`). Ratios are encode.py /
bare; the issue's target is loop >= 0.9. stdout gets one JSON line; encode.py's output goes to stderr.
"""

import argparse
import contextlib
import io
import json
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import jax
import numpy as np
from safetensors.numpy import save_file
from tqdm import tqdm

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "train"))
import encode as encode_script  # noqa: E402  (train/encode.py)

from eqxdiff.nn import AutoencoderKL  # noqa: E402
from harness import PACKAGES, report  # noqa: E402  (benchmarks/ is on sys.path)

SHAPES = REPO / "tests" / "data" / "autoencoder_kl" / "full_size_shapes.json"


def write_sd_vae(folder: Path, seed: int) -> None:
    """Random float32 SD VAE weights by diffusers' state_dict names: N(0, 1/fan_in) weights,
    GroupNorm scales around 1, small biases (the tests' recipe, tests/nn/test_autoencoder_kl.py)."""
    full = json.loads(SHAPES.read_text())["sd"]
    rng = np.random.default_rng(seed)
    state = {}
    for key, shape in full["shapes"].items():
        fan_in = int(np.prod(shape[1:])) if len(shape) > 1 else 0
        scale = 1 / np.sqrt(fan_in) if fan_in else 0.1
        base = 1.0 if key.endswith("weight") and len(shape) == 1 else 0.0
        state[key] = (base + scale * rng.standard_normal(shape, np.float32)).astype(np.float32)
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(full["config"]))
    save_file(state, str(folder / "diffusion_pytorch_model.safetensors"))


def bare_pass(vae, device_batches: list) -> float:
    start = time.perf_counter()
    for images in device_batches:
        jax.block_until_ready(encode_script.encode_uint8(vae, images))
    return time.perf_counter() - start


class TimedBar(tqdm):
    """encode.py's progress bar, recording when it opens and closes: encode.py starts its own
    clock right after opening it and stops it right after closing it, so the interval is the
    one behind its printed images/s (which it rounds to 0.1)."""

    opened = closed = 0.0

    def __init__(self, *args, **kwargs):
        TimedBar.opened = time.perf_counter()
        super().__init__(*args, **kwargs)

    def close(self):
        super().close()
        TimedBar.closed = time.perf_counter()


encode_script.tqdm = TimedBar


def encode_py_pass(argv: list[str]) -> tuple[float, float, float]:
    """(wall seconds of main(), seconds of its encode loop, the images/s encode.py printed)."""
    printed = io.StringIO()
    start = time.perf_counter()
    with contextlib.redirect_stdout(printed):
        encode_script.main(encode_script.parse_config(argv))
    wall = time.perf_counter() - start
    print(printed.getvalue(), file=sys.stderr, end="")
    return wall, TimedBar.closed - TimedBar.opened, float(re.search(r"([0-9.]+) images/s", printed.getvalue()).group(1))


def run_size(args, tmp: Path, folder: Path, size: int, count: int, batch: int) -> dict:
    rng = np.random.default_rng(args.seed + size)
    images = rng.integers(0, 256, (count, size, size, 3), dtype=np.uint8)
    source = tmp / f"images_{size}.npz"
    np.savez(source, images=images)

    vae = AutoencoderKL.from_diffusers(folder)
    device_batches = [jax.device_put(images[i : i + batch]) for i in range(0, count, batch)]
    start = time.perf_counter()
    jax.block_until_ready(encode_script.encode_uint8(vae, device_batches[0]))
    compile_s = time.perf_counter() - start

    def argv(run: str) -> list[str]:
        out = tmp / f"latents_{size}_{run}"
        return [
            f"--dataset=npz:{source}",
            f"--vae={folder}",
            f"--out={out}",
            f"--image_size={size}",
            f"--batch_size={batch}",
            f"--shard_size={max(1, count // 4)}",
        ]

    cold_wall, cold_loop, _ = encode_py_pass(argv("cold"))
    bare_s, main_s, loop_s, printed = [], [], [], []
    for r in range(args.rounds):
        bare_s.append(bare_pass(vae, device_batches))
        wall, loop, rate = encode_py_pass(argv(f"warm{r}"))
        main_s.append(wall)
        loop_s.append(loop)
        printed.append(rate)

    bare, loop_rates, main_rates = ([count / s for s in seconds] for seconds in (bare_s, loop_s, main_s))
    result = {
        "size": size,
        "images": count,
        "batch": batch,
        "rounds": args.rounds,
        "bare_compile_plus_first_call_s": round(compile_s, 3),
        "encode_py_cold": {"main_s": round(cold_wall, 3), "loop_s": round(cold_loop, 3)},
        "bare_images_per_s": round(count * args.rounds / sum(bare_s), 3),
        "bare_round_images_per_s": [round(b, 3) for b in bare],
        "encode_py_loop_images_per_s": round(count * args.rounds / sum(loop_s), 3),
        "encode_py_loop_round_images_per_s": [round(lr, 3) for lr in loop_rates],
        "encode_py_printed_images_per_s": printed,
        "encode_py_main_images_per_s": round(count * args.rounds / sum(main_s), 3),
        "encode_py_main_round_images_per_s": [round(m, 3) for m in main_rates],
        "ratio_loop_over_bare": round(sum(bare_s) / sum(loop_s), 3),
        "ratio_main_over_bare": round(sum(bare_s) / sum(main_s), 3),
        "paired_ratio_loop_median": round(statistics.median(lr / b for lr, b in zip(loop_rates, bare)), 3),
    }
    print(json.dumps(result), file=sys.stderr, flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="64", help="comma-separated image sizes (64 and/or 256)")
    parser.add_argument("--images_64", type=int, default=128)
    parser.add_argument("--batch_64", type=int, default=16)
    parser.add_argument("--images_256", type=int, default=16)
    parser.add_argument("--batch_256", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2, help="alternating bare / encode.py passes")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="smoke run: 16 images at 64², batch 8, one round")
    args = parser.parse_args()
    if args.quick:
        args.sizes, args.images_64, args.batch_64, args.rounds = "64", 16, 8, 1
    sizes = [int(s) for s in args.sizes.split(",")]
    plan = {s: (args.images_64, args.batch_64) if s <= 64 else (args.images_256, args.batch_256) for s in sizes}

    with tempfile.TemporaryDirectory(prefix="bench_encode_pipeline_") as tmp:
        tmp = Path(tmp)
        folder = tmp / "sd_vae"
        write_sd_vae(folder, args.seed)
        results = [run_size(args, tmp, folder, s, *plan[s]) for s in sizes]

    report(
        "encode_pipeline",
        {
            "vae": "SD VAE architecture, random fp32 weights",
            "quick": args.quick,
            "results": results,
            "note": "ratio = encode.py / bare images/s; target loop ratio >= 0.9",
        },
        (*PACKAGES, "grain"),
    )


if __name__ == "__main__":
    main()
