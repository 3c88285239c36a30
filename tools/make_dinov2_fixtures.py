"""Write tests/data/dinov2/: small random-weight DINOv2 towers as transformers saves them, with transformers'
outputs, and FD-DINOv2's pieces as NVlabs/edm2's calculate_metrics.py computes them, for tests/nn/test_dinov2.py
and tests/eval/test_fd_dinov2.py.

Towers (`<name>/config.json`, `model.safetensors` from transformers' `save_pretrained`, which writes the keys
facebook/dinov2-* hold: `attention.attention.query`, `attention.output.dense`, SwiGLU's fused `mlp.weights_in`;
`reference.npz`: NHWC float32 inputs `pixels_<i>` and transformers' `last_hidden_state_<i>`, `pooler_output_<i>`):

| name | what it exercises |
|---|---|
| `small` | `Dinov2Model`, width 32, 2 layers x 4 heads, patch 4, a 4x4 position grid; inputs at 16x16 (the grid), 24x20 and 8x12 (bicubic interpolation up and down, non-square) |
| `swiglu` | ViT-g's SwiGLU MLP (`use_swiglu_ffn`), width 24, 3 heads, patch 2, a 5x5 grid, layer_norm_eps 1e-5; inputs 10x10 and 14x6 |
| `registers` | `Dinov2WithRegistersModel`, 4 registers, patch 4, a 3x3 grid (antialiased interpolation); inputs 12x12 and 20x16 |

Every LayerNorm affine, Linear bias, layer scale, cls/mask/register token and the position embeddings are
moved off their init (transformers' would leave layer scales 1 and biases 0: untested), and the weights drawn at
unit gain (N(0, 1/fan_in)): at the init's std 0.02 the CLS token hardly depends on the image.

`full_size.json`: the configs of facebook/dinov2-{small,base,large,giant} and dinov2-with-registers-large
(patch 14, image_size 518) and transformers' `num_parameters()` of each, built on the meta device.

FD-DINOv2 (`fd_dinov2/`): EDM2's `DINOv2Detector` (imported from a clone given as `--edm2`, not copied: CC
BY-NC-SA) with its torch.hub model replaced by the same architecture built from facebookresearch/dinov2's
`DinoVisionTransformer` (a clone given as `--dinov2`, Apache 2.0; img_size 518, patch 14, width 32, 2 layers,
interpolate_offset 0.1 without antialias: the hub's `dinov2_vitl14` settings), random weights, converted to
transformers' layout (`fd_dinov2/tower/`: checked equal to the hub model on a 518x518 input). `reference.npz`:
uint8 NHWC image sets `a` (48 of 32x32, uniform noise) and `b` (48 of 40x24,
8x8 blocks), `features_a`, `features_b` (the detector's
output: resize to 224 bicubic antialiased, /255, ImageNet mean/std, the normed CLS token), the statistics
`calculate_stats_for_iterable` accumulates (`mu_a`, `sigma_a`, `mu_b`, `sigma_b`, float64),
`calculate_metrics_from_stats`' `fd` between them, and `resized_<i>`: torch's
`interpolate(bicubic, antialias=True)` to 224 of `resize_in_<i>` (a 300x200 and a 7x9 one-channel image).

    tools/.venv/bin/python tools/make_dinov2_fixtures.py --edm2 PATH/TO/edm2 --dinov2 PATH/TO/dinov2
"""

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
from transformers import Dinov2Config, Dinov2Model, Dinov2WithRegistersConfig, Dinov2WithRegistersModel

OUT = Path(__file__).resolve().parent.parent / "tests" / "data" / "dinov2"
TOWERS = {  # name: (model class, config class, config, input sizes (h, w))
    "small": (
        Dinov2Model,
        Dinov2Config,
        dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, image_size=16, patch_size=4),
        [(16, 16), (24, 20), (8, 12)],
    ),
    "swiglu": (
        Dinov2Model,
        Dinov2Config,
        dict(
            hidden_size=24,
            num_hidden_layers=2,
            num_attention_heads=3,
            image_size=10,
            patch_size=2,
            use_swiglu_ffn=True,
            layer_norm_eps=1e-5,
        ),
        [(10, 10), (14, 6)],
    ),
    "registers": (
        Dinov2WithRegistersModel,
        Dinov2WithRegistersConfig,
        dict(
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            image_size=12,
            patch_size=4,
            num_register_tokens=4,
        ),
        [(12, 12), (20, 16)],
    ),
}
FULL_SIZE = {  # the released configs' shaping fields (facebook/dinov2-*/config.json)
    "dinov2-small": dict(hidden_size=384, num_hidden_layers=12, num_attention_heads=6),
    "dinov2-base": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12),
    "dinov2-large": dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16),
    "dinov2-giant": dict(hidden_size=1536, num_hidden_layers=40, num_attention_heads=24, use_swiglu_ffn=True),
    "dinov2-with-registers-large": dict(
        hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, num_register_tokens=4
    ),
}


def randomise(model: torch.nn.Module, gen: torch.Generator) -> None:
    """Move every parameter that transformers initialises to a constant off it."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if name.endswith(("norm1.weight", "norm2.weight", "layernorm.weight", "lambda1")):
                p.copy_(1 + 0.3 * noise)
            elif name.endswith("bias") or "token" in name:
                p.copy_(0.2 * noise)
            elif "position_embeddings" in name:
                p.copy_(0.5 * noise)
            elif p.ndim >= 2:  # Linear and conv weights at unit gain: the init's std 0.02 leaves the CLS token
                p.copy_(noise / np.sqrt(p[0].numel()))  # almost independent of the image


def towers() -> None:
    for name, (model_cls, config_cls, config, sizes) in TOWERS.items():
        torch.manual_seed(0)
        gen = torch.Generator().manual_seed(len(name))
        model = model_cls(config_cls(**config)).eval()
        randomise(model, gen)
        folder = OUT / name
        folder.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(folder)
        loaded, info = model_cls.from_pretrained(folder, output_loading_info=True)
        assert not any(info.values()), info  # the saved keys load back whole
        refs = {}
        for i, (h, w) in enumerate(sizes):
            x = torch.randn(2, 3, h, w, generator=gen)
            with torch.no_grad():
                out = loaded.eval()(x)
            refs[f"pixels_{i}"] = x.permute(0, 2, 3, 1).numpy()
            refs[f"last_hidden_state_{i}"] = out.last_hidden_state.numpy()
            refs[f"pooler_output_{i}"] = out.pooler_output.numpy()
        np.savez_compressed(folder / "reference.npz", **refs)
        print(name, model.num_parameters(), "params")


def full_size() -> None:
    out = {}
    for name, shaping in FULL_SIZE.items():
        registers = "registers" in name
        config_cls, model_cls = (
            (Dinov2WithRegistersConfig, Dinov2WithRegistersModel) if registers else (Dinov2Config, Dinov2Model)
        )
        config = dict(image_size=518, patch_size=14, **shaping)
        with torch.device("meta"):
            model = model_cls(config_cls(**config))
        out[name] = {
            "config": {"model_type": config_cls.model_type, **config},
            "num_parameters": model.num_parameters(),
        }
    (OUT / "full_size.json").write_text(json.dumps(out, indent=2, sort_keys=True) + "\n")


def hub_to_transformers(state: dict[str, torch.Tensor], depth: int) -> dict[str, torch.Tensor]:
    """facebookresearch/dinov2's state_dict in transformers' saved layout (its conversion's key map)."""
    out = {
        "embeddings.cls_token": state["cls_token"],
        "embeddings.mask_token": state["mask_token"],
        "embeddings.position_embeddings": state["pos_embed"],
        "embeddings.patch_embeddings.projection.weight": state["patch_embed.proj.weight"],
        "embeddings.patch_embeddings.projection.bias": state["patch_embed.proj.bias"],
        "layernorm.weight": state["norm.weight"],
        "layernorm.bias": state["norm.bias"],
    }
    for i in range(depth):
        hub, hf = f"blocks.{i}.", f"encoder.layer.{i}."
        for kind in ("weight", "bias"):
            for qkv, part in zip(("query", "key", "value"), state[f"{hub}attn.qkv.{kind}"].chunk(3), strict=True):
                out[f"{hf}attention.attention.{qkv}.{kind}"] = part
            out[f"{hf}attention.output.dense.{kind}"] = state[f"{hub}attn.proj.{kind}"]
            for n in ("norm1", "norm2", "mlp.fc1", "mlp.fc2"):
                out[f"{hf}{n}.{kind}"] = state[f"{hub}{n}.{kind}"]
        out[f"{hf}layer_scale1.lambda1"] = state[f"{hub}ls1.gamma"]
        out[f"{hf}layer_scale2.lambda1"] = state[f"{hub}ls2.gamma"]
    return {k: v.contiguous() for k, v in out.items()}


def fd_dinov2(edm2: Path, dinov2: Path) -> None:
    sys.path[:0] = [str(edm2), str(dinov2)]
    import calculate_metrics  # noqa: PLC0415 — EDM2's, from the clone
    from dinov2.models.vision_transformer import DinoVisionTransformer  # noqa: PLC0415 — the hub model's class

    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
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
    with torch.no_grad():
        for name, p in hub.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if name.endswith(("norm1.weight", "norm2.weight", "norm.weight", "gamma")):
                p.copy_(1 + 0.3 * noise)
            elif name.endswith("bias") or "token" in name:
                p.copy_(0.2 * noise)
            elif name == "pos_embed":
                p.copy_(0.5 * noise)
            elif p.ndim >= 2:  # as in randomise
                p.copy_(noise / np.sqrt(p[0].numel()))
    folder = OUT / "fd_dinov2" / "tower"
    folder.mkdir(parents=True, exist_ok=True)
    config = Dinov2Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, image_size=518, patch_size=14)
    model = Dinov2Model(config).eval()
    model.save_pretrained(folder)  # config.json; the weights are the hub model's, below
    from safetensors.torch import save_file  # noqa: PLC0415

    save_file(hub_to_transformers(hub.state_dict(), 2), str(folder / "model.safetensors"), metadata={"format": "pt"})
    model, info = Dinov2Model.from_pretrained(folder, output_loading_info=True)
    assert not any(info.values()), info
    x = torch.randn(1, 3, 518, 518, generator=gen)
    with torch.no_grad():  # the converted folder is the hub model (at its own size: no interpolation)
        torch.testing.assert_close(model.eval()(x).pooler_output, hub(x), rtol=0, atol=1e-5)

    detector = object.__new__(calculate_metrics.DINOv2Detector)  # its __init__ would fetch the hub weights
    detector.feature_dim, detector.resize_mode, detector.model = 32, "torch", hub
    calculate_metrics._detector_cache["fd_dinov2"] = detector
    with tempfile.TemporaryDirectory() as tmp:
        torch.distributed.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=0, world_size=1)
        rng = np.random.default_rng(0)
        sets = {
            "a": rng.integers(0, 256, (48, 32, 32, 3), dtype=np.uint8),
            "b": np.kron(rng.integers(0, 256, (48, 5, 3, 3)), np.ones((1, 8, 8, 1))).astype(np.uint8),
        }
        refs: dict[str, np.ndarray] = {}
        stats = {}
        for key, images in sets.items():
            batches = [torch.from_numpy(images[i : i + 20]).permute(0, 3, 1, 2) for i in range(0, 48, 20)]
            with torch.no_grad():
                refs[f"features_{key}"] = torch.cat([detector(b) for b in batches]).numpy()
                for r in calculate_metrics.calculate_stats_for_iterable(
                    batches, metrics=["fd_dinov2"], verbose=False, device=torch.device("cpu")
                ):
                    pass
            stats[key] = r.stats
            refs[key] = images
            refs[f"mu_{key}"], refs[f"sigma_{key}"] = r.stats["fd_dinov2"]["mu"], r.stats["fd_dinov2"]["sigma"]
        torch.distributed.destroy_process_group()
    fd = calculate_metrics.calculate_metrics_from_stats(stats["a"], stats["b"], metrics=["fd_dinov2"], verbose=False)
    refs["fd"] = np.float64(fd["fd_dinov2"])
    for i, (h, w) in enumerate([(300, 200), (7, 9)]):
        image = torch.from_numpy(rng.integers(0, 256, (1, 1, h, w)).astype(np.float32))  # one channel: smaller
        refs[f"resize_in_{i}"] = image.permute(0, 2, 3, 1).numpy()
        resized = torch.nn.functional.interpolate(image, size=(224, 224), mode="bicubic", antialias=True)
        refs[f"resized_{i}"] = resized.permute(0, 2, 3, 1).numpy()
    np.savez_compressed(OUT / "fd_dinov2" / "reference.npz", **refs)
    print("fd_dinov2", refs["fd"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--edm2", type=Path, required=True, help="a clone of github.com/NVlabs/edm2")
    parser.add_argument("--dinov2", type=Path, required=True, help="a clone of github.com/facebookresearch/dinov2")
    args = parser.parse_args()
    torch.set_num_threads(1)
    OUT.mkdir(parents=True, exist_ok=True)
    towers()
    full_size()
    fd_dinov2(args.edm2.resolve(), args.dinov2.resolve())


if __name__ == "__main__":
    main()
