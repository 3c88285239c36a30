"""Text-to-image on CPU without pretrained weights: `python train/main.py --dataset captioned_digits`
(its text tower trained from scratch with the model), then samples for the dataset's 90 prompts
(each an ordered pair of different digits, "a 3 left of a 7", "seven then three", ...) scored by
the digits classifier on each 8×8 half (`eqxdiff.eval.two_digit_accuracy`), guided and unguided.

    python benchmarks/captioned_digits_job.py --out /tmp/captioned_digits.json [--steps 500] [--guidance 1,1.5,4]

The recipe (RECIPE below, docs/latent-and-text.md, "Text-to-image"): 500 steps of batch 128 with EDM's
training ln σ centred at 0 instead of -1.2: the order of the digits is learned where the noise hides the
image, and at -1.2 a 6-minute run ends before it is (BENCHMARKS.md "Text-to-image without weights").

Writes JSON: the machine record (benchmarks/harness.py), the training wall time (the whole main.py
process), its time to the first step, its logged step times (ms, one per 50 steps) and the fp32 matmul rate
it measured at start-up (GFLOP/s: the machine's speed then, which on a shared one varies from hour to hour),
final loss, and per guidance scale the fractions of samples whose left digit, right digit and both are the
prompted ones.
"""

import argparse
import json
import tempfile
from pathlib import Path

import numpy as np

from harness import machine_record, run_logs, run_script  # benchmarks/ is on sys.path

RECIPE = ("--batch_size", "128", "--edm_p_mean", "0.0")  # with --steps; --flags come after, so they win


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--guidance", default="1,1.5,4", help="guidance scales to sample at, comma-separated")
    parser.add_argument("--per_prompt", type=int, default=5, help="samples per prompt (90 prompts)")
    parser.add_argument("--run_dir", default="", help="keep the run here (default: a temporary folder)")
    parser.add_argument("--flags", default="", help="extra train/main.py flags, space-separated")
    args = parser.parse_args()
    from eqxdiff.data.captioned_digits import captioned_digits_prompts
    from eqxdiff.eval import two_digit_accuracy

    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(args.run_dir or tmp) / "run"
        wall = run_script(
            "main.py",
            "--run_dir",
            run_dir,
            "--dataset",
            "captioned_digits",
            "--steps",
            args.steps,
            "--wandb",
            "disabled",
            "--sample_every",
            0,
            *RECIPE,
            *args.flags.split(),
            quiet=False,
        )
        result = {
            "bench": "captioned_digits_job",
            **machine_record(),
            "steps": args.steps,
            "flags": " ".join([*RECIPE, *args.flags.split()]),
            "train_wall_s": wall,
        }
        rows, startup = run_logs(run_dir)
        result["final_loss"] = [r["train/loss"] for r in rows if "train/loss" in r][-1]
        result["step_time_ms"] = [round(r["train/step_time_ms"]) for r in rows if "train/step_time_ms" in r]
        result["time_to_first_step_s"] = startup["startup/time_to_first_step_s"]
        result["matmul_gflops"] = startup["startup/peak_flops_per_device"] / 1e9
        _, digits = captioned_digits_prompts(90, seed=0)
        for scale in args.guidance.split(","):
            out = run_dir / f"guidance_{scale}.npz"
            wall = run_script(
                "sample.py",
                "--run_dir",
                run_dir,
                "--num",
                90 * args.per_prompt,
                "--per_prompt",
                args.per_prompt,
                "--guidance",
                scale,
                "--out",
                out,
                quiet=False,
            )
            with np.load(out) as saved:
                scores = two_digit_accuracy(saved["images"], np.repeat(digits, args.per_prompt, axis=0))
            result[f"guidance_{scale}"] = {**scores, "sample_wall_s": wall}
            print(json.dumps({scale: result[f"guidance_{scale}"]}), flush=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
