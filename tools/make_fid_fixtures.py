"""Write tests/data/inception/: parity fixtures of `eqxdiff.eval.InceptionV3` against pytorch-fid's own
FID network (`pytorch_fid.inception.InceptionV3([3])`, built by its `fid_inception_v3()`), run with
seeded random weights.

The weights are not committed (23.9M parameters, 95 MB in float32). numpy's legacy `RandomState`
draws them from a recipe this script writes to `weights.json` — per state_dict key, in order: shape,
dtype and a uniform range (convs He-uniform, BatchNorm affines and running statistics spread around
1/0 so that eval-mode BN is not the identity; the int64 counters constant) — so the tests regenerate
the same tensors without torch; `sha256` there hashes them (key names and bytes, in order).
pytorch-fid's network loads them through its own code: its download (`load_state_dict_from_url`) is
replaced by a function returning them, and `inception.load_state_dict` checks every key strictly.
The same tensors saved as a .pth go through tools/convert_pytorch_fid.py, and every tensor of its
safetensors output is compared with them.

`reference.npz` holds uint8 NHWC inputs (`images_299` [2, 299, 299, 3], `images_64x48`, `images_32x32`),
pytorch-fid's pool3 features of the first two (`pool3_299`, `pool3_64x48`: float32 [b, 2048], computed as its
fid_score does: ToTensor's /255, then the wrapper's resize to 299 and 2x - 1), and its bilinear
resize (`F.interpolate`, align_corners=False) in NHWC: the 64×48 and 32×32 inputs at 299×299 on the
rows and columns `resize_index` (every 10th and the last two, 1 MB each in full), the 64×48 input at
23×71 (shrink h, stretch w) and the 299 inputs at 50×37, in full.

How pytorch-fid runs without torchvision's compiled ops: torchvision wheels do not load against this
CPU torch (importing `torchvision` fails at its `torchvision::nms` registration), and pytorch-fid needs
only its pure-Python `models/inception.py`. The script imports that file straight from a torchvision
wheel (zipimport) under stub `torchvision` and `torchvision.models` packages whose `__init__` never
runs, so neither `_C.so` nor the ops are loaded; the venv gets no torchvision install:

    tools/.venv/bin/pip install --no-deps pytorch-fid==0.3.0   # pillow (already there) for torchvision.transforms
    tools/.venv/bin/pip download --no-deps torchvision==0.28.0 -d /tmp/tv
    tools/.venv/bin/python tools/make_fid_fixtures.py --torchvision /tmp/tv/torchvision-0.28.0-*.whl
"""

import argparse
import hashlib
import importlib.machinery
import importlib.metadata
import json
import sys
import tempfile
import types
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.numpy import load_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from convert_pytorch_fid import convert  # a sibling script: tools/ is not a package

OUT = Path(__file__).resolve().parent.parent / "tests" / "data" / "inception"
SEED = 0
RESIZE_INDEX = np.r_[0:299:10, 297, 298]


def stub_package(name: str, path: str) -> types.ModuleType:
    """An importable package `name` whose submodules come from `path`, without running its __init__."""
    module = types.ModuleType(name)
    module.__path__ = [path]
    module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
    module.__spec__.submodule_search_locations = module.__path__
    sys.modules[name] = module
    return module


def import_torchvision_inception(wheel: Path, built: list) -> str:
    """Make `import torchvision` give pytorch-fid what it uses (`__version__`, `models.inception`,
    `models.inception_v3`) from the wheel's Python files; every network `inception_v3` builds is
    appended to `built`. Returns the version."""
    version = wheel.name.split("-")[1]
    tv = stub_package("torchvision", f"{wheel}/torchvision")
    tv.__version__ = version
    tv.models = stub_package("torchvision.models", f"{wheel}/torchvision/models")
    from torchvision.models import inception

    def inception_v3(*args, **kwargs):
        built.append(inception.inception_v3(*args, **kwargs))
        return built[-1]

    tv.models.inception, tv.models.inception_v3 = inception, inception_v3
    return version


def recipe(template: dict[str, torch.Tensor]) -> list[list]:
    """[key, shape, dtype, low, high] per state_dict entry, in order: the draws both sides replay."""
    entries = []
    for key, t in template.items():
        if key.endswith("conv.weight"):
            bound = float(np.sqrt(6.0 / np.prod(t.shape[1:])))  # He-uniform: fan_in = cin·kh·kw
            low, high = -bound, bound
        elif key.endswith(("bn.weight", "bn.running_var")):
            low, high = 0.5, 1.5
        elif key.endswith(("bn.bias", "bn.running_mean")):
            low, high = -0.2, 0.2
        elif key.startswith("fc."):
            low, high = -(2048**-0.5), 2048**-0.5  # nn.Linear's default range
        elif key.endswith("num_batches_tracked"):
            low = high = 0
        else:
            raise ValueError(f"no draw for {key}")
        entries.append([key, list(t.shape), str(t.dtype).removeprefix("torch."), low, high])
    return entries


def draw(entries: list[list], seed: int) -> dict[str, np.ndarray]:
    """The recipe's tensors (tests/eval/test_inception.py replays this loop): float32 entries drawn in
    order from one RandomState (whose stream numpy keeps fixed), int64 ones constant."""
    rng = np.random.RandomState(seed)
    out = {}
    for key, shape, dtype, low, high in entries:
        if dtype == "float32":
            out[key] = rng.uniform(low, high, size=shape).astype(np.float32)
        else:
            out[key] = np.full(shape, low, dtype=dtype)
    return out


def digest(state: dict[str, np.ndarray]) -> str:
    h = hashlib.sha256()
    for key, value in state.items():
        h.update(key.encode())
        h.update(np.ascontiguousarray(value).tobytes())
    return h.hexdigest()


def images(shape: tuple[int, ...], seed: int) -> np.ndarray:
    """Smooth gradients and waves with a few hard-edged boxes and discs: uint8 `[b, h, w, 3]` that
    compress well and have both flat regions and edges."""
    rng = np.random.RandomState(seed)
    b, h, w, _ = shape
    y, x = np.mgrid[0:h, 0:w] / max(h, w)
    out = np.empty(shape, np.float64)
    for i in range(b):
        for c in range(3):
            a, f, p = rng.uniform(-1, 1, 2), rng.uniform(2, 12), rng.uniform(0, 2 * np.pi)
            out[i, :, :, c] = 128 + 60 * (a[0] * x + a[1] * y) + 50 * np.sin(f * (x + y) + p)
        for _ in range(4):
            y0, x0, r = rng.uniform(0, 1), rng.uniform(0, w / max(h, w)), rng.uniform(0.05, 0.25)
            box = rng.rand() < 0.5
            inside = (np.abs(y - y0) < r) & (np.abs(x - x0) < r) if box else (y - y0) ** 2 + (x - x0) ** 2 < r**2
            out[i][inside] = rng.uniform(0, 255, 3)
    return np.clip(np.round(out), 0, 255).astype(np.uint8)


def to_torch(u8: np.ndarray) -> torch.Tensor:
    """NHWC uint8 -> NCHW float in [0, 1], as torchvision's ToTensor in pytorch-fid's fid_score."""
    return torch.from_numpy(u8).permute(0, 3, 1, 2).float().div(255)


def nhwc(t: torch.Tensor) -> np.ndarray:
    return t.permute(0, 2, 3, 1).numpy()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--torchvision", type=Path, required=True, help="a torchvision wheel (its .py files are read)")
    args = parser.parse_args()
    torch.set_num_threads(1)  # a shared 2-core box

    built: list = []
    tv_version = import_torchvision_inception(args.torchvision.resolve(), built)
    import pytorch_fid.inception as fid

    entries: list = []

    def random_weights(url: str, progress: bool = True) -> dict[str, torch.Tensor]:
        """Stands in for the download inside fid_inception_v3(): random weights shaped like the
        network it has just patched (built[-1])."""
        entries.extend(recipe(built[-1].state_dict()))
        return {k: torch.from_numpy(v) for k, v in draw(entries, SEED).items()}

    fid.load_state_dict_from_url = random_weights
    model = fid.InceptionV3([fid.InceptionV3.BLOCK_INDEX_BY_DIM[2048]]).eval()
    state = draw(entries, SEED)

    with tempfile.TemporaryDirectory() as tmp:  # the converter on the same weights, saved as a .pth
        pth, converted = Path(tmp) / "random_fid_inception.pth", Path(tmp) / "random_fid_inception.safetensors"
        torch.save({k: torch.from_numpy(v) for k, v in state.items()}, pth)
        convert(pth, converted)
        back = load_file(str(converted))
        assert set(back) == set(state) and all(
            back[k].dtype == v.dtype and np.array_equal(back[k], v) for k, v in state.items()
        ), "convert_pytorch_fid.py changed the weights"

    inputs = {
        "images_299": images((2, 299, 299, 3), seed=1),
        "images_64x48": images((1, 64, 48, 3), seed=2),
        "images_32x32": images((1, 32, 32, 3), seed=3),
    }
    ref = dict(inputs, resize_index=RESIZE_INDEX)
    with torch.no_grad():
        for name in ("images_299", "images_64x48"):
            u8 = inputs[name]
            ref[name.replace("images", "pool3")] = model(to_torch(u8))[0][:, :, 0, 0].numpy()
            exact = model.double()(to_torch(u8).double())[0][:, :, 0, 0].numpy()
            model.float()
            err = np.abs(ref[name.replace("images", "pool3")] - exact).max() / np.abs(exact).max()
            print(f"{name}: pytorch-fid float32 vs float64 {err:.2e} (max abs diff / max abs)")
        for name in ("images_64x48", "images_32x32"):
            full = F.interpolate(to_torch(inputs[name]), size=(299, 299), mode="bilinear", align_corners=False)
            ref[name.replace("images", "resized")] = nhwc(full)[:, RESIZE_INDEX][:, :, RESIZE_INDEX]
        for name, source, size in (
            ("resized_64x48_to_23x71", "images_64x48", (23, 71)),
            ("resized_299_to_50x37", "images_299", (50, 37)),
        ):
            ref[name] = nhwc(F.interpolate(to_torch(inputs[source]), size=size, mode="bilinear", align_corners=False))

    features = ref["pool3_299"]
    print(f"pool3 features: mean {features.mean():.3f}, std {features.std():.3f}, zero {np.mean(features == 0):.3f}")
    OUT.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(OUT / "reference.npz", **ref)
    meta = {
        "seed": SEED,
        "sha256": digest(state),
        "versions": {
            "torch": torch.__version__,
            "torchvision": tv_version,
            "pytorch-fid": importlib.metadata.version("pytorch-fid"),
        },
        "entries": entries,
    }
    head = json.dumps({k: v for k, v in meta.items() if k != "entries"}, indent=1).removesuffix("\n}")
    rows = ",\n".join("  " + json.dumps(entry) for entry in entries)  # one line per key: a readable diff
    (OUT / "weights.json").write_text(f'{head},\n "entries": [\n{rows}\n ]\n}}\n')
    for path in sorted(OUT.iterdir()):
        print(f"{path}: {path.stat().st_size / 1e3:.0f} kB")


if __name__ == "__main__":
    main()
