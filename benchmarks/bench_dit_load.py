"""Peak host memory of loading the full DiT-XL/2 (675M parameters) straight into FSDP shardings over
8 simulated devices, in float32 and bfloat16, against the checkpoint's size.

A random state_dict with the official DiT-XL/2 256² shapes (tests/data/dit/official_shapes.json;
values N(0, 0.02²) — memory does not depend on them — and the official sin-cos `pos_embed`) is
written as float32 safetensors in a temporary folder. Each dtype loads in a fresh subprocess with 8
CPU devices: `load_dit(path, place=placement(make_mesh(data=-1, fsdp=8)), dtype=...)`. Its resident
peak (VmHWM: JAX's runtime, the devices' buffers, the file pages read) is reported against the file
size and the loaded model's size; "no full host copy per device" means the peak stays far below
8 × the model. The resident memory added, split after the load into
anonymous (the arrays: about one model) and file-backed (the checkpoint's pages read through
safetensors' mapping: page cache, up to one file), says where the peak goes. The child also
checks every leaf's sharding is `state_shardings`' FSDP one and a few leaves' values equal the file's,
and (float32) samples one image's latents from it by DiT's protocol (`--sample_steps` DDPM steps, cfg 1.5).

    python benchmarks/bench_dit_load.py                 # full XL/2
    python benchmarks/bench_dit_load.py --shapes "DiT-S/2 256"
"""

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from harness import ROOT, report  # benchmarks/ is on sys.path

SHAPES = ROOT / "tests" / "data" / "dit" / "official_shapes.json"
MIB = 2**20


def write_checkpoint(entry: str, path: Path) -> int:
    """A random float32 state_dict with the official shapes of `entry` at `path`; its byte size."""
    from safetensors.numpy import save_file

    from eqxdiff.nn.layers import sincos_pos_embed_2d

    shapes = json.loads(SHAPES.read_text())[entry]
    rng = np.random.default_rng(0)
    state = {k: (0.02 * rng.standard_normal(s, dtype=np.float32)) for k, s in shapes.items()}
    _, tokens, hidden = shapes["pos_embed"]
    state["pos_embed"] = sincos_pos_embed_2d(hidden, int(tokens**0.5)).astype(np.float32)[None]
    save_file(state, str(path))
    return path.stat().st_size


def peak_rss() -> int:
    """This process's resident peak in bytes: Linux's VmHWM (its own, unlike `ru_maxrss`, which a
    child starts with its parent's peak at the fork), else `ru_maxrss`."""
    status = Path("/proc/self/status")
    if status.is_file():
        line = next(ln for ln in status.read_text().splitlines() if ln.startswith("VmHWM:"))
        return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)


def rss_kinds() -> dict[str, float]:
    """Resident MiB now, by kind (Linux): anonymous (the arrays) and file-backed (the checkpoint's
    pages safetensors mapped in: page cache, given back under pressure); {} elsewhere."""
    status = Path("/proc/self/status")
    if not status.is_file():
        return {}
    fields = dict(ln.split(":", 1) for ln in status.read_text().splitlines() if ln.startswith(("RssAnon", "RssFile")))
    return {k: int(v.split()[0]) / 1024 for k, v in fields.items()}


def child(path: str, dtype: str, min_size: int, sample_steps: int) -> dict:
    """Load `path` onto an 8-device FSDP mesh in `dtype`; the peak RSS and the checks; in float32, then one
    image's latents by DiT's protocol (`sample_dit`, DDPM, cfg 1.5) in `sample_steps` steps."""
    import jax
    import jax.numpy as jnp
    from safetensors import safe_open

    from eqxdiff.pretrained import load_dit
    from eqxdiff.sharding import make_mesh, placement, state_shardings

    mesh = make_mesh(data=-1, fsdp=8)
    before, kinds_before = peak_rss(), rss_kinds()
    start = time.perf_counter()
    model = load_dit(path, place=placement(mesh, min_size), dtype=jnp.dtype(dtype))
    jax.block_until_ready(model)
    seconds = time.perf_counter() - start
    peak, kinds_after = peak_rss(), rss_kinds()
    leaves = [x for x in jax.tree.leaves(model) if isinstance(x, jax.Array)]
    expected = [s for s in jax.tree.leaves(state_shardings(model, mesh, min_size)) if s is not None]
    pairs = enumerate(zip(leaves, expected, strict=True))
    wrong = [i for i, (x, s) in pairs if not x.sharding.is_equivalent_to(s, x.ndim)]
    sharded = sum(x.nbytes for x in leaves if len(x.sharding.device_set) > 1 and not x.sharding.is_fully_replicated)
    assert not wrong and all(x.dtype == jnp.dtype(dtype) for x in leaves), (wrong, {x.dtype for x in leaves})
    last = len(model.blocks) - 1
    with safe_open(path, framework="numpy") as f:  # torch layouts: Dense weights are [out, in]
        checks = {
            "label_embed.weight": (model.label_embed.weight, f.get_tensor("y_embedder.embedding_table.weight")),
            "blocks[-1].fc2.weight": (model.blocks[-1].fc2.weight, f.get_tensor(f"blocks.{last}.mlp.fc2.weight").T),
            "blocks.3.ada.bias": (model.blocks[3].ada.bias, f.get_tensor("blocks.3.adaLN_modulation.1.bias")),
        }
        for name, (ours, theirs) in checks.items():
            assert ours.sharding.spec != jax.sharding.PartitionSpec() or ours.size < min_size, name
            np.testing.assert_array_equal(np.asarray(ours.astype(jnp.float32)), theirs.astype(dtype).astype(np.float32))
    sampled = {}
    if sample_steps and dtype == "float32":  # the loaded model runs: one image, sharded weights, cfg's doubled batch
        from eqxdiff.pretrained import sample_dit

        noise = jax.random.normal(jax.random.key(0), (1, model.image_size, model.image_size, model.in_channels))
        start = time.perf_counter()
        latents = np.asarray(
            sample_dit(
                model, jnp.array([207]), noise, steps=sample_steps, method="ddpm", guidance=1.5, key=jax.random.key(1)
            )
        )
        assert latents.shape == noise.shape and np.isfinite(latents).all() and latents.std() > 0
        sampled = dict(
            sample_steps=sample_steps, sample_s=time.perf_counter() - start, latents_std=float(latents.std())
        )
    return dict(
        dtype=dtype,
        baseline_mib=before / MIB,
        peak_mib=peak / MIB,
        load_s=seconds,
        **sampled,
        model_mib=sum(x.nbytes for x in leaves) / MIB,
        sharded_fraction=sharded / sum(x.nbytes for x in leaves),
        params=sum(x.size for x in leaves),
        leaves=len(leaves),
        anon_added_mib=kinds_after.get("RssAnon", np.nan) - kinds_before.get("RssAnon", np.nan),
        file_added_mib=kinds_after.get("RssFile", np.nan) - kinds_before.get("RssFile", np.nan),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="DiT-XL/2 256", help="an entry of official_shapes.json")
    parser.add_argument("--min_size", type=int, default=2**12, help="placement's: smaller leaves replicate")
    parser.add_argument("--sample_steps", type=int, default=2, help="then sample one image in this many DDPM steps")
    parser.add_argument("--child", nargs=2, metavar=("PATH", "DTYPE"), help=argparse.SUPPRESS)
    parser.add_argument("--write", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(*args.child, args.min_size, args.sample_steps)))
        return
    if args.write:
        print(write_checkpoint(args.shapes, args.write))
        return
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=8"
    path_env = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu", "PYTHONPATH": path_env}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "dit.safetensors"
        # Written by a child too: this process stays small, so nothing of the state_dict is in the loads' memory.
        write = [sys.executable, __file__, "--shapes", args.shapes, "--write", str(path)]
        size = int(subprocess.run(write, env=env, capture_output=True, text=True, check=True).stdout.split()[-1])
        runs = []
        for dtype in ("float32", "bfloat16"):
            command = [
                sys.executable,
                __file__,
                "--child",
                str(path),
                dtype,
                "--min_size",
                str(args.min_size),
                "--sample_steps",
                str(args.sample_steps),
            ]
            out = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
            if out.returncode:
                raise SystemExit(f"the {dtype} load failed:\n{out.stderr[-3000:]}")
            run = json.loads(out.stdout.strip().splitlines()[-1])
            run["peak_over_model"] = run["peak_mib"] / run["model_mib"]
            run["added_over_model"] = (run["peak_mib"] - run["baseline_mib"]) / run["model_mib"]
            run["anon_added_over_model"] = run["anon_added_mib"] / run["model_mib"]
            runs.append(run)
    report("dit_load", {"shapes": args.shapes, "file_mib": size / MIB, "devices": 8, "runs": runs})


if __name__ == "__main__":
    main()
