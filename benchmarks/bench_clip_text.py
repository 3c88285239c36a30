"""CLIP-L/14 text encoding throughput, side by side: eqxdiff's `CLIPTextModel` vs transformers' PyTorch model.

The CLIP-L/14 text tower as SD 1.x ships it (hidden 768, 12 layers, 12 heads, MLP 3072, vocab
49408, 77 positions, quick_gelu, legacy eos pooling; 123,060,480 params) with random weights, the
SAME weights on both sides: the torch peer draws transformers' own seeded init once and saves it
to a temporary folder (config.json + model.safetensors, float32); eqxdiff reads it with
`CLIPTextModel.from_transformers(folder)`, transformers with `CLIPTextModel.from_pretrained(folder)`.

    python benchmarks/bench_clip_text.py           # batch 8 x 77 tokens, fp32, 5 rounds
    python benchmarks/bench_clip_text.py --quick   # smoke: a 2-layer tower, one round

The torch side runs in its own venv (tools/README.md: tools/.venv; torch is never a project
dependency) as ONE child process, benchmarks/clip_torch_peer.py, started once and driven over
stdin/stdout; the two sides never run at the same time. Nothing is downloaded.

Both sides get the same prompts: `batch` rows of 77 int32 ids (bos, 5-40 random tokens, eos,
padded with eos as SD 1.x's tokenizer pads), no attention mask (as SD pipelines call the encoder).
- eqxdiff: `eqx.filter_jit` of `clip(ids)` with the model as an argument (as a training step takes
  a frozen tower), `xla_cpu.enable()` as the train scripts do; compile (`.lower(...).compile()`)
  is timed and reported apart, then one warm-up call.
- torch: `torch.set_num_threads(--threads)` (the cores XLA uses), `torch.inference_mode()`,
  transformers' default attention (sdpa), one warm-up call.
Then ALTERNATING rounds: eqxdiff `calls` calls, torch `calls` calls, eqxdiff, torch, ... (each
eqxdiff call blocks on its output before the next). prompts/s = batch·calls·rounds / summed round
seconds; `ratio` = eqxdiff / torch prompts/s; `paired_ratio_median` = the median over rounds of
(eqxdiff round prompts/s / the torch round right after it). Agreement: max abs difference of the
warm-up outputs (last_hidden_state, pooler_output). stdout gets one JSON line.
"""

import argparse
import os
import tempfile
import time
from pathlib import Path

import equinox as eqx
import numpy as np

from eqxdiff import xla_cpu
from eqxdiff.nn import CLIPTextModel
from harness import alternate, call_seconds, compile_and_first_call, param_count, peer_report, rates
from torch_peer import TORCH_PYTHON, TorchPeer

xla_cpu.enable()  # as train/main.py (no effect on a forward pass)

PEER = Path(__file__).resolve().parent / "clip_torch_peer.py"
CLIP_L14_TEXT = {  # SD 1.x's text_encoder/config.json, the fields that shape the network
    "architectures": ["CLIPTextModel"],
    "model_type": "clip_text_model",
    "vocab_size": 49408,
    "hidden_size": 768,
    "intermediate_size": 3072,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "max_position_embeddings": 77,
    "hidden_act": "quick_gelu",
    "layer_norm_eps": 1e-05,
    "bos_token_id": 0,
    "eos_token_id": 2,
    "pad_token_id": 1,
    "projection_dim": 768,
}
BOS, EOS, LENGTH = 49406, 49407, 77


def prompts(batch: int, rng: np.random.Generator) -> np.ndarray:
    """`[batch, 77]` int32 ids: bos, 5-40 random tokens, eos, eos padding (SD 1.x's tokenizer)."""
    ids = np.full((batch, LENGTH), EOS, np.int32)
    for row in ids:
        n = int(rng.integers(5, 41))
        row[0], row[1 : n + 1] = BOS, rng.integers(256, BOS, n)
    return ids


@eqx.filter_jit
def encode(clip: CLIPTextModel, ids):
    return clip(ids)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--calls", type=int, default=3, help="calls per round")
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds")
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads")
    parser.add_argument("--torch_python", default=TORCH_PYTHON)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="smoke run: a 2-layer tower, one round")
    args = parser.parse_args()
    config = CLIP_L14_TEXT
    if args.quick:
        config, args.rounds, args.calls = {**config, "num_hidden_layers": 2}, 1, 1

    ids = prompts(args.batch, np.random.default_rng(args.seed))
    peer = TorchPeer(args.torch_python, PEER)
    result = {"batch": args.batch, "tokens": LENGTH, "dtype": "fp32", "calls_per_round": args.calls}
    with tempfile.TemporaryDirectory(prefix="bench_clip_") as tmp:
        tmp = Path(tmp)
        params = peer("write_weights", config=config, folder=str(tmp / "clip"), seed=args.seed)["params"]
        torch_load = peer("load", folder=str(tmp / "clip"), threads=args.threads)
        start = time.perf_counter()
        clip = CLIPTextModel.from_transformers(tmp / "clip")
        eqx_load_s = time.perf_counter() - start
        eqx_params = param_count(clip)

        (hidden, pooled), times = compile_and_first_call(encode, clip, ids)
        result.update(times)
        np.save(tmp / "ids.npy", ids)
        answer = peer("prepare", input=str(tmp / "ids.npy"), output=str(tmp / "out.npz"))
        result["torch_first_call_s"] = round(answer["first_call_s"], 3)
        with np.load(tmp / "out.npz") as ref:
            result["max_abs_diff"] = {
                "last_hidden_state": float(np.abs(np.asarray(hidden) - ref["hidden"]).max()),
                "pooler_output": float(np.abs(np.asarray(pooled) - ref["pooled"]).max()),
            }
            result["output_max_abs"] = float(np.abs(ref["hidden"]).max())

        sides = {
            "eqxdiff": lambda: call_seconds(args.calls, encode, clip, ids),
            "torch": lambda: peer("time", calls=args.calls)["seconds"],
        }
        result.update(rates(alternate(sides, args.rounds), args.batch * args.calls, "prompts"))
        peer.close()

    peer_report(
        "clip_text_vs_transformers",
        args.torch_python,
        torch_load,
        "prompts",
        {
            "config": config,
            "params": {"torch": params, "eqxdiff": eqx_params},
            "load_s": {"eqxdiff": round(eqx_load_s, 3), "torch": round(torch_load["load_s"], 3)},
            "quick": args.quick,
            "result": result,
        },
    )


if __name__ == "__main__":
    main()
