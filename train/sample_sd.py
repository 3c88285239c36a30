"""train/sample.py --pretrained sd:FOLDER: a diffusers Stable Diffusion 1.x/2.x or XL pipeline folder (as
`save_pretrained` writes it, or a Hub snapshot) sampled by eqxdiff (`eqxdiff.sd.load_sd`), `--per_prompt`
images for each prompt (default 1; or `--num` in all, a multiple of the prompts), as diffusers' pipeline makes them
from the same noise.

    python train/sample.py --pretrained sd:stable-diffusion-v1-5/ --prompts "a photo of a cat" "a red car" \\
        --negative_prompts "blurry" "" --cfg 7.5 --steps 30 --method dpmpp_2m --out grid.png

`--method` swaps the folder's scheduler for another class made from its config (diffusers' `from_config`): ddim,
euler, euler_ancestral or dpmpp_2m (default: the folder's own). `--negative_prompts`: one per prompt, or one for all
(default: SD 1.x/2.x "", SDXL zeros when its model_index.json says force_zeros_for_empty_prompt). `--seed` draws
each image's noise (image i's from fold_in(seed's noise key, i), whatever --batch_size: images per pipeline call);
`--out` a .png grid (a row per prompt) or an .npz of `images` (uint8 NHWC), `latents` and `prompts` (one per image).
`--clip_score FOLDER` (a transformers CLIP folder: openai/clip-vit-large-patch14 with its tokenizer and
preprocessor_config.json) also prints the images' CLIP score against their prompts, as torchmetrics computes it
(eqxdiff/eval/clip_score.py). Runs on the first device.
"""

import argparse
import json
from pathlib import Path

import jax
import numpy as np

from outputs import check_writable  # train/outputs.py
from startup import Parser, start_jax

from eqxdiff.paths import what_path_is
from eqxdiff.images import save_image_grid, to_uint8
from eqxdiff.sd import load_sd

METHODS = ("ddim", "euler", "euler_ancestral", "dpmpp_2m")


def check_args(args: argparse.Namespace) -> tuple[Path, list[str] | None]:
    """The folder and the negative prompts (one per prompt), checked before JAX starts; defaults filled in."""
    folder = Path(args.pretrained.partition(":")[2]).expanduser()
    if not (folder / "model_index.json").is_file():
        given = what_path_is(folder) + (f" (did you mean dit:{folder} or sit:{folder}?)" if folder.is_file() else "")
        raise SystemExit(f"--pretrained sd:{folder}: no model_index.json there: {folder} {given}; give a diffusers "
                         "pipeline folder (model_index.json, unet/, vae/, text_encoder/, tokenizer/, "
                         "scheduler/).")  # fmt: skip
    if args.run_dir or args.vae or args.eval or args.fid or args.classes or args.sampler or args.format != "eqxdiff":
        raise SystemExit("--pretrained sd: takes --prompts, --negative_prompts, --cfg, --steps, --method, --seed, "
                         "--clip_score and --out; the pipeline brings its own VAE (no --run_dir, --vae, --eval, --fid, "
                         "--classes, --sampler, --format).")  # fmt: skip
    if not args.prompts:
        raise SystemExit('--pretrained sd: needs --prompts "a photo of a cat" ... (one image each).')
    if args.method is not None and args.method not in METHODS:
        raise SystemExit(f"--method {args.method}: a Stable Diffusion pipeline samples with {', '.join(METHODS)} "
                         "(default: its scheduler's).")  # fmt: skip
    negative = args.negative_prompts
    if negative is not None and len(negative) not in (1, len(args.prompts)):
        raise SystemExit(f"--negative_prompts: one for all prompts or one per prompt ({len(args.prompts)}), got "
                         f"{len(negative)}.")  # fmt: skip
    if negative is not None and len(negative) == 1:
        negative = negative * len(args.prompts)
    if "num" in args.given:  # --num images in all: as many for each prompt
        per_prompt, rest = divmod(args.num, len(args.prompts))
        if rest or ("per_prompt" in args.given and per_prompt != args.per_prompt):
            raise SystemExit(f"--num {args.num}: --pretrained sd: makes --per_prompt images for each of the "
                             f"{len(args.prompts)} prompts; pass --per_prompt N alone, or --num a multiple of "
                             f"{len(args.prompts)}.")  # fmt: skip
        args.per_prompt = per_prompt
    args.num = len(args.prompts) * args.per_prompt
    if args.clip_score and not (Path(args.clip_score).expanduser() / "preprocessor_config.json").is_file():
        raise SystemExit(f"--clip_score {args.clip_score}: no preprocessor_config.json there; give a transformers CLIP "
                         "folder (openai/clip-vit-large-patch14: config.json, model.safetensors, its tokenizer and "
                         "preprocessor_config.json).")  # fmt: skip
    check_writable(args.out, "--out")  # its folder made (the README's runs/sd15/), before the pipeline loads
    args.steps = args.steps or 30
    args.guidance = 7.5 if args.guidance is None else args.guidance
    return folder, negative


def main(args: argparse.Namespace) -> None:
    folder, negative = check_args(args)
    start_jax(args)
    try:
        pipe = load_sd(folder)
        if args.method:
            pipe = pipe.with_scheduler(args.method)
    except (ValueError, OSError) as e:  # another pipeline class, a missing part, an unported scheduler option
        raise SystemExit(f"--pretrained sd:{folder}: {e}") from e
    prompts = [p for p in args.prompts for _ in range(args.per_prompt)]  # prompt-major: a grid row per prompt
    negative = None if negative is None else [n for n in negative for _ in range(args.per_prompt)]
    config = json.loads(pipe.unet.config)
    side = config["sample_size"]  # latents, as diffusers' default height/width
    noise_key, step_key = jax.random.split(jax.random.key(args.seed))
    noise = [jax.random.normal(jax.random.fold_in(noise_key, i), (1, side, side, config["in_channels"]))
             for i in range(len(prompts))]  # fmt: skip
    latents, batch = [], max(1, args.batch_size)  # images per pipeline call
    for start in range(0, len(prompts), batch):
        rows = slice(start, start + batch)
        latents.append(pipe.latents(prompts[rows], None if negative is None else negative[rows], steps=args.steps,
                                    guidance=args.guidance, initial_latents=np.concatenate(noise[rows]),
                                    key=jax.random.fold_in(step_key, start)))  # fmt: skip
    latents = np.concatenate([np.asarray(x) for x in latents])
    images = np.asarray(pipe.decode(latents))
    if Path(args.out).suffix == ".npz":
        np.savez(args.out, images=to_uint8(images), latents=latents, prompts=np.asarray(prompts))
    else:
        save_image_grid(args.out, images, ncols=args.per_prompt, row_labels=args.prompts)
    print(f"{args.pretrained}: {len(prompts)} {'image' if len(prompts) == 1 else 'images'} ({args.per_prompt} per "
          f"prompt, {pipe.scheduler.method}, {args.steps} steps, cfg {args.guidance:g}) -> {args.out}")  # fmt: skip
    if args.clip_score:
        from eqxdiff.eval.clip_score import CLIPScorer, clip_score  # imported here: only this flag needs it

        try:
            scorer = CLIPScorer.from_transformers(args.clip_score)
        except (ValueError, OSError) as e:
            raise SystemExit(f"--clip_score {args.clip_score}: {e}") from e
        scores = scorer.scores(list(to_uint8(images)), prompts)
        print(f"CLIP score {clip_score(scores):.4f} ({len(prompts)} images against their prompts, {args.clip_score})")


if __name__ == "__main__":  # sample.py's --pretrained part: --help says what it does, anything else where to run it
    parser = Parser(description=__doc__, usage="python train/sample.py --pretrained sd:FOLDER --prompts PROMPT ...")
    parser.parse_known_args()
    parser.error("this file is train/sample.py's --pretrained part: run python train/sample.py --pretrained "
                 "sd:FOLDER --prompts PROMPT ... (python train/sample.py --help lists the flags)")
