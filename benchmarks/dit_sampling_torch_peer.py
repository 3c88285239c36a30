"""facebookresearch/DiT's own sampling (`models.py` + `diffusion/`) as a timing peer for
benchmarks/bench_dit_sampling.py (torch venv only).

Started once by bench_dit_sampling.py as a child process, `tools/.venv/bin/python
benchmarks/dit_sampling_torch_peer.py`, it reads one JSON command per line on stdin and answers one JSON
line on stdout (benchmarks/torch_peer.py). DiT's code comes from a clone given in `build` (imported, not
copied: CC BY-NC 4.0), with tools/make_dit_fixtures.py's timm stand-ins where timm does not import (its
attention fused, as timm's default on torch 2: torch's scaled_dot_product_attention).

Commands (answers carry "ok": true, or "error"):

- `{"cmd": "build", "dit": CLONE, "config": {...}, "seed": S, "path": F.safetensors, "threads": T}`:
  `torch.set_num_threads(T)`, the official `models.DiT(**config)` in eval mode, every trainable parameter
  moved off its init by N(0, 0.02²) (seeded; adaLN-Zero's zeros would make the output trivially 0), its
  state_dict written to F. -> `{"params": n, "threads": T, "versions": {...}}`
- `{"cmd": "prepare", "method": "ddpm"|"ddim", "steps": "50", "cfg_scale": w, "input": X.npz, "output": Y.npy}`:
  X.npz's `noise` (NHWC x_T) and `labels`; the loop as DiT's sample.py / sample_ddp.py run it
  (`create_diffusion(steps)`, `p_sample_loop` or `ddim_sample_loop`, `clip_denoised=False`;
  `forward_with_cfg` on the doubled batch with the null class when cfg_scale > 1, else `forward`); one
  call runs (the warm-up, timed), its conditional half saved to Y.npy (NHWC). -> `{"first_call_s": s}`
- `{"cmd": "time", "calls": n}`: n loops back to back. -> `{"seconds": s}`
- `{"cmd": "exit"}`
"""

import sys
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file
from torch_peer import TimedCalls, serve  # benchmarks/torch_peer.py (this folder is sys.path[0])

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
from make_dit_fixtures import Attention, official_models  # noqa: E402  (tools/: DiT's models.py, timm stood in)

Attention.fused_attn = True  # where timm stands in: its default on torch 2 (F.scaled_dot_product_attention)


class Peer(TimedCalls):
    no_grad = staticmethod(torch.inference_mode)

    def __init__(self):
        self.model = None
        self.dit = None

    def build(self, dit: str, config: dict, seed: int, path: str, threads: int) -> dict:
        torch.set_num_threads(threads)
        self.dit = Path(dit)
        models = official_models(self.dit)
        torch.manual_seed(seed)
        self.model = models.DiT(**config).eval()
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in self.model.parameters():
                if p.requires_grad:
                    p.add_(0.02 * torch.randn(p.shape, generator=gen))
        save_file({k: v.contiguous() for k, v in self.model.state_dict().items()}, path)
        params = int(sum(p.numel() for p in self.model.parameters() if p.requires_grad))  # pos_embed is fixed
        return {"params": params, "threads": torch.get_num_threads(), "versions": {"torch": torch.__version__}}

    def prepare(self, method: str, steps: str, cfg_scale: float, input: str, output: str) -> dict:
        from diffusion import create_diffusion  # the clone's, on sys.path since build

        with np.load(input) as data:
            z = torch.from_numpy(data["noise"]).permute(0, 3, 1, 2).contiguous()
            y = torch.from_numpy(data["labels"]).long()
        b = len(y)
        if cfg_scale > 1:
            z, y = torch.cat([z, z]), torch.cat([y, torch.full_like(y, self.model.y_embedder.num_classes)])
            fn, kwargs = self.model.forward_with_cfg, dict(y=y, cfg_scale=cfg_scale)
        else:
            fn, kwargs = self.model.forward, dict(y=y)
        diffusion = create_diffusion(steps)
        loop = {"ddpm": diffusion.p_sample_loop, "ddim": diffusion.ddim_sample_loop}[method]
        self.call = lambda: loop(fn, z.shape, z, clip_denoised=False, model_kwargs=kwargs, device="cpu")
        out, first = self.first_call()
        np.save(output, out[:b].permute(0, 2, 3, 1).contiguous().numpy())
        return {"first_call_s": first}


if __name__ == "__main__":
    serve(Peer())
