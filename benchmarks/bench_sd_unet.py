"""Stable Diffusion 1.5's UNet forward, side by side: eqxdiff's `SDUNet` vs diffusers' PyTorch
`UNet2DConditionModel`, on the same CPU in one run.

The released SD 1.5 UNet architecture (benchmarks/sd_unet_configs.py: diffusers' unet/config.json;
859,520,964 params) with random weights, the SAME weights on both sides: the torch peer
(benchmarks/sd_unet_torch_peer.py, in the torch venv: tools/README.md) draws diffusers' own seeded init,
keeps that model and writes it to a temporary diffusers folder (float32), which eqxdiff reads with
`SDUNet.from_diffusers`. Inputs: latents [b, 64, 64, 4] ~ N(0, 1) (SD's 512² images), timesteps
~ U{0..999}, text context [b, 77, 768] ~ N(0, 1); batch 1 (one prompt) and 2 (the CFG pair), float32.

    python benchmarks/bench_sd_unet.py                  # batch 1 and 2, 3 rounds each (minutes on a 2-core CPU)
    python benchmarks/bench_sd_unet.py --xla_cpu off    # XLA's defaults (YNNPACK on) instead of every switch
    python benchmarks/bench_sd_unet.py --quick          # smoke: a small SD-like config at 16², one round

- eqxdiff: the forward jitted on the module's arrays and compiled with `xla_cpu.compiler_options()` (the
  `--xla_cpu` switches, as the train scripts take them: "on", "off" or a comma list; YNNPACK's process flag
  is set before JAX starts); compile timed apart, one warm-up call.
- torch: `torch.set_num_threads(--threads)`, `torch.inference_mode()`, NCHW, diffusers' default attention
  processor (reported: torch's scaled_dot_product_attention), one warm-up call.
Then ALTERNATING rounds (benchmarks/harness.py): eqxdiff `calls` calls, torch `calls` calls, ...; the two
sides never run at once. `ratio` = eqxdiff / torch forwards·batch per second; `paired_ratio_median` per
round. Agreement: the warm-up outputs' max abs difference, with the output's max abs for scale.

The LoRA step against the full fine-tune: benchmarks/bench_sd_lora_step.py. stdout gets one JSON line.
"""

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from harness import alternate, call_seconds, param_count, peer_report, rates
from sd_unet_configs import SD15_UNET
from torch_peer import TORCH_PYTHON, TorchPeer

PEER = Path(__file__).resolve().parent / "sd_unet_torch_peer.py"
SMALL = {  # --quick
    **SD15_UNET,
    "block_out_channels": [32, 64, 64, 64],
    "norm_num_groups": 8,
    "attention_head_dim": 2,
    "cross_attention_dim": 32,
    "layers_per_block": 1,
}


def switches(flag: str) -> frozenset[str]:
    from eqxdiff import xla_cpu

    if flag in ("on", "off"):
        return xla_cpu.DEFAULT if flag == "on" else frozenset()
    names = frozenset(n.strip() for n in flag.split(",") if n.strip())
    if unknown := names - xla_cpu.SWITCHES.keys():
        raise SystemExit(
            f"--xla_cpu: unknown switch(es) {sorted(unknown)}; give on, off or a comma list of "
            f"{', '.join(xla_cpu.SWITCHES)}."
        )
    return names


def compiled_forward(unet, x, t, cond, options: dict):
    """`fn(x, t, cond)`: the UNet's forward compiled ahead of time on its arrays; (fn, compile seconds)."""
    import equinox as eqx
    import jax

    arrays, static = eqx.partition(unet, eqx.is_array)
    start = time.perf_counter()
    compiled = jax.jit(lambda a, x, t, c: eqx.combine(a, static)(x, t, c)).lower(arrays, x, t, cond).compile(options)
    return (lambda x, t, c: compiled(arrays, x, t, c)), time.perf_counter() - start


def run_batch(args, peer: TorchPeer, unet, tmp: Path, batch: int, rng) -> dict:
    import jax

    from eqxdiff import xla_cpu
    from eqxdiff.nn import TextCond

    size, width = args.size, unet.context_dim
    x = rng.standard_normal((batch, size, size, 4)).astype(np.float32)
    t = rng.integers(0, 1000, batch).astype(np.float32)
    context = rng.standard_normal((batch, 77, width)).astype(np.float32)
    cond = TextCond(jax.numpy.asarray(context), jax.numpy.ones((batch, 77), jax.numpy.int32))
    xj, tj = jax.numpy.asarray(x), jax.numpy.asarray(t)
    fn, compile_s = compiled_forward(unet, xj, tj, cond, xla_cpu.compiler_options())
    start = time.perf_counter()
    ours = np.asarray(jax.block_until_ready(fn(xj, tj, cond)))
    first_s = time.perf_counter() - start
    result = {
        "batch": batch,
        "latent": [size, size, 4],
        "calls_per_round": args.calls,
        "rounds": args.rounds,
        "eqxdiff_compile_s": round(compile_s, 3),
        "eqxdiff_first_call_s": round(first_s, 3),
    }
    np.savez(tmp / "input.npz", x=x, t=t, context=context)
    answer = peer("prepare", input=str(tmp / "input.npz"), output=str(tmp / "output.npy"))
    theirs = np.load(tmp / "output.npy")
    result["torch_first_call_s"] = round(answer["first_call_s"], 3)
    result["max_abs_diff"], result["output_max_abs"] = float(np.abs(ours - theirs).max()), float(np.abs(theirs).max())
    sides = {
        "eqxdiff": lambda: call_seconds(args.calls, fn, xj, tj, cond),
        "torch": lambda: peer("time", calls=args.calls)["seconds"],
    }
    result.update(rates(alternate(sides, args.rounds), batch * args.calls, "latents"))
    print(result, file=sys.stderr, flush=True)  # progress
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="1,2", help="batch sizes, comma-separated (2: a CFG pair)")
    parser.add_argument("--size", type=int, default=64, help="latent height and width")
    parser.add_argument("--calls", type=int, default=1, help="calls per round")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds per batch size")
    parser.add_argument("--xla_cpu", default="on", help='"on", "off" or a comma list of eqxdiff/xla_cpu.py switches')
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads")
    parser.add_argument("--torch_python", default=TORCH_PYTHON)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="smoke run: a small SD-like config at 16², one round")
    args = parser.parse_args()
    if not Path(args.torch_python).exists():
        raise SystemExit(
            f"--torch_python {args.torch_python} does not exist: make the torch venv (tools/README.md) "
            "or point the flag at its python"
        )
    from eqxdiff import xla_cpu

    xla_cpu.enable(switches(args.xla_cpu))  # before JAX starts: YNNPACK's process flag
    from eqxdiff.sd import SDUNet

    config = SMALL if args.quick else SD15_UNET
    if args.quick:
        args.size, args.rounds = 16, 1
    rng = np.random.default_rng(args.seed)
    peer = TorchPeer(args.torch_python, PEER)
    with tempfile.TemporaryDirectory(prefix="bench_sd_unet_") as tmp:
        tmp = Path(tmp)
        start = time.perf_counter()
        info = peer("write_weights", config=config, folder=str(tmp / "unet"), seed=args.seed, threads=args.threads)
        torch_s = time.perf_counter() - start
        start = time.perf_counter()
        unet = SDUNet.from_diffusers(tmp / "unet")
        load_s = time.perf_counter() - start
        (tmp / "unet" / "diffusion_pytorch_model.safetensors").unlink()  # read: the page cache may go
        results = [run_batch(args, peer, unet, tmp, int(b), rng) for b in args.batches.split(",")]
        peer.close()
    peer_report(
        "sd_unet_vs_diffusers",
        args.torch_python,
        info,
        "latents",
        {
            "config": "quick (small SD-like)" if args.quick else "SD 1.5 unet/config.json",
            "weights": "the same (diffusers' seeded init, fp32)",
            "params": {"torch": info["params"], "eqxdiff": param_count(unet)},
            "xla_cpu": sorted(xla_cpu.switched_on()),
            "torch_init_and_write_s": round(torch_s, 3),
            "eqxdiff_load_s": round(load_s, 3),
            "results": results,
        },
    )


if __name__ == "__main__":
    main()
