"""Write tests/data/sd_pipeline/: two tiny Stable Diffusion pipeline folders as diffusers saves them (`sd1/` a
StableDiffusionPipeline, `sdxl/` a StableDiffusionXLPipeline: `model_index.json`, `unet/`, `scheduler/`) and what
diffusers' own pipelines make of them from given latents: `reference.npz` in each.

Only the new parts are stored. The other folders are committed fixtures, which the tests copy in under the names
diffusers saves them as (see tests/sd/test_sd_pipeline.py's `assemble`):
- `text_encoder/`, `text_encoder_2/`: tests/data/sdxl_text/ (CLIP-L-like width 8, OpenCLIP-like width 16 with a
  projection to 12); SD 1.x's tower is the first;
- `tokenizer/`, `tokenizer_2/`: tests/data/clip_tokenizer/sd1 (pads <|endoftext|>) and sd2 (pads "!");
- `vae/`: tests/data/autoencoder_kl/sd_like (downsampling 4, scaling_factor 0.18215).
The UNets are tests/data/sd_unet/'s sd1_like and sdxl_like configs with their context widths set to those towers'
(8; 8 + 16 = 24 and a pooled 12 + 6·4 time features), random weights rounded to fp16, stored fp16.

Each case runs the pipeline (`output_type="latent"`, float32, CPU) for STEPS steps from LATENTS with PROMPTS and
NEGATIVE (or none), cfg CFG, on the folder's scheduler or one made `from_config` of it as named, and stores
`<case>_latents` [b, 4, 8, 8] (NCHW, as diffusers returns them) and, for debugging, `<case>_prompt_embeds` and
`<case>_negative_embeds`; `latents` is the shared initial noise.

    tools/.venv/bin/python tools/make_sd_pipeline_fixtures.py     # requirements-ports.txt
"""

import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch
from diffusers import (
    AutoencoderKL,
    DDIMScheduler,
    DPMSolverMultistepScheduler,
    EulerDiscreteScheduler,
    StableDiffusionPipeline,
    StableDiffusionXLPipeline,
    UNet2DConditionModel,
)
from transformers import CLIPTextModel, CLIPTextModelWithProjection, CLIPTokenizer

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "tests" / "data"
OUT = DATA / "sd_pipeline"
STEPS, CFG, SIZE = 4, 5.0, 32  # SIZE: image pixels, latents SIZE / 4 = 8
PROMPTS = ["a photo of a cat", "wow! a dog!!"]
NEGATIVE = ["blurry, ugly", ""]
# SD 1.5's scheduler_config.json (PNDM there; DDIM is what diffusers' docs pair with it), and SDXL base's
SD1_SCHEDULER = dict(
    beta_start=0.00085,
    beta_end=0.012,
    beta_schedule="scaled_linear",
    clip_sample=False,
    set_alpha_to_one=False,
    steps_offset=1,
    num_train_timesteps=1000,
)
SDXL_SCHEDULER = dict(
    beta_start=0.00085,
    beta_end=0.012,
    beta_schedule="scaled_linear",
    steps_offset=1,
    timestep_spacing="leading",
    interpolation_type="linear",
    num_train_timesteps=1000,
)
# case: (scheduler class or None for the folder's, its config overrides, negative prompts?, cfg)
SD1_CASES = {
    "ddim": (None, {}, True, CFG),
    "ddim_no_negative": (None, {}, False, CFG),  # SD 1.x encodes "" as the unconditional prompt
    "ddim_unguided": (None, {}, True, 1.0),  # cfg 1: diffusers runs the conditional half only
    "ddim_v": (None, dict(prediction_type="v_prediction"), True, CFG),  # SD 2.x's parameterization
    "euler": (EulerDiscreteScheduler, {}, True, CFG),
    "dpmpp_2m": (DPMSolverMultistepScheduler, dict(use_karras_sigmas=True), True, CFG),
}
SDXL_MICRO = dict(original_size=(40, 24), crops_coords_top_left=(2, 3), target_size=(32, 28))
SDXL_CASES = {
    "euler": (None, {}, True, SDXL_MICRO),
    "euler_zeros": (None, {}, False, SDXL_MICRO),  # force_zeros_for_empty_prompt: zeros as the negative
    "euler_default_sizes": (None, {}, True, {}),  # original_size = target_size = (SIZE, SIZE), crop (0, 0)
    "dpmpp_2m": (DPMSolverMultistepScheduler, {}, True, SDXL_MICRO),
}


def randomize(model: torch.nn.Module) -> None:
    """GroupNorm/LayerNorm weights 1 + 0.2·N(0,1) and biases 0.2·N(0,1), every bias 0.1·N(0,1) (the default
    init leaves them 1 and 0, which would test nothing), conv_out (zero-free here) kept; then all rounded to fp16."""
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, (torch.nn.GroupNorm, torch.nn.LayerNorm)) and module.weight is not None:
                module.weight.copy_(1 + 0.2 * torch.randn_like(module.weight))
                module.bias.copy_(0.2 * torch.randn_like(module.bias))
            elif isinstance(module, (torch.nn.Linear, torch.nn.Conv2d)) and module.bias is not None:
                module.bias.copy_(0.1 * torch.randn_like(module.bias))
        for p in model.parameters():
            p.copy_(p.half().float())


def unet(family: str, **overrides) -> UNet2DConditionModel:
    config = UNet2DConditionModel.load_config(DATA / "sd_unet" / family)
    model = UNet2DConditionModel.from_config({**config, **overrides}).eval()
    randomize(model)
    return model


def save(pipe, folder: Path, out: Path) -> None:
    """The pipeline saved as diffusers saves it (UNet in fp16), then only what the committed fixtures lack copied."""
    pipe.save_pretrained(folder)
    pipe.unet.to(torch.float16).save_pretrained(folder / "unet")
    pipe.unet.to(torch.float32)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    shutil.copy(folder / "model_index.json", out)
    for name in ("unet", "scheduler"):
        shutil.copytree(folder / name, out / name)


def run(
    pipe, scheduler, overrides: dict, negative: bool, cfg: float, latents: torch.Tensor, refs: dict, case: str, **extra
) -> None:
    base = pipe.scheduler
    # from_config's keyword overrides: a key merged into the config dict is dropped when the base config lists it
    # under _use_default_values (an Euler config's use_karras_sigmas, say)
    pipe.scheduler = (scheduler or type(base)).from_config(base.config, **overrides)
    out = pipe(
        prompt=PROMPTS,
        negative_prompt=NEGATIVE if negative else None,
        num_inference_steps=STEPS,
        guidance_scale=cfg,
        latents=latents.clone(),
        height=SIZE,
        width=SIZE,
        output_type="latent",
        **extra,
    ).images
    refs[f"{case}_latents"] = out.numpy()
    assert all(pipe.scheduler.config[k] == v for k, v in overrides.items()), f"{case}: overrides not applied"
    print(case, type(pipe.scheduler).__name__, float(out.abs().mean()))
    pipe.scheduler = base


def main() -> None:
    torch.set_num_threads(1)
    torch.manual_seed(31)
    text = DATA / "sdxl_text"
    tower_1 = CLIPTextModel.from_pretrained(text / "text_encoder", dtype=torch.float32).eval()
    tower_2 = CLIPTextModelWithProjection.from_pretrained(text / "text_encoder_2", dtype=torch.float32).eval()
    tokenizer_1 = CLIPTokenizer.from_pretrained(DATA / "clip_tokenizer" / "sd1")
    tokenizer_2 = CLIPTokenizer.from_pretrained(DATA / "clip_tokenizer" / "sd2")
    vae = AutoencoderKL.from_pretrained(DATA / "autoencoder_kl" / "sd_like").eval()
    latents = torch.randn(len(PROMPTS), 4, SIZE // 4, SIZE // 4)
    with torch.no_grad(), tempfile.TemporaryDirectory() as tmp:
        sd1 = StableDiffusionPipeline(
            vae=vae,
            text_encoder=tower_1,
            tokenizer=tokenizer_1,
            unet=unet("sd1_like", cross_attention_dim=8),
            scheduler=DDIMScheduler(**SD1_SCHEDULER),
            safety_checker=None,
            feature_extractor=None,
            requires_safety_checker=False,
        )
        save(sd1, Path(tmp) / "sd1", OUT / "sd1")
        sd1 = StableDiffusionPipeline.from_pretrained(Path(tmp) / "sd1", torch_dtype=torch.float32)
        refs = {"latents": latents.numpy()}
        embeds, negative = sd1.encode_prompt(PROMPTS, "cpu", 1, True, NEGATIVE)
        refs["prompt_embeds"], refs["negative_embeds"] = embeds.numpy(), negative.numpy()
        for case, (scheduler, overrides, negative, cfg) in SD1_CASES.items():
            run(sd1, scheduler, overrides, negative, cfg, latents, refs, case)
        np.savez_compressed(OUT / "sd1" / "reference.npz", **refs)

        sdxl = StableDiffusionXLPipeline(
            vae=vae,
            text_encoder=tower_1,
            text_encoder_2=tower_2,
            tokenizer=tokenizer_1,
            tokenizer_2=tokenizer_2,
            scheduler=EulerDiscreteScheduler(**SDXL_SCHEDULER),
            unet=unet("sdxl_like", cross_attention_dim=24, projection_class_embeddings_input_dim=12 + 6 * 4),
            force_zeros_for_empty_prompt=True,
            add_watermarker=False,
        )
        save(sdxl, Path(tmp) / "sdxl", OUT / "sdxl")
        sdxl = StableDiffusionXLPipeline.from_pretrained(
            Path(tmp) / "sdxl", torch_dtype=torch.float32, add_watermarker=False
        )
        refs = {"latents": latents.numpy()}
        embeds, negative, pooled, negative_pooled = sdxl.encode_prompt(PROMPTS, device="cpu", negative_prompt=NEGATIVE)
        refs |= dict(
            prompt_embeds=embeds.numpy(),
            negative_embeds=negative.numpy(),
            pooled=pooled.numpy(),
            negative_pooled=negative_pooled.numpy(),
        )
        for case, (scheduler, overrides, negative, micro) in SDXL_CASES.items():
            run(sdxl, scheduler, overrides, negative, CFG, latents, refs, case, **micro)
        np.savez_compressed(OUT / "sdxl" / "reference.npz", **refs)


if __name__ == "__main__":
    main()
