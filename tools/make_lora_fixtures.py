"""Write the LoRA fixtures of `eqxdiff.sd.lora_files.load_lora` under tests/data/lora/<case>/: diffusers/PEFT
adapters on the SD 1.x-like UNet fixture (tests/data/sd_unet/sd1_like), saved by diffusers' own
`StableDiffusionPipeline.save_lora_weights` (pytorch_lora_weights.safetensors), and reference.npz with the
UNet's output with the LoRA on, on that fixture's inputs (NHWC float32: `out`).

Cases: `alpha8_meta`: r=4, lora_alpha=8 (scale 2) on the attention projections and proj_in/proj_out (1x1
convolutions in SD 1.x), with the LoraConfig as metadata, as diffusers' `training_utils` passes it;
`alpha_eq_r`: r=4, lora_alpha=4 on diffusers' training scripts' targets, written without metadata (files of
older scripts: diffusers reads alpha = r); `convs`: r=4, lora_alpha=2 on the resnets' 3x3 and 1x1 convolutions,
the stride-2 downsampler's and the upsampler's (PEFT's conv LoRA: A kxk, B 1x1), with metadata; `unet_adapter`:
r=2, lora_alpha=3 written by the UNet's own `save_lora_adapter` (no `unet.` prefix, unprefixed metadata). Every adapter
weight is moved off PEFT's init (B from zero): lora_A += 0.1·N(0, 1), lora_B = 0.1·N(0, 1).

    tools/.venv/bin/pip install -r tools/requirements-lora.txt
    tools/.venv/bin/python tools/make_lora_fixtures.py
"""

import shutil
from pathlib import Path

import numpy as np
import torch
from diffusers import StableDiffusionPipeline, UNet2DConditionModel
from peft import LoraConfig
from peft.utils import get_peft_model_state_dict

ROOT = Path(__file__).resolve().parent.parent
BASE = ROOT / "tests" / "data" / "sd_unet" / "sd1_like"
OUT = ROOT / "tests" / "data" / "lora"
ATTENTION = ["to_k", "to_q", "to_v", "to_out.0"]  # diffusers' train_text_to_image_lora.py's target_modules
CASES = {
    "alpha8_meta": dict(config=dict(r=4, lora_alpha=8, target_modules=ATTENTION + ["proj_in", "proj_out"]), meta=True),
    "alpha_eq_r": dict(config=dict(r=4, lora_alpha=4, target_modules=ATTENTION), meta=False),
    # The resnets' 3x3 and 1x1 convolutions and the stride-2 downsampler's ("conv": down/upsamplers.0.conv).
    # The UNet's own save_lora_adapter: keys and metadata without the pipeline's `unet.` prefix.
    "unet_adapter": dict(config=dict(r=2, lora_alpha=3, target_modules=["to_k", "to_v", "proj_out"]), meta=True),
    "convs": dict(
        config=dict(r=4, lora_alpha=2, target_modules=["conv1", "conv2", "conv_shortcut", "conv", "to_q"]), meta=True
    ),
}


def nhwc(t: torch.Tensor) -> np.ndarray:
    return t.detach().permute(0, 2, 3, 1).contiguous().numpy().astype(np.float32)


def unet_with_lora(config: dict, seed: int) -> UNet2DConditionModel:
    torch.manual_seed(seed)  # before add_adapter: PEFT draws A's init from torch's global generator
    unet = UNet2DConditionModel.from_pretrained(BASE).eval()
    unet.add_adapter(LoraConfig(init_lora_weights=True, **config))
    with torch.no_grad():
        for name, p in unet.named_parameters():
            if ".lora_A." in name:
                p.add_(0.1 * torch.randn_like(p))
            elif ".lora_B." in name:
                p.copy_(0.1 * torch.randn_like(p))
    return unet


def main() -> None:
    shutil.rmtree(OUT, ignore_errors=True)
    ref = np.load(BASE / "reference.npz")
    x = torch.from_numpy(ref["x"]).permute(0, 3, 1, 2)
    t, context = torch.from_numpy(ref["t"]), torch.from_numpy(ref["context"])
    for seed, (name, case) in enumerate(CASES.items()):
        unet, folder = unet_with_lora(case["config"], seed), OUT / name
        with torch.no_grad():
            out = nhwc(unet(x, t, context).sample)
            base = UNet2DConditionModel.from_pretrained(BASE).eval()
            base_out = nhwc(base(x, t, context).sample)
        meta = unet.peft_config["default"].to_dict() if case["meta"] else None
        if meta:  # a set in PEFT's config: sorted, so that the file's bytes are the same each run
            meta["target_modules"] = sorted(meta["target_modules"])
        if name == "unet_adapter":
            unet.save_lora_adapter(folder)
        else:
            StableDiffusionPipeline.save_lora_weights(
                folder, unet_lora_layers=get_peft_model_state_dict(unet), unet_lora_adapter_metadata=meta
            )
        np.savez_compressed(folder / "reference.npz", out=out)
        # diffusers' own reading of the file back into the base UNet gives the same output
        reread = UNet2DConditionModel.from_pretrained(BASE).eval()
        pipe = StableDiffusionPipeline(
            vae=None,
            text_encoder=None,
            tokenizer=None,
            unet=reread,
            scheduler=None,
            safety_checker=None,
            feature_extractor=None,
            requires_safety_checker=False,
        )
        if name == "unet_adapter":  # the pipeline reads `unet.`-prefixed files only; the UNet reads this one
            pipe.unet.load_lora_adapter(folder, prefix=None, weight_name="pytorch_lora_weights.safetensors")
        else:
            pipe.load_lora_weights(folder)
        with torch.no_grad():
            again = nhwc(pipe.unet(x, t, context).sample)
        print(
            name,
            "|out - base| max",
            np.abs(out - base_out).max(),
            "reread |diff| max",
            np.abs(again - out).max(),
            sorted(p.name for p in folder.iterdir()),
        )
    (OUT / "README.md").write_text(__doc__.split("\n\n")[0] + "\n\nWritten by tools/make_lora_fixtures.py.\n")


if __name__ == "__main__":
    main()
