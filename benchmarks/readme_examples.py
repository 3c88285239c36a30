"""What the documentation's train/main.py examples (README.md, docs/training.md) cost on this machine: seconds
per step of each, run as the page writes it (only shorter), and each one's ratio to the default job's step.

Each example runs `--steps N` with `--log_every N/2`, sampling and wandb off, in a fresh run
directory; its step time is metrics.jsonl's `train/step_time_ms` of the second window (the first
holds no compile, but the second is past every warm-up). The DiT example trains on a folder of
32×32 RGB PNGs (the digits upscaled, in class sub-folders), as `--dataset folder:... --image_size 32`
reads them, and so does the UNet's own-images example (batch 16, as the pages give it). The
default job runs first and last, so drift shows. Prints one JSON line.

    python benchmarks/readme_examples.py [--steps 40] [--dit_steps 4 --dit_batch 16]

The DiT runs a smaller batch by default (`--dit_batch`): on a CPU one step of the default 128 takes minutes.
"""

import argparse
import tempfile
from pathlib import Path

import numpy as np
from PIL import Image

EXAMPLES = {
    "default": [],
    "fsdp_8_cpu_devices": ["--cpu_devices", "8", "--fsdp_size", "4"],
    "bf16_remat_accum2": ["--precision", "bf16", "--remat", "--grad_accum_steps", "2"],
    "unet_folder_32": ["--image_size", "32", "--hflip", "--batch_size", "16"],  # + --dataset folder:
    "dit_s_folder_32": ["--image_size", "32", "--hflip", "--model", "dit_s"],  # + --dataset folder:, --dit_batch
}


def rgb_digits_folder(folder: Path, per_class: int = 30) -> Path:
    from eqxdiff.data import open_source

    digits = open_source("digits")
    for k in range(10):
        (folder / str(k)).mkdir(parents=True)
        for i in np.flatnonzero(digits.labels == k)[:per_class]:
            tile = Image.fromarray(digits.images[i, :, :, 0]).resize((32, 32), Image.Resampling.BICUBIC)
            tile.convert("RGB").save(folder / str(k) / f"{i}.png")
    return folder


def step_ms(args: list[str], steps: int, work: Path, name: str) -> dict:
    from harness import run_logs, run_script  # here: tests/test_readme_examples.py loads this file by path

    run_dir = work / name
    wall = run_script(
        "main.py",
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
        *args,
    )
    rows, _ = run_logs(run_dir)
    return {"step_ms": rows[-1]["train/step_time_ms"], "wall_s": round(wall, 1), "steps": steps}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--dit_steps", type=int, default=4)
    parser.add_argument("--dit_batch", type=int, default=16)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        folder = rgb_digits_folder(work / "digits32")
        results = {}
        for name, flags in [*EXAMPLES.items(), ("default_again", [])]:
            if "folder" in name:
                flags = [*flags, "--dataset", f"folder:{folder}"]
            if name.startswith("dit"):
                flags = [*flags, "--batch_size", str(args.dit_batch)]
            steps = args.dit_steps if name.startswith("dit") else args.steps
            results[name] = step_ms(flags, steps, work, name)
    base = (results["default"]["step_ms"] + results["default_again"]["step_ms"]) / 2
    for r in results.values():
        r["vs_default"] = round(r["step_ms"] / base, 2)
    results["dit_s_folder_32"]["batch_size"] = args.dit_batch
    from harness import report

    report("readme_examples", {"results": results})


if __name__ == "__main__":
    main()
