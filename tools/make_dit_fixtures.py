"""Write tests/data/dit/: a small random-weight DiT built by the official code (facebookresearch/DiT's
`models.py`), saved the ways DiT's checkpoints are published, and its outputs, for
tests/pretrained/test_pretrained_dit.py (eqxdiff.pretrained.load_dit reads them without torch).

The official model code is imported from a clone of https://github.com/facebookresearch/DiT given as
`--dit` (written against commit ed81ce2229091fd4ecc9a223645f95cf379d582b); it is not copied here:
DiT's code and weights are under CC BY-NC 4.0 (its LICENSE.txt). Its `models.py` imports timm's
`PatchEmbed`, `Attention` and `Mlp`; where timm does not import (it needs torchvision), the three
stand-ins below compute what timm's do for DiT's arguments (timm/layers/{patch_embed,attention,mlp}.py,
Apache-2.0; the unfused attention path, softmax(q·scale @ kᵀ) @ v) and have its state_dict names.

- `train_checkpoint.pt`: what DiT's train.py saves, `{"model", "ema", "opt", "args"}` (torch.save's
  zip format), "args" an argparse.Namespace; "ema" is the network below, "model" the same network
  moved further (so a loader that takes "model" fails), "opt" an AdamW state_dict.
- `ema_legacy.pt`: the bare "ema" state_dict as DiT-XL-2-256x256.pt is published, in torch's legacy
  (pre-zip) format; `ema.safetensors`: the same state_dict as safetensors.
- `reference.npz`: inputs `x` [b, h, w, c] (NHWC), `t` [b], `y` [b] (the last one the null class
  `num_classes`) and `out` = the official `forward(x, t, y)` in eval mode, transposed to NHWC
  [b, h, w, 2c]; `config.json`: the constructor arguments.
- `official_shapes.json`: every state_dict key's shape for DiT-S/2, DiT-B/4, DiT-L/8 and DiT-XL/2
  at 256² (latent 32) and DiT-XL/2 at 512², built on torch's meta device (no weights).

The network: depth 2, hidden 32, 2 heads, patch 2, input 8, 4 channels, 10 classes, learn_sigma;
every trainable parameter moved off its init by N(0, 0.2²) (adaLN-Zero's zeros included), the
frozen sin-cos `pos_embed` left as the official code sets it.

    tools/.venv/bin/python tools/make_dit_fixtures.py --dit PATH/TO/DiT
"""

import argparse
import json
import sys
import types
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file
from torch import nn

OUT = Path(__file__).resolve().parent.parent / "tests" / "data" / "dit"
CONFIG = dict(
    input_size=8, patch_size=2, in_channels=4, hidden_size=32, depth=2, num_heads=2, num_classes=10, learn_sigma=True
)
SHAPE_MODELS = [("DiT-S/2", 32), ("DiT-B/4", 32), ("DiT-L/8", 32), ("DiT-XL/2", 32), ("DiT-XL/2", 64)]


class PatchEmbed(nn.Module):
    """timm's PatchEmbed for DiT's use: a p×p stride-p conv, tokens [N, H/p·W/p, D] row-major."""

    def __init__(self, img_size, patch_size, in_chans, embed_dim, bias=True):
        super().__init__()
        self.img_size, self.patch_size = (img_size, img_size), (patch_size, patch_size)
        self.grid_size = (img_size // patch_size, img_size // patch_size)
        self.num_patches = self.grid_size[0] * self.grid_size[1]
        self.proj = nn.Conv2d(in_chans, embed_dim, patch_size, stride=patch_size, bias=bias)
        self.norm = nn.Identity()

    def forward(self, x):
        return self.norm(self.proj(x).flatten(2).transpose(1, 2))


class Attention(nn.Module):
    """timm's Attention without q/k norms: qkv split as (3, heads, head_dim), proj. `fused_attn` as timm's:
    torch's scaled_dot_product_attention (timm's default on torch 2), else the unfused path, which wrote
    the committed fixtures (the two agree to float32 rounding)."""

    fused_attn = False  # the fixtures'; benchmarks/dit_sampling_torch_peer.py times timm's default, fused

    def __init__(self, dim, num_heads=8, qkv_bias=False, attn_drop=0.0, proj_drop=0.0):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.scale = self.head_dim**-0.5
        self.qkv = nn.Linear(dim, 3 * dim, bias=qkv_bias)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        b, n, c = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        if self.fused_attn:
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        else:
            out = ((q * self.scale) @ k.transpose(-2, -1)).softmax(dim=-1) @ v
        return self.proj(out.transpose(1, 2).reshape(b, n, c))


class Mlp(nn.Module):
    """timm's Mlp: fc1 -> act -> fc2 (dropout 0, no norm)."""

    def __init__(self, in_features, hidden_features=None, act_layer=nn.GELU, drop=0.0):
        super().__init__()
        self.fc1, self.act = nn.Linear(in_features, hidden_features), act_layer()
        self.fc2 = nn.Linear(hidden_features, in_features)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


def official_models(dit: Path):
    """DiT's models.py from the clone, with timm's three layers stood in where timm does not import."""
    try:
        import timm.models.vision_transformer  # noqa: F401
    except ImportError:
        vit = types.ModuleType("timm.models.vision_transformer")
        vit.PatchEmbed, vit.Attention, vit.Mlp = PatchEmbed, Attention, Mlp
        for name in ("timm", "timm.models"):
            sys.modules[name] = types.ModuleType(name)
        sys.modules["timm.models.vision_transformer"] = vit
    if not (dit / "models.py").is_file():
        raise SystemExit(f"--dit {dit}: no models.py there; pass a clone of github.com/facebookresearch/DiT")
    sys.path.insert(0, str(dit))
    import models

    return models


def write_reference(folder: Path, x, t, y, out, config: dict) -> None:
    """reference.npz (inputs and the official output, NHWC) and config.json: what the parity tests read."""
    np.savez(
        folder / "reference.npz",
        x=x.permute(0, 2, 3, 1).numpy(),
        t=t.numpy(),
        y=y.numpy().astype(np.int32),
        out=out.permute(0, 2, 3, 1).numpy(),
    )
    (folder / "config.json").write_text(json.dumps(config, indent=1) + "\n")


def perturbed(model: nn.Module, gen: torch.Generator, std: float) -> dict:
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(std * torch.randn(p.shape, generator=gen))
    return {k: v.clone() for k, v in model.state_dict().items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dit", type=Path, required=True, help="a clone of github.com/facebookresearch/DiT")
    models = official_models(parser.parse_args().dit)
    OUT.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    model = models.DiT(**CONFIG).eval()
    ema = perturbed(model, gen, 0.2)  # large enough that GELU(tanh) vs exact moves the output by 1e-4
    x = torch.randn(4, CONFIG["in_channels"], CONFIG["input_size"], CONFIG["input_size"], generator=gen)
    t = torch.tensor([0.0, 17.0, 500.0, 999.0])
    y = torch.tensor([0, 3, 9, CONFIG["num_classes"]])
    with torch.no_grad():
        out = model(x, t, y)
    assert out.shape[1] == 2 * CONFIG["in_channels"] and out.abs().mean() > 0.1, "a degenerate reference"
    trained = perturbed(model, gen, 0.05)  # "model": moved on from "ema"
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0)  # train.py's optimizer
    args = argparse.Namespace(model="DiT-XL/2", image_size=64, num_classes=CONFIG["num_classes"], global_seed=0)
    checkpoint = {"model": trained, "ema": ema, "opt": opt.state_dict(), "args": args}
    torch.save(checkpoint, OUT / "train_checkpoint.pt")
    torch.save(ema, OUT / "ema_legacy.pt", _use_new_zipfile_serialization=False)
    save_file({k: v.contiguous() for k, v in ema.items()}, OUT / "ema.safetensors")
    write_reference(OUT, x, t, y, out, CONFIG)
    shapes = {}
    for name, size in SHAPE_MODELS:
        with torch.device("meta"):
            net = models.DiT_models[name](input_size=size, num_classes=1000)
        shapes[f"{name} {size * 8}"] = {k: list(v.shape) for k, v in net.state_dict().items()}
    (OUT / "official_shapes.json").write_text(json.dumps(shapes, separators=(",", ":")) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
