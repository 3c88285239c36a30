"""Write tests/data/repa/reference.npz: REPA's projection loss as sihyun-yu/REPA computes it, for
tests/training/test_repa.py.

From a clone given as `--repa` (written against commit 67f7145; its code is imported, not copied): `build_mlp`
(models/sit.py; timm, which that file imports for the SiT blocks, is stood in by empty names) makes a projector
(hidden 24, projector_dim 40, z_dim 32: the DINOv2 tower of tests/data/dinov2/fd_dinov2/tower, width 32), and
`SILoss.__call__` (loss.py) gives the projection loss for a stand-in model that returns the projected tokens.
The targets: train.py's DINOv2 preprocessing (÷255, ImageNet's mean/std, `interpolate(bicubic)` to
224·(256 // 256) = 224; written out here: train.py imports accelerate and the whole training stack) and the
hub tower's `forward_features(x)["x_norm_patchtokens"]` (facebookresearch/dinov2's `DinoVisionTransformer`, a
clone given as `--dinov2`, with the fixture tower's weights mapped back to its names).

reference.npz: `images` (uint8 [2, 256, 256, 3], 8×8 blocks: small to store), `targets` [2, 256, 32]
(the patch tokens), `tokens` [2, 256, 24] (stand-in DiT tokens), the projector's weights (`fc<i>_weight` [out, in],
`fc<i>_bias`), `projected` and `proj_loss` (SILoss's, a scalar: its per-batch value, REPA's `proj_loss.mean()`).

    tools/.venv/bin/python tools/make_repa_fixture.py --repa PATH/TO/REPA --dinov2 PATH/TO/dinov2
"""

import argparse
import sys
import types
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parent.parent / "tests" / "data"
OUT = ROOT / "repa"
TOWER = ROOT / "dinov2" / "fd_dinov2" / "tower"
MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)  # timm's IMAGENET_DEFAULT_MEAN/STD


def hub_state(state: dict[str, torch.Tensor], depth: int) -> dict[str, torch.Tensor]:
    """transformers' saved DINOv2 keys back to facebookresearch/dinov2's (make_dinov2_fixtures.py's map inverted)."""
    out = {
        "cls_token": state["embeddings.cls_token"],
        "mask_token": state["embeddings.mask_token"],
        "pos_embed": state["embeddings.position_embeddings"],
        "patch_embed.proj.weight": state["embeddings.patch_embeddings.projection.weight"],
        "patch_embed.proj.bias": state["embeddings.patch_embeddings.projection.bias"],
        "norm.weight": state["layernorm.weight"],
        "norm.bias": state["layernorm.bias"],
    }
    for i in range(depth):
        hub, hf = f"blocks.{i}.", f"encoder.layer.{i}."
        for kind in ("weight", "bias"):
            out[f"{hub}attn.qkv.{kind}"] = torch.cat(
                [state[f"{hf}attention.attention.{n}.{kind}"] for n in ("query", "key", "value")]
            )
            out[f"{hub}attn.proj.{kind}"] = state[f"{hf}attention.output.dense.{kind}"]
            for n in ("norm1", "norm2", "mlp.fc1", "mlp.fc2"):
                out[f"{hub}{n}.{kind}"] = state[f"{hf}{n}.{kind}"]
        out[f"{hub}ls1.gamma"] = state[f"{hf}layer_scale1.lambda1"]
        out[f"{hub}ls2.gamma"] = state[f"{hf}layer_scale2.lambda1"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repa", type=Path, required=True, help="a clone of github.com/sihyun-yu/REPA")
    parser.add_argument("--dinov2", type=Path, required=True, help="a clone of github.com/facebookresearch/dinov2")
    args = parser.parse_args()
    sys.path[:0] = [str(args.repa.resolve()), str(args.dinov2.resolve())]
    timm = types.ModuleType("timm.models.vision_transformer")  # models/sit.py's SiT blocks: not needed for build_mlp
    timm.PatchEmbed = timm.Attention = timm.Mlp = None
    sys.modules.update(
        {
            "timm": types.ModuleType("timm"),
            "timm.models": types.ModuleType("timm.models"),
            "timm.models.vision_transformer": timm,
        }
    )
    from dinov2.models.vision_transformer import DinoVisionTransformer  # noqa: PLC0415
    from loss import SILoss  # noqa: PLC0415 — REPA's
    from models.sit import build_mlp  # noqa: PLC0415 — REPA's

    torch.set_num_threads(1)
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    hub = DinoVisionTransformer(
        img_size=518,
        patch_size=14,
        embed_dim=32,
        depth=2,
        num_heads=2,
        mlp_ratio=4,
        init_values=1.0,
        ffn_layer="mlp",
        block_chunks=0,
        interpolate_offset=0.1,
        interpolate_antialias=False,
    ).eval()
    hub.load_state_dict(hub_state(load_file(str(TOWER / "model.safetensors")), 2), strict=True)
    rng = np.random.default_rng(0)
    images = np.kron(rng.integers(0, 256, (2, 32, 32, 3)), np.ones((1, 8, 8, 1))).astype(np.uint8)  # 8×8 blocks
    raw = torch.from_numpy(images).permute(0, 3, 1, 2)
    with torch.no_grad():  # train.py's preprocess_raw_image for 'dinov2', then the encoder
        x = raw / 255.0
        x = (x - torch.tensor(MEAN).view(1, 3, 1, 1)) / torch.tensor(STD).view(1, 3, 1, 1)
        x = torch.nn.functional.interpolate(x, 224 * (256 // 256), mode="bicubic")
        targets = hub.forward_features(x)["x_norm_patchtokens"]
    projector = build_mlp(24, 40, 32)
    with torch.no_grad():
        for p in projector.parameters():  # off PyTorch's init: larger, so the loss is far from 0
            p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
    tokens = torch.randn(2, targets.shape[1], 24, generator=gen)
    with torch.no_grad():
        projected = projector(tokens)
        stand_in = lambda x, t, **kwargs: (torch.zeros_like(x), [projected])  # noqa: E731 — the model REPA calls
        _, proj_loss = SILoss()(stand_in, torch.zeros(2, 4, 8, 8), zs=[targets])
    refs = {
        "images": images,
        "targets": targets.numpy(),
        "tokens": tokens.numpy(),
        "projected": projected.numpy(),
        "proj_loss": proj_loss.numpy(),
    }
    for i, layer in zip((1, 2, 3), (0, 2, 4), strict=True):
        refs[f"fc{i}_weight"] = projector[layer].weight.detach().numpy()
        refs[f"fc{i}_bias"] = projector[layer].bias.detach().numpy()
    OUT.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(OUT / "reference.npz", **refs)
    print("proj_loss", refs["proj_loss"])


if __name__ == "__main__":
    main()
