"""Start-up cost of a JAX process here: `import ml_dtypes` alone, `train/main.py --help`, and the
same under the tests' jaxtyping import hook with and without importing the dependencies first
(tests/typechecked.py), each a fresh subprocess, alternated over rounds; CPU seconds (user+sys).

    python benchmarks/bench_startup.py --out /tmp/startup.json [--rounds 5]

Writes JSON: per variant the median CPU and wall seconds, and the ml_dtypes version.
"""

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HOOK_ONLY = (
    "import runpy, sys; from jaxtyping import install_import_hook; sys.argv = sys.argv[1:]; "
    "sys.path.insert(0, 'train'); h = install_import_hook('eqxdiff', 'beartype.beartype'); "
    "runpy.run_path(sys.argv[0], run_name='__main__')"
)
VARIANTS = {
    "import ml_dtypes": [sys.executable, "-c", "import ml_dtypes"],
    "main.py --help": [sys.executable, "train/main.py", "--help"],
    "hook, dependencies imported inside it": [sys.executable, "-c", HOOK_ONLY, "train/main.py", "--help"],
    "hook, dependencies imported first (tests/typechecked.py)": [
        sys.executable, "tests/typechecked.py", "train/main.py", "--help"
    ],
}  # fmt: skip


def timed(cmd: list[str]) -> tuple[float, float]:
    """(CPU seconds of the child, wall seconds)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime), wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    import ml_dtypes

    samples = {name: [] for name in VARIANTS}
    for _ in range(args.rounds):
        for name, cmd in VARIANTS.items():
            samples[name].append(timed(cmd))
    result = {"ml_dtypes": ml_dtypes.__version__, "rounds": args.rounds}
    for name, runs in samples.items():
        result[name] = {"cpu_s": statistics.median(c for c, _ in runs), "wall_s": statistics.median(w for _, w in runs)}
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
