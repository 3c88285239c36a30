"""pytorch-fid's PyTorch FID network (`pytorch_fid.inception.InceptionV3([3])`) as a timing peer for
benchmarks/bench_inception.py (torch venv only).

Started once by bench_inception.py as a child process, `tools/.venv/bin/python
benchmarks/inception_torch_peer.py`, it reads one JSON command per line on stdin and answers one
JSON line on stdout (everything else it or torch prints goes to stderr). Imports torch, pytorch-fid,
numpy, safetensors, and tools/make_fid_fixtures.py + tools/convert_pytorch_fid.py by path.

pytorch-fid subclasses torchvision's Inception blocks, and torchvision wheels do not import against
this CPU torch: as tools/make_fid_fixtures.py does (its `import_torchvision_inception`, reused
here), torchvision's pure-Python `models/inception.py` is imported straight from a torchvision
wheel under stub packages, so neither its `_C.so` nor its ops load and the venv has no torchvision
install (`pip download --no-deps torchvision==0.28.0 -d /tmp/tv` gives the wheel).

Commands (answers carry "ok": true, or "error"):

- `{"cmd": "build", "torchvision": WHEEL, "weights": W.safetensors, "seed": S, "threads": T}`:
  `torch.set_num_threads(T)`, then pytorch-fid's `InceptionV3([3])` (pool3, 2048-d, its defaults
  `resize_input=True, normalize_input=True`, as fid_score builds it) in eval mode, float32, with
  random weights in place of its download: make_fid_fixtures.py's seeded recipe (convs He-uniform,
  BatchNorm affines and running statistics spread so that eval-mode BN is not the identity; numpy
  `RandomState(S)`), loaded by pytorch-fid's own `fid_inception_v3()` (strict `load_state_dict`).
  The same state_dict is saved as a .pth and turned into W.safetensors by tools/convert_pytorch_fid.py's
  `convert`, the file `eqxdiff.eval.InceptionV3.from_pytorch_fid` reads.
  -> `{"params": n (float32, fc.* left out), "build_s": s, "threads": T, "versions": {...}}`
- `{"cmd": "prepare", "input": X.npy, "output": Y.npy}`: the uint8 NHWC images in X.npy become the
  current input as fid_score feeds them (torchvision's ToTensor: NCHW float32 in [0, 1]); one call
  runs (the warm-up, timed) and its pool3 features are saved to Y.npy, float32 `[b, 2048]`.
  -> `{"first_call_s": s}`
- `{"cmd": "time", "calls": n}`: n calls on the current input, back to back. -> `{"seconds": s}`
- `{"cmd": "exit"}`

Every call is fid_score's: `model(batch)[0]` under `torch.no_grad()` (the network resizes to 299
and maps to [-1, 1] inside).
"""

import importlib.metadata
import importlib.util
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from torch_peer import TimedCalls, serve  # benchmarks/torch_peer.py (this folder is sys.path[0])

TOOLS = Path(__file__).resolve().parent.parent / "tools"


def fixtures_module():
    """tools/make_fid_fixtures.py (a script, tools/ is not a package), imported by path; it imports
    tools/convert_pytorch_fid.py's `convert` itself."""
    spec = importlib.util.spec_from_file_location("make_fid_fixtures", TOOLS / "make_fid_fixtures.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Peer(TimedCalls):
    no_grad = staticmethod(torch.no_grad)

    def __init__(self):
        self.model = None

    def build(self, torchvision: str, weights: str, seed: int, threads: int) -> dict:
        torch.set_num_threads(threads)
        start = time.perf_counter()
        fixtures = fixtures_module()
        built: list = []
        tv_version = fixtures.import_torchvision_inception(Path(torchvision).resolve(), built)
        import pytorch_fid.inception as fid

        state: dict[str, np.ndarray] = {}

        def random_weights(url: str, progress: bool = True) -> dict[str, torch.Tensor]:
            """Stands in for the download inside fid_inception_v3(): random weights shaped like the
            network it has just patched (built[-1])."""
            state.update(fixtures.draw(fixtures.recipe(built[-1].state_dict()), seed))
            return {k: torch.from_numpy(v) for k, v in state.items()}

        fid.load_state_dict_from_url = random_weights
        self.model = fid.InceptionV3([fid.InceptionV3.BLOCK_INDEX_BY_DIM[2048]]).eval()
        build_s = time.perf_counter() - start
        with tempfile.TemporaryDirectory(prefix="inception_peer_") as tmp:
            pth = Path(tmp) / "random_fid_inception.pth"
            torch.save({k: torch.from_numpy(v) for k, v in state.items()}, pth)
            fixtures.convert(pth, Path(weights))
        versions = {
            "torch": torch.__version__,
            "torchvision (python files only)": tv_version,
            "pytorch-fid": importlib.metadata.version("pytorch-fid"),
            "numpy": np.__version__,
        }
        # what pool3 reads (convs, BatchNorm affines and statistics), as eqxdiff's network holds: not fc.*
        params = int(sum(v.size for k, v in state.items() if v.dtype == np.float32 and not k.startswith("fc.")))
        return {"params": params, "build_s": build_s, "threads": torch.get_num_threads(), "versions": versions}

    def prepare(self, input: str, output: str) -> dict:
        batch = torch.from_numpy(np.load(input)).permute(0, 3, 1, 2).contiguous().float().div(255)  # ToTensor
        self.call = lambda: self.model(batch)[0]
        out, first = self.first_call()
        np.save(output, out[:, :, 0, 0].numpy().astype(np.float32))
        return {"first_call_s": first}


if __name__ == "__main__":
    serve(Peer())
