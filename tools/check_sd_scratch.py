"""Issue 31 §5, first half: an SD-architecture model trained from scratch here, exported as a diffusers
StableDiffusionPipeline folder, and sampled by diffusers and by eqxdiff from the same initial latents.

The run: `train/main.py --dataset captioned_digits --model sd_tiny --schedule vp_linear --parameterization eps`
(an eqxdiff SDUNet of a small UNet2DConditionModel config, cross-attending to the dataset's causal CLIP-style
tower trained with it, on diffusers' "linear" betas with ε-prediction). Three halves, two venvs:

    PYTHONPATH=. .venv/bin/python tools/check_sd_scratch.py write --run_dir RUN --out /tmp/sd_scratch
    tools/.venv/bin/python tools/check_sd_scratch.py check --out /tmp/sd_scratch
    PYTHONPATH=. .venv/bin/python tools/check_sd_scratch.py score --out /tmp/sd_scratch

`write` exports the run's EMA with `save_pipeline`: unet/ (the SDUNet), text_encoder/ (the tower: CLIPTextModel),
tokenizer/ (the word tokenizer as tokenizer.json, PreTrainedTokenizerFast), scheduler/ (DDIM on the training
betas, SD's spacing), and vae/, a placeholder AutoencoderKL of factor 1 with one latent channel: the run is in
pixels, so the pipeline's "latents" are the 8×16 images themselves (diffusers' `output_type="latent"`). It then
samples the folder with eqxdiff's `load_sd` for the 90 ordered digit pairs (`captioned_digits_prompts`), one
sample each, 30 DDIM steps, cfg 1 and 4, from stored unit noise. `check` runs diffusers' pipeline on the same
folder, prompts and noise and prints max |diffusers - eqxdiff| / max |eqxdiff| (fails above 1e-4); `score` reads
both sets of samples with the digits classifier (`two_digit_accuracy`, each 8×8 half on its own).
"""

import argparse
import json
import sys
from pathlib import Path

import numpy as np

STEPS, CFGS, SEED = 30, (1.0, 4.0), 0
TOLERANCE = 1e-4
SCHEDULER = {
    "_class_name": "DDIMScheduler",
    "num_train_timesteps": 1000,
    "beta_schedule": "linear",
    "beta_start": 1e-4,
    "beta_end": 0.02,
    "prediction_type": "epsilon",
    "clip_sample": False,
    "set_alpha_to_one": False,
    "steps_offset": 1,
    "timestep_spacing": "leading",
}
VAE = {
    "in_channels": 1,
    "out_channels": 1,
    "latent_channels": 1,
    "block_out_channels": [8],
    "layers_per_block": 1,
    "norm_num_groups": 4,
    "scaling_factor": 1.0,
    "sample_size": 16,
}


def write(run_dir: Path, out: Path) -> None:
    """eqxdiff's side (the main venv): export, then sample the exported folder."""
    import jax

    from eqxdiff.run.rebuild import load_run

    from eqxdiff.data.captioned_digits import captioned_digits_prompts, captioned_digits_tokenizer
    from eqxdiff.data.tokenizer import WORD_SPECIALS
    from eqxdiff.data.tokenizer_files import save_tokenizer
    from eqxdiff.nn import AutoencoderKL
    from eqxdiff.sd import load_sd, save_pipeline
    from eqxdiff.sharding import make_mesh

    run = load_run(run_dir, mesh=make_mesh(1, devices=jax.devices()[:1]))
    pad, unk, bos, eos = WORD_SPECIALS
    tokenizer = save_tokenizer(
        captioned_digits_tokenizer(), out / "tokenizer_files", bos_token=bos, eos_token=eos, unk_token=unk
    )
    parts = {
        "unet": run.ema.net,
        "text_encoder": run.ema.text_encoder,
        "tokenizer": tokenizer,
        "scheduler": SCHEDULER,
        "vae": AutoencoderKL.from_config(VAE, key=jax.random.key(0)),
    }
    folder = save_pipeline(parts, out / "pipeline", overwrite=True)
    pipe = load_sd(folder)
    prompts, digits = captioned_digits_prompts(90, seed=SEED)
    noise = np.asarray(jax.random.normal(jax.random.key(SEED), (len(prompts), 8, 16, 1)))
    cases = {"noise": noise, "digits": digits}
    for cfg in CFGS:
        cases[f"eqxdiff_cfg{cfg}"] = np.asarray(pipe.latents(prompts, steps=STEPS, guidance=cfg, initial_latents=noise))
    np.savez(out / "eqxdiff.npz", **cases)
    (out / "prompts.json").write_text(json.dumps({"prompts": prompts, "run_dir": str(run_dir), "step": run.step}))
    print(f"exported step {run.step} of {run_dir} to {folder}; eqxdiff's samples in {out / 'eqxdiff.npz'}")


def check(out: Path) -> None:
    """diffusers' side (tools/.venv, requirements-ports.txt)."""
    import torch
    from diffusers import StableDiffusionPipeline

    torch.set_num_threads(1)
    ours, prompts = np.load(out / "eqxdiff.npz"), json.loads((out / "prompts.json").read_text())["prompts"]
    pipe = StableDiffusionPipeline.from_pretrained(out / "pipeline", torch_dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    theirs, worst = {}, 0.0
    noise = torch.from_numpy(np.ascontiguousarray(np.transpose(ours["noise"], (0, 3, 1, 2))))
    with torch.no_grad():
        for cfg in CFGS:
            latents = pipe(
                prompt=prompts,
                num_inference_steps=STEPS,
                guidance_scale=cfg,
                latents=noise.clone(),
                height=8,
                width=16,
                output_type="latent",
            ).images
            theirs[f"diffusers_cfg{cfg}"] = got = latents.permute(0, 2, 3, 1).numpy()
            want = ours[f"eqxdiff_cfg{cfg}"]
            err = float(np.abs(got - want).max() / np.abs(want).max())
            worst = max(worst, err)
            print(f"cfg {cfg}: {len(prompts)} samples, max |diffusers - eqxdiff| / max |eqxdiff| = {err:.2e}")
    np.savez(out / "diffusers.npz", **theirs)
    if not worst <= TOLERANCE:
        sys.exit(f"check_sd_scratch: {worst:.2e} above {TOLERANCE:.0e}")


def score(out: Path) -> None:
    """The digits classifier on both sides' samples (the main venv)."""
    from eqxdiff.eval import two_digit_accuracy

    ours, theirs = np.load(out / "eqxdiff.npz"), np.load(out / "diffusers.npz")
    for cfg in CFGS:
        for side, samples in (("eqxdiff", ours[f"eqxdiff_cfg{cfg}"]), ("diffusers", theirs[f"diffusers_cfg{cfg}"])):
            scores = two_digit_accuracy(np.clip(samples, -1, 1), ours["digits"])
            print(json.dumps({"cfg": cfg, "sampled_by": side, **{k: round(v, 3) for k, v in scores.items()}}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("half", choices=["write", "check", "score"])
    parser.add_argument("--out", type=Path, required=True, help="folder for the pipeline and the samples")
    parser.add_argument("--run_dir", type=Path, help="write: the captioned_digits run (--model sd_tiny) to export")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.half == "write":
        if args.run_dir is None:
            sys.exit("check_sd_scratch: write needs --run_dir (a captioned_digits run with --model sd_tiny)")
        write(args.run_dir, args.out)
    else:
        (check if args.half == "check" else score)(args.out)


if __name__ == "__main__":
    main()
