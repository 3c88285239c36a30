"""load_dit(..., place=, dtype=) reads each leaf straight into its FSDP sharding over the 8 test
devices, in bfloat16 cast slice by slice; benchmarks/bench_dit_load.py's memory property (the load
adds about one model to the resident peak, not one per device) at DiT-S/2 size (slow)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors import safe_open

from eqxdiff.pretrained import load_dit
from eqxdiff.sharding import make_mesh, placement, state_shardings

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "tests" / "data" / "dit"
MIN_SIZE = 64  # the fixture's leaves are small: shard all but the biases and norms' rows


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_leaves_land_in_their_fsdp_shardings_with_the_files_values(dtype):
    mesh = make_mesh(data=-1, fsdp=8)
    model = load_dit(DATA / "ema.safetensors", num_heads=2, place=placement(mesh, MIN_SIZE), dtype=dtype)
    leaves = [x for x in jax.tree.leaves(model) if eqx.is_array(x)]
    expected = [s for s in jax.tree.leaves(state_shardings(model, mesh, MIN_SIZE)) if s is not None]
    assert all(x.sharding.is_equivalent_to(s, x.ndim) for x, s in zip(leaves, expected, strict=True))
    assert sum(not x.sharding.is_fully_replicated for x in leaves) >= 10  # most weights are sharded
    assert {x.dtype for x in leaves} == {jnp.dtype(dtype)}
    with safe_open(str(DATA / "ema.safetensors"), framework="numpy") as f:
        fc1 = f.get_tensor("blocks.1.mlp.fc1.weight").T  # torch's [out, in]
    assert not model.blocks[1].fc1.weight.sharding.is_fully_replicated
    np.testing.assert_array_equal(np.asarray(model.blocks[1].fc1.weight), fc1.astype(dtype))
    with np.load(DATA / "reference.npz") as ref:
        out = eqx.filter_jit(lambda m, *a: m(*a))(model, *(jnp.asarray(ref[k]) for k in ("x", "t", "y")))
        error = np.abs(np.asarray(out, np.float32) - ref["out"]).max() / np.abs(ref["out"]).max()
    assert error <= (1e-4 if dtype == jnp.float32 else 0.05)  # bf16 weights and activations


@pytest.mark.slow
def test_sharded_load_adds_about_one_model_to_the_peak_not_one_per_device():
    """The benchmark at DiT-S/2 (33M parameters), fresh processes, float32 and bfloat16: the arrays
    add < 2 models of anonymous memory (measured 1.09, 1.14; all leaves replicated, 6.8) and the
    peak < 4.5 models (measured 2.1, 3.2, the file's pages mapped while read; replicated 7.7, 8.8). Without the
    benchmark's sampling after the load (--sample_steps 0: half the test's CPU time, a DiT sampler's compile): the
    sharded model's outputs are checked against the reference above."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "bench_dit_load.py"),
            "--shapes",
            "DiT-S/2 256",
            "--sample_steps",
            "0",
        ],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT / "benchmarks",
    )
    runs = json.loads(out.stdout.strip().splitlines()[-1])["runs"]
    assert [r["dtype"] for r in runs] == ["float32", "bfloat16"]
    for run in runs:
        assert run["sharded_fraction"] > 0.99 and run["params"] == 32_865_056
        assert run["anon_added_over_model"] < 2.0 and run["added_over_model"] < 4.5, run
