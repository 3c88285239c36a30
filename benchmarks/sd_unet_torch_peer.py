"""diffusers' PyTorch `UNet2DConditionModel` as a timing peer for benchmarks/bench_sd_unet.py (torch venv only).

Started once by bench_sd_unet.py as a child process, `tools/.venv/bin/python benchmarks/sd_unet_torch_peer.py`,
it reads one JSON command per line on stdin and answers one JSON line on stdout (benchmarks/torch_peer.py).
Imports only torch, diffusers, numpy, safetensors.

Commands (answers carry "ok": true, or "error"):

- `{"cmd": "write_weights", "config": {...}, "folder": DIR, "seed": S, "threads": T}`: `torch.set_num_threads(T)`,
  diffusers' own random init for `config` (seeded), kept as the timed model (eval mode, float32) and written
  as DIR/config.json + DIR/diffusion_pytorch_model.safetensors. -> `{"params": n, "threads": T, "attention":
  the processor class, "versions": {...}}`
- `{"cmd": "prepare", "input": X.npz, "output": Y.npy}`: X.npz's `x` (NHWC latents), `t` [b] and `context`
  [b, 77, d] become the current input (NCHW); one call runs (the warm-up, timed) and its output is saved to
  Y.npy as NHWC float32. -> `{"first_call_s": s}`
- `{"cmd": "time", "calls": n}`: n calls on the current input, back to back. -> `{"seconds": s}`
- `{"cmd": "exit"}`

Every call runs under `torch.inference_mode()`: `unet(x, t, encoder_hidden_states=context).sample`.
"""

import json
import time
from pathlib import Path

import diffusers
import numpy as np
import torch
from diffusers import UNet2DConditionModel
from safetensors.torch import save_file
from torch_peer import TimedCalls, serve  # benchmarks/torch_peer.py (this folder is sys.path[0])


class Peer(TimedCalls):
    no_grad = staticmethod(torch.inference_mode)

    def __init__(self):
        self.unet = None

    def write_weights(self, config: dict, folder: str, seed: int, threads: int) -> dict:
        torch.set_num_threads(threads)
        torch.manual_seed(seed)
        self.unet = UNet2DConditionModel(**{k: v for k, v in config.items() if not k.startswith("_")}).eval()
        path = Path(folder)
        path.mkdir(parents=True, exist_ok=True)
        stored = {k: v for k, v in dict(self.unet.config).items() if not k.startswith("_")}
        (path / "config.json").write_text(json.dumps({"_class_name": "UNet2DConditionModel", **stored}, indent=1))
        state = {k: v.detach().contiguous() for k, v in self.unet.state_dict().items()}
        save_file(state, str(path / "diffusion_pytorch_model.safetensors"))
        processor = type(next(iter(self.unet.attn_processors.values()))).__name__
        versions = {"torch": torch.__version__, "diffusers": diffusers.__version__}
        params = int(sum(v.numel() for v in state.values()))
        return {"params": params, "threads": torch.get_num_threads(), "attention": processor, "versions": versions}

    def prepare(self, input: str, output: str) -> dict:
        with np.load(input) as arrays:
            x = torch.from_numpy(arrays["x"]).permute(0, 3, 1, 2).contiguous()
            t, context = torch.from_numpy(arrays["t"]), torch.from_numpy(arrays["context"])
        self.call = lambda: self.unet(x, t, encoder_hidden_states=context).sample
        out, first = self.first_call()
        np.save(output, out.detach().float().permute(0, 2, 3, 1).contiguous().numpy())
        return {"first_call_s": first}


if __name__ == "__main__":
    serve(Peer())
