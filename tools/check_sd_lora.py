"""Issue 31 §5, second half: a LoRA fine-tune (train/main.py --init sd:FOLDER --lora_rank R) teaching the
SD-architecture model of check_sd_scratch.py a new caption, "inverted ...": the digits on a white background.
Measured before (the base) and after (base + LoRA) with the digits classifier, on the new caption and on the old
ones; the run's LoRA file loaded into diffusers' pipeline samples what eqxdiff samples. Four halves, two venvs:

    PYTHONPATH=. .venv/bin/python tools/check_sd_lora.py data --pipeline /tmp/sd_scratch/pipeline --out /tmp/sd_lora
    PYTHONPATH=. .venv/bin/python train/main.py --init sd:/tmp/sd_lora/pixels/unet \\
        --dataset npz:/tmp/sd_lora/inverted_digits.npz --lora_rank 8 --lr 3e-3 --warmup_steps 25 --steps 1000 \\
        --lora_targets '(^|\\.)(to_q|to_k|to_v|to_out\\.0|conv1|conv2)$' \\
        --batch_size 64 --run_dir /tmp/sd_lora_run --wandb disabled --sample_every 0
    PYTHONPATH=. .venv/bin/python tools/check_sd_lora.py write --run_dir /tmp/sd_lora_run --out /tmp/sd_lora
    tools/.venv/bin/python tools/check_sd_lora.py check --run_dir /tmp/sd_lora_run --out /tmp/sd_lora   # + peft
    PYTHONPATH=. .venv/bin/python tools/check_sd_lora.py score --out /tmp/sd_lora

`data` copies the exported pipeline to OUT/pipeline (what load_sd and diffusers sample) and its unet/,
text_encoder/, tokenizer/ and scheduler/ to OUT/pixels, without the placeholder vae/: a folder without a VAE is a
pixel-space UNet, which --init trains on images (eqxdiff/run/finetune.py). It writes the training set, an npz of
captioned_digits examples: half inverted (255 - image) with "inverted " before a caption of the short templates
("inverted 3 then 7"; the tower has 8 positions, so the longest captions leave no room for a word), half as they
were, so the old captions are still trained on. "inverted" is not in the word tokenizer's vocabulary: it is read
as <unk>, a token the tower never saw in training (any unknown word would read the same; DreamBooth's rare
identifier in a closed vocabulary). It goes first because the tower is causal: after the caption it would change
only its own, the eos and the padding positions of the context (by 0.04-0.3 of their norm), and 500 LoRA steps
did not learn that (BENCHMARKS.md); first, it changes every later position (0.2-0.76). The adapters sit on the
attention projections and on the resnets' convolutions (--lora_targets): with attention alone the old captions'
samples turned white too. `write` samples, with eqxdiff's `load_sd` of OUT/pipeline, the base and the base with the
run's RUN_DIR/lora/pytorch_lora_weights.safetensors (`load_lora`), for the old prompts (the 90 digit
pairs, twice) and the same pairs as new ones, from the same unit noise, 30 DDIM steps, cfg 1 and 4. `check` runs
diffusers' StableDiffusionPipeline on OUT/pipeline, before and after `load_lora_weights(RUN_DIR/lora)`, on the same
prompts and noise, and fails when max |diffusers - eqxdiff| / max |eqxdiff| exceeds 1e-4 (check_sd_scratch's
bar). `score` reads every set with the digits classifier (`two_digit_accuracy`; the new caption's samples negated
first, white back to black; as drawn too) and the fraction of samples with a white background (mean pixel above 0).
"""

import argparse
import dataclasses
import json
import shutil
import sys
from pathlib import Path

import numpy as np

STEPS, CFGS, SEED, COPIES = 30, (1.0, 4.0), 0, 2
TOLERANCE = 1e-4
WORD = "inverted"
SHORT_TEMPLATES = (2, 3, 4)  # "L then R", "L before R", "R after L": with the word, 4 words + bos + eos <= 8
NUM_EACH = 4000  # training examples per half
MODELS = ("base", "lora")
PROMPT_SETS = ("old", "new")


def data(pipeline: Path, out: Path) -> None:
    """The folders and the training set (the main venv)."""
    from eqxdiff.data.captioned_digits import CaptionedDigitsSource, captioned_digits_tokenizer

    for name, ignore in (("pipeline", ()), ("pixels", ("vae", "model_index.json"))):
        if (out / name).exists():
            shutil.rmtree(out / name)
        shutil.copytree(pipeline, out / name, ignore=shutil.ignore_patterns(*ignore))
    source = CaptionedDigitsSource()
    short = np.flatnonzero(np.isin(source.template, SHORT_TEMPLATES))[:NUM_EACH]
    rest = np.setdiff1d(np.arange(len(source)), short)[:NUM_EACH]
    images, captions = [], []
    for i in short:
        images.append(255 - source[int(i)]["image"])
        captions.append(f"{WORD} {source.caption(int(i))}")
    for i in rest:
        images.append(source[int(i)]["image"])
        captions.append(source.caption(int(i)))
    images = np.stack(images)
    np.savez(out / "inverted_digits.npz", images=images, captions=np.array(captions))
    ids, _ = captioned_digits_tokenizer()([captions[0]])
    white = (images.astype(np.float32) / 127.5 - 1).mean(axis=(1, 2, 3)) > 0
    print(
        f"{len(images)} examples in {out / 'inverted_digits.npz'}: {captions[0]!r} -> ids {ids[0].tolist()} (1 is "
        f"<unk>); white background (mean pixel > 0): {white[:NUM_EACH].mean():.3f} of the inverted half, "
        f"{white[NUM_EACH:].mean():.3f} of the rest"
    )


def prompt_sets() -> tuple[dict[str, list[str]], np.ndarray]:
    """{"old": the 90 ordered digit pairs COPIES times (captioned_digits_prompts), "new": the same pairs in a
    short template after WORD}, and the (left, right) digits of both."""
    from eqxdiff.data.captioned_digits import captioned_digits_prompts, digits_caption

    old, digits = captioned_digits_prompts(90 * COPIES, seed=SEED)
    rng = np.random.default_rng(SEED + 1)
    templates, as_word = rng.choice(SHORT_TEMPLATES, len(old)), rng.integers(0, 2, (len(old), 2)).astype(bool)
    new = [
        f"{WORD} {digits_caption(int(l), int(r), int(t), bool(wl), bool(wr))}"
        for (l, r), t, (wl, wr) in zip(digits, templates, as_word)
    ]
    return {"old": old, "new": new}, digits


def write(run_dir: Path, out: Path) -> None:
    """eqxdiff's side (the main venv): the base and the LoRA'd pipeline sample both prompt sets."""
    import jax

    from eqxdiff.sd.lora_files import load_lora
    from eqxdiff.sd import load_sd

    base = load_sd(out / "pipeline")
    pipes = {"base": base, "lora": dataclasses.replace(base, unet=load_lora(base.unet, run_dir / "lora"))}
    prompts, digits = prompt_sets()
    noise = np.asarray(jax.random.normal(jax.random.key(SEED), (len(digits), 8, 16, 1)))
    cases = {"noise": noise, "digits": digits}
    for model, pipe in pipes.items():
        for name, texts in prompts.items():
            for cfg in CFGS:
                latents = pipe.latents(texts, steps=STEPS, guidance=cfg, initial_latents=noise)
                cases[f"eqxdiff_{model}_{name}_cfg{cfg}"] = np.asarray(latents)
    np.savez(out / "eqxdiff.npz", **cases)
    (out / "prompts.json").write_text(json.dumps({**prompts, "run_dir": str(run_dir)}))
    print(f"eqxdiff's samples of the base and of {run_dir / 'lora'} in {out / 'eqxdiff.npz'}")


def check(run_dir: Path, out: Path) -> None:
    """diffusers' side (tools/.venv with tools/requirements-lora.txt): the same samples, before and after
    load_lora_weights."""
    import torch
    from diffusers import StableDiffusionPipeline

    torch.set_num_threads(1)
    ours, prompts = np.load(out / "eqxdiff.npz"), json.loads((out / "prompts.json").read_text())
    pipe = StableDiffusionPipeline.from_pretrained(out / "pipeline", torch_dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    noise = torch.from_numpy(np.ascontiguousarray(np.transpose(ours["noise"], (0, 3, 1, 2))))
    theirs, worst = {}, 0.0
    for model in MODELS:
        if model == "lora":
            pipe.load_lora_weights(run_dir / "lora")
        for name in PROMPT_SETS:
            for cfg in CFGS:
                with torch.no_grad():
                    latents = pipe(
                        prompt=prompts[name],
                        num_inference_steps=STEPS,
                        guidance_scale=cfg,
                        latents=noise.clone(),
                        height=8,
                        width=16,
                        output_type="latent",
                    ).images
                key = f"{model}_{name}_cfg{cfg}"
                theirs[f"diffusers_{key}"] = got = latents.permute(0, 2, 3, 1).numpy()
                want = ours[f"eqxdiff_{key}"]
                err = float(np.abs(got - want).max() / np.abs(want).max())
                worst = max(worst, err)
                effect = ""
                if model == "lora":  # the LoRA's own effect, so an adapter diffusers dropped would show
                    moved = np.abs(want - ours[f"eqxdiff_base_{name}_cfg{cfg}"]).max() / np.abs(want).max()
                    effect = f" (the LoRA moves eqxdiff's samples by {moved:.2e} of their max)"
                print(f"{key}: {len(got)} samples, max |diffusers - eqxdiff| / max |eqxdiff| = {err:.2e}{effect}")
    np.savez(out / "diffusers.npz", **theirs)
    if not worst <= TOLERANCE:
        sys.exit(f"check_sd_lora: {worst:.2e} above {TOLERANCE:.0e}")


def score(out: Path) -> None:
    """The digits classifier and the white-background fraction on both sides' samples (the main venv)."""
    from eqxdiff.eval import two_digit_accuracy

    ours = np.load(out / "eqxdiff.npz")
    theirs = np.load(out / "diffusers.npz") if (out / "diffusers.npz").is_file() else {}
    for model in MODELS:
        for name in PROMPT_SETS:
            for cfg in CFGS:
                key = f"{model}_{name}_cfg{cfg}"
                for side in ("eqxdiff", "diffusers"):
                    if f"{side}_{key}" not in (ours if side == "eqxdiff" else theirs):
                        continue
                    samples = np.clip((ours if side == "eqxdiff" else theirs)[f"{side}_{key}"], -1, 1)
                    white = float((samples.mean(axis=(1, 2, 3)) > 0).mean())
                    # The new caption asks for the digits turned over: the classifier reads them turned back
                    # ("drawn_": read as sampled, which is how a model that ignores the word draws them).
                    scores = two_digit_accuracy(-samples if name == "new" else samples, ours["digits"])
                    drawn = two_digit_accuracy(samples, ours["digits"]) if name == "new" else {}
                    row = {"model": model, "prompts": name, "cfg": cfg, "sampled_by": side, "white": round(white, 3)}
                    row |= {k: round(v, 3) for k, v in scores.items()}
                    print(json.dumps(row | {f"drawn_{k}": round(v, 3) for k, v in drawn.items()}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("half", choices=["data", "write", "check", "score"])
    parser.add_argument("--out", type=Path, required=True, help="folder for the folders, data and samples")
    parser.add_argument("--pipeline", type=Path, help="data: check_sd_scratch.py's exported pipeline folder")
    parser.add_argument("--run_dir", type=Path, help="write, check: the --init sd:OUT/pixels/unet --lora_rank run")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.half == "data":
        if args.pipeline is None or not (args.pipeline / "model_index.json").is_file():
            sys.exit("check_sd_lora: data needs --pipeline, the folder check_sd_scratch.py write exported")
        data(args.pipeline, args.out)
    elif args.half in ("write", "check"):
        if args.run_dir is None or not (args.run_dir / "lora" / "pytorch_lora_weights.safetensors").is_file():
            sys.exit(f"check_sd_lora: {args.half} needs --run_dir, a finished LoRA run (its lora/ folder)")
        (write if args.half == "write" else check)(args.run_dir, args.out)
    else:
        score(args.out)


if __name__ == "__main__":
    main()
