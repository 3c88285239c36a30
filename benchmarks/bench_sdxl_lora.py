"""SDXL's UNet at full size (2.567B parameters, random values) loaded in bf16 into FSDP over 8 devices,
then LoRA training steps with remat: bytes per device, peak RSS, load and step time.

    python benchmarks/bench_sdxl_lora.py                 # 8 simulated CPU devices, batch 8 at 32x32 latents
    python benchmarks/bench_sdxl_lora.py --folder DIR    # reuse (or keep) the random bf16 folder in DIR
    python benchmarks/bench_sdxl_lora.py --quick         # smoke: a tiny SDXL-like config, batch 8 at 16²

1. A diffusers UNet folder is written with random bf16 values (benchmarks/sd_unet_configs.py's SDXL base
   config; every weight ~ N(0, 1/fan_in), norm scales 1, biases 0), leaf by leaf into 1 GiB shards with an
   index as diffusers' `save_pretrained(max_shard_size=)` writes them: no float32 copy of the model exists.
2. `SDUNet.from_diffusers(folder, dtype=bfloat16, place=placement(mesh), remat=True)` reads each weight
   straight into its FSDP shard on `make_mesh(1, 8)` (`--xla_force_host_platform_device_count=8` on a CPU).
3. `add_lora` (rank `--rank`, the attention projections), the adapters in float32 and laid out by the same
   rules; `partition_lora` splits them from the base, which the step takes as its frozen argument
   (benchmarks/sd_train_steps.py: gradient, AdamW state and update only for the adapters).
4. `--steps` steps on latents [batch, 32, 32, 4] (bf16), SDXL's condition: context [batch, 77, 2048], pooled
   [batch, 1280] (bf16), time_ids for 256² crops of 256² images. Compile timed apart from the steps.

The step compiles as `train/main.py --remat` compiles it on a CPU (`xla_cpu.shipped(remat=True)`: with XLA:CPU's
default scheduler every gathered weight and kept activation stays live, and remat saves nothing). After compiling,
XLA's buffer plan for the step (per device; the 8 simulated devices share this host's memory, so 8 times it) must
fit in the host's available memory, else the script stops naming the plan.

One JSON line: bytes per device (each of the 8; the first device's shards) of the base, the adapters and the
optimizer state, XLA's buffer plan for the step (per device), peak RSS of the process, and the times.
"""

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from sd_unet_configs import SDXL_BASE_UNET

DEVICES = 8
WEIGHTS = "diffusion_pytorch_model"
SHARD_BYTES = 2**30
TINY = {
    **SDXL_BASE_UNET,
    "block_out_channels": [32, 64, 64],
    "norm_num_groups": 8,
    "attention_head_dim": [1, 2, 2],
    "cross_attention_dim": 64,
    "transformer_layers_per_block": [1, 1, 2],
    "addition_time_embed_dim": 8,
    "projection_class_embeddings_input_dim": 32 + 6 * 8,
}


def write_random_folder(config: dict, folder: Path, seed: int) -> dict:
    """A diffusers UNet folder of random bf16 weights in shards of at most SHARD_BYTES; the file layout (torch's
    shapes) comes from the abstract model. Returns {"params", "bytes", "shards", "write_s"}."""
    import equinox as eqx
    import jax
    import ml_dtypes
    from safetensors.numpy import save_file

    from eqxdiff.sd import SDUNet
    from eqxdiff.nn.torch_weights import leaf_layouts

    start = time.perf_counter()
    abstract = eqx.filter_eval_shape(SDUNet.from_config, config, key=jax.random.key(0))
    perms = leaf_layouts(abstract)
    leaves = [x for x in jax.tree.leaves(abstract) if isinstance(x, jax.ShapeDtypeStruct)]
    shapes = {}
    for (name, perm), leaf in zip(perms.items(), leaves, strict=True):
        torch_shape = [0] * leaf.ndim
        for i, p in enumerate(perm):
            torch_shape[p] = leaf.shape[i]
        shapes[name] = tuple(torch_shape)
    rng = np.random.default_rng(seed)
    groups, current, size = [], [], 0
    for name, shape in shapes.items():
        nbytes = 2 * int(np.prod(shape))
        if current and size + nbytes > SHARD_BYTES:
            groups.append(current)
            current, size = [], 0
        current.append(name)
        size += nbytes
    groups.append(current)
    folder.mkdir(parents=True, exist_ok=True)
    weight_map = {}
    for i, names in enumerate(groups):
        file = f"{WEIGHTS}-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        tensors = {}
        for name in names:
            shape = shapes[name]
            if len(shape) > 1:
                values = rng.standard_normal(shape, dtype=np.float32) / np.sqrt(np.prod(shape[1:]))
            else:
                values = np.full(shape, 1.0 if name.endswith("weight") else 0.0, np.float32)
            tensors[name] = values.astype(ml_dtypes.bfloat16)
            weight_map[name] = file
        save_file(tensors, str(folder / file), metadata={"format": "pt"})
        del tensors
    total = 2 * sum(int(np.prod(s)) for s in shapes.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / f"{WEIGHTS}.safetensors.index.json").write_text(json.dumps(index, indent=1))
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    params = sum(int(np.prod(s)) for s in shapes.values())
    return {"params": params, "bytes": total, "shards": len(groups), "write_s": round(time.perf_counter() - start, 3)}


def available_bytes() -> int:
    """MemAvailable of /proc/meminfo (Linux), else the physical memory."""
    try:
        line = next(ln for ln in Path("/proc/meminfo").read_text().splitlines() if ln.startswith("MemAvailable:"))
        return int(line.split()[1]) * 1024
    except (OSError, StopIteration):
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--folder",
        default="",
        help="the random bf16 folder: reused if it holds config.json, "
        "else written there and kept (default: a temporary one)",
    )
    parser.add_argument("--rank", type=int, default=4, help="LoRA rank")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--size", type=int, default=32, help="latent height and width")
    parser.add_argument("--steps", type=int, default=2, help="timed steps after compiling")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="smoke run: a tiny SDXL-like config at 16²")
    args = parser.parse_args()
    flag = f"--xla_force_host_platform_device_count={DEVICES}"
    if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flag}".strip()
    from eqxdiff import xla_cpu

    xla_cpu.enable(xla_cpu.shipped(remat=True))  # as train/main.py --remat (the memory-optimized scheduler); before JAX
    import jax
    import jax.numpy as jnp
    import optax

    from eqxdiff.nn import TextCond
    from eqxdiff.sd import SDUNet, SDXLCond, sdxl_time_ids
    from eqxdiff.nn.lora import add_lora, partition_lora
    from eqxdiff.sharding import HEAD_LAYOUT_RULES, batch_sharding, make_mesh, state_shardings
    from harness import report
    from sd_train_steps import bytes_per_device, make_step, memory_of, peak_rss, random_latents, tree_bytes

    if jax.device_count() != DEVICES:
        raise SystemExit(f"bench_sdxl_lora: {jax.device_count()} devices; XLA_FLAGS must give {flag} (or run on 8)")
    config = TINY if args.quick else SDXL_BASE_UNET
    if args.quick:
        args.size = 16
    mesh, min_size = make_mesh(1, DEVICES), 2**12
    # train/main.py --init's layout: FSDP by size, the attention output projections split along their output axis.
    layout = lambda tree: state_shardings(tree, mesh, min_size, rules=HEAD_LAYOUT_RULES, strict=False)  # noqa: E731
    mib = lambda n: round(n / 2**20, 1)  # noqa: E731
    with tempfile.TemporaryDirectory(prefix="bench_sdxl_") as tmp:
        folder = Path(args.folder).expanduser() if args.folder else Path(tmp) / "unet"
        written = None if (folder / "config.json").is_file() else write_random_folder(config, folder, args.seed)
        print(f"folder: {written or 'reused'}; peak RSS {mib(peak_rss())} MiB", file=sys.stderr, flush=True)
        rss_before_load = peak_rss()
        start = time.perf_counter()
        unet = SDUNet.from_diffusers(folder, dtype=jnp.bfloat16, place=layout, remat=True)
        jax.block_until_ready(unet)
        load_s = time.perf_counter() - start
    rss_after_load = peak_rss()
    print(f"loaded in {load_s:.1f} s; peak RSS {mib(rss_after_load)} MiB", file=sys.stderr, flush=True)

    key_lora, key_step = jax.random.split(jax.random.key(args.seed))
    adapters, base = partition_lora(add_lora(unet, args.rank, key=key_lora))
    adapters = jax.tree.map(lambda x: x.astype(jnp.float32), adapters)  # trained in float32, the base in bf16
    adapters = jax.device_put(adapters, layout(adapters))
    optimizer = optax.adamw(1e-4)
    opt_shardings = layout(jax.eval_shape(optimizer.init, adapters))
    opt_state = jax.jit(optimizer.init, out_shardings=opt_shardings)(adapters)

    rng = np.random.default_rng(args.seed)
    b, width, pooled_dim = args.batch, unet.context_dim, unet.add_input_dim - 6 * unet.addition_time_embed_dim
    on_batch = batch_sharding(mesh)
    put = lambda a, dtype: jax.device_put(jnp.asarray(a, dtype), on_batch)  # noqa: E731
    x0 = put(random_latents(rng, b, args.size), jnp.bfloat16)
    text = TextCond(
        put(rng.standard_normal((b, 77, width)), jnp.bfloat16),
        put(np.ones((b, 77)), jnp.int32),
        put(rng.standard_normal((b, pooled_dim)), jnp.bfloat16),
    )
    pixels = 8 * args.size
    cond = SDXLCond(text, put(sdxl_time_ids((pixels, pixels), (0, 0), (pixels, pixels), b), jnp.float32))

    start = time.perf_counter()
    step = make_step(optimizer)(adapters, opt_state, base, x0, cond, key_step)
    compile_s = time.perf_counter() - start
    plan = memory_of(step)
    print(
        f"compiled in {compile_s:.1f} s; peak RSS {mib(peak_rss())} MiB; XLA's plan {plan}", file=sys.stderr, flush=True
    )
    # 8 simulated devices share this host's memory: XLA's per-device plan, 8 times, must fit in what is free now.
    if DEVICES * (plan["temp_mib"] + plan["output_mib"]) * 2**20 > available_bytes():
        raise SystemExit(
            f"bench_sdxl_lora: the step plans {plan} MiB per device, {DEVICES} times more than the "
            f"{mib(available_bytes())} MiB this host has available; lower --batch or --size"
        )
    step_s, losses = [], []
    for i in range(args.steps):
        start = time.perf_counter()
        adapters, opt_state, loss = jax.block_until_ready(
            step(adapters, opt_state, base, x0, cond, jax.random.fold_in(key_step, i))
        )
        step_s.append(round(time.perf_counter() - start, 3))
        losses.append(float(loss))
        print(f"step {i}: {step_s[-1]} s, loss {losses[-1]:.4f}", file=sys.stderr, flush=True)

    report(
        "sdxl_lora_step_fsdp8",
        {
            "config": "quick (tiny SDXL-like)" if args.quick else "SDXL base unet/config.json",
            "params": sum(x.size for x in jax.tree.leaves(base)),
            "adapter_params": sum(x.size for x in jax.tree.leaves(adapters)),
            "mesh": dict(mesh.shape),
            "min_size": min_size,
            "rank": args.rank,
            "batch": b,
            "latent": [args.size, args.size, 4],
            "remat": True,
            "dtypes": {"base": "bfloat16", "adapters": "float32", "activations": "bfloat16"},
            "bytes": {
                "base_total": tree_bytes(base),
                "base_per_device": bytes_per_device(base),
                "adapters_total": tree_bytes(adapters),
                "adapters_per_device": bytes_per_device(adapters),
                "opt_state_total": tree_bytes(opt_state),
                "opt_state_per_device": bytes_per_device(opt_state),
            },
            "step_buffers_per_device": plan,
            "folder_written": written,
            "peak_rss_mib": {
                "before_load": mib(rss_before_load),
                "after_load": mib(rss_after_load),
                "end": mib(peak_rss()),
            },
            "load_s": round(load_s, 3),
            "compile_s": round(compile_s, 3),
            "step_s": step_s,
            "losses": losses,
        },
    )


if __name__ == "__main__":
    main()
