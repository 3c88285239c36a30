"""What text conditioning costs a training step: the same UNet trained class-conditional, on
captions encoded ahead of time (train/encode.py --encode_text), and on caption tokens encoded in
the step by a frozen CLIP text tower (the step's argument), alternated in one process.

    python benchmarks/bench_text_step.py [--image_size 32 --batch 16 --rounds 3 --steps 10]
    python benchmarks/bench_text_step.py --tower clip_l     # the frozen tower at CLIP-L/14 size (123M)

One device, fp32, train/main.py's `prepare`/`loss_fn` and eqxdiff/run/conditions.py's conditions, AdamW. The UNet is
(64, 128) channels, 2 blocks per level, attention at level 1 in all three (so the text steps
add only the cross-attention, the pooled projection and the text itself); the text models
cross-attend to 77 tokens of width 768 (CLIP-L's). The tower has random weights (speed does not
depend on them). Prints one JSON line: per variant the median step time over rounds and its
ratio to the class-conditional step.
"""

import argparse
import functools
import time

import jax
import numpy as np

from eqxdiff import xla_cpu
from eqxdiff.run.conditions import EncodedText, FrozenText, Labels
from eqxdiff.diffusion import EDMPreconditioning, EDMSchedule
from eqxdiff.nn import CLIPTextModel, TextCond, UNet
from eqxdiff.sharding import batch_sharding, make_mesh, state_shardings
from eqxdiff.text.conditioning import encode_tokens
from eqxdiff.training import abstract_train_state, adamw_cosine, create_train_state, make_train_step
from harness import alternate, param_count, report  # benchmarks/ is on sys.path when run as a script
from unconditional_edm import train_main  # train/main.py (the module puts train/ on sys.path)

TOKENS, WIDTH = 77, 768
TOWERS = {  # transformers CLIPTextConfig fields
    "clip_l": dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12),
    "small": dict(hidden_size=768, intermediate_size=768, num_hidden_layers=2, num_attention_heads=12),
}


def variant(name: str, args, mesh, tower):
    """(step, state, batches, frozen) for one variant."""
    cond = {"num_classes": 10} if name == "class" else {"context_dim": WIDTH, "pooled_dim": WIDTH}

    def make_model(key):
        return UNet(3, (64, 128), 2, (1,), key=key, **cond)

    optimizer, lr = adamw_cosine(2e-4, 10_000, 10)
    abstract, shardings = abstract_train_state(make_model, optimizer, mesh, 2**14)
    frozen = frozen_shardings = None
    if name == "in_step":
        frozen = {"text_encoder": tower, "null_cond": None}
        frozen_shardings = state_shardings(frozen, mesh, 2**14)
    # The conditions only inside the step: no tokenizer (text None); the in-step tower's null is in `frozen`.
    condition = Labels(10)
    if name == "encoded":
        condition = EncodedText(
            None,
            TextCond(
                np.zeros((1, TOKENS, WIDTH), np.float32),
                np.ones((1, TOKENS), np.int32),
                np.zeros((1, WIDTH), np.float32),
            ),
        )
    if name == "in_step":
        frozen["null_cond"] = jax.tree.map(lambda a: a[:1], tower_null(tower))
        condition = FrozenText(None, frozen["null_cond"])
    schedule = EDMSchedule()
    prepare = functools.partial(train_main.prepare, condition=condition, schedule=schedule, cond_dropout=0.1)
    loss_fn = functools.partial(train_main.loss_fn, schedule=schedule, parameterization=EDMPreconditioning())
    step = make_train_step(
        prepare=prepare,
        loss_fn=loss_fn,
        optimizer=optimizer,
        lr_schedule=lr,
        ema_decay=0.995,
        state_shardings=shardings,
        batch_sharding=batch_sharding(mesh),
        seed=0,
        frozen_shardings=frozen_shardings,
    )
    state, _ = create_train_state(make_model, optimizer, jax.random.key(0), mesh, 2**14, shardings=shardings)
    rng = np.random.default_rng(0)
    b = args.batch
    batch = {"image": rng.integers(0, 256, (b, args.image_size, args.image_size, 3), dtype=np.uint8)}
    mask = (np.arange(TOKENS)[None] < rng.integers(4, TOKENS, b)[:, None]).astype(np.int32)
    if name == "class":
        batch["label"] = rng.integers(0, 10, b).astype(np.int32)
    elif name == "encoded":
        batch.update(
            context=rng.normal(size=(b, TOKENS, WIDTH)).astype(np.float16),
            attention_mask=mask,
            pooled=rng.normal(size=(b, WIDTH)).astype(np.float16),
        )
    else:
        batch.update(input_ids=rng.integers(0, 49406, (b, TOKENS)).astype(np.int32), attention_mask=mask)
    batch = jax.device_put(batch, batch_sharding(mesh))
    frozen = None if frozen is None else jax.device_put(frozen, frozen_shardings)
    return step, state, batch, frozen


def tower_null(tower):
    """The tower's encoding of "" (bos, eos, padding)."""
    ids = np.full((1, TOKENS), 49407, np.int32)
    ids[0, 0] = 49406
    return encode_tokens(tower, {"input_ids": ids, "attention_mask": (np.arange(TOKENS) < 2).astype(np.int32)[None]})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--image_size", type=int, default=32)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10, help="timed steps per round and variant")
    parser.add_argument("--tower", default="small", choices=sorted(TOWERS), help="the frozen tower's size")
    args = parser.parse_args()
    xla_cpu.enable()  # as train/main.py, in main: bench_xla_cpu.py imports `variant` and sets its own switches
    mesh = make_mesh(1, 1, jax.devices()[:1])
    config = {"vocab_size": 49408, "max_position_embeddings": TOKENS, "eos_token_id": 49407, **TOWERS[args.tower]}
    tower = CLIPTextModel.from_config(config, key=jax.random.key(1))
    names = ("class", "encoded", "in_step")
    runs = {name: list(variant(name, args, mesh, tower)) for name in names}
    for name, (step, state, batch, frozen) in runs.items():  # compile + warm up
        for _ in range(2):
            state, metrics = step(state, batch, frozen)
        jax.block_until_ready(metrics["loss"])
        runs[name][1] = state

    def step_seconds(name: str) -> float:
        """Seconds per step over `--steps` steps of one variant."""
        step, state, batch, frozen = runs[name]
        start = time.perf_counter()
        for _ in range(args.steps):
            state, metrics = step(state, batch, frozen)
        jax.block_until_ready(metrics["loss"])
        runs[name][1] = state
        return (time.perf_counter() - start) / args.steps

    times = alternate({name: functools.partial(step_seconds, name) for name in names}, args.rounds)
    median = {name: float(np.median(t)) for name, t in times.items()}
    tower_params = param_count(tower)
    report(
        "text_step",
        {
            "image_size": args.image_size,
            "batch": args.batch,
            "tokens": TOKENS,
            "context_width": WIDTH,
            "tower": args.tower,
            "tower_params": int(tower_params),
            "step_ms": {k: round(1000 * v, 1) for k, v in median.items()},
            "ratio_to_class": {k: round(v / median["class"], 3) for k, v in median.items()},
            "rounds_ms": {k: [round(1000 * t, 1) for t in v] for k, v in times.items()},
        },
    )


if __name__ == "__main__":
    main()
