"""FSDP memory: TrainState bytes per device at fsdp=8 against fsdp=1, on 8 simulated CPU devices.

Builds the real TrainState (model + EMA + AdamW moments + counters) with `create_train_state`
on a (data=1, fsdp=8) mesh and on a (data=8, fsdp=1) mesh, and measures the bytes actually
allocated on device 0: the sum of `shard.data.nbytes` over each array leaf's
`addressable_shards` on that device (not the PartitionSpec arithmetic, which is reported next to
it as a cross-check). No training step is compiled or run; only the state's init jit.
Target: fsdp8/fsdp1 <= 1/8 + 5% = 0.18. Prints one JSON line.

    python benchmarks/bench_fsdp_memory.py [--model unet_flaxdiff --min_size 4096]
    python benchmarks/bench_fsdp_memory.py --model dit_s      # DiT-S/2, 32x32x4, 1000 classes
    python benchmarks/bench_fsdp_memory.py --quick            # smoke run: a small UNet
"""

import jax

jax.config.update("jax_num_cpu_devices", 8)  # before any JAX op

import argparse  # noqa: E402
import gc  # noqa: E402

import equinox as eqx  # noqa: E402
import numpy as np  # noqa: E402

from eqxdiff import xla_cpu  # noqa: E402
from eqxdiff.nn import DiT, UNet  # noqa: E402
from eqxdiff.sharding import make_mesh  # noqa: E402
from eqxdiff.training import adamw_cosine, create_train_state  # noqa: E402
from harness import param_count, report  # noqa: E402  (benchmarks/ is on sys.path)

xla_cpu.enable()  # XLA:CPU workarounds on, as in train/main.py (eqxdiff/xla_cpu.py)

DEVICES = 8
TARGET = 1 / 8 + 0.05  # 0.175, "0.18"

MODELS = {
    "unet_flaxdiff": ("UNet.flaxdiff_simple(3)", lambda key: UNet.flaxdiff_simple(3, key=key)),
    "dit_s": ("DiT.small(32, 4, 2, num_classes=1000)", lambda key: DiT.small(32, 4, 2, num_classes=1000, key=key)),
    "unet_small": ("UNet(1, (32, 64), 2, num_classes=10)", lambda key: UNet(1, (32, 64), 2, num_classes=10, key=key)),
}


def measure(make_model, fsdp: int, min_size: int) -> dict:
    """Build the state on a (DEVICES // fsdp, fsdp) mesh; bytes really held by device 0 and by each device."""
    mesh = make_mesh(data=-1, fsdp=fsdp)
    optimizer, _ = adamw_cosine(1e-4, 1000, 10, 1e-4)
    state, _ = create_train_state(make_model, optimizer, jax.random.key(0), mesh, min_size)
    leaves = jax.tree.leaves(eqx.filter(state, eqx.is_array))
    jax.block_until_ready(leaves)
    devices = mesh.devices.flatten().tolist()
    device0 = jax.devices()[0]
    per_device = dict.fromkeys(devices, 0)
    spec_device0 = 0
    sharded = 0
    replicated_bytes = 0  # device 0's bytes in replicated leaves: the part FSDP cannot split
    big_replicated = []  # leaves >= min_size left replicated (no axis divisible by fsdp)
    for leaf in leaves:
        is_sharded = any(axis is not None for axis in leaf.sharding.spec)
        for shard in leaf.addressable_shards:
            per_device[shard.device] += shard.data.nbytes
            if shard.device == device0 and not is_sharded:
                replicated_bytes += shard.data.nbytes
        sharded += is_sharded
        if fsdp > 1 and not is_sharded and leaf.size >= min_size:
            big_replicated.append(list(leaf.shape))
        spec_device0 += int(np.prod(leaf.sharding.shard_shape(leaf.shape), dtype=np.int64)) * leaf.dtype.itemsize
    result = {
        "bytes_device0": per_device[device0],
        "bytes_device_max": max(per_device.values()),
        "bytes_device_min": min(per_device.values()),
        "spec_bytes_per_device": spec_device0,
        "total_bytes": sum(leaf.nbytes for leaf in leaves),
        "leaves": len(leaves),
        "sharded_leaves": sharded,
        "replicated_leaves": len(leaves) - sharded,
        "replicated_bytes_device0": replicated_bytes,
        "replicated_leaves_at_or_over_min_size": big_replicated,
        "params": param_count(state.model),
    }
    del state, leaves
    gc.collect()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="unet_flaxdiff", choices=sorted(MODELS))
    parser.add_argument("--min_size", type=int, default=2**12, help="leaves with fewer elements are replicated")
    parser.add_argument("--quick", action="store_true", help="smoke run: the small digits UNet")
    args = parser.parse_args()
    if args.quick:
        args.model = "unet_small"
    assert len(jax.devices()) == DEVICES, jax.devices()

    name, make_model = MODELS[args.model]
    fsdp1 = measure(make_model, 1, args.min_size)
    fsdp8 = measure(make_model, DEVICES, args.min_size)
    ratio = fsdp8["bytes_device0"] / fsdp1["bytes_device0"]
    mib = lambda b: round(b / 2**20, 3)  # noqa: E731
    report(
        "fsdp_memory",
        {
            "model": name,
            "params": fsdp1["params"],
            "state": "model + EMA + AdamW moments (clip_by_global_norm, adamw) + step/bad_steps",
            "min_size": args.min_size,
            "devices": DEVICES,
            "quick": args.quick,
            "fsdp1_mesh": {"data": DEVICES, "fsdp": 1},
            "fsdp8_mesh": {"data": 1, "fsdp": DEVICES},
            "total_state_mib": mib(fsdp1["total_bytes"]),
            "fsdp1_device0_mib": mib(fsdp1["bytes_device0"]),
            "fsdp8_device0_mib": mib(fsdp8["bytes_device0"]),
            "fsdp8_device_max_mib": mib(fsdp8["bytes_device_max"]),
            "fsdp8_device_min_mib": mib(fsdp8["bytes_device_min"]),
            "fsdp8_spec_per_device_mib": mib(fsdp8["spec_bytes_per_device"]),
            "fsdp1_device0_bytes": fsdp1["bytes_device0"],
            "fsdp8_device0_bytes": fsdp8["bytes_device0"],
            "total_state_bytes": fsdp1["total_bytes"],
            "ratio_fsdp8_vs_fsdp1": round(ratio, 4),
            "target_ratio": round(TARGET, 3),
            "meets_target": ratio <= TARGET,
            "leaves": fsdp8["leaves"],
            "fsdp8_sharded_leaves": fsdp8["sharded_leaves"],
            "fsdp8_replicated_leaves": fsdp8["replicated_leaves"],
            "fsdp1_sharded_leaves": fsdp1["sharded_leaves"],
            "fsdp8_replicated_device0_mib": mib(fsdp8["replicated_bytes_device0"]),
            "fsdp8_replicated_share_of_device0": round(fsdp8["replicated_bytes_device0"] / fsdp8["bytes_device0"], 4),
            "fsdp8_replicated_leaves_at_or_over_min_size": fsdp8["replicated_leaves_at_or_over_min_size"],
        },
    )


if __name__ == "__main__":
    main()
