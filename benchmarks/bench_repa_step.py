"""REPA's cost on the CPU (BENCHMARKS.md "REPA's cost"): train/main.py's step (its `prepare` and `loss_fn`) on a small
class-conditional DiT/2 over 32×32×3 images, side by side in one process, timed rounds alternating:

- `plain`: the denoising loss alone (--repa_weight 0);
- `repa`: + λ·REPA's loss, the clean images' DINOv2 patch tokens computed in the step by a frozen tower (random
  weights shaped as facebook/dinov2-small by default) at 224² (16² tokens: the DiT's 16² patches), and REPA's
  projector (width 2048) on the tokens after block `--block`;
- `repa_features`: the same with the features read from the batch, as train/encode.py --repa_encoder writes them
  beside latents: the projector and the loss alone.

    python benchmarks/bench_repa_step.py [--batch 8 --rounds 3 --steps 3 --tower small]
"""

import argparse
import functools
import time

import jax
import numpy as np

from eqxdiff import xla_cpu
from eqxdiff.diffusion import EDMPreconditioning, EDMSchedule
from eqxdiff.nn import DiT, Dinov2Model
from eqxdiff.run.conditions import Labels
from eqxdiff.sharding import batch_sharding, make_mesh, state_shardings
from eqxdiff.training import abstract_train_state, adamw_cosine, create_train_state, make_train_step
from eqxdiff.training.repa import dinov2_targets, with_projector
from harness import alternate, param_count, report  # benchmarks/ is on sys.path when run as a script
from unconditional_edm import train_main  # train/main.py (the module puts train/ on sys.path)

# transformers' Dinov2Config of facebook/dinov2-{small,base} (hidden, layers, heads); patch 14, 518² positions
TOWERS = {"small": (384, 12, 6), "base": (768, 12, 12)}
SIDE = 224  # DINOv2's input: 16² patches of 14², one per DiT token (32² images, patch 2)


def variant(name: str, args, mesh, tower):
    """(step, state, batch, frozen) of one side: the same network and data, REPA off, in the step or read."""
    schedule, parameterization = EDMSchedule(), EDMPreconditioning(0.5)
    repa = name != "plain"
    prepare = functools.partial(
        train_main.prepare, condition=Labels(10), schedule=schedule, cond_dropout=0.1, repa_side=SIDE if repa else 0
    )
    loss_fn = functools.partial(
        train_main.loss_fn, schedule=schedule, parameterization=parameterization, repa_weight=0.5 if repa else 0.0
    )

    def make_model(key):
        return DiT(32, 2, 3, args.hidden, args.depth, args.heads, num_classes=10, key=key)

    if repa:
        width = tower.layernorm.weight.shape[0]
        make_model = with_projector(make_model, block=args.block, z_dim=width, projector_dim=2048)
    frozen = {"repa_encoder": tower} if name == "repa" else None
    optimizer = adamw_cosine(1e-4, 10**6, 0, 0.0)[0]
    abstract, shardings = abstract_train_state(make_model, optimizer, mesh, 2**14)
    frozen_shardings = None if frozen is None else state_shardings(frozen, mesh, 2**14)
    step = make_train_step(
        prepare=prepare,
        loss_fn=loss_fn,
        optimizer=optimizer,
        lr_schedule=lambda s: 1e-4,
        ema_decay=0.999,
        state_shardings=shardings,
        batch_sharding=batch_sharding(mesh),
        seed=0,
        frozen_shardings=frozen_shardings,
    )
    state, _ = create_train_state(make_model, optimizer, jax.random.key(0), mesh, 2**14, shardings=shardings)
    rng = np.random.default_rng(0)
    batch = {"image": rng.integers(0, 256, (args.batch, 32, 32, 3), np.uint8)}
    batch["label"] = rng.integers(0, 10, args.batch).astype(np.int32)
    if name == "repa_features":  # what train/encode.py stores: the tower's tokens of these images, float16
        features = tower_targets(tower, batch["image"])
        batch["repa_features"] = np.asarray(features, np.float16)
    batch = jax.device_put(batch, batch_sharding(mesh))
    frozen = None if frozen is None else jax.device_put(frozen, frozen_shardings)
    return step, state, batch, frozen, param_count(state.model)


@jax.jit
def tower_targets(tower, images):
    return dinov2_targets(tower, images.astype(np.float32), SIDE)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=192, help="the DiT's width (DiT-S: 384)")
    parser.add_argument("--depth", type=int, default=6)
    parser.add_argument("--heads", type=int, default=3)
    parser.add_argument("--block", type=int, default=2, help="REPA's aligned block (round(depth·8/28) = 2 of 6)")
    parser.add_argument("--tower", default="small", choices=sorted(TOWERS))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per round and side")
    args = parser.parse_args()
    xla_cpu.enable()  # as train/main.py
    mesh = make_mesh(1, 1, jax.devices()[:1])
    hidden, layers, heads = TOWERS[args.tower]
    config = {"model_type": "dinov2", "hidden_size": hidden, "num_hidden_layers": layers,
              "num_attention_heads": heads, "image_size": 518, "patch_size": 14}  # fmt: skip
    tower = Dinov2Model.from_config(config, key=jax.random.key(1), interpolate_offset=0.1)
    names = ("plain", "repa", "repa_features")
    runs = {name: list(variant(name, args, mesh, tower)) for name in names}
    losses = {}
    for name, (step, state, batch, frozen, _) in runs.items():  # compile + warm up
        for _ in range(2):
            state, metrics = step(state, batch, frozen)
        losses[name] = float(metrics["loss"])
        runs[name][1] = state

    def step_seconds(name: str) -> float:
        step, state, batch, frozen, _ = runs[name]
        start = time.perf_counter()
        for _ in range(args.steps):
            state, metrics = step(state, batch, frozen)
        jax.block_until_ready(metrics["loss"])
        runs[name][1] = state
        return (time.perf_counter() - start) / args.steps

    times = alternate({name: functools.partial(step_seconds, name) for name in names}, args.rounds, rotate=True)
    median = {name: float(np.median(t)) for name, t in times.items()}
    report(
        "repa_step",
        {
            "batch": args.batch,
            "dit": dict(hidden=args.hidden, depth=args.depth, heads=args.heads, patch=2, image=32, block=args.block),
            "tower": f"dinov2-{args.tower} (random weights), {SIDE}²",
            "trained_params": {name: runs[name][4] for name in names},
            "tower_params": param_count(tower),
            "step_ms_median": {name: round(1e3 * s, 1) for name, s in median.items()},
            "step_ms_rounds": {name: [round(1e3 * s, 1) for s in t] for name, t in times.items()},
            "ratio_repa_over_plain": round(median["repa"] / median["plain"], 3),
            "ratio_repa_features_over_plain": round(median["repa_features"] / median["plain"], 3),
            "loss_after_warmup": {name: round(v, 4) for name, v in losses.items()},
        },
    )


if __name__ == "__main__":
    main()
