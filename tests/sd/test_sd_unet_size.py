"""The released UNets at full size without their weights, and SDUNet's remat: the benchmarks' SD 1.5 and SDXL
configs (benchmarks/sd_unet_configs.py) are diffusers' (parsed equal to the fixtures' and of its parameter
count), SDXL's 2.567B parameters lay out over an 8-device FSDP group at an eighth per device, and
`remat=True` changes the backward pass's memory, not its numbers."""

import gzip
import json
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from runs import script_module

from eqxdiff.nn import TextCond
from eqxdiff.sd import SDUNet
from eqxdiff.sd.unet_config import parse_config
from eqxdiff.sharding import make_mesh, state_shardings

ROOT = Path(__file__).parents[2]
DATA = ROOT / "tests" / "data" / "sd_unet"
configs = script_module("benchmarks/sd_unet_configs.py")
with gzip.open(DATA / "full_size_shapes.json.gz") as f:
    FULL = json.loads(f.read())


def test_benchmark_configs_are_the_released_ones():
    """The dicts the benchmarks build are the configs the fixtures took from diffusers (defaults filled in;
    SDXL's file says upcast_attention null, diffusers' default false: both off)."""

    def parsed(config: dict) -> dict:
        return {**parse_config(config), "upcast_attention": bool(config.get("upcast_attention"))}

    assert parsed(configs.SD15_UNET) == parsed(FULL["sd15"]["config"])
    assert parsed(configs.SDXL_BASE_UNET) == parsed(FULL["sdxl_base"]["config"])


def test_sdxl_shards_to_an_eighth_per_device():
    """SDXL's UNet in bf16 (abstract: nothing is allocated) over make_mesh(1, 8) with the training default
    min_size (2^12): every leaf that size or more is split 8 ways, and a device holds an eighth of the 5.1 GB
    and a little more (the replicated norms and biases)."""
    abstract = eqx.filter_eval_shape(SDUNet.from_config, configs.SDXL_BASE_UNET, key=jax.random.key(0))
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.bfloat16), abstract)
    leaves = jax.tree.leaves(abstract)
    assert sum(x.size for x in leaves) == 2_567_463_684
    shardings = jax.tree.leaves(state_shardings(abstract, make_mesh(1, 8), 2**12))
    per_device = [int(np.prod(s.shard_shape(x.shape))) * 2 for x, s in zip(leaves, shardings, strict=True)]
    for x, s in zip(leaves, shardings, strict=True):
        if x.size >= 2**12:
            assert len(s.device_set) == 8 and "fsdp" in s.spec, (x.shape, s.spec)
    total = sum(x.size for x in leaves) * 2
    assert total / 8 <= sum(per_device) < 1.005 * total / 8  # 1.0025: the replicated small leaves


def test_remat_recomputes_each_block_and_keeps_diffusers_output():
    """remat=True wraps each resnet and transformer in a checkpoint (in the gradient's program; none without), and
    the network it wraps is the same: the output equals diffusers' reference. That jax.checkpoint's gradient is
    the plain one is JAX's to keep; test_finetune's LoRA run trains with --remat."""
    ref = np.load(DATA / "sd1_like" / "reference.npz")
    x, t, cond = jnp.asarray(ref["x"]), jnp.asarray(ref["t"]), TextCond(jnp.asarray(ref["context"]), ref["mask"])

    def loss(unet):
        return jnp.mean(unet(x, t, cond) ** 2)

    # sd1_like (2 levels, 1 layer): down 2 resnets + 1 transformer, mid 2 + 1, up 4 + 2: 12 blocks.
    for remat in (False, True):
        unet = SDUNet.from_diffusers(DATA / "sd1_like", remat=remat)
        jaxpr = str(jax.make_jaxpr(eqx.filter_grad(loss))(unet))
        assert jaxpr.count("checkpoint") + jaxpr.count("remat") == (12 if remat else 0), remat
    out = eqx.filter_jit(lambda unet: unet(x, t, cond))(unet)
    np.testing.assert_allclose(out, ref["out"], rtol=0, atol=1e-4 * np.abs(ref["out"]).max())
