"""Write the parity fixtures of eqxdiff's PyTorch ports with the reference PyTorch models:
diffusers' `AutoencoderKL` under tests/data/autoencoder_kl/ and transformers' `CLIPTextModel` under
tests/data/clip_text/.

Runs in its own venv (tools/README.md); eqxdiff's tests read what it writes and never import torch.

AutoencoderKL, per config <name>/: config.json, diffusion_pytorch_model.safetensors (seeded random
weights, GroupNorm affines randomised too) and reference.npz (NHWC float32: x, its posterior mean
and logvar, a latent z and decode(z)). <name>_fp16/ and <name>_bf16/ hold the first config's weights
rounded to that dtype, with references computed in float32 from the rounded weights. Full-size
architectures (the SD and FLUX VAEs) are written as state_dict shapes and diffusers' own parameter
count only: full_size_shapes.json.

CLIPTextModel, per config <name>/: config.json, model.safetensors (seeded random weights, biases
and LayerNorm affines randomised too) and reference.npz (token ids and a padding mask, and for
both "no mask" and "mask": last_hidden_state, pooler_output and, except in the fp16/bf16 copies,
every hidden state). The SD-style fixtures store keys as SD's text_encoder/ does ("text_model."
prefix, the position_ids buffer); the other is transformers' own save_pretrained output. The full
CLIP-L/14 text tower is written as state_dict shapes and transformers' parameter count:
full_size_shapes.json.

    tools/.venv/bin/python tools/make_reference_fixtures.py              # both
    tools/.venv/bin/python tools/make_reference_fixtures.py --only clip  # or --only vae, --only tokenizer
    tools/.venv/bin/python tools/make_reference_fixtures.py --only vae --vae_names non_square  # one fixture
"""

import argparse
import json
from pathlib import Path

import numpy as np
import torch
from diffusers import AutoencoderKL
from safetensors.torch import save_file
from transformers import CLIPTextConfig, CLIPTextModel

DATA = Path(__file__).resolve().parent.parent / "tests" / "data"
OUT = DATA / "autoencoder_kl"


def blocks(n: int) -> dict:
    return {"down_block_types": ["DownEncoderBlock2D"] * n, "up_block_types": ["UpDecoderBlock2D"] * n}


# name: (config, image size (square) or (height, width), batch)
SMALL = {
    # SD 1/2-style: 4 latent channels, quant convs, mid attention, three levels.
    "sd_like": (
        dict(
            block_out_channels=[4, 8, 8],
            layers_per_block=2,
            latent_channels=4,
            norm_num_groups=2,
            scaling_factor=0.18215,
            **blocks(3),
        ),
        16,
        2,
    ),
    # SD3/FLUX-style: 16 latent channels, no quant convs, a shift.
    "flux_like": (
        dict(
            block_out_channels=[8, 8],
            layers_per_block=1,
            latent_channels=16,
            norm_num_groups=4,
            use_quant_conv=False,
            use_post_quant_conv=False,
            scaling_factor=0.3611,
            shift_factor=0.1159,
            **blocks(2),
        ),
        16,
        2,
    ),
    # No mid attention, one-channel images, quant_conv without post_quant_conv, groups of one channel.
    "no_attention": (
        dict(
            block_out_channels=[4, 8],
            layers_per_block=1,
            latent_channels=4,
            norm_num_groups=4,
            in_channels=1,
            out_channels=1,
            use_quant_conv=True,
            use_post_quant_conv=False,
            mid_block_add_attention=False,
            **blocks(2),
        ),
        16,
        2,
    ),
    # Non-square images (16x24, latents 4x6): a height/width mix-up in a reshape or pad shows here only.
    "non_square": (
        dict(
            block_out_channels=[4, 8],
            layers_per_block=1,
            latent_channels=4,
            norm_num_groups=2,
            scaling_factor=0.18215,
            **blocks(2),
        ),
        (16, 24),
        2,
    ),
}
FULL_SIZE = {
    "sd": dict(
        block_out_channels=[128, 256, 512, 512],
        layers_per_block=2,
        latent_channels=4,
        norm_num_groups=32,
        sample_size=512,
        scaling_factor=0.18215,
        **blocks(4),
    ),
    "flux": dict(
        block_out_channels=[128, 256, 512, 512],
        layers_per_block=2,
        latent_channels=16,
        norm_num_groups=32,
        use_quant_conv=False,
        use_post_quant_conv=False,
        scaling_factor=0.3611,
        shift_factor=0.1159,
        sample_size=1024,
        **blocks(4),
    ),
}


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


def reference(vae: AutoencoderKL, size: int | tuple[int, int], batch: int, seed: int) -> dict:
    """x ~ U(-1, 1), its posterior moments, z ~ N(0, 1) and decode(z), all NHWC."""
    gen = torch.Generator().manual_seed(seed)
    cfg, f = vae.config, 2 ** (len(vae.config.block_out_channels) - 1)
    h, w = (size, size) if isinstance(size, int) else size
    x = torch.rand(batch, cfg.in_channels, h, w, generator=gen) * 2 - 1
    z = torch.randn(batch, cfg.latent_channels, h // f, w // f, generator=gen)
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


def write_vae_fixtures(names: list[str] | None = None) -> None:
    """Every fixture, or only `names` (then full_size_shapes.json is left as it is)."""
    for seed, (name, (config, size, batch)) in enumerate(SMALL.items()):
        if names is not None and name not in names:
            continue
        vae = random_vae(config, seed)
        write(name, vae, reference(vae, size, batch, seed=100 + seed))
        if name == "sd_like":
            for dtype, suffix in ((torch.float16, "fp16"), (torch.bfloat16, "bf16")):
                rounded = random_vae(config, seed)
                with torch.no_grad():
                    for p in rounded.parameters():
                        p.copy_(p.to(dtype).to(torch.float32))
                write(f"{name}_{suffix}", rounded, reference(rounded, size, batch, seed=100 + seed), dtype)
    if names is not None:
        return
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


# --- transformers' CLIPTextModel -------------------------------------------------------------------

CLIP_OUT = DATA / "clip_text"
# SD 1.x's text_encoder/config.json (CLIP-L/14's text tower, legacy eos_token_id 2), field for field.
SD_TEXT_ENCODER = {
    "_name_or_path": "openai/clip-vit-large-patch14",
    "architectures": ["CLIPTextModel"],
    "attention_dropout": 0.0,
    "bos_token_id": 0,
    "dropout": 0.0,
    "eos_token_id": 2,
    "hidden_act": "quick_gelu",
    "hidden_size": 768,
    "initializer_factor": 1.0,
    "initializer_range": 0.02,
    "intermediate_size": 3072,
    "layer_norm_eps": 1e-05,
    "max_position_embeddings": 77,
    "model_type": "clip_text_model",
    "num_attention_heads": 12,
    "num_hidden_layers": 12,
    "pad_token_id": 1,
    "projection_dim": 768,
    "torch_dtype": "float32",
    "transformers_version": "4.22.0.dev0",
    "vocab_size": 49408,
}
CLIP_L_PARAMETERS = 123_060_480
# name: (config, sequence length, bos/eos/pad ids, text tokens drawn from [low, high), rows). A row is
# its texts' token counts: bos, then each text's tokens followed by eos, then padding (mask 0).
CLIP_SMALL = {
    # SD 1.x layout: legacy argmax pooling (eos is the largest id, as CLIP's 49407), quick_gelu,
    # sequences as long as the positions, padded with eos; SD's file layout (see clip_state).
    "sd_like": (
        SD_TEXT_ENCODER
        | dict(
            hidden_size=32,
            intermediate_size=37,
            num_attention_heads=4,
            num_hidden_layers=2,
            max_position_embeddings=16,
            vocab_size=99,
        ),
        16,
        dict(bos=97, eos=98, pad=98),
        (3, 97),
        [[14], [5], [0]],
    ),
    # Newer configs: pooling at the first eos id (3: neither 2 nor the largest id, so argmax pooling
    # picks elsewhere), exact gelu, eps 1e-6, sequences shorter than the positions, a pad id of its
    # own, one row with two eos; transformers 5's save_pretrained layout.
    "eos_pooling": (
        dict(
            vocab_size=50,
            hidden_size=24,
            intermediate_size=40,
            num_hidden_layers=3,
            num_attention_heads=2,
            max_position_embeddings=20,
            hidden_act="gelu",
            layer_norm_eps=1e-6,
            bos_token_id=1,
            eos_token_id=3,
            pad_token_id=0,
        ),
        12,
        dict(bos=1, eos=3, pad=0),
        (4, 50),
        [[10], [4], [2, 3]],
    ),
}


def random_clip(config: dict, seed: int) -> CLIPTextModel:
    """transformers' init, then every Linear bias 0.1·N(0,1) and LayerNorm weight 1 + 0.2·N(0,1),
    bias 0.2·N(0,1) (the defaults 0, 1 and 0 would leave them untested)."""
    torch.manual_seed(seed)
    model = CLIPTextModel(CLIPTextConfig.from_dict(config)).eval()
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.LayerNorm):
                module.weight.copy_(1 + 0.2 * torch.randn_like(module.weight))
                module.bias.copy_(0.2 * torch.randn_like(module.bias))
            elif isinstance(module, torch.nn.Linear):
                module.bias.copy_(0.1 * torch.randn_like(module.bias))
    return model


def clip_inputs(length: int, ids: dict, tokens: tuple[int, int], rows: list, seed: int) -> tuple:
    """Token ids and padding mask `[len(rows), length]` (int64): bos, texts each ended by eos, padding."""
    rng = np.random.default_rng(seed)
    input_ids = np.full((len(rows), length), ids["pad"], np.int64)
    mask = np.zeros((len(rows), length), np.int64)
    for i, texts in enumerate(rows):
        row = [ids["bos"]]
        for count in texts:
            row += [*rng.integers(*tokens, count).tolist(), ids["eos"]]
        input_ids[i, : len(row)], mask[i, : len(row)] = row, 1
    return input_ids, mask


def clip_reference(model: CLIPTextModel, input_ids: np.ndarray, mask: np.ndarray, all_states: bool = True) -> dict:
    """transformers' outputs without and with the padding mask (`_masked`), float32; with `all_states`
    hidden_states stacked `[layers + 1, b, n, d]` (embeddings first, the last layer's before final_layer_norm)."""
    refs = {"input_ids": input_ids.astype(np.int32), "attention_mask": mask.astype(np.int32)}
    for suffix, attention_mask in (("", None), ("_masked", torch.from_numpy(mask))):
        with torch.no_grad():
            out = model(torch.from_numpy(input_ids), attention_mask=attention_mask, output_hidden_states=True)
        refs[f"last_hidden_state{suffix}"] = out.last_hidden_state.numpy()
        refs[f"pooler_output{suffix}"] = out.pooler_output.numpy()
        if all_states:
            refs[f"hidden_states{suffix}"] = torch.stack(out.hidden_states).numpy()
    return refs


def clip_state(model: CLIPTextModel, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The state_dict as SD's text_encoder/model.safetensors holds it: keys under "text_model." (the
    transformers 4 layout) and the int64 position_ids buffer that transformers 4 saved."""
    state = {f"text_model.{k}": v.detach().to(dtype).contiguous() for k, v in model.state_dict().items()}
    positions = model.config.max_position_embeddings
    return state | {"text_model.embeddings.position_ids": torch.arange(positions, dtype=torch.int64)[None]}


def write_clip(name: str, model: CLIPTextModel, config: dict, refs: dict, sd_style: bool, dtype=torch.float32):
    folder = CLIP_OUT / name
    folder.mkdir(parents=True, exist_ok=True)
    if sd_style:
        (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        save_file(clip_state(model, dtype), str(folder / "model.safetensors"), metadata={"format": "pt"})
    else:
        model.save_pretrained(folder)
    np.savez_compressed(folder / "reference.npz", **refs)
    print(name, model.num_parameters(), "params", dtype, "attention:", model.config._attn_implementation)


def write_clip_fixtures() -> None:
    for seed, (name, (config, length, ids, tokens, rows)) in enumerate(CLIP_SMALL.items()):
        model = random_clip(config, seed)
        input_ids, mask = clip_inputs(length, ids, tokens, rows, seed=200 + seed)
        sd_style = name == "sd_like"
        write_clip(name, model, config, clip_reference(model, input_ids, mask), sd_style)
        if sd_style:
            for dtype, suffix in ((torch.float16, "fp16"), (torch.bfloat16, "bf16")):
                rounded = random_clip(config, seed)
                with torch.no_grad():
                    for p in rounded.parameters():
                        p.copy_(p.to(dtype).to(torch.float32))
                stored = config | {"torch_dtype": str(dtype).removeprefix("torch.")}
                refs = clip_reference(rounded, input_ids, mask, all_states=False)
                write_clip(f"{name}_{suffix}", rounded, stored, refs, True, dtype)
    with torch.device("meta"):
        model = CLIPTextModel(CLIPTextConfig.from_dict(SD_TEXT_ENCODER))
    if model.num_parameters() != CLIP_L_PARAMETERS:
        raise RuntimeError(f"CLIP-L/14 text tower: transformers counts {model.num_parameters()} parameters")
    full = {
        "clip_l14": {
            "config": SD_TEXT_ENCODER,
            "num_parameters": model.num_parameters(),  # transformers' PreTrainedModel count
            "shapes": {k: list(v.shape) for k, v in model.state_dict().items()},
        }
    }
    print("clip_l14", full["clip_l14"]["num_parameters"], "params (transformers)")
    (CLIP_OUT / "full_size_shapes.json").write_text(json.dumps(full, indent=1) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", choices=["vae", "clip", "tokenizer"], help="write one part's fixtures (default: all)")
    parser.add_argument("--vae_names", nargs="+", choices=list(SMALL), help="with --only vae: just these fixtures")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.only in (None, "vae"):
        write_vae_fixtures(args.vae_names)
    if args.only in (None, "clip"):
        write_clip_fixtures()
    if args.only in (None, "tokenizer"):  # needs open_clip_torch, ftfy, wcwidth (tools/requirements-tokenizer.txt)
        from make_tokenizer_fixtures import make_tokenizer_fixtures  # tools/ is on sys.path as the script's folder

        make_tokenizer_fixtures()


if __name__ == "__main__":
    main()
