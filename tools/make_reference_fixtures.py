"""Write the AutoencoderKL parity fixtures under tests/data/autoencoder_kl/ with diffusers' PyTorch model.

Runs in its own venv (tools/README.md); eqxdiff's tests read what it writes and never import torch.
Per config <name>/: config.json, diffusion_pytorch_model.safetensors (seeded random weights,
GroupNorm affines randomised too) and reference.npz (NHWC float32: x, its posterior mean and
logvar, a latent z and decode(z)). <name>_fp16/ and <name>_bf16/ hold the first config's weights
rounded to that dtype, with references computed in float32 from the rounded weights. Full-size
architectures (the SD and FLUX VAEs) are written as state_dict shapes and diffusers' own parameter
count only: full_size_shapes.json.

    /work/torchvenv/bin/python tools/make_reference_fixtures.py
"""

import json
from pathlib import Path

import numpy as np
import torch
from diffusers import AutoencoderKL
from safetensors.torch import save_file

OUT = Path(__file__).resolve().parent.parent / "tests" / "data" / "autoencoder_kl"


def blocks(n: int) -> dict:
    return {"down_block_types": ["DownEncoderBlock2D"] * n, "up_block_types": ["UpDecoderBlock2D"] * n}


# name: (config, image size, batch)
SMALL = {
    # SD 1/2-style: 4 latent channels, quant convs, mid attention, three levels.
    "sd_like": (dict(block_out_channels=[4, 8, 8], layers_per_block=2, latent_channels=4, norm_num_groups=2,
                     scaling_factor=0.18215, **blocks(3)), 16, 2),
    # SD3/FLUX-style: 16 latent channels, no quant convs, a shift.
    "flux_like": (dict(block_out_channels=[8, 8], layers_per_block=1, latent_channels=16, norm_num_groups=4,
                       use_quant_conv=False, use_post_quant_conv=False, scaling_factor=0.3611, shift_factor=0.1159,
                       **blocks(2)), 16, 2),
    # No mid attention, one-channel images, quant_conv without post_quant_conv, groups of one channel.
    "no_attention": (dict(block_out_channels=[4, 8], layers_per_block=1, latent_channels=4, norm_num_groups=4,
                          in_channels=1, out_channels=1, use_quant_conv=True, use_post_quant_conv=False,
                          mid_block_add_attention=False, **blocks(2)), 16, 2),
}  # fmt: skip
FULL_SIZE = {
    "sd": dict(block_out_channels=[128, 256, 512, 512], layers_per_block=2, latent_channels=4, norm_num_groups=32,
               sample_size=512, scaling_factor=0.18215, **blocks(4)),
    "flux": dict(block_out_channels=[128, 256, 512, 512], layers_per_block=2, latent_channels=16, norm_num_groups=32,
                 use_quant_conv=False, use_post_quant_conv=False, scaling_factor=0.3611, shift_factor=0.1159,
                 sample_size=1024, **blocks(4)),
}  # fmt: skip


def random_vae(config: dict, seed: int) -> AutoencoderKL:
    """diffusers' init, then GroupNorm weights 1 + 0.2·N(0,1) and biases 0.2·N(0,1) (defaults are 1 and 0)."""
    torch.manual_seed(seed)
    vae = AutoencoderKL(**config).eval()
    with torch.no_grad():
        for module in vae.modules():
            if isinstance(module, torch.nn.GroupNorm):
                module.weight.copy_(1 + 0.2 * torch.randn_like(module.weight))
                module.bias.copy_(0.2 * torch.randn_like(module.bias))
    return vae


def nhwc(t: torch.Tensor) -> np.ndarray:
    return t.detach().permute(0, 2, 3, 1).contiguous().numpy().astype(np.float32)


def reference(vae: AutoencoderKL, size: int, batch: int, seed: int) -> dict:
    """x ~ U(-1, 1), its posterior moments, z ~ N(0, 1) and decode(z), all NHWC."""
    gen = torch.Generator().manual_seed(seed)
    cfg, f = vae.config, 2 ** (len(vae.config.block_out_channels) - 1)
    x = torch.rand(batch, cfg.in_channels, size, size, generator=gen) * 2 - 1
    z = torch.randn(batch, cfg.latent_channels, size // f, size // f, generator=gen)
    with torch.no_grad():
        posterior = vae.encode(x).latent_dist
        y = vae.decode(z).sample
    moments = {"mean": nhwc(posterior.mean), "logvar": nhwc(posterior.logvar)}
    return {"x": nhwc(x), **moments, "z": nhwc(z), "decoded": nhwc(y)}


def write(name: str, vae: AutoencoderKL, refs: dict, dtype: torch.dtype = torch.float32) -> None:
    folder = OUT / name
    folder.mkdir(parents=True, exist_ok=True)
    config = {k: v for k, v in dict(vae.config).items() if not k.startswith("_")}
    config = {"_class_name": "AutoencoderKL", "_diffusers_version": __import__("diffusers").__version__, **config}
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    state = {k: v.detach().to(dtype).contiguous() for k, v in vae.state_dict().items()}
    save_file(state, str(folder / "diffusion_pytorch_model.safetensors"))
    np.savez_compressed(folder / "reference.npz", **refs)
    print(name, sum(v.numel() for v in state.values()), "params", dtype)


def main() -> None:
    torch.set_num_threads(1)
    for seed, (name, (config, size, batch)) in enumerate(SMALL.items()):
        vae = random_vae(config, seed)
        write(name, vae, reference(vae, size, batch, seed=100 + seed))
        if name == "sd_like":
            for dtype, suffix in ((torch.float16, "fp16"), (torch.bfloat16, "bf16")):
                rounded = random_vae(config, seed)
                with torch.no_grad():
                    for p in rounded.parameters():
                        p.copy_(p.to(dtype).to(torch.float32))
                write(f"{name}_{suffix}", rounded, reference(rounded, size, batch, seed=100 + seed), dtype)
    full = {}
    for name, config in FULL_SIZE.items():
        with torch.device("meta"):
            vae = AutoencoderKL(**config)
        full[name] = {
            "config": {"_class_name": "AutoencoderKL", **config},
            "num_parameters": vae.num_parameters(),  # diffusers' ModelMixin count
            "shapes": {k: list(v.shape) for k, v in vae.state_dict().items()},
        }
        print(name, full[name]["num_parameters"], "params (diffusers)")
    (OUT / "full_size_shapes.json").write_text(json.dumps(full, indent=1) + "\n")


if __name__ == "__main__":
    main()
