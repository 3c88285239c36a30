"""transformers' PyTorch `CLIPTextModel` as a timing peer for benchmarks/bench_clip_text.py (torch venv only).

Started once by bench_clip_text.py as a child process, `tools/.venv/bin/python
benchmarks/clip_torch_peer.py`, it reads one JSON command per line on stdin and answers one JSON
line on stdout (everything else it or transformers prints goes to stderr). Imports only torch,
transformers and numpy.

Commands (answers carry "ok": true, or "error"):

- `{"cmd": "write_weights", "config": {...}, "folder": DIR, "seed": S}`: transformers' own random
  init for the CLIPTextConfig `config` (seeded), saved with `save_pretrained(DIR)` (config.json +
  model.safetensors, float32). -> `{"params": n}`
- `{"cmd": "load", "folder": DIR, "threads": T}`: `torch.set_num_threads(T)`, then
  `CLIPTextModel.from_pretrained(DIR)` in eval mode (float32, transformers' default attention).
  -> `{"load_s": s, "threads": T, "attention": impl, "versions": {...}}`
- `{"cmd": "prepare", "input": X.npy, "output": Y.npz}`: the int32 token ids `[b, n]` in X.npy
  become the current input; one call runs (the warm-up, timed) and `last_hidden_state` and
  `pooler_output` are saved to Y.npz as float32. -> `{"first_call_s": s}`
- `{"cmd": "time", "calls": n}`: n calls on the current input, back to back. -> `{"seconds": s}`
- `{"cmd": "exit"}`

Every call is `model(input_ids)` (no attention mask, as SD pipelines call their text encoder) under
`torch.inference_mode()`.
"""

import time

import numpy as np
import torch
import transformers
from transformers import CLIPTextConfig, CLIPTextModel
from torch_peer import TimedCalls, serve  # benchmarks/torch_peer.py (this folder is sys.path[0])


class Peer(TimedCalls):
    no_grad = staticmethod(torch.inference_mode)

    def __init__(self):
        self.model: CLIPTextModel | None = None

    def write_weights(self, config: dict, folder: str, seed: int) -> dict:
        torch.manual_seed(seed)
        model = CLIPTextModel(CLIPTextConfig.from_dict(config)).eval()
        model.save_pretrained(folder)
        return {"params": int(model.num_parameters())}

    def load(self, folder: str, threads: int) -> dict:
        torch.set_num_threads(threads)
        start = time.perf_counter()
        self.model = CLIPTextModel.from_pretrained(folder, dtype=torch.float32).eval()
        load_s = time.perf_counter() - start
        versions = {"torch": torch.__version__, "transformers": transformers.__version__}
        attention = self.model.config._attn_implementation
        return {"load_s": load_s, "threads": torch.get_num_threads(), "attention": attention, "versions": versions}

    def prepare(self, input: str, output: str) -> dict:
        ids = torch.from_numpy(np.load(input)).to(torch.int64)
        self.call = lambda: self.model(ids)
        out, first = self.first_call()
        np.savez(output, hidden=out.last_hidden_state.float().numpy(), pooled=out.pooler_output.float().numpy())
        return {"first_call_s": first}


if __name__ == "__main__":
    serve(Peer())
