"""Write single-file (original LDM / FLUX names) autoencoder fixtures under tests/data/ldm_vae/,
with reference outputs from diffusers' own converter, for `AutoencoderKL.from_single_file`.

Per fixture <name>/: the single file, as the LDM code names its state_dict (CompVis'
`ldm/modules/diffusionmodules/model.py`: `encoder.down.<i>.block.<j>`, `mid.attn_1.q` as 1x1
convs [c, c, 1, 1], `decoder.up.<i>` counted from the bottom, `norm_out`, `nin_shortcut`),
written here from that layout with seeded random values; config.json, the diffusers config the
test passes as `config=`; and reference.npz (NHWC float32: x, posterior mean and logvar, z and
decode(z)) from diffusers' `AutoencoderKL` holding what diffusers' `convert_ldm_vae_checkpoint`
makes of the file (loaded with `strict=True`; the script also checks that the converter used every
VAE key, so the names here are the ones diffusers reads).

    tools/.venv/bin/python tools/make_ldm_vae_fixtures.py
"""

import json
from pathlib import Path

import numpy as np
import torch
from diffusers import AutoencoderKL
from diffusers.loaders.single_file_utils import convert_ldm_vae_checkpoint
from safetensors.torch import save_file

OUT = Path(__file__).resolve().parent.parent / "tests" / "data" / "ldm_vae"

# name: (diffusers config, file name, key prefix, extra non-VAE keys, image (h, w), batch)
FIXTURES = {
    # A whole SD checkpoint's VAE part: `first_stage_model.` keys next to a UNet's and a text tower's.
    "sd_checkpoint": (
        dict(
            block_out_channels=[4, 8, 8],
            layers_per_block=2,
            latent_channels=4,
            norm_num_groups=2,
            scaling_factor=0.18215,
        ),
        "sd_checkpoint.safetensors",
        "first_stage_model.",
        [
            "model.diffusion_model.input_blocks.0.0.weight",
            "cond_stage_model.transformer.text_model.final_layer_norm.weight",
        ],
        (16, 16),
        2,
    ),
    # FLUX's ae.safetensors: bare keys, 16 latent channels, no quant convs, a shift; non-square images.
    "flux_ae": (
        dict(
            block_out_channels=[4, 8],
            layers_per_block=1,
            latent_channels=16,
            norm_num_groups=2,
            use_quant_conv=False,
            use_post_quant_conv=False,
            scaling_factor=0.3611,
            shift_factor=0.1159,
        ),
        "ae.safetensors",
        "",
        [],
        (8, 12),
        2,
    ),
}


def ldm_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """Every state_dict key and torch shape of LDM's `AutoencoderKL(ddconfig, embed_dim)` for a diffusers
    config (ch_mult = widths, num_res_blocks = layers_per_block, z_channels = embed_dim = latent)."""
    widths, n, z = cfg["block_out_channels"], cfg["layers_per_block"], cfg["latent_channels"]
    shapes: dict[str, tuple[int, ...]] = {}

    def conv(name, cin, cout, k=3):
        shapes[f"{name}.weight"], shapes[f"{name}.bias"] = (cout, cin, k, k), (cout,)

    def norm(name, c):
        shapes[f"{name}.weight"], shapes[f"{name}.bias"] = (c,), (c,)

    def resnet(name, cin, cout):
        norm(f"{name}.norm1", cin), conv(f"{name}.conv1", cin, cout)
        norm(f"{name}.norm2", cout), conv(f"{name}.conv2", cout, cout)
        if cin != cout:
            conv(f"{name}.nin_shortcut", cin, cout, 1)

    def mid(side, c):
        resnet(f"{side}.mid.block_1", c, c)
        norm(f"{side}.mid.attn_1.norm", c)
        for proj in ("q", "k", "v", "proj_out"):
            conv(f"{side}.mid.attn_1.{proj}", c, c, 1)
        resnet(f"{side}.mid.block_2", c, c)

    conv("encoder.conv_in", cfg.get("in_channels", 3), widths[0])
    cin = widths[0]
    for i, w in enumerate(widths):
        for j in range(n):
            resnet(f"encoder.down.{i}.block.{j}", cin if j == 0 else w, w)
        cin = w
        if i != len(widths) - 1:
            conv(f"encoder.down.{i}.downsample.conv", w, w)
    mid("encoder", widths[-1])
    norm("encoder.norm_out", widths[-1]), conv("encoder.conv_out", widths[-1], 2 * z)
    conv("decoder.conv_in", z, widths[-1])
    mid("decoder", widths[-1])
    cin = widths[-1]
    for i in reversed(range(len(widths))):
        for j in range(n + 1):
            resnet(f"decoder.up.{i}.block.{j}", cin if j == 0 else widths[i], widths[i])
        cin = widths[i]
        if i != 0:
            conv(f"decoder.up.{i}.upsample.conv", widths[i], widths[i])
    norm("decoder.norm_out", widths[0]), conv("decoder.conv_out", widths[0], cfg.get("out_channels", 3))
    if cfg.get("use_quant_conv", True):
        conv("quant_conv", 2 * z, 2 * z, 1)
    if cfg.get("use_post_quant_conv", True):
        conv("post_quant_conv", z, z, 1)
    return shapes


def random_state(shapes: dict, seed: int) -> dict[str, torch.Tensor]:
    """Weights ~ N(0, 1/fan_in), biases 0.1·N(0,1), GroupNorm affines 1 + 0.2·N(0,1) and 0.2·N(0,1)."""
    gen = torch.Generator().manual_seed(seed)
    state = {}
    for key, shape in shapes.items():
        x = torch.randn(shape, generator=gen)
        if len(shape) > 1:
            x = x / np.sqrt(np.prod(shape[1:]))
        elif ".norm" in key or "norm_out" in key or key.endswith("attn_1.norm.weight"):
            x = (1 if key.endswith("weight") else 0) + 0.2 * x
        else:
            x = 0.1 * x
        state[key] = x.contiguous()
    return state


def nhwc(t: torch.Tensor) -> np.ndarray:
    return t.detach().permute(0, 2, 3, 1).contiguous().numpy().astype(np.float32)


def main() -> None:
    torch.set_num_threads(1)
    for seed, (name, (cfg, file_name, prefix, extra, (h, w), batch)) in enumerate(FIXTURES.items()):
        levels = len(cfg["block_out_channels"])
        config = {
            "_class_name": "AutoencoderKL",
            "down_block_types": ["DownEncoderBlock2D"] * levels,
            "up_block_types": ["UpDecoderBlock2D"] * levels,
            **cfg,
        }
        vae_keys = random_state(ldm_shapes(config), seed)
        gen = torch.Generator().manual_seed(1000 + seed)
        others = {k: torch.randn(3, generator=gen) for k in extra}  # another model's keys in the same file
        checkpoint = {f"{prefix}{k}": v for k, v in vae_keys.items()} | others
        converted = convert_ldm_vae_checkpoint(checkpoint, config)
        if len(converted) != len(vae_keys):
            raise RuntimeError(f"{name}: diffusers converted {len(converted)} of the {len(vae_keys)} VAE keys")
        vae = AutoencoderKL(**{k: v for k, v in config.items() if not k.startswith("_")}).eval()
        vae.load_state_dict(converted, strict=True)
        gen = torch.Generator().manual_seed(100 + seed)
        f = 2 ** (levels - 1)
        x = torch.rand(batch, 3, h, w, generator=gen) * 2 - 1
        z = torch.randn(batch, cfg["latent_channels"], h // f, w // f, generator=gen)
        with torch.no_grad():
            posterior = vae.encode(x).latent_dist
            y = vae.decode(z).sample
        refs = {
            "x": nhwc(x),
            "mean": nhwc(posterior.mean),
            "logvar": nhwc(posterior.logvar),
            "z": nhwc(z),
            "decoded": nhwc(y),
        }
        folder = OUT / name
        folder.mkdir(parents=True, exist_ok=True)
        save_file(checkpoint, str(folder / file_name))
        (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        np.savez_compressed(folder / "reference.npz", **refs)
        print(name, len(vae_keys), "VAE keys,", len(others), "other keys,", sum(v.numel() for v in vae_keys.values()))


if __name__ == "__main__":
    main()
