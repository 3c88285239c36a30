"""Write the parity fixtures of `eqxdiff.sd.SDUNet` with diffusers' `UNet2DConditionModel` under
tests/data/sd_unet/<family>/: small seeded random configs of the Stable Diffusion families (SD 1.x, 2.x,
XL, and the x4 upscaler's and 2.x unCLIP's class embeddings), saved by diffusers' own `save_pretrained`
(config.json + diffusion_pytorch_model.safetensors; `sd1_like` also as the `fp16` variant, `sdxl_like` in
shards with an index), and reference.npz.

Every parameter is moved off diffusers' init (norm scales 1 + 0.2·N(0, 1), everything else + 0.02·N(0, 1)),
so no layer sits at an init value that would hide a mistake. reference.npz (NHWC float32): the input `x`,
timesteps `t`, text `context` [b, n, cross_attention_dim] with a padding `mask` (never passed to diffusers:
its SD pipelines do not, and SDUNet ignores it likewise), SDXL's `pooled` (text_embeds) and `time_ids`, the
upscaler's and unCLIP's `class_labels`, and diffusers' outputs `out` (fp32 weights), `out_fp16` and
`out_bf16` (the weights rounded to that dtype, run in float32). `sd2_like` also holds `x_odd`/`out_odd`: a
7x9 latent, which diffusers' UNet upsamples to the skip connections' sizes.

full_size_shapes.json.gz holds, for the released UNets' configs (SD 1.5, SD 2.1, SDXL base; fields as in
their unet/config.json), every state_dict key with its shape and diffusers' own `num_parameters()`, so
the tests check the full architectures without torch or weights.

    tools/.venv/bin/python tools/make_sd_unet_fixtures.py
"""

import gzip
import json
import shutil
from pathlib import Path

import numpy as np
import torch
from diffusers import UNet2DConditionModel

OUT = Path(__file__).resolve().parent.parent / "tests" / "data" / "sd_unet"

COMMON = dict(sample_size=8, in_channels=4, out_channels=4, cross_attention_dim=16, layers_per_block=1)
FAMILIES = {
    # SD 1.x: attention_head_dim 8 as an int (diffusers reads it as 8 heads per level), 1x1-conv projections.
    "sd1_like": dict(
        COMMON,
        block_out_channels=[8, 16],
        norm_num_groups=4,
        attention_head_dim=8,
        down_block_types=["CrossAttnDownBlock2D", "DownBlock2D"],
        up_block_types=["UpBlock2D", "CrossAttnUpBlock2D"],
    ),
    # SD 2.x: heads per level, linear projections, upcast attention; the x4 upscaler's only_cross_attention.
    "sd2_like": dict(
        COMMON,
        block_out_channels=[8, 16, 16],
        norm_num_groups=4,
        attention_head_dim=[2, 4, 4],
        use_linear_projection=True,
        upcast_attention=True,
        only_cross_attention=[True, False, False],
        down_block_types=["CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"],
        up_block_types=["UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"],
    ),
    # SDXL: no attention in the first level, transformer depth per level (and in the mid block), text_time.
    "sdxl_like": dict(
        COMMON,
        block_out_channels=[8, 16, 16],
        norm_num_groups=4,
        attention_head_dim=[2, 4, 4],
        use_linear_projection=True,
        transformer_layers_per_block=[1, 1, 2],
        layers_per_block=2,
        down_block_types=["DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"],
        up_block_types=["CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"],
        addition_embed_type="text_time",
        addition_time_embed_dim=4,
        projection_class_embeddings_input_dim=8 + 6 * 4,
        norm_eps=1e-6,
        flip_sin_to_cos=True,
        freq_shift=0,
    ),
    # The SD x4 upscaler: 7 input channels (latent + low-res image), a noise-level embedding table.
    "upscaler_like": dict(
        COMMON,
        in_channels=7,
        block_out_channels=[8, 16, 16],
        norm_num_groups=4,
        attention_head_dim=2,
        use_linear_projection=True,
        num_class_embeds=10,
        only_cross_attention=[True, True, False],
        down_block_types=["DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"],
        up_block_types=["CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"],
    ),
    # SD 2.x unCLIP: class_embed_type "projection" of a (noised) image embedding.
    "unclip_like": dict(
        COMMON,
        block_out_channels=[8, 16],
        norm_num_groups=4,
        attention_head_dim=[2, 4],
        use_linear_projection=True,
        class_embed_type="projection",
        projection_class_embeddings_input_dim=12,
        down_block_types=["CrossAttnDownBlock2D", "DownBlock2D"],
        up_block_types=["UpBlock2D", "CrossAttnUpBlock2D"],
    ),
}
SD_BLOCKS = dict(
    down_block_types=["CrossAttnDownBlock2D"] * 3 + ["DownBlock2D"],
    up_block_types=["UpBlock2D"] + ["CrossAttnUpBlock2D"] * 3,
)
FULL_SIZE = {
    "sd15": dict(
        SD_BLOCKS,
        block_out_channels=[320, 640, 1280, 1280],
        attention_head_dim=8,
        cross_attention_dim=768,
        layers_per_block=2,
        norm_num_groups=32,
        sample_size=64,
    ),
    "sd21": dict(
        SD_BLOCKS,
        block_out_channels=[320, 640, 1280, 1280],
        attention_head_dim=[5, 10, 20, 20],
        cross_attention_dim=1024,
        layers_per_block=2,
        norm_num_groups=32,
        sample_size=96,
        use_linear_projection=True,
        upcast_attention=True,
    ),
    "sdxl_base": dict(
        block_out_channels=[320, 640, 1280],
        attention_head_dim=[5, 10, 20],
        cross_attention_dim=2048,
        down_block_types=["DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"],
        up_block_types=["CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"],
        layers_per_block=2,
        norm_num_groups=32,
        sample_size=128,
        use_linear_projection=True,
        transformer_layers_per_block=[1, 2, 10],
        addition_embed_type="text_time",
        addition_time_embed_dim=256,
        projection_class_embeddings_input_dim=2816,
    ),
}
POOLED_DIM = 8  # sdxl_like's text_embeds width: projection_class_embeddings_input_dim - 6 * addition_time_embed_dim
BATCH, TOKENS = 2, 5


def random_unet(config: dict, seed: int) -> UNet2DConditionModel:
    torch.manual_seed(seed)
    unet = UNet2DConditionModel(**config).eval()
    with torch.no_grad():
        for name, p in unet.named_parameters():
            is_norm_scale = "norm" in name.split(".")[-2] and name.endswith("weight")
            p.copy_(1 + 0.2 * torch.randn_like(p) if is_norm_scale else p + 0.02 * torch.randn_like(p))
    return unet


def nhwc(t: torch.Tensor) -> np.ndarray:
    return t.detach().permute(0, 2, 3, 1).contiguous().numpy().astype(np.float32)


def inputs(config: dict, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    size = config["sample_size"]
    out = {
        "x": torch.randn(BATCH, config["in_channels"], size, size, generator=gen),
        "t": torch.tensor([981.0, 7.25]),
        "context": torch.randn(BATCH, TOKENS, config["cross_attention_dim"], generator=gen),
        "mask": torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.int32),
        "x_odd": torch.randn(BATCH, config["in_channels"], 7, 9, generator=gen),
    }
    if config.get("addition_embed_type") == "text_time":
        out["pooled"] = torch.randn(BATCH, POOLED_DIM, generator=gen)
        # (original h, w, crop top, left, target h, w), as SDXL's pipelines make add_time_ids.
        out["time_ids"] = torch.tensor([[64.0, 64.0, 0.0, 0.0, 64.0, 64.0], [48.0, 80.0, 4.0, 8.0, 64.0, 64.0]])
    if config.get("num_class_embeds"):
        out["class_labels"] = torch.tensor([3, 7])
    if config.get("class_embed_type") == "projection":
        out["class_labels"] = torch.randn(BATCH, config["projection_class_embeddings_input_dim"], generator=gen)
    return out


def run(unet: UNet2DConditionModel, ins: dict, x: torch.Tensor) -> np.ndarray:
    added = {"text_embeds": ins["pooled"], "time_ids": ins["time_ids"]} if "pooled" in ins else None
    with torch.no_grad():
        return nhwc(
            unet(x, ins["t"], ins["context"], class_labels=ins.get("class_labels"), added_cond_kwargs=added).sample
        )


def main() -> None:
    shutil.rmtree(OUT, ignore_errors=True)
    for seed, (name, config) in enumerate(FAMILIES.items()):
        unet, folder = random_unet(config, seed), OUT / name
        ins = inputs(config, 100 + seed)
        refs = {"out": run(unet, ins, ins["x"])}
        if name == "sd2_like":
            refs |= {"x_odd": nhwc(ins["x_odd"]), "out_odd": run(unet, ins, ins["x_odd"])}
        for dtype, suffix in ((torch.float16, "fp16"), (torch.bfloat16, "bf16")):
            rounded = random_unet(config, seed)
            with torch.no_grad():
                for p in rounded.parameters():
                    p.copy_(p.to(dtype).to(torch.float32))
            refs[f"out_{suffix}"] = run(rounded, ins, ins["x"])
        shard = {"max_shard_size": "150KB"} if name == "sdxl_like" else {}
        unet.save_pretrained(folder, **shard)
        if name == "sd1_like":
            unet.half().save_pretrained(folder, variant="fp16")
        arrays = {
            "x": nhwc(ins["x"]),
            "t": ins["t"].numpy(),
            "context": ins["context"].numpy(),
            "mask": ins["mask"].numpy(),
        }
        arrays |= {k: ins[k].numpy() for k in ("pooled", "time_ids", "class_labels") if k in ins}
        np.savez_compressed(folder / "reference.npz", **arrays, **refs)
        n = sum(p.numel() for p in unet.parameters())
        print(name, n, "params", sorted(p.name for p in folder.iterdir()), "|out|max", np.abs(refs["out"]).max())
    full = {}
    for name, config in FULL_SIZE.items():
        with torch.device("meta"):
            unet = UNet2DConditionModel(**config)
        full[name] = {
            "config": {"_class_name": "UNet2DConditionModel", **config},
            "num_parameters": unet.num_parameters(),  # diffusers' ModelMixin count
            "shapes": {k: list(v.shape) for k, v in unet.state_dict().items()},
        }
        print(name, full[name]["num_parameters"], "params (diffusers)")
    with gzip.GzipFile(OUT / "full_size_shapes.json.gz", "wb", mtime=0) as f:  # mtime 0: the same bytes each run
        f.write(json.dumps(full, indent=1).encode())
    (OUT / "README.md").write_text(__doc__.split("\n\n")[0] + "\n\nWritten by tools/make_sd_unet_fixtures.py.\n")
    total = sum(p.stat().st_size for p in OUT.rglob("*") if p.is_file())
    print(f"{total / 1e6:.2f} MB in {OUT}")


if __name__ == "__main__":
    main()
