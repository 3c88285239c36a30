"""The default job end to end (`python train/main.py`, no flags), this checkout against another
revision, alternating runs on the same machine so drift hits both alike.

Each run is a fresh process in a fresh run directory, timed from start to exit (compile, sample
grids and checkpoints included); its final logged loss and the box's 2048² fp32 matmul rate
(measured between runs) are printed with it. The other revision is checked out with
`git worktree` into a temporary folder and runs with this checkout's Python environment.

    python benchmarks/bench_default_job.py --against c6f8982 --rounds 2
    python benchmarks/bench_default_job.py --rounds 3          # this checkout only
"""

import argparse
import statistics
import subprocess
import tempfile
from pathlib import Path

from harness import ROOT, matmul_gflops, report, run_logs, run_script  # benchmarks/ is on sys.path


def run_job(checkout: Path, run_dir: Path, extra: list[str]) -> dict:
    run_dir.mkdir(parents=True)  # made first: main.py asks whether a new folder beside a run is a typo of it
    wall = run_script("main.py", "--run_dir", run_dir, "--wandb", "disabled", *extra, checkout=checkout)
    rows, startup = run_logs(run_dir)
    last = rows[-1]
    return {
        "wall_s": round(wall, 1),
        "time_to_first_step_s": round(startup["startup/time_to_first_step_s"], 1),
        "final_loss": last["train/loss"],
        "step_time_ms": round(last["train/step_time_ms"], 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--against", default="", help="a git revision to run side by side (default: none)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--extra", default="", help="flags for every run, e.g. '--steps 100'")
    args = parser.parse_args()
    extra = args.extra.split()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        sides = {"this": ROOT}
        if args.against:
            other = tmp / "other"
            subprocess.run(
                ["git", "-C", str(ROOT), "worktree", "add", "--detach", str(other), args.against],
                check=True,
                capture_output=True,
            )
            sides[args.against] = other
        results = {name: [] for name in sides}
        try:
            for r in range(args.rounds):
                for name, checkout in sides.items():
                    gflops = matmul_gflops()
                    result = run_job(checkout, tmp / f"{name}-{r}", extra)
                    results[name].append(dict(result, matmul_gflops=gflops))
        finally:
            if args.against:
                subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(other)], check=False)
    walls = {name: [r["wall_s"] for r in rows] for name, rows in results.items()}
    report(
        "default_job",
        {"extra_flags": extra, "runs": results, "median_wall_s": {k: statistics.median(v) for k, v in walls.items()}},
    )


if __name__ == "__main__":
    main()
