"""FID feature extraction throughput, side by side: eqxdiff's `InceptionV3` vs pytorch-fid's PyTorch network.

pytorch-fid's FID Inception (`pytorch_fid.inception.InceptionV3([3])`: pool3, 2048-d, 23.9M
params) with random weights, the SAME weights on both sides: the torch peer draws them
(tools/make_fid_fixtures.py's seeded recipe: BatchNorm statistics not the identity), loads them
into pytorch-fid's network through its own `fid_inception_v3()`, and writes them as the safetensors
file tools/convert_pytorch_fid.py produces (its `convert`, on the state_dict saved as a .pth);
eqxdiff reads that with `InceptionV3.from_pytorch_fid(path)`. No real weights exist on this machine
(nothing is downloaded); speed does not depend on the values.

    python benchmarks/bench_inception.py            # 32² and 299² inputs, batch 50, 5 rounds (minutes on a 2-core CPU)
    python benchmarks/bench_inception.py --quick    # smoke: 32², batch 2, one round

The torch side runs in its own venv (tools/README.md: tools/.venv, pytorch-fid installed
--no-deps; torch is never a project dependency) as ONE child process, benchmarks/inception_torch_peer.py,
started once and driven over stdin/stdout; the two sides never run at the same time. pytorch-fid's
network needs torchvision's pure-Python inception.py, read from a torchvision wheel under stub
packages (`--torchvision`; `tools/.venv/bin/pip download --no-deps torchvision==0.28.0 -d /tmp/tv`).

Per input size, both sides get the same uint8 NHWC images (uniform random bytes) and the same batch
(default 50, pytorch-fid's fid_score default; every input is resized to 299×299 inside the network
on both sides, so the work per image hardly depends on the input size: 32² is what FID of CIFAR-size
models feeds it, 299² skips the upsampling's interpolation work):
- eqxdiff: `eqxdiff.eval.fid.rgb_features(net, images)`, the `eqx.filter_jit` function
  `fid_of_samples` (train/sample.py, train/main.py) calls per chunk, on uint8 images already on
  the device; it is `net(images)`: /255, bilinear resize to 299, 2x - 1, pool3, float32 (convs at
  `Precision.HIGHEST`). `xla_cpu.enable()` as the train scripts do (of its switches only YNNPACK's, a
  process flag, reaches a forward pass: BENCHMARKS.md, occasion 3). Compile (`.lower(...).compile()`)
  is timed and reported apart, then one warm-up call.
- torch: `torch.set_num_threads(--threads)` (the cores XLA uses), the images as fid_score's
  DataLoader hands them over (ToTensor: NCHW float32 in [0, 1], converted once, outside the timing),
  `model(batch)[0]` under `torch.no_grad()` as fid_score calls it (F.interpolate to 299 and 2x - 1
  inside the network), one warm-up call.
Then ALTERNATING rounds: eqxdiff `calls` calls, torch `calls` calls, eqxdiff, torch, ... (each
eqxdiff call blocks on its output before the next). images/s = batch·calls·rounds / summed round
seconds; `ratio` = eqxdiff / torch images/s (> 1 favours eqxdiff); `paired_ratio_median` = the
median over rounds of (eqxdiff round images/s / the torch round right after it), less sensitive to
load from other jobs drifting over the run.

Agreement: the warm-up features of the two sides, max abs difference, with the features' max abs for
scale; `relative_diff` = their ratio, to be within 1e-4 (tests/eval/test_inception.py's parity tolerance;
float32 through ~95 conv layers). stdout gets one JSON line; progress goes to stderr.
"""

import argparse
import glob
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

from eqxdiff import xla_cpu
from eqxdiff.eval import InceptionV3
from eqxdiff.eval.fid import rgb_features
from harness import alternate, call_seconds, compile_and_first_call, param_count, peer_report, rates
from torch_peer import TORCH_PYTHON, TorchPeer

xla_cpu.enable()  # as train/main.py (YNNPACK's process flag reaches the forward)

PEER = Path(__file__).resolve().parent / "inception_torch_peer.py"
TORCHVISION_WHEEL = "/tmp/tv/torchvision-0.28.0-*.whl"
TOLERANCE = 1e-4  # max abs difference / max abs feature, as tests/eval/test_inception.py


def run_size(args, peer: TorchPeer, net: InceptionV3, tmp: Path, size: int, rng) -> dict:
    """Compile, warm up, check agreement and time alternating rounds for one input size."""
    batch, calls, rounds = args.batch, args.calls, args.rounds
    images = rng.integers(0, 256, (batch, size, size, 3), dtype=np.uint8)
    x = jax.device_put(images)
    result = {"size": size, "batch": batch, "calls_per_round": calls, "rounds": rounds}

    out, times = compile_and_first_call(rgb_features, net, x)
    eqx_out = np.asarray(out)
    result.update(times)

    np.save(tmp / "input.npy", images)
    answer = peer("prepare", input=str(tmp / "input.npy"), output=str(tmp / "output.npy"))
    result["torch_first_call_s"] = round(answer["first_call_s"], 3)
    torch_out = np.load(tmp / "output.npy")
    if eqx_out.shape != torch_out.shape:
        raise RuntimeError(f"feature shapes differ: eqxdiff {eqx_out.shape}, torch {torch_out.shape}")
    diff, scale = float(np.max(np.abs(eqx_out - torch_out))), float(np.max(np.abs(torch_out)))
    result.update(max_abs_diff=diff, feature_max_abs=scale, feature_mean=float(torch_out.mean()))
    result["relative_diff"] = diff / scale
    result["agrees"] = bool(diff <= TOLERANCE * scale)

    sides = {
        "eqxdiff": lambda: call_seconds(calls, rgb_features, net, x),
        "torch": lambda: peer("time", calls=calls)["seconds"],
    }
    result.update(rates(alternate(sides, rounds), batch * calls, "images"))
    print(json.dumps(result), file=sys.stderr, flush=True)  # progress
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--sizes",
        type=lambda s: [int(v) for v in s.split(",") if v],
        default=[32, 299],
        help="input sizes (square), resized to 299 inside the network",
    )
    parser.add_argument("--batch", type=int, default=50, help="images per call, both sides (fid_score's default)")
    parser.add_argument("--calls", type=int, default=1, help="calls per round")
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds per size")
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads")
    parser.add_argument("--torch_python", default=TORCH_PYTHON)
    parser.add_argument("--torchvision", default=TORCHVISION_WHEEL, help="a torchvision wheel (glob; .py files read)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="smoke run: 32², batch 2, one round")
    args = parser.parse_args()
    if args.quick:
        args.sizes, args.batch, args.calls, args.rounds = [32], 2, 1, 1
    wheels = sorted(glob.glob(args.torchvision))
    if not wheels:
        raise SystemExit(
            f"no torchvision wheel at {args.torchvision}: "
            "tools/.venv/bin/pip download --no-deps torchvision==0.28.0 -d /tmp/tv"
        )

    rng = np.random.default_rng(args.seed)
    peer = TorchPeer(args.torch_python, PEER)
    results = []
    with tempfile.TemporaryDirectory(prefix="bench_inception_") as tmp:
        tmp = Path(tmp)
        weights = tmp / "fid_inception.safetensors"
        build = peer("build", torchvision=wheels[-1], weights=str(weights), seed=args.seed, threads=args.threads)
        start = time.perf_counter()
        net = InceptionV3.from_pytorch_fid(weights)
        eqx_load_s = time.perf_counter() - start
        eqx_params = param_count(net)
        for size in args.sizes:
            results.append(run_size(args, peer, net, tmp, size, rng))
        peer.close()

    peer_report(
        "inception_vs_pytorch_fid",
        args.torch_python,
        build,
        "images",
        {
            "dtype": "fp32",
            "params_pool3": {"torch": build["params"], "eqxdiff": eqx_params},
            "load_s": {"eqxdiff": round(eqx_load_s, 3), "torch_build": round(build["build_s"], 3)},
            "quick": args.quick,
            "results": results,
        },
    )


if __name__ == "__main__":
    main()
