"""What every benchmark here shares: the machine record printed with its figures, the timing loops,
and runs of the train scripts in fresh processes.

- `report(bench, result)` prints the one JSON line: `{"bench": ..., **machine_record(), **result}`.
  The record holds the date, the CPU, the JAX devices, package versions and the box's fp32 2048²
  matmul rate right then: on a shared box the speed changes by the hour, so a figure without it
  does not compare with another day's.
- `steps_in_flight` runs a training step as train/main.py's loop does (at most 2 in flight);
  `call_seconds` times back-to-back calls; `compile_and_first_call` times both apart; `alternate`
  runs timed rounds of several sides in turn, so drift hits each alike; `rates` turns two sides'
  round seconds into items/s and their ratios; `param_count` counts a model's parameters.
- `peer_report` is `report` for a run against a torch peer (benchmarks/torch_peer.py).
- `run_script` / `run_logs` run `train/*.py` as a user would and read its run directory.

JAX is imported inside the functions that need it: a benchmark that drives train scripts in
subprocesses loads it only for the record, and tests can load a benchmark by path.
"""

import datetime
import importlib.metadata
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("jax", "jaxlib", "equinox", "eqxdiff", "numpy")
MATMUL = "from eqxdiff.training.metrics import measured_cpu_matmul_flops as m; print(m() / 1e9)"


def version(name: str) -> str | None:
    """An installed distribution's version, or None."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def cpu_model() -> str | None:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or None
    return next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), None)


def cpu_simd_flags() -> list[str]:
    """The CPU's vector-unit flags (/proc/cpuinfo, as lscpu shows them): what XLA:CPU's and the
    libraries' kernels can use, so two boxes with one model name still compare."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return []
    flags = next((line.split(":", 1)[1].split() for line in lines if line.startswith("flags")), [])
    return sorted(f for f in flags if f.startswith(("avx", "amx", "fma", "f16c", "sse4", "vnni")))


def matmul_gflops() -> float:
    """The box's speed now: the best of 5 jitted fp32 2048² matmuls (GFLOP/s), as train/main.py's MFU
    measures its peak. In a fresh process: the measurement is cached per process, and the caller's
    JAX (simulated devices, compiler options) stays as it is."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    out = subprocess.run([sys.executable, "-c", MATMUL], env=env, capture_output=True, text=True, check=True).stdout
    return round(float(out), 1)


def machine_record(packages: Iterable[str] = PACKAGES) -> dict:
    import jax

    return {
        "date": datetime.date.today().isoformat(),
        "machine": platform.machine(),
        "cpu": cpu_model(),
        "cpu_simd_flags": cpu_simd_flags(),
        "cpu_count": os.cpu_count(),
        "jax_devices": f"{jax.devices()[0].device_kind} x{jax.device_count()}",
        "versions": {p: version(p) for p in packages},
        "matmul_2048_fp32_gflops": matmul_gflops(),
    }


def report(bench: str, result: dict, packages: Iterable[str] = PACKAGES) -> dict:
    """Print the benchmark's one JSON line: its name, the machine record, then its own figures; return it."""
    record = {"bench": bench, **machine_record(packages), **result}
    print(json.dumps(record), flush=True)
    return record


def peer_report(bench: str, peer_python: str, peer_info: dict, unit: str, result: dict) -> None:
    """`report` for a side-by-side run against a torch peer (benchmarks/torch_peer.py): the peer's python,
    threads, attention kernel (if it says) and versions, then `result`, then how to read its ratios."""
    peer = {
        "python": peer_python,
        "threads": peer_info["threads"],
        **({"attention": peer_info["attention"]} if "attention" in peer_info else {}),
        **peer_info["versions"],
    }
    note = f"ratio = eqxdiff / torch {unit}/s (> 1 favours eqxdiff); rounds alternate, one side at a time"
    report(bench, {"torch_peer": peer, **result, "note": note})


def steps_in_flight(step: Callable, state, batches: Iterable, *extra):
    """`state, metrics = step(state, batch, *extra)` over `batches` as train/main.py's loop runs it:
    after dispatching step i, block on step i-1's loss (at most 2 in flight); then block on the
    last. Returns (state, last metrics)."""
    import jax

    previous = metrics = None
    for batch in batches:
        state, metrics = step(state, batch, *extra)
        if previous is not None:
            jax.block_until_ready(previous["loss"])
        previous = metrics
    jax.block_until_ready((state, metrics))
    return state, metrics


def param_count(tree) -> int:
    """Elements in the arrays of a pytree (an Equinox module, a flax params dict)."""
    import equinox as eqx
    import jax

    return int(sum(x.size for x in jax.tree.leaves(tree) if eqx.is_array(x)))


def call_seconds(calls: int, fn: Callable, *args) -> float:
    """Wall seconds of `calls` calls of `fn(*args)`, each blocked on before the next."""
    import jax

    start = time.perf_counter()
    for _ in range(calls):
        jax.block_until_ready(fn(*args))
    return time.perf_counter() - start


def compile_and_first_call(fn, *args) -> tuple[object, dict]:
    """(output, {"eqxdiff_compile_s", "eqxdiff_first_call_s"}) of a jitted `fn`: `.lower().compile()`
    timed apart from the first call (the warm-up)."""
    import jax

    start = time.perf_counter()
    fn.lower(*args).compile()
    compile_s = time.perf_counter() - start
    start = time.perf_counter()
    out = jax.block_until_ready(fn(*args))
    first_s = time.perf_counter() - start
    return out, {"eqxdiff_compile_s": round(compile_s, 3), "eqxdiff_first_call_s": round(first_s, 3)}


def alternate(sides: dict[str, Callable[[], float]], rounds: int, rotate: bool = False) -> dict[str, list[float]]:
    """Each round runs every side once, in order (`rotate`: round r starts at the r-th side, so that with
    as many rounds as sides each runs once in every position, after every other); a side returns its
    round's seconds."""
    seconds = {name: [] for name in sides}
    names = list(sides)
    for r in range(rounds):
        shift = r % len(names) if rotate else 0
        for name in names[shift:] + names[:shift]:
            seconds[name].append(sides[name]())
    return seconds


def rates(seconds: dict[str, list[float]], items_per_round: int, unit: str) -> dict:
    """Per side `{side}_{unit}_per_s` (items·rounds / summed seconds) and its rounds; with two sides
    (eqxdiff, peer) `ratio` = eqxdiff / peer and `paired_ratio_median`, the median over rounds of
    eqxdiff's rate / the peer round right after it (less sensitive to load drifting over the run)."""
    out = {}
    for side, s in seconds.items():
        if s:
            out[f"{side}_{unit}_per_s"] = round(items_per_round * len(s) / sum(s), 3)
            out[f"{side}_round_{unit}_per_s"] = [round(items_per_round / t, 3) for t in s]
    if len(seconds) == 2 and all(seconds.values()):
        ours, peer = seconds
        out["ratio"] = round(out[f"{ours}_{unit}_per_s"] / out[f"{peer}_{unit}_per_s"], 3)
        paired = [t / e for e, t in zip(seconds[ours], seconds[peer])]
        out["paired_ratio_median"] = round(statistics.median(paired), 3)
    return out


def run_script(name: str, *args, checkout: Path = ROOT, quiet: bool = True) -> float:
    """`python train/NAME ARGS` in a fresh process, the checkout's eqxdiff first on its path; its
    wall seconds (start to exit)."""
    env = dict(os.environ, PYTHONPATH=str(checkout))
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, str(checkout / "train" / name), *map(str, args)],
        cwd=checkout,
        env=env,
        capture_output=quiet,
        text=True,
    )
    if done.returncode:  # what the script said, kept from a quiet run: its last lines name the error
        raise RuntimeError(
            f"train/{name} {' '.join(map(str, args))} exited {done.returncode}:\n"
            + "\n".join((done.stderr or "").splitlines()[-5:])
        )
    return time.perf_counter() - start


def run_logs(run_dir: Path) -> tuple[list[dict], dict]:
    """A train/main.py run directory's metrics.jsonl rows and run.json (its start-up figures)."""
    rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return rows, json.loads((Path(run_dir) / "run.json").read_text())
