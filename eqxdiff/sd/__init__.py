"""Stable Diffusion (1.x/2.x, XL) as diffusers and transformers distribute it, in eqxdiff.

The network: `SDUNet` (unet.py; its levels unet_blocks.py, its text attention attention.py, its config.json
unet_config.py), the condition SDXL adds (`SDXLCond`, `sdxl_time_ids`: sdxl_cond.py), the prompt embeddings the
pipelines take from their CLIP towers (`sd_prompt_embeds`, `SDXLTextEncoders`: prompt_embeds.py; SDXL's two
tokenizers: sdxl_prompts.py). The pipeline: `load_sd` -> `SDPipeline` (pipeline.py), its
`scheduler/scheduler_config.json` in σ-space (`scheduler_from_diffusers`: scheduler.py). The way back:
`save_diffusers` (a UNet or VAE: export.py), `save_transformers` (a CLIP tower: clip_export.py), `save_pipeline`
(a whole folder: pipeline_export.py); LoRA adapters in diffusers' file format: lora_files.py (the adapters
themselves are eqxdiff.nn.lora's, for any network). The VAE and the CLIP towers are eqxdiff.nn's: latent and text
runs use them without SD.
"""

from eqxdiff.sd.clip_export import save_transformers
from eqxdiff.sd.export import save_diffusers
from eqxdiff.sd.pipeline import SDPipeline, load_sd
from eqxdiff.sd.pipeline_export import save_pipeline
from eqxdiff.sd.prompt_embeds import SDXLTextEncoders, sd_prompt_embeds
from eqxdiff.sd.scheduler import scheduler_from_diffusers
from eqxdiff.sd.sdxl_cond import SDXLCond, sdxl_time_ids
from eqxdiff.sd.unet import SDUNet

__all__ = [
    "SDPipeline",
    "SDUNet",
    "SDXLCond",
    "SDXLTextEncoders",
    "load_sd",
    "save_diffusers",
    "save_pipeline",
    "save_transformers",
    "scheduler_from_diffusers",
    "sd_prompt_embeds",
    "sdxl_time_ids",
]
