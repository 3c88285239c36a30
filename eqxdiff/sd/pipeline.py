"""A Stable Diffusion pipeline folder as diffusers saves it (`model_index.json`, `unet/`, `vae/`, `text_encoder[_2]/`,
`tokenizer[_2]/`, `scheduler/scheduler_config.json`), sampled by eqxdiff: `load_sd(folder)` -> `SDPipeline`.

`StableDiffusionPipeline` (SD 1.x/2.x: one CLIP tower, `last_hidden_state` or `clip_skip`) and
`StableDiffusionXLPipeline` (two towers, pooled text_embeds and the size/crop `time_ids`) are read; any other
`_class_name` is refused. `latents(...)` is what diffusers' `__call__(..., output_type="latent")` returns for the same
unit noise, NHWC: the prompts and negative prompts encoded as its `encode_prompt` does, the UNet as an eqxdiff
`Denoiser` (the scheduler config's schedule and parameterization) and the scheduler's σ grid sampled by eqxdiff's
samplers (`DiffusersScheduler.sample`). Guidance: diffusers mixes the UNet's outputs, `F_u + guidance·(F_c − F_u)`;
eqxdiff's `ClassifierFreeGuidance` mixes D = c_skip·x + c_out·F, whose c_skip and c_out do not depend on the
condition, so D_u + guidance·(D_c − D_u) = c_skip·x + c_out·(F_u + guidance·(F_c − F_u)) for ε and v alike: the
same step. As diffusers, guidance ≤ 1 runs the conditional half alone (no negative prompt is read).
"""

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, PRNGKeyArray

from eqxdiff.data.tokenizer import TextTokenizer, load_tokenizer
from eqxdiff.diffusion import ClassifierFreeGuidance, Denoiser
from eqxdiff.nn import AutoencoderKL, CLIPTextModel, TextCond
from eqxdiff.sd.prompt_embeds import sd_prompt_embeds
from eqxdiff.sd.scheduler import METHOD_OF_SCHEDULER, DiffusersScheduler, scheduler_from_diffusers
from eqxdiff.sd.sdxl_cond import SDXLCond, sdxl_time_ids
from eqxdiff.sd.sdxl_prompts import SDXLPrompts
from eqxdiff.sd.unet import SDUNet

PIPELINES = {"StableDiffusionPipeline": "sd", "StableDiffusionXLPipeline": "sdxl"}
SCHEDULER_OF_METHOD = {method: name for name, method in METHOD_OF_SCHEDULER.items() if name != "PNDMScheduler"}


@eqx.filter_jit
def _sd_embeds(tower: CLIPTextModel, ids, clip_skip: int | None):
    return sd_prompt_embeds(tower, ids, clip_skip=clip_skip)


@dataclasses.dataclass(frozen=True)
class SDPrompts:
    """SD 1.x/2.x's text side, as `StableDiffusionPipeline.encode_prompt`: `tokenizer/` to 77 ids, `text_encoder/`'s
    `last_hidden_state` (or, with clip_skip k, the normed `hidden_states[-(k + 1)]`). Negative prompts ("" when
    none is given) are always `last_hidden_state`: diffusers applies clip_skip to the prompts only."""

    encoder: CLIPTextModel
    tokenizer: TextTokenizer

    def encode(self, prompts: Sequence[str], *, clip_skip: int | None = None) -> TextCond:
        """TextCond(context f32[b, 77, d], mask int32[b, 77] of ones: no mask reaches SD's UNet)."""
        ids = self.tokenizer(list(prompts), self.tokenizer.check_length(None))[0]
        context = np.asarray(_sd_embeds(self.encoder, ids, clip_skip), np.float32)
        return TextCond(context, np.ones(ids.shape, np.int32))

    def negative(self, batch_size: int, negative_prompts: Sequence[str] | None = None) -> TextCond:
        negative = list(negative_prompts or [""] * batch_size)
        if len(negative) != batch_size:
            raise ValueError(f"{len(negative)} negative prompts for a batch of {batch_size}: give one per prompt")
        return self.encode(negative)


@eqx.filter_jit
def _sample(unet, scheduler: DiffusersScheduler, cond, null_cond, guidance, noise, steps: int, key):
    denoiser = Denoiser(unet, scheduler.schedule, scheduler.parameterization)
    if null_cond is None:  # diffusers' do_classifier_free_guidance is False for guidance <= 1
        denoise = lambda x, sigma: denoiser(x, sigma, cond)  # noqa: E731
    else:
        denoise = ClassifierFreeGuidance(denoiser, cond, guidance, null_cond)
    return scheduler.sample(denoise, noise, steps, key)


@dataclasses.dataclass(frozen=True)
class SDPipeline:
    """`family` "sd" (SD 1.x/2.x) or "sdxl"; `unet` an `SDUNet`; `prompts` `SDPrompts` or `SDXLPrompts`; `vae` the
    `AutoencoderKL` (`scaling_factor`, `shift_factor`); `scheduler` the folder's `DiffusersScheduler`, built from
    `scheduler_config` (kept so that `with_scheduler` can swap the class as diffusers' `from_config` does)."""

    family: str
    unet: SDUNet
    prompts: SDPrompts | SDXLPrompts
    vae: AutoencoderKL
    scheduler: DiffusersScheduler
    scheduler_config: dict

    def with_scheduler(self, name_or_method: str, **overrides) -> "SDPipeline":
        """This pipeline on another scheduler class (a diffusers name or eqxdiff method: "ddim", "euler",
        "euler_ancestral", "dpmpp_2m") made from this one's config plus `overrides`, as
        `NewScheduler.from_config(pipe.scheduler.config, **overrides)`."""
        name = SCHEDULER_OF_METHOD.get(name_or_method, name_or_method)
        config = {**self.scheduler_config, "_class_name": name, **overrides}
        return dataclasses.replace(self, scheduler=scheduler_from_diffusers(config), scheduler_config=config)

    @property
    def vae_scale_factor(self) -> int:
        return self.vae.downsample_factor

    def latents(
        self,
        prompts: Sequence[str],
        negative_prompts: Sequence[str] | None = None,
        *,
        steps: int = 30,
        guidance: float = 7.5,
        initial_latents: Float[Array | np.ndarray, "b h w c"] | None = None,
        key: PRNGKeyArray | None = None,
        height: int | None = None,
        width: int | None = None,
        original_size: Sequence[int] | None = None,
        crops_coords_top_left: Sequence[int] = (0, 0),
        target_size: Sequence[int] | None = None,
        clip_skip: int | None = None,
        method: str | None = None,
        guidance_rescale: float = 0.0,
    ) -> Float[Array, "b h w c"]:
        """What diffusers' pipeline `__call__(prompts, negative_prompts, num_inference_steps=steps,
        guidance_scale=guidance, latents=..., output_type="latent")` returns, NHWC [b, height/f, width/f, c].

        `initial_latents`: diffusers' `latents=` (unit noise) as NHWC, else drawn from `key` (which also drives
        Euler ancestral's noise). height/width (pixels) default to the initial latents' size·f, or the UNet's
        sample_size·f. SDXL only: `original_size` and `target_size` (height, width; default (height, width)) and
        `crops_coords_top_left` (top, left) become the time_ids of both halves, as diffusers' defaults for the
        negative ones. `method` (a scheduler class or eqxdiff method) samples as `with_scheduler(method)` does.
        `guidance_rescale` (SDXL's φ) other than 0 is not ported."""
        if guidance_rescale != 0:
            raise ValueError(
                f"guidance_rescale={guidance_rescale}: the rescaled guidance of Lin et al. 2023 is not "
                "ported; use 0 (diffusers' default)."
            )
        if isinstance(prompts, str):
            raise TypeError("prompts: a list of prompts, e.g. [prompt]; a str would be one prompt per character.")
        b, f = len(prompts), self.vae_scale_factor
        if self.family == "sd" and (original_size or target_size or tuple(crops_coords_top_left) != (0, 0)):
            raise ValueError(
                "original_size, crops_coords_top_left and target_size are SDXL's micro-conditioning; "
                "this is an SD 1.x/2.x pipeline."
            )
        if initial_latents is None:
            if key is None:
                raise ValueError("pass initial_latents (unit noise, NHWC) or a key to draw them")
            config = json.loads(self.unet.config)
            height, width = height or config["sample_size"] * f, width or config["sample_size"] * f
            if height % f or width % f:
                raise ValueError(f"height {height} and width {width}: multiples of the VAE's factor {f}")
            key, noise_key = jax.random.split(key)
            initial_latents = jax.random.normal(noise_key, (b, height // f, width // f, config["in_channels"]))
        initial_latents = jnp.asarray(initial_latents, jnp.float32)
        if initial_latents.shape[0] != b:
            raise ValueError(f"{initial_latents.shape[0]} initial latents for {b} prompts: one row per prompt")
        height = height or initial_latents.shape[1] * f
        width = width or initial_latents.shape[2] * f
        guided = guidance > 1
        if self.family == "sd":
            cond = self.prompts.encode(prompts, clip_skip=clip_skip)
            null = self.prompts.negative(b, negative_prompts) if guided else None
        else:
            time_ids = sdxl_time_ids(
                original_size or (height, width), crops_coords_top_left, target_size or (height, width), b
            )
            cond = SDXLCond(self.prompts.encode(prompts, clip_skip=clip_skip), time_ids)
            null = SDXLCond(self.prompts.negative(b, negative_prompts), time_ids) if guided else None
        scheduler = self.scheduler if method is None else self.with_scheduler(method).scheduler
        return _sample(self.unet, scheduler, cond, null, guidance, initial_latents, steps, key)

    def images(
        self, prompts: Sequence[str], negative_prompts: Sequence[str] | None = None, **kwargs
    ) -> Float[Array, "b H W 3"]:
        """`latents(...)` decoded by the VAE, `decode(z / scaling_factor + shift_factor)`: images in about [-1, 1]."""
        return self.decode(self.latents(prompts, negative_prompts, **kwargs))

    def decode(self, latents: Float[Array | np.ndarray, "b h w c"]) -> Float[Array, "b H W 3"]:
        """Latents as the UNet sees them -> images in about [-1, 1], `vae.decode(z / scaling_factor + shift_factor)`."""
        return _decode(self.vae, jnp.asarray(latents, jnp.float32))


@eqx.filter_jit
def _decode(vae: AutoencoderKL, latents):
    return vae.decode(latents / vae.scaling_factor + vae.shift_factor)


def load_sd(folder: str | Path, *, variant: str | None = None) -> SDPipeline:
    """A diffusers StableDiffusionPipeline or StableDiffusionXLPipeline folder as an `SDPipeline`, float32 on the
    first device; `variant` (e.g. "fp16") picks the weight files of every model as diffusers' `variant=`."""
    folder = Path(folder).expanduser()
    index_file = folder / "model_index.json"
    if not index_file.is_file():
        raise FileNotFoundError(
            f"{folder} has no model_index.json: give a pipeline folder as diffusers' "
            "save_pretrained writes it (model_index.json, unet/, vae/, …)"
        )
    name = json.loads(index_file.read_text()).get("_class_name")
    if name not in PIPELINES:
        raise ValueError(
            f"{folder} is a {name}: load_sd reads StableDiffusionPipeline (SD 1.x/2.x) and "
            "StableDiffusionXLPipeline folders only"
        )
    family = PIPELINES[name]
    for part in ("unet", "vae", "scheduler", "text_encoder" if family == "sd" else "text_encoder_2"):
        if not (folder / part).is_dir():
            raise FileNotFoundError(
                f"{folder} has no {part}/: a {name} folder holds unet/, vae/, scheduler/ and "
                "its text encoders and tokenizers"
            )
    if family == "sd":
        prompts = SDPrompts(
            CLIPTextModel.from_transformers(folder / "text_encoder", variant=variant),
            load_tokenizer(folder / "tokenizer"),
        )
    else:
        prompts = SDXLPrompts.from_diffusers(folder, variant=variant)
    config = json.loads((folder / "scheduler" / "scheduler_config.json").read_text())
    return SDPipeline(
        family,
        SDUNet.from_diffusers(folder / "unet", variant=variant),
        prompts,
        AutoencoderKL.from_diffusers(folder / "vae", variant=variant),
        scheduler_from_diffusers(config),
        config,
    )
