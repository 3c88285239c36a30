"""`--xla_cpu auto`: the XLA:CPU switches chosen on this machine, by timing the run's own step.

Which workarounds pay off depends on the CPU (BENCHMARKS.md, "XLA:CPU switches": the conv-gradient
matmuls sped one 2-core box's step up 1.6× and slowed the next box's by a tenth; YNNPACK's kernels lost
to XLA's own on one box and not on another). So on a CPU mesh the
step is compiled under each set of `candidates` (the shipped one is the step the run already built),
each runs `steps` steps on a copy of the state with a zero batch, and the fastest wins. The choice is
stored in a JSON file (beside the persistent compile cache when there is one, else in the run
directory) keyed by the CPU, JAX's version and the step's shapes, so the next run of this step on
this machine starts with it and times nothing. All processes take process 0's choice (their programs
must match). Costs: one compile and a few steps per candidate, once, and the state's memory twice
while a candidate runs.
"""

import hashlib
import json
import time
from pathlib import Path

import jax
import numpy as np
from jax.experimental import multihost_utils
from tqdm import tqdm

from eqxdiff import xla_cpu
from eqxdiff.paths import as_path, is_url, write_whole

FILE = "xla_cpu_choice.json"


def candidates(on: frozenset[str]) -> dict[str, frozenset[str]]:
    """The sets timed, around `on` (the run's shipped set, `xla_cpu.shipped(remat)`): as shipped, none, with the
    conv-gradient matmuls (they won on the box they were tuned on), with YNNPACK, without the channel sums as
    matmuls (they tied on the small digits step)."""
    return {"on": on, "off": frozenset(), "on_with_conv_grad_matmul": on | {"conv_grad_matmul"},
            "on_with_ynnpack": on - {"no_ynnpack"}, "on_without_channel_sum_matmul": on - {"channel_sum_matmul"}}  # fmt: skip


def machine() -> dict:
    """What the choice is valid for: the CPU (model, vector flags, cores) and JAX's version."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    field = lambda name: next((line.split(":", 1)[1].strip() for line in lines if line.startswith(name)), "")  # noqa: E731
    simd = sorted(f for f in field("flags").split() if f.startswith(("avx", "amx", "fma", "sse4")))
    return {"cpu": field("model name"), "simd": simd, "cores": len(jax.devices("cpu")), "jax": jax.__version__}


def step_key(abstract_state, batch_spec: dict, frozen, mesh_shape: dict, extra: dict) -> str:
    """A fingerprint of what the step computes: the state's, batch's and frozen towers' shapes and
    dtypes, the mesh, the step's options (`extra`: precision, remat, accumulation), and the machine."""
    shapes = jax.tree.map(lambda x: (tuple(x.shape), str(x.dtype)), (abstract_state, batch_spec, frozen),
                          is_leaf=lambda x: hasattr(x, "shape"))  # fmt: skip
    text = json.dumps([str(jax.tree.structure(shapes)), jax.tree.leaves(shapes), mesh_shape, extra, machine()],
                      default=str)  # fmt: skip
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def target(cfg, abstract_state, batch_spec: dict, frozen, mesh) -> tuple[Path, str, dict] | None:
    """(the choice file, this step's key, the candidate sets) for a run's Config on a CPU mesh; None elsewhere
    (nothing to choose)."""
    if mesh.devices.flat[0].platform != "cpu":
        return None
    folder = as_path(cfg.compilation_cache_dir or cfg.run_dir)  # a local folder or a bucket's prefix
    extra = {"precision": cfg.precision, "remat": cfg.remat, "grad_accum_steps": cfg.grad_accum_steps}
    key = step_key(abstract_state, batch_spec, frozen, dict(mesh.shape), extra)
    return folder / FILE, key, candidates(xla_cpu.shipped(cfg.remat))


def cached(path: Path, key: str, sets: dict) -> str | None:
    """The candidate of `sets` stored for `key` in process 0's file, None when there is none (or it is
    unreadable); switched on when found."""
    names = list(sets)
    index = -1
    if jax.process_index() == 0:
        try:
            entry = json.loads(path.read_text()).get(key) or {}
        except (OSError, ValueError):
            entry = {}
        index = names.index(entry["choice"]) if entry.get("choice") in sets else -1
    index = int(multihost_utils.broadcast_one_to_all(np.int32(index)))
    if index < 0:
        return None
    xla_cpu.enable(sets[names[index]], process_flags=False)
    return names[index]


def _store(path: Path, key: str, entry: dict) -> None:
    try:
        table = json.loads(path.read_text())
    except (OSError, ValueError):
        table = {}
    table[key] = entry
    if not is_url(path):  # a bucket has no folders to make
        path.parent.mkdir(parents=True, exist_ok=True)
    write_whole(path, json.dumps(table, indent=1))  # a reader never sees half a file


def _zero_batch(batch_spec: dict, sharding) -> dict:
    return {k: jax.make_array_from_callback(s.shape, sharding, lambda idx, s=s: np.zeros(s.shape, s.dtype)[idx])
            for k, s in batch_spec.items()}  # fmt: skip


def _seconds(step, state, batch, frozen, steps: int) -> float:
    """Seconds of `steps` steps after one untimed one, on a copy of `state` (the step donates it)."""
    state = jax.tree.map(lambda x: x.copy() if isinstance(x, jax.Array) else x, state)
    state, metrics = step(state, batch, frozen)
    jax.block_until_ready(metrics)
    start = time.perf_counter()
    for _ in range(steps):
        state, metrics = step(state, batch, frozen)
    jax.block_until_ready((state, metrics))
    return time.perf_counter() - start


def choose(build_step, shipped_step, state, batch_spec: dict, frozen, path: Path, key: str, sets: dict,
           steps: int = 3):  # fmt: skip
    """Time the step under each candidate set of `sets` (`build_step()` builds one under the switches on when it
    is called; `shipped_step` is the one built under "on"), switch the fastest on, store it under `key`
    and return (its name, its step). Process 0's timings decide for every process."""
    sharding = shipped_step.batch_sharding
    batch, start, seconds, built = _zero_batch(batch_spec, sharding), time.perf_counter(), {}, {}
    for name, switches in sets.items():
        with xla_cpu.only(switches):
            built[name] = shipped_step if name == "on" else build_step()
            built[name].compile(state, batch, frozen)
        seconds[name] = _seconds(built[name], state, batch, frozen, steps)
    names = list(sets)
    best = names[int(multihost_utils.broadcast_one_to_all(np.int32(np.argmin([seconds[n] for n in names]))))]
    xla_cpu.enable(sets[best], process_flags=False)  # later traces (sampling grids) follow the choice
    step_ms = {n: round(1000 * s / steps, 2) for n, s in seconds.items()}
    if jax.process_index() == 0:
        _store(path, key, {"choice": best, "step_ms": step_ms, "switches": sorted(sets[best]),
                           "date": time.strftime("%Y-%m-%d"), **machine()})  # fmt: skip
        tqdm.write(f"--xla_cpu auto: {best} (step ms {step_ms}; {time.perf_counter() - start:.0f} s to measure; "
                   f"stored in {path})")  # fmt: skip
    return best, built[best]
