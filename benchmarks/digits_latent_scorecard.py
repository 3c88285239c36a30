"""The default digits job in pixel space and in latent spaces, scored with the same scorecard.

    python benchmarks/digits_latent_scorecard.py --out /tmp/latent_scorecard.json [--steps 600] [--factors 1,2]
        [--small_model unet_flat]

The latent spaces are `space_to_depth:F` (8×8×1 digits -> (8/F)×(8/F)×F² latents; the decode is
exact), so a gap in the scores is the diffusion model's, not the autoencoder's. F = 1 stores the
images themselves (as float16) and runs the whole latent path (encode, posterior draw, scaling,
decode): its scores must be the pixel job's. F = 2 is a real 4× spatial compression: the same
UNet then sees 4×4 latents, and is
scored again as `--small_model` (default `unet_flat`, one level of 128 channels: a model for
inputs that small). Every run is the default job (`python train/main.py`, same seed,
steps and flags) with σ_data = 0.5 (these latents are the pixels rearranged, std unchanged);
each is sampled with `train/sample.py --num 500 --guidance 1` (no guidance, 50 per class) and scored
by `eqxdiff.eval.digits_sample_metrics`. Writes JSON: the machine record (benchmarks/harness.py),
then per space the scorecard, train wall time and final loss.
"""

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

from harness import ROOT, machine_record, run_logs, run_script  # benchmarks/ is on sys.path


def train_and_score(run_dir: Path, steps: int, extra: list) -> dict:
    from eqxdiff.eval import digits_sample_metrics

    train_s = run_script(
        "main.py",
        "--run_dir",
        run_dir,
        "--steps",
        steps,
        "--wandb",
        "disabled",
        "--sample_every",
        0,
        *extra,
        quiet=False,
    )
    run_script(
        "sample.py", "--run_dir", run_dir, "--num", 500, "--guidance", 1, "--out", run_dir / "s.npz", quiet=False
    )
    with np.load(run_dir / "s.npz") as saved:
        scores = digits_sample_metrics(saved["images"], saved["labels"])
    rows, _ = run_logs(run_dir)
    return {"scores": scores, "train_wall_s": train_s, "final_loss": rows[-1]["train/loss"], "flags": extra}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--factors", default="1,2", help="space_to_depth factors, comma-separated")
    parser.add_argument(
        "--small_model", default="unet_flat", help="also train F >= 2 latents with this model ('' : no)"
    )
    args = parser.parse_args()
    result = {"bench": "digits_latent_scorecard", **machine_record(), "steps": args.steps}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        result["pixels"] = train_and_score(tmp / "pixels", args.steps, [])
        for factor in map(int, args.factors.split(",")):
            latents = tmp / f"latents_{factor}"
            run_script(
                "encode.py", "--dataset", "digits", "--vae", f"space_to_depth:{factor}", "--out", latents, quiet=False
            )
            flags = ["--dataset", f"latents:{latents}", "--sigma_data", 0.5]
            result[f"space_to_depth:{factor}"] = train_and_score(tmp / f"run_{factor}", args.steps, flags)
            if factor >= 2 and args.small_model:
                result[f"space_to_depth:{factor} {args.small_model}"] = train_and_score(
                    tmp / f"run_{factor}_{args.small_model}", args.steps, [*flags, "--model", args.small_model]
                )
    Path(args.out).write_text(json.dumps(result, indent=1))
    for space, r in result.items():
        if isinstance(r, dict) and "scores" in r:
            print(space, {k: round(v, 3) for k, v in r["scores"].items()}, f"{r['train_wall_s']:.0f} s")


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))  # this checkout's eqxdiff scores, as its train scripts run
    main()
