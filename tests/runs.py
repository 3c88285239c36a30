"""Helpers for tests that run `train/main.py` (and friends) as subprocesses."""

import importlib.util
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import equinox as eqx
import jax
import numpy as np
import orbax.checkpoint as ocp
from safetensors.numpy import save_file

ROOT = Path(__file__).parent.parent
# A tiny conditional UNet on digits: the smallest step that runs every path (one level, 16 channels).
TINY = [
    "--model",
    "unet_tiny",
    "--batch_size",
    "16",
    "--warmup_steps",
    "4",
    "--sample_every",
    "0",
    "--log_every",
    "1",
    "--wandb",
    "disabled",
]


# The reference job of the resume and multi-host tests: 24 steps with checkpoints at 6, 12, 18
# and 24 (3 kept), FSDP over 2 devices; one process × 8 devices (conftest's `eight_device_run`)
# is what a resumed or a 2-process run must reproduce.
REFERENCE_STEPS = 24
REFERENCE = [*TINY, "--steps", REFERENCE_STEPS, "--ckpt_every", 6, "--fsdp_size", 2]


# A class-conditional run on latents (the digits through space_to_depth:2), of another schedule and σ_data than the
# defaults: tests/run/test_rebuild.py's, and tests/scripts/test_bucket.py's on latents in a bucket (the same step
# program: the second loads it from the persistent compile cache).
LATENT_RUN = [*TINY, "--steps", 2, "--schedule", "vp_cosine", "--sigma_data", 0.7]


def script_module(path: str):
    """The Python file at `path` (relative to the repository: a benchmarks/ or tools/ script, not a package),
    imported as a module named by its stem."""
    spec = importlib.util.spec_from_file_location(Path(path).stem, ROOT / path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def command(script: str, *args) -> list[str]:
    """`python train/<script> args`, run under the jaxtyping import hook (tests/typechecked.py)."""
    return [sys.executable, "-u", str(ROOT / "tests" / "typechecked.py"), str(ROOT / "train" / script), *map(str, args)]


def run(script: str, *args, timeout: float = 600) -> subprocess.CompletedProcess:
    result = subprocess.run(command(script, *args), cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    return result


def launch_local(*args, timeout: float = 600) -> subprocess.CompletedProcess:
    """`python train/launch_local.py args` under the plain interpreter: the launcher imports no eqxdiff and starts
    its processes without the import hook whatever runs it, so `run`'s hook would only import its dependencies
    (~1.5 s of CPU) for nothing checked."""
    cmd = [sys.executable, "-u", str(ROOT / "train" / "launch_local.py"), *map(str, args)]
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    return result


def train_here(*args, features_fn=None) -> None:
    """train/main.py's own parse_config and main in this process: the test process's 8 devices, jit
    caches and import hook, without a process start. Runs that must be processes of their own
    (killed, resumed, several processes, the persistent compile cache) go through `run`."""
    import train_scripts  # noqa: F401 — train/ on sys.path: the caller is a test of the scripts
    import main as train_main

    train_main.main(train_main.parse_config([*map(str, args)]), features_fn=features_fn)


class Started(subprocess.Popen):
    """A Popen whose merged stdout/stderr is read as it comes (tqdm writes no newlines), into
    `output()`; `finish(timeout)` waits and returns (returncode, all output)."""

    def __init__(self, cmd, **kwargs):
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        super().__init__(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, **kwargs)
        self._chunks: list[bytes] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        while chunk := os.read(self.stdout.fileno(), 65536):
            self._chunks.append(chunk)

    def output(self) -> str:
        return b"".join(self._chunks).decode(errors="replace")

    def finish(self, timeout: float) -> tuple[int, str]:
        self.wait(timeout=timeout)
        self._reader.join(timeout=10)
        self.stdout.close()
        return self.returncode, self.output()


def start(script: str, *args) -> Started:
    return Started(command(script, *args))


def wait_for(condition, proc: Started, timeout: float = 300) -> None:
    """Poll `condition()` until true; fail if `proc` exits first or time runs out."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert proc.poll() is None, f"exited {proc.returncode} first:\n" + proc.output()[-4000:]
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def kill(proc: Started) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.finish(timeout=30)


def committed(run_dir: Path) -> list[int]:
    root = run_dir / "checkpoints"
    return sorted(int(p.parent.name) for p in root.glob("*/commit_success.txt") if p.parent.name.isdigit())


def metric_rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def assert_finite_training(rows: list[dict]) -> None:
    """Every logged step trained: a finite loss (a non-finite one is logged as null or NaN) and no
    skipped (non-finite) step in the window before it."""
    for r in rows:
        loss = r.get("train/loss")
        assert isinstance(loss, float) and np.isfinite(loss) and r["train/bad_steps"] == 0, r


def last_logged_step(run_dir: Path) -> int:
    """The newest step in metrics.jsonl while a run may be writing it (a torn line is skipped)."""
    path, steps = run_dir / "metrics.jsonl", [0]
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            steps.append(json.loads(line)["step"])
        except json.JSONDecodeError:
            continue
    return steps[-1]


def saved_arrays(run_dir: Path, step: int, parts: tuple[str, ...] = ()) -> dict[str, np.ndarray]:
    """Every array of the checkpointed state, by path, as host numpy (no target: plain dicts). `parts`: the state's
    fields to read ("model", "ema"), the others left unread (orbax's partial restore: each array is a read of its
    own, and an Adam run's optimizer holds half of them); empty: all."""
    import jax

    path = run_dir / "checkpoints" / str(step) / "state"
    checkpointer = ocp.PyTreeCheckpointer()
    saved = checkpointer.metadata(path).item_metadata.tree
    if parts:
        assert set(parts) <= saved.keys(), f"{parts} not all among the state's fields {sorted(saved)}"
        saved = {part: saved[part] for part in parts}
    as_numpy = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), saved)
    restore = ocp.args.PyTreeRestore(saved if parts else None, restore_args=as_numpy, partial_restore=bool(parts))
    tree = checkpointer.restore(path, args=restore)
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return {jax.tree_util.keystr(path): np.asarray(x) for path, x in flat}


def assert_bitwise_equal(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> None:
    assert a.keys() == b.keys()
    different = [k for k in a if a[k].tobytes() != b[k].tobytes()]
    assert not different, f"{len(different)} of {len(a)} arrays differ, e.g. {different[:3]}"


def random_clip_folder(folder: Path, config: dict, seed: int = 7) -> Path:
    """A transformers CLIPTextModel folder of `config` with random weights drawn in numpy (a random
    CLIPTextModel.from_config takes seconds of small eager ops): config.json and model.safetensors, keys
    "text_model." + our leaf names, each tensor in torch's layout (a Dense weight transposed: (out, in)),
    as SD's text_encoder/ holds them."""
    from eqxdiff.nn import CLIPTextModel
    from eqxdiff.nn.torch_weights import leaf_layouts

    config = {"model_type": "clip_text_model", **config}
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config))
    abstract = eqx.filter_eval_shape(CLIPTextModel.from_config, config, key=jax.random.key(0))
    leaves = [x for x in jax.tree.leaves(abstract) if isinstance(x, jax.ShapeDtypeStruct)]
    rng, state = np.random.default_rng(seed), {}
    for (name, perm), leaf in zip(leaf_layouts(abstract).items(), leaves, strict=True):
        ours = rng.normal(0, 0.2 if leaf.ndim == 2 else 0.1, leaf.shape)
        ours += "layer_norm" in name and name.endswith(".weight")  # LayerNorm gains near 1
        state[f"text_model.{name}"] = np.ascontiguousarray(np.transpose(ours, np.argsort(perm)), np.float32)
    save_file(state, str(folder / "model.safetensors"))
    return folder
