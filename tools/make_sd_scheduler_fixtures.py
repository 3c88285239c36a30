"""Write tests/data/sd_scheduler/reference.npz and cases.json: diffusers' own schedulers (DDIMScheduler,
EulerDiscreteScheduler, EulerAncestralDiscreteScheduler, DPMSolverMultistepScheduler) run by the loop its
pipelines run, on a closed-form stand-in model, for tests/sd/test_sd_scheduler.py.

The stand-in model F(x_in, t) = 0.8·tanh(x_in)·cos(t/250) + 0.05·(t/1000)·x_in (elementwise, float32) is
what the test runs on eqxdiff's side; it sees what a UNet would, `scheduler.scale_model_input(latents, t)`
and `t` itself. Each case (cases.json: the scheduler class, its config, the step count) stores, NHWC float32:
`<case>_noise` (the unit latents a pipeline draws; the loop starts from noise·init_noise_sigma), `<case>_t`
(every t fed to the model), `<case>_sigmas` (the scheduler's σ grid after set_timesteps, DDIM: its
σ = sqrt((1-ᾱ)/ᾱ) at each t and at t - T//n), `<case>_latents` (the loop's result), `<case>_alphas_cumprod`,
and for EulerAncestral `<case>_noises` [n, b, h, w, c], the unit noise each `step` drew (its `randn_tensor`
replaced by a seeded recorder).

    tools/.venv/bin/python tools/make_sd_scheduler_fixtures.py
"""

import json
from pathlib import Path

import numpy as np
import torch
from diffusers import (
    DDIMScheduler,
    DPMSolverMultistepScheduler,
    EulerAncestralDiscreteScheduler,
    EulerDiscreteScheduler,
    PNDMScheduler,
)
from diffusers.schedulers import scheduling_euler_ancestral_discrete

OUT = Path(__file__).resolve().parent.parent / "tests" / "data" / "sd_scheduler"

# runwayml/stable-diffusion-v1-5's scheduler/scheduler_config.json (PNDMScheduler).
SD15 = {
    "_class_name": "PNDMScheduler",
    "beta_end": 0.012,
    "beta_schedule": "scaled_linear",
    "beta_start": 0.00085,
    "clip_sample": False,
    "num_train_timesteps": 1000,
    "set_alpha_to_one": False,
    "skip_prk_steps": True,
    "steps_offset": 1,
    "trained_betas": None,
}
# stabilityai/stable-diffusion-2-1's (DDIMScheduler, v-prediction).
SD21 = {
    "_class_name": "DDIMScheduler",
    "beta_end": 0.012,
    "beta_schedule": "scaled_linear",
    "beta_start": 0.00085,
    "clip_sample": False,
    "num_train_timesteps": 1000,
    "prediction_type": "v_prediction",
    "set_alpha_to_one": False,
    "skip_prk_steps": True,
    "steps_offset": 1,
    "trained_betas": None,
}
# stabilityai/stable-diffusion-xl-base-1.0's (EulerDiscreteScheduler).
SDXL = {
    "_class_name": "EulerDiscreteScheduler",
    "beta_end": 0.012,
    "beta_schedule": "scaled_linear",
    "beta_start": 0.00085,
    "clip_sample": False,
    "interpolation_type": "linear",
    "num_train_timesteps": 1000,
    "prediction_type": "epsilon",
    "sample_max_value": 1.0,
    "set_alpha_to_one": False,
    "skip_prk_steps": True,
    "steps_offset": 1,
    "timestep_spacing": "leading",
    "trained_betas": None,
    "use_karras_sigmas": False,
}
# Lin et al. 2023's fix: trailing timesteps, zero terminal SNR, v-prediction.
ZSNR = dict(SD21, timestep_spacing="trailing", rescale_betas_zero_snr=True)

CLASSES = {
    c.__name__: c
    for c in (DDIMScheduler, EulerDiscreteScheduler, EulerAncestralDiscreteScheduler, DPMSolverMultistepScheduler)
}
# fmt: off
CASES = {  # name: (scheduler class, config over the base, steps)
    "sd15_ddim": ("DDIMScheduler", SD15, 20),  # DDIMScheduler.from_config(SD 1.5's PNDM config)
    "sd15_euler": ("EulerDiscreteScheduler", SD15, 20),
    "sd15_euler_ancestral": ("EulerAncestralDiscreteScheduler", SD15, 20),
    "sd15_dpmpp_2m": ("DPMSolverMultistepScheduler", SD15, 20),
    "sd15_dpmpp_2m_karras": ("DPMSolverMultistepScheduler", dict(SD15, use_karras_sigmas=True), 20),
    "sd21_ddim_v": ("DDIMScheduler", SD21, 20),
    "sd21_euler_v": ("EulerDiscreteScheduler", SD21, 20),
    "sd21_euler_ancestral_v": ("EulerAncestralDiscreteScheduler", SD21, 20),
    "sd21_dpmpp_2m_v": ("DPMSolverMultistepScheduler", SD21, 20),
    "sd21_dpmpp_2m_karras_v": ("DPMSolverMultistepScheduler", dict(SD21, use_karras_sigmas=True), 20),
    "sdxl_euler": ("EulerDiscreteScheduler", SDXL, 25),
    "sdxl_euler_karras": ("EulerDiscreteScheduler", dict(SDXL, use_karras_sigmas=True), 25),
    "sdxl_euler_linspace": ("EulerDiscreteScheduler", dict(SDXL, timestep_spacing="linspace"), 25),
    "sdxl_euler_sigma_min": ("EulerDiscreteScheduler", dict(SDXL, final_sigmas_type="sigma_min"), 25),
    "zsnr_ddim": ("DDIMScheduler", ZSNR, 10),
    "zsnr_euler": ("EulerDiscreteScheduler", ZSNR, 10),
    "zsnr_euler_ancestral": ("EulerAncestralDiscreteScheduler", ZSNR, 10),
    "zsnr_dpmpp_2m": ("DPMSolverMultistepScheduler", ZSNR, 10),
    # DDIM stepping to t - T//n, not the next timestep (30 does not divide 1000), linear and cosine betas.
    "linear_ddim_trailing_30": ("DDIMScheduler", dict(SD15, beta_schedule="linear", beta_start=1e-4, beta_end=0.02,
                                                      timestep_spacing="trailing"), 30),
    "cosine_ddim_linspace_30": ("DDIMScheduler", dict(SD15, beta_schedule="squaredcos_cap_v2", set_alpha_to_one=True,
                                                      timestep_spacing="linspace"), 30),
    "cosine_dpmpp_2m_leading": ("DPMSolverMultistepScheduler", dict(SD15, beta_schedule="squaredcos_cap_v2",
                                                                    timestep_spacing="leading"), 12),
    "dpmpp_2m_sigma_min_10": ("DPMSolverMultistepScheduler", dict(SD15, final_sigmas_type="sigma_min"), 10),
    "dpmpp_2m_sigma_min_16": ("DPMSolverMultistepScheduler", dict(SD15, final_sigmas_type="sigma_min",
                                                                  timestep_spacing="linspace"), 16),
    "dpmpp_2m_lambda_clipped": ("DPMSolverMultistepScheduler", dict(SD15, lambda_min_clipped=-2.5), 15),
    "sample_prediction_euler": ("EulerDiscreteScheduler", dict(SD15, prediction_type="sample"), 8),
}
# fmt: on
SHAPE = (2, 4, 8, 6)  # b, c, h, w: a non-square latent


def stand_in(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    t = torch.as_tensor(t, dtype=torch.float32)
    return 0.8 * torch.tanh(x) * torch.cos(t / 250) + 0.05 * (t / 1000) * x


def nhwc(x: torch.Tensor) -> np.ndarray:
    return x.permute(0, 2, 3, 1).numpy().astype(np.float32)


def run(name: str, cls_name: str, config: dict, steps: int, seed: int) -> dict[str, np.ndarray]:
    scheduler = CLASSES[cls_name].from_config(config)
    scheduler.set_timesteps(steps)
    noise = torch.randn(SHAPE, generator=torch.Generator().manual_seed(seed))
    drawn, original = [], scheduling_euler_ancestral_discrete.randn_tensor
    generator = torch.Generator().manual_seed(seed + 1)

    def recorder(shape, generator=None, device=None, dtype=None, layout=None):
        drawn.append(original(shape, generator=generator, device=device, dtype=dtype))
        return drawn[-1]

    scheduling_euler_ancestral_discrete.randn_tensor = recorder
    try:
        latents = noise * scheduler.init_noise_sigma
        fed = []
        for t in scheduler.timesteps:
            fed.append(float(t))
            out = stand_in(scheduler.scale_model_input(latents, t), t)
            kwargs = dict(generator=generator) if cls_name == "EulerAncestralDiscreteScheduler" else {}
            latents = scheduler.step(out, t, latents, **kwargs).prev_sample
    finally:
        scheduling_euler_ancestral_discrete.randn_tensor = original
    ref = {
        f"{name}_noise": nhwc(noise),
        f"{name}_latents": nhwc(latents),
        f"{name}_t": np.array(fed, np.float32),
        f"{name}_alphas_cumprod": scheduler.alphas_cumprod.numpy(),
    }
    if cls_name == "DDIMScheduler":
        a = scheduler.alphas_cumprod.double()
        ts = scheduler.timesteps.numpy()
        prev = ts - scheduler.config.num_train_timesteps // steps
        at = lambda i: (a[i] if i >= 0 else scheduler.final_alpha_cumprod.double()).item()  # noqa: E731
        sig = lambda v: np.sqrt((1 - v) / v) if v > 0 else np.inf  # noqa: E731
        ref[f"{name}_sigmas"] = np.array([sig(at(i)) for i in ts] + [sig(at(prev[-1]))])
        ref[f"{name}_sigmas_to"] = np.array([sig(at(i)) for i in prev])
    else:
        ref[f"{name}_sigmas"] = scheduler.sigmas.numpy().astype(np.float64)
    if drawn:
        ref[f"{name}_noises"] = np.stack([nhwc(d) for d in drawn])
    return ref


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    ref, cases = {}, {}
    for seed, (name, (cls_name, config, steps)) in enumerate(CASES.items()):
        ref.update(run(name, cls_name, config, steps, seed=10 * seed))
        cases[name] = dict(scheduler=cls_name, config=dict(config, _class_name=cls_name), steps=steps)
    # SD 1.5's own folder config names PNDMScheduler: kept as written, for the mapping test.
    cases["sd15_ddim"]["folder_config"] = SD15
    assert PNDMScheduler.from_config(SD15).config.steps_offset == 1
    np.savez_compressed(OUT / "reference.npz", **ref)
    (OUT / "cases.json").write_text(json.dumps(cases, indent=1) + "\n")
    print(f"wrote {len(cases)} cases to {OUT}")


if __name__ == "__main__":
    main()
