"""diffusers' PyTorch `AutoencoderKL` as a timing peer for benchmarks/bench_vae.py (torch venv only).

Started once by bench_vae.py as a child process, `tools/.venv/bin/python benchmarks/vae_torch_peer.py`,
it reads one JSON command per line on stdin and answers one JSON line on stdout (everything
else it or diffusers prints goes to stderr). Imports only torch, diffusers, numpy, safetensors.

Commands (answers carry "ok": true, or "error"):

- `{"cmd": "write_weights", "config": {...}, "folder": DIR, "seed": S}`: diffusers' own random
  init for `config` (seeded), written as DIR/config.json + DIR/diffusion_pytorch_model.safetensors
  (float32). -> `{"params": n}`
- `{"cmd": "load", "folder": DIR, "threads": T}`: `torch.set_num_threads(T)`, then
  `AutoencoderKL.from_pretrained(DIR)` in eval mode (float32; a bfloat16 copy is loaded the same
  way with `torch_dtype=torch.bfloat16` when first asked for). -> `{"load_s": s, "threads": T, "versions": {...}}`
- `{"cmd": "prepare", "op": "encode"|"decode", "dtype": "fp32"|"bf16", "input": X.npy, "output": Y.npz}`:
  the NHWC float32 array in X.npy becomes the current NCHW input in that dtype; one call runs (the
  warm-up, timed) and its result is saved to Y.npz as NHWC float32 (`mean`, `logvar` for encode —
  the posterior's, logvar clamped as diffusers does — or `decoded`). -> `{"first_call_s": s}`
- `{"cmd": "time", "calls": n}`: n calls on the current input, back to back. -> `{"seconds": s}`
- `{"cmd": "exit"}`

Every call runs under `torch.inference_mode()`. encode = `vae.encode(x).latent_dist` (moments
split and clamped, as diffusers' encode returns them); decode = `vae.decode(z).sample`.
"""

import json
import time
from pathlib import Path

import diffusers
import numpy as np
import torch
from diffusers import AutoencoderKL
from safetensors.torch import save_file
from torch_peer import TimedCalls, serve  # benchmarks/torch_peer.py (this folder is sys.path[0])

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def nhwc(t: torch.Tensor) -> np.ndarray:
    return t.detach().float().permute(0, 2, 3, 1).contiguous().numpy()


class Peer(TimedCalls):
    no_grad = staticmethod(torch.inference_mode)

    def __init__(self):
        self.models: dict[str, AutoencoderKL] = {}
        self.folder = ""

    def write_weights(self, config: dict, folder: str, seed: int) -> dict:
        torch.manual_seed(seed)
        vae = AutoencoderKL(**config).eval()
        path = Path(folder)
        path.mkdir(parents=True, exist_ok=True)
        stored = {k: v for k, v in dict(vae.config).items() if not k.startswith("_")}
        (path / "config.json").write_text(json.dumps({"_class_name": "AutoencoderKL", **stored}, indent=1))
        state = {k: v.detach().to(torch.float32).contiguous() for k, v in vae.state_dict().items()}
        save_file(state, str(path / "diffusion_pytorch_model.safetensors"))
        return {"params": int(sum(v.numel() for v in state.values()))}

    def load(self, folder: str, threads: int) -> dict:
        torch.set_num_threads(threads)
        start = time.perf_counter()
        self.folder = folder
        self.models = {"fp32": AutoencoderKL.from_pretrained(folder, torch_dtype=torch.float32).eval()}
        load_s = time.perf_counter() - start
        versions = {"torch": torch.__version__, "diffusers": diffusers.__version__}
        return {"load_s": load_s, "threads": torch.get_num_threads(), "versions": versions}

    def model(self, dtype: str) -> AutoencoderKL:
        if dtype not in self.models:
            self.models[dtype] = AutoencoderKL.from_pretrained(self.folder, torch_dtype=DTYPES[dtype]).eval()
        return self.models[dtype]

    def prepare(self, op: str, dtype: str, input: str, output: str) -> dict:
        vae = self.model(dtype)
        x = torch.from_numpy(np.load(input)).permute(0, 3, 1, 2).contiguous().to(DTYPES[dtype])
        if op == "encode":
            self.call = lambda: vae.encode(x).latent_dist
        elif op == "decode":
            self.call = lambda: vae.decode(x).sample
        else:
            raise ValueError(f"unknown op {op!r}")
        out, first = self.first_call()
        if op == "encode":
            np.savez(output, mean=nhwc(out.mean), logvar=nhwc(out.logvar))
        else:
            np.savez(output, decoded=nhwc(out))
        return {"first_call_s": first}


if __name__ == "__main__":
    serve(Peer())
