"""VAE encode/decode throughput, side by side: eqxdiff's `AutoencoderKL` vs diffusers' PyTorch model.

The real SD VAE architecture (block_out_channels [128, 256, 512, 512], layers_per_block 2,
latent_channels 4, norm_num_groups 32, quant convs; 83,653,863 params) with random weights, the
SAME weights on both sides: the torch peer draws diffusers' own seeded init once and writes it to a
temporary diffusers folder (config.json + diffusion_pytorch_model.safetensors, float32); eqxdiff
reads it with `AutoencoderKL.from_diffusers(folder)`, diffusers with `AutoencoderKL.from_pretrained(folder)`.

    python benchmarks/bench_vae.py            # 64² and 256², fp32 and bf16 (minutes on a 2-core CPU)
    python benchmarks/bench_vae.py --quick    # smoke: a small VAE at 32², one round

The torch side runs in its own venv (tools/README.md: tools/.venv; torch is never a project
dependency) as ONE child process, benchmarks/vae_torch_peer.py, started once and driven over
stdin/stdout; the two sides never run at the same time. Nothing is downloaded.

Per (op, size, dtype), both sides get the same input (NHWC float32, cast to the dtype; images
~U(-1, 1) for encode, latents ~N(0, 1) for decode) and the same batch:
- eqxdiff: `eqx.filter_jit` of `vae.encode` / `vae.decode` (as train/encode.py and sample grids
  call them), `xla_cpu.enable()` as the train scripts do (a forward reads only its YNNPACK-off XLA_FLAGS);
  compile (`.lower(...).compile()`) is timed and reported apart, then one warm-up call. bf16 =
  every floating parameter and the input cast to bfloat16: every layer then computes in bfloat16,
  except GroupNorm's statistics (float32 inside, output cast back) and the attention softmax
  (float32 logits in XLA's `dot_product_attention`).
- torch: `torch.set_num_threads(--threads)` (the cores XLA uses), `torch.inference_mode()`, NCHW
  input, the model loaded in the dtype (`from_pretrained(..., torch_dtype=)`), one warm-up call.
  encode = `vae.encode(x).latent_dist` (moments split and clamped), decode = `vae.decode(z).sample`.
Then ALTERNATING rounds: eqxdiff `calls` calls, torch `calls` calls, eqxdiff, torch, ... (each
eqxdiff call blocks on its output before the next). images/s = batch·calls·rounds / summed round
seconds; `ratio` = eqxdiff / torch images/s; `paired_ratio_median` = the median over rounds of
(eqxdiff round images/s / the torch round right after it).

Agreement: the warm-up outputs of the two sides, max abs difference (encode: mean and logvar;
decode: the image), with the output's max abs for scale. fp32 should agree to float32 rounding
through 80+ layers; bf16 differs by bf16 rounding (the two sides round at different places).

torch bf16 on a CPU without native bf16 (AVX512-BF16/AMX) runs its convolutions through
`aten::_slow_conv2d_forward`, tens of times slower than fp32: where torch bf16 is not measured
(`--torch_bf16_sizes`) only eqxdiff's figure is reported; where it is, bf16 uses its own batch
(`--bf16_batch`, both sides) and rounds (`--bf16_rounds`). stdout gets one JSON line.
"""

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from eqxdiff import xla_cpu
from eqxdiff.nn import AutoencoderKL
from harness import alternate, call_seconds, compile_and_first_call, param_count, peer_report, rates
from torch_peer import TORCH_PYTHON, TorchPeer

PEER = Path(__file__).resolve().parent / "vae_torch_peer.py"
SD_VAE = {
    "block_out_channels": [128, 256, 512, 512],
    "layers_per_block": 2,
    "latent_channels": 4,
    "norm_num_groups": 32,
    "use_quant_conv": True,
    "use_post_quant_conv": True,
    "scaling_factor": 0.18215,
    "down_block_types": ["DownEncoderBlock2D"] * 4,
    "up_block_types": ["UpDecoderBlock2D"] * 4,
}
SMALL_VAE = {  # --quick
    **SD_VAE,
    "block_out_channels": [32, 64],
    "layers_per_block": 1,
    "norm_num_groups": 8,
    "down_block_types": ["DownEncoderBlock2D"] * 2,
    "up_block_types": ["UpDecoderBlock2D"] * 2,
}
JNP_DTYPES = {"fp32": jnp.float32, "bf16": jnp.bfloat16}


def cast(vae: AutoencoderKL, dtype) -> AutoencoderKL:
    """Every floating parameter in `dtype` (the layers compute in their parameters' dtype)."""
    return jax.tree.map(lambda a: a.astype(dtype) if eqx.is_inexact_array(a) else a, vae)


@eqx.filter_jit
def encode(vae: AutoencoderKL, x):
    return vae.encode(x)


@eqx.filter_jit
def decode(vae: AutoencoderKL, z):
    return vae.decode(z)


def as_outputs(op: str, out) -> dict[str, np.ndarray]:
    if op == "encode":
        return {"mean": np.asarray(out[0], np.float32), "logvar": np.asarray(out[1], np.float32)}
    return {"decoded": np.asarray(out, np.float32)}


def run_config(args, peer: TorchPeer, vaes: dict, tmp: Path, op: str, size: int, dtype: str, rng) -> dict:
    """Compile, warm up, check agreement and time alternating rounds for one (op, size, dtype)."""
    bf16 = dtype == "bf16"
    with_torch = not bf16 or size in args.torch_bf16_sizes
    batch = args.bf16_batch if bf16 and with_torch else args.batch[size]
    calls = 1 if bf16 and with_torch else args.calls[size]
    rounds = args.bf16_rounds if bf16 and with_torch else args.rounds
    f, latent = vaes["fp32"].downsample_factor, vaes["fp32"].decoder.conv_in.weight.shape[2]
    if op == "encode":
        x32 = rng.uniform(-1, 1, (batch, size, size, 3)).astype(np.float32)
    else:
        x32 = rng.standard_normal((batch, size // f, size // f, latent)).astype(np.float32)
    vae, fn = vaes[dtype], {"encode": encode, "decode": decode}[op]
    x = jnp.asarray(x32, JNP_DTYPES[dtype])
    result = {"op": op, "size": size, "dtype": dtype, "batch": batch, "calls_per_round": calls, "rounds": rounds}

    out, times = compile_and_first_call(fn, vae, x)
    eqx_out = as_outputs(op, out)
    result.update(times)

    sides = {"eqxdiff": lambda: call_seconds(calls, fn, vae, x)}
    if with_torch:
        np.save(tmp / "input.npy", x32)
        answer = peer("prepare", op=op, dtype=dtype, input=str(tmp / "input.npy"), output=str(tmp / "output.npz"))
        result["torch_first_call_s"] = round(answer["first_call_s"], 3)
        with np.load(tmp / "output.npz") as torch_out:
            result["max_abs_diff"] = {k: float(np.max(np.abs(eqx_out[k] - torch_out[k]))) for k in eqx_out}
            result["output_max_abs"] = {k: float(np.max(np.abs(torch_out[k]))) for k in eqx_out}
        sides["torch"] = lambda: peer("time", calls=calls)["seconds"]
    else:
        result["torch_not_measured"] = (
            f"torch {dtype} at {size}² skipped (--torch_bf16_sizes): its bf16 convs take the slow path on this CPU"
        )
    result.update(rates(alternate(sides, rounds), batch * calls, "images"))
    print(json.dumps(result), file=sys.stderr, flush=True)  # progress
    return result


def sizes_arg(text: str) -> list[int]:
    return [int(s) for s in text.split(",") if s]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=sizes_arg, default=[64, 256])
    parser.add_argument("--dtypes", default="fp32,bf16")
    parser.add_argument("--ops", default="encode,decode")
    parser.add_argument("--batch_64", type=int, default=8, help="batch at 64² (other sizes: --batch_256)")
    parser.add_argument("--batch_256", type=int, default=1)
    parser.add_argument("--calls_64", type=int, default=2, help="calls per round at 64²")
    parser.add_argument("--calls_256", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds per (op, size, dtype)")
    parser.add_argument("--torch_bf16_sizes", type=sizes_arg, default=[64], help="sizes where torch bf16 runs")
    parser.add_argument("--bf16_batch", type=int, default=1, help="batch where torch bf16 runs (both sides)")
    parser.add_argument("--bf16_rounds", type=int, default=1, help="rounds where torch bf16 runs")
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads")
    parser.add_argument("--torch_python", default=TORCH_PYTHON)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="smoke run: a small VAE at 32², one round")
    args = parser.parse_args()
    xla_cpu.enable()  # as train/main.py, in main: bench_xla_cpu.py imports the configs and sets its own switches
    config = SD_VAE
    if args.quick:
        config, args.sizes, args.torch_bf16_sizes, args.rounds, args.bf16_rounds = SMALL_VAE, [32], [32], 1, 1
        args.batch_64 = args.calls_64 = 1
    small = lambda s: s <= 64  # noqa: E731
    args.batch = {s: args.batch_64 if small(s) else args.batch_256 for s in args.sizes}
    args.calls = {s: args.calls_64 if small(s) else args.calls_256 for s in args.sizes}

    rng = np.random.default_rng(args.seed)
    peer = TorchPeer(args.torch_python, PEER)
    results = []
    with tempfile.TemporaryDirectory(prefix="bench_vae_") as tmp:
        tmp = Path(tmp)
        folder = tmp / "vae"
        params = peer("write_weights", config=config, folder=str(folder), seed=args.seed)["params"]
        torch_load = peer("load", folder=str(folder), threads=args.threads)
        start = time.perf_counter()
        vae = AutoencoderKL.from_diffusers(folder)
        eqx_load_s = time.perf_counter() - start
        eqx_params = param_count(vae)
        dtypes = args.dtypes.split(",")
        vaes = {d: vae if d == "fp32" else cast(vae, JNP_DTYPES[d]) for d in dtypes}
        for dtype in dtypes:
            for size in args.sizes:
                for op in args.ops.split(","):
                    results.append(run_config(args, peer, vaes, tmp, op, size, dtype, rng))
        peer.close()

    peer_report(
        "vae_vs_diffusers",
        args.torch_python,
        torch_load,
        "images",
        {
            "config": config,
            "params": {"torch": params, "eqxdiff": eqx_params},
            "load_s": {"eqxdiff": round(eqx_load_s, 3), "torch": round(torch_load["load_s"], 3)},
            "quick": args.quick,
            "results": results,
        },
    )


if __name__ == "__main__":
    main()
