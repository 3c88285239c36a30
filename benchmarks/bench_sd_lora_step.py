"""A LoRA training step against the full fine-tune on an SD-family UNet: time and memory, one process,
alternating rounds.

The model: SD 1.5's UNet architecture (benchmarks/sd_unet_configs.py) at a fifth of its widths
(block_out_channels [64, 128, 256, 256], about 1/20 of its parameters; SD's 768-wide text context, 8
heads), random weights (`SDUNet.from_config`), float32, latents [batch, 32, 32, 4], context [batch, 77, 768].
Both sides take the same optimizer (AdamW), loss (`sd_train_steps.eps_loss`, diffusers' epsilon objective)
and hand-written step (`sd_train_steps.make_step`): `full` trains every parameter; `lora` wraps the attention
projections (to_q/to_k/to_v/to_out.0, diffusers' LoRA scripts' default) in rank-`--rank` adapters
(`add_lora`), trains only those and passes the base as the step's frozen argument (`partition_lora`).
The first step's loss is the same on both sides (the adapters start at B = 0): printed as a check.

    python benchmarks/bench_sd_lora_step.py                     # rank 4, batch 4, 3 rounds of 2 steps
    python benchmarks/bench_sd_lora_step.py --quick             # smoke: a tiny config at 16², one round

Memory: XLA's buffer plan of each compiled step (`memory_analysis`: temporaries = activations, gradients,
updates) and the trained parameters' and optimizer state's bytes; time: steps/s per side over the rounds,
each side's rounds alternating with the other's (benchmarks/harness.py `alternate`). stdout: one JSON line.
"""

import argparse
import sys
import time

import numpy as np

from harness import alternate, rates, report
from sd_train_steps import make_step, memory_of, random_latents, tree_bytes
from sd_unet_configs import SD15_UNET

FIFTH = {**SD15_UNET, "block_out_channels": [64, 128, 256, 256]}
TINY = {
    **SD15_UNET,
    "block_out_channels": [32, 64, 64, 64],
    "norm_num_groups": 8,
    "attention_head_dim": 2,
    "cross_attention_dim": 32,
    "layers_per_block": 1,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rank", type=int, default=4, help="LoRA rank (diffusers' LoRA script's default)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--size", type=int, default=32, help="latent height and width")
    parser.add_argument("--steps", type=int, default=2, help="steps per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="smoke run: a tiny config at 16², one round")
    args = parser.parse_args()
    from eqxdiff import xla_cpu

    xla_cpu.enable()  # as train/main.py
    import equinox as eqx
    import jax
    import optax

    from eqxdiff.nn import TextCond
    from eqxdiff.sd import SDUNet
    from eqxdiff.nn.lora import add_lora, partition_lora

    config = TINY if args.quick else FIFTH
    if args.quick:
        args.size, args.batch, args.rounds, args.steps = 16, 2, 1, 1
    key_model, key_lora, key_step = jax.random.split(jax.random.key(args.seed), 3)
    rng = np.random.default_rng(args.seed)
    unet = SDUNet.from_config(config, key=key_model)
    width = unet.context_dim
    x0 = jax.numpy.asarray(random_latents(rng, args.batch, args.size))
    context = jax.numpy.asarray(rng.standard_normal((args.batch, 77, width)).astype(np.float32))
    cond = TextCond(context, jax.numpy.ones((args.batch, 77), jax.numpy.int32))
    optimizer = optax.adamw(1e-4)

    adapters, base = partition_lora(add_lora(unet, args.rank, key=key_lora))
    own = jax.tree.map(jax.numpy.copy, eqx.filter(unet, eqx.is_inexact_array))  # donated; the base shares unet's
    sides = {"full": (own, eqx.filter(unet, eqx.is_inexact_array, inverse=True)), "lora": (adapters, base)}
    state, compiled, result = {}, {}, {"rank": args.rank}
    for name, (trained, frozen) in sides.items():
        opt_state = optimizer.init(trained)
        start = time.perf_counter()
        compiled[name] = make_step(optimizer)(trained, opt_state, frozen, x0, cond, key_step)
        compile_s = time.perf_counter() - start
        print(f"{name}: compiled in {compile_s:.1f} s", file=sys.stderr, flush=True)
        start = time.perf_counter()
        trained, opt_state, loss = jax.block_until_ready(compiled[name](trained, opt_state, frozen, x0, cond, key_step))
        first_s = time.perf_counter() - start
        state[name] = [trained, opt_state, frozen]
        result[name] = {
            "trained_params": int(sum(x.size for x in jax.tree.leaves(trained))),
            "trained_mib": round(tree_bytes(trained) / 2**20, 2),
            "opt_state_mib": round(tree_bytes(opt_state) / 2**20, 2),
            "frozen_mib": round(tree_bytes(frozen) / 2**20, 2),
            **memory_of(compiled[name]),
            "compile_s": round(compile_s, 3),
            "first_step_s": round(first_s, 3),
            "first_loss": float(loss),
        }

    def run(name: str):
        def steps() -> float:
            start = time.perf_counter()
            for i in range(args.steps):
                trained, opt_state, frozen = state[name]
                step_key = jax.random.fold_in(key_step, i)
                trained, opt_state, loss = compiled[name](trained, opt_state, frozen, x0, cond, step_key)
                state[name] = [trained, opt_state, frozen]
            jax.block_until_ready(loss)
            return time.perf_counter() - start

        return steps

    seconds = alternate({"lora": run("lora"), "full": run("full")}, args.rounds)
    result.update(rates(seconds, args.steps, "steps"))
    temp = round(result["lora"]["temp_mib"] / result["full"]["temp_mib"], 3)
    result["lora_over_full"] = {
        "steps_per_s": result.pop("ratio"),
        "paired_median": result.pop("paired_ratio_median"),
        "temp_memory": temp,
    }
    report(
        "sd_lora_step_vs_full",
        {
            "config": "quick (tiny SD-like)" if args.quick else "SD 1.5 unet at 1/5 width",
            "block_out_channels": config["block_out_channels"],
            "params": sum(x.size for x in jax.tree.leaves(eqx.filter(unet, eqx.is_array))),
            "batch": args.batch,
            "latent": [args.size, args.size, 4],
            "steps_per_round": args.steps,
            "rounds": args.rounds,
            **result,
            "note": "lora_over_full.steps_per_s > 1: the LoRA step is faster; temp_memory < 1: it plans less memory",
        },
    )


if __name__ == "__main__":
    main()
