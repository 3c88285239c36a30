"""What the UNet costs on a user's own images on this machine: seconds per training step of
train/main.py's default model (`--model unet`) on a folder of RGB images at 16², 32² and 64²,
batch 16, with the README's own-data flags (`--dataset folder:... --image_size S --hflip`).

Each size runs train/main.py as a user would, `--steps N` with `--log_every N/2`, sampling and
wandb off, in a fresh run directory; the step time is metrics.jsonl's `train/step_time_ms` of the
second window (past the compile and every warm-up), the process start to the first step is
run.json's `startup/time_to_first_step_s` (mostly the step's compile). The folder holds the digits
upscaled to 32×32 RGB PNGs in class sub-folders (benchmarks/readme_examples.py), resized to each
size as the folder source does: the pixels do not change a step's cost. The box's fp32 matmul rate
(2048², best of 5) is measured before and after each round (`matmul_gflops_rounds`), so a slower or
busier box shows; with `--repeats R` the sizes run R rounds and each size's best round is reported
(other work on a shared box only slows a step). Prints one JSON line, the machine record first
(benchmarks/harness.py).

    python benchmarks/unet_own_images.py [--sizes 16 32 64 --batch 16 --steps 20 --repeats 2]
"""

import argparse
import tempfile
from pathlib import Path

from harness import matmul_gflops, report, run_logs, run_script  # benchmarks/ is on sys.path when run as a script
from readme_examples import rgb_digits_folder


def unet_step(folder: Path, size: int, batch: int, steps: int, work: Path, repeat: int) -> dict:
    run_dir = work / f"unet_{size}_{repeat}"
    wall = run_script(
        "main.py",
        "--dataset",
        f"folder:{folder}",
        "--image_size",
        size,
        "--hflip",
        "--batch_size",
        batch,
        "--run_dir",
        run_dir,
        "--steps",
        steps,
        "--log_every",
        steps // 2,
        "--sample_every",
        0,
        "--wandb",
        "disabled",
    )
    rows, startup = run_logs(run_dir)
    step_s = rows[-1]["train/step_time_ms"] / 1000
    flops = startup["startup/step_flops_per_device"]
    return {
        "step_s": round(step_s, 3),
        "images_per_s": round(batch / step_s, 1),
        "achieved_gflops": round(flops / step_s / 1e9, 1),
        "first_step_s": round(startup["startup/time_to_first_step_s"], 1),
        "wall_s": round(wall, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[16, 32, 64])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=1, help="rounds over the sizes (a shared box: the best counts)")
    args = parser.parse_args()
    matmul = [matmul_gflops()]
    results = {f"{s}x{s}": [] for s in args.sizes}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        folder = rgb_digits_folder(work / "images")
        for repeat in range(args.repeats):  # sizes alternated, so load that comes and goes hits each alike
            for s in args.sizes:
                results[f"{s}x{s}"].append(unet_step(folder, s, args.batch, args.steps, work, repeat))
            matmul.append(matmul_gflops())
    best = {size: min(runs, key=lambda r: r["step_s"]) for size, runs in results.items()}
    report(
        "unet_own_images",
        {
            "matmul_gflops_rounds": matmul,
            "model": "unet",
            "batch": args.batch,
            "steps": args.steps,
            "best": best,
            "all_step_s": {k: [r["step_s"] for r in v] for k, v in results.items()},
        },
    )


if __name__ == "__main__":
    main()
