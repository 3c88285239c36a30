"""DiT sampling throughput, side by side: eqxdiff's `sample_dit` vs facebookresearch/DiT's own PyTorch loop.

The official DiT-S/2 and DiT-B/4 at 32×32×4 latents (256² images), 1000 classes, learn_sigma, random weights:
the torch peer (benchmarks/dit_sampling_torch_peer.py, in tools/.venv, a clone of DiT given as `--dit`)
builds DiT's `models.DiT` with every parameter moved off its init (seeded) and writes its state_dict as
safetensors; eqxdiff loads that file with `load_dit`, so both sides run the SAME weights. Per model, both
get the same x_T and labels, batch, respacing, method and cfg scale:
- eqxdiff: `sample_dit(model, labels, noise, steps=, method=, guidance=, key=)` (one lax.scan in one jit);
  the first call (compile + run) reported apart, `xla_cpu.enable()` as the train scripts do;
- torch: `create_diffusion(steps)`'s `p_sample_loop` / `ddim_sample_loop` on `forward_with_cfg` (the doubled
  batch, as DiT's sample.py; `forward` at cfg 1), `torch.set_num_threads(--threads)`, inference mode, one
  warm-up loop.
Then ALTERNATING rounds of `--calls` loops each; images/s = batch·calls·rounds / summed round seconds;
`ratio` = eqxdiff / torch images/s. With `--method ddim` (deterministic) the two warm-up outputs are
compared (`max_abs_diff`, with the output's max abs for scale). stdout gets one JSON line.

    python benchmarks/bench_dit_sampling.py --dit /tmp/DiT                     # S/2 and B/4, ddpm, 50 steps, cfg 1.5
    python benchmarks/bench_dit_sampling.py --dit /tmp/DiT --steps 250 --batch 8
    python benchmarks/bench_dit_sampling.py --dit /tmp/DiT --quick             # smoke: a tiny DiT at 8², 5 steps
"""

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from eqxdiff import xla_cpu
from eqxdiff.pretrained import load_dit, sample_dit
from harness import alternate, param_count, peer_report, rates
from torch_peer import TORCH_PYTHON, TorchPeer

xla_cpu.enable()  # as train/main.py and train/sample.py

PEER = Path(__file__).resolve().parent / "dit_sampling_torch_peer.py"
LATENT = dict(input_size=32, in_channels=4, num_classes=1000, learn_sigma=True)
MODELS = {  # models.py's DiT_models entries
    "DiT-S/2": dict(depth=12, hidden_size=384, patch_size=2, num_heads=6, **LATENT),
    "DiT-B/4": dict(depth=12, hidden_size=768, patch_size=4, num_heads=12, **LATENT),
}
TINY = {
    "tiny": dict(
        input_size=8,
        in_channels=4,
        num_classes=10,
        learn_sigma=True,
        depth=2,
        hidden_size=32,
        patch_size=2,
        num_heads=2,
    )
}


def run_model(args, peer: TorchPeer, tmp: Path, name: str, config: dict, rng) -> tuple[dict, dict]:
    """Build both sides on one set of weights, warm up, compare (ddim) and time alternating rounds."""
    path = tmp / "dit.safetensors"
    built = peer("build", dit=str(args.dit), config=config, seed=args.seed, path=str(path), threads=args.threads)
    model = load_dit(path, num_heads=config["num_heads"])
    size, c = config["input_size"], config["in_channels"]
    noise = rng.standard_normal((args.batch, size, size, c)).astype(np.float32)
    labels = rng.integers(0, config["num_classes"], args.batch).astype(np.int32)
    np.savez(tmp / "input.npz", noise=noise, labels=labels)
    noise, labels = jnp.asarray(noise), jnp.asarray(labels)
    key = jax.random.key(args.seed)

    def run():
        return sample_dit(model, labels, noise, steps=args.steps, method=args.method, guidance=args.guidance, key=key)

    start = time.perf_counter()
    ours = np.asarray(jax.block_until_ready(run()))
    first_s = time.perf_counter() - start
    answer = peer(
        "prepare",
        method=args.method,
        steps=args.steps,
        cfg_scale=args.guidance,
        input=str(tmp / "input.npz"),
        output=str(tmp / "output.npy"),
    )
    result = {
        "model": name,
        "config": config,
        "params": {"torch": built["params"], "eqxdiff": param_count(model)},
        "batch": args.batch,
        "steps": args.steps,
        "method": args.method,
        "guidance": args.guidance,
        "calls_per_round": args.calls,
        "rounds": args.rounds,
        "eqxdiff_first_call_s": round(first_s, 3),
        "torch_first_call_s": round(answer["first_call_s"], 3),
    }
    if args.method == "ddim":
        theirs = np.load(tmp / "output.npy")
        result["max_abs_diff"] = float(np.abs(ours - theirs).max())
        result["output_max_abs"] = float(np.abs(theirs).max())

    def eqxdiff_round() -> float:
        start = time.perf_counter()
        for _ in range(args.calls):
            jax.block_until_ready(run())
        return time.perf_counter() - start

    sides = {"eqxdiff": eqxdiff_round, "torch": lambda: peer("time", calls=args.calls)["seconds"]}
    result.update(rates(alternate(sides, args.rounds), args.batch * args.calls, "images"))
    print(result, file=sys.stderr, flush=True)  # progress
    return result, built


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dit", type=Path, required=True, help="a clone of github.com/facebookresearch/DiT")
    parser.add_argument("--models", default="DiT-S/2,DiT-B/4", help=f"some of {list(MODELS)}")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", default="50", help='a respacing, as DiT\'s: "250", "ddim50"')
    parser.add_argument("--method", choices=("ddpm", "ddim"), default="ddpm")
    parser.add_argument("--guidance", type=float, default=1.5, help="guidance scale (> 1: the doubled batch)")
    parser.add_argument("--calls", type=int, default=1, help="sampling loops per round")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds per model")
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads")
    parser.add_argument("--torch_python", default=TORCH_PYTHON)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="smoke run: a tiny DiT at 8², 5 steps, one round")
    args = parser.parse_args()
    if not (args.dit / "diffusion" / "respace.py").is_file():
        raise SystemExit(
            f"--dit {args.dit}: no diffusion/respace.py there; pass a clone of github.com/facebookresearch/DiT"
        )
    models = {n: MODELS[n] for n in args.models.split(",") if n in MODELS}
    if args.quick:
        models, args.batch, args.steps, args.rounds = TINY, 2, "5", 1
    elif len(models) != len(args.models.split(",")):
        raise SystemExit(f"--models {args.models}: choose from {list(MODELS)}")

    rng = np.random.default_rng(args.seed)
    peer = TorchPeer(args.torch_python, PEER)
    results, built = [], {}
    with tempfile.TemporaryDirectory(prefix="bench_dit_sampling_") as tmp:
        for name, config in models.items():
            result, built = run_model(args, peer, Path(tmp), name, config, rng)
            results.append(result)
        peer.close()
    summary = {"quick": args.quick, "results": results}
    peer_report("dit_sampling_vs_official", args.torch_python, built, "images", summary)


if __name__ == "__main__":
    main()
