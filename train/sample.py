"""Samples from a trained run's EMA model: a PNG grid or an .npz, and (digits) quality numbers.

    python train/sample.py --run_dir runs/digits-unet --out samples.png
    python train/sample.py --run_dir runs/digits-unet --num 1000 --out samples.npz --eval
    python train/sample.py --run_dir runs/digits-unet --num 500 --eval --guidance 2 --guidance_interval 0.3,3
    python train/sample.py --run_dir runs/digits-unet --num 500 --eval --guide_run runs/digits-unet_tiny --guide_scale 2
    python train/sample.py --run_dir runs/digits-unet --ema sigma_rel=0.05 --eval   # a post-hoc EMA (posthoc_ema.py)
    python train/sample.py --run_dir runs/captioned_digits-unet --prompts "a 3 left of a 7" --guidance 4 --out g.png
    python train/sample.py --run_dir runs/pets --num 50000 --fid pets_256.npz --inception pt_inception-2015-12-05-6726825d.pth

A published checkpoint (DiT, SiT, a Stable Diffusion pipeline) samples with train/sample_pretrained.py instead.

The model is rebuilt from the config stored with the checkpoint and restored onto whatever
devices are present (the run may have trained on another mesh or on several processes).
`--classes` takes class names (a folder's sub-folders) or indices; the grid has a row per class
(or per prompt), labelled with its name (or index, or prompt). `.npz` holds `images` (uint8 NHWC,
the dataset's resolution and channels) and, one per image, `labels` (class-conditional runs) or
`prompts` (text-to-image runs); for a run on latents (train/encode.py) also `latents` (as the
model drew them, before decoding), and the images are decoded with the autoencoder the
checkpoint names. A text-to-image run samples `--per_prompt` images for each of `--prompts`,
guided (`--guidance`) against the null text the run trained with; a run on a dataset
with its own scoring prompts (captioned_digits) draws those without `--prompts`, and `--eval` scores
both digits of each sample (with `--prompts` too, when they are in that dataset's grammar). `--eval`
scores digits and captioned_digits runs only; any other run is refused before anything loads.

Guidance: `--guidance_interval LO,HI` applies classifier-free guidance only for σ in (LO, HI] (Kynkäänniemi
et al. 2024; the conditional model alone elsewhere, one network call there). `--guide_run RUN [--guide_step N]
--guide_scale S` is autoguidance instead (Karras et al. 2024): D_w + S·(D - D_w) with the weak model D_w
the EMA of another run of the same task (same data, codec, condition; any size), both in one sampler program.

`--fid STATS.npz` (train/fid_stats.py's) measures FID instead of writing images: the `--num` samples
are made `--batch_size` at a time on every device of every process and streamed through
pytorch-fid's InceptionV3 (`--inception pt_inception-2015-12-05-6726825d.pth`), grayscale
repeated to RGB, latents decoded first; `FID <value>` is printed and a JSON line (step, num, fid,
precision and recall when the statistics keep features, ref, sampler, guidance) appended to `--fid_out`.
With `--dinov2 FOLDER` (a transformers DINOv2 folder, facebook/dinov2-large) in place of `--inception` it is
FD-DINOv2 as EDM2 computes it, against train/fid_stats.py --dinov2's statistics.

`--format adm --out FILE.npz` writes ADM's sample batch instead (eqxdiff/eval/sample_batches.py): `arr_0` uint8
NHWC, `arr_1` int64 labels balanced over `--classes`, made `--batch_size` at a time on every device of
every process in chunks kept in FILE.npz.parts/, which a restart with the same flags skips (the result
equals an uninterrupted run's); what ADM's evaluator and train/evaluate.py read.
"""

import argparse
import functools
import json
from dataclasses import dataclass
from pathlib import Path

import jax
import numpy as np

from guidance_flags import check_same_task  # train/guidance_flags.py
from outputs import check_writable
from sample_many import measure_fid, write_adm_batch  # train/sample_many.py: FID, ADM batches
from startup import Launch, dataclass_parser, exit_on_user_error, parsed_flags, start_jax

from eqxdiff.autoencoders import TILING_MODES
from eqxdiff.checkpoint import CheckpointError
from eqxdiff.data import open_source
from eqxdiff.data.specs import BUILTIN_SOURCES
from eqxdiff.diffusion import METHODS, Denoiser
from eqxdiff.images import save_image_grid, to_uint8
from eqxdiff.paths import as_path
from eqxdiff.run.conditions import TextCondition
from eqxdiff.run.open_condition import stored_condition
from eqxdiff.run.rebuild import load_run, stored_run  # a run from its checkpoint
from eqxdiff.run.sampling import parse_interval, run_sampling
from eqxdiff.sharding import make_mesh


# A table the formatter leaves as written: each field's comment is its flag's --help line.
# fmt: off
@dataclass(frozen=True)
class Flags(Launch):
    """train/sample.py's flags: each field is `--name`, its comment the flag's help, each `# section:` line a group of
    --help (train/startup.py); the launch flags (--cpu_devices, ...) are `Launch`'s."""

    # run: the model sampled
    run_dir: str = ""  # a train/main.py run directory (read only, but for --fid's default --fid_out)
    step: int = -1  # checkpoint step (default: the newest); with --ema: the post-hoc EMA's
    ema: float | None = None  # sigma_rel=S: the post-hoc EMA train/posthoc_ema.py made of that profile, not the run's --ema_decay EMA
    # draw: what is sampled
    num: int = 100  # number of images (text-to-image: --per_prompt for each prompt)
    classes: str = ""  # comma-separated class names (a folder's sub-folders) or indices to draw (default: all, balanced)
    prompts: tuple[str, ...] = ()  # text-to-image runs: one grid row per prompt
    per_prompt: int = 10  # text-to-image runs: images per prompt
    seed: int = 0  # the sampler's noise
    # sampler: how (each unset one: the run's own, as its sample grids used)
    method: str = ""  # the sampler, eqxdiff/diffusion/samplers.py (default: the run's --sample_method)
    steps: int = 18  # sampler steps (the grids' --sample_steps are fewer, for speed)
    guidance: float | None = None  # classifier-free guidance scale (1: none; default: the run's --guidance)
    guidance_interval: str = ""  # LO,HI: guide only for σ in (LO, HI] (default: the run's --guidance_interval)
    guide_run: str = ""  # autoguidance: a run of the same task, its EMA the weak model (not with --guidance)
    guide_step: int = -1  # --guide_run's checkpoint step (default: the newest)
    guide_scale: float | None = None  # autoguidance scale S: D_w + S·(D - D_w)
    vae_tiling: str = "auto"  # latent runs: decode tile by tile (diffusers' tiling); auto: images above 768²
    # output: the images, or what is measured of them
    out: str = "samples.png"  # a .png grid or an .npz of images and labels
    format: str = "eqxdiff"  # .npz: eqxdiff's (images, labels/prompts, latents) or ADM's sample batch (arr_0, arr_1), made in chunks a restart skips
    eval: bool = False  # print sample-quality numbers (digits runs)
    json: bool = False  # --eval: one JSON line instead of the table
    fid: str = ""  # FID of --num samples against this .npz (train/fid_stats.py), instead of writing them
    inception: str = ""  # --fid: pytorch-fid's Inception weights, pt_inception-2015-12-05-6726825d.pth
    dinov2: str = ""  # --fid: FD-DINOv2 instead, with this DINOv2 folder (facebook/dinov2-large)
    fid_out: str = ""  # --fid: append a JSON line here (default: RUN_DIR/fid.jsonl)
    batch_size: int = 500  # --fid, --format adm: samples per sampler call (rounded up to a multiple of the devices)
# fmt: on


CHOICES = {"method": METHODS, "format": ["eqxdiff", "adm"], "vae_tiling": list(TILING_MODES)}  # METHODS: live
# A published checkpoint's flags, now train/sample_pretrained.py's: one line saying so.
PRETRAINED = (
    "python train/sample_pretrained.py --pretrained dit:FILE|sit:FILE|sd:FOLDER ... samples a published "
    "checkpoint; train/sample.py samples a run (--run_dir)"
)
MOVED = {
    f"--{name}": f"--{name}: {PRETRAINED}"
    for name in ("pretrained", "vae", "sampler", "num_heads", "negative_prompts", "clip_score")
}


def posthoc_ema(text: str) -> float:
    """--ema sigma_rel=S -> S, or the one line naming the form."""
    kind, _, value = text.partition("=")
    try:
        if kind == "sigma_rel":
            return float(value)
    except ValueError:
        pass
    raise argparse.ArgumentTypeError(f"takes sigma_rel=S (a post-hoc EMA of train/posthoc_ema.py), got {text!r}")


def parse_args(argv: list[str] | None = None) -> Flags:
    """The command line as one frozen `Flags`; a flag that does not fit is one line naming the fix."""
    parser = dataclass_parser(Flags, __doc__, CHOICES, required=("run_dir",), parsers={"ema": posthoc_ema}, moved=MOVED)
    flags = parsed_flags(Flags, parser.parse_args(argv))
    if Path(flags.out).suffix not in (".png", ".npz"):
        parser.error(f"--out must end in .png or .npz, got {flags.out!r}")
    if flags.num < 1 or flags.steps < 1 or flags.per_prompt < 1:
        parser.error("--num, --steps and --per_prompt must be >= 1")
    if flags.fid and bool(flags.inception) == bool(flags.dinov2):
        parser.error(
            "--fid needs --inception FILE: pytorch-fid's weights, pt_inception-2015-12-05-6726825d.pth "
            "(or --dinov2 FOLDER for FD-DINOv2, not both)"
        )
    if flags.fid and flags.eval:
        parser.error("--fid and --eval are separate runs: --fid streams its samples and keeps none")
    if flags.json and not flags.eval:
        parser.error("--json prints --eval's scores: pass --eval too")
    if flags.format == "adm" and (
        Path(flags.out).suffix != ".npz" or flags.eval or flags.fid or flags.prompts or flags.batch_size < 1
    ):
        parser.error(
            "--format adm writes --num samples to --out FILE.npz (--batch_size >= 1), without --eval, --fid "
            "or --prompts (its arr_1 holds class labels)"
        )
    try:
        parse_interval(flags.guidance_interval)
    except ValueError as e:
        parser.error(str(e))
    if (flags.guide_step >= 0 or flags.guide_scale is not None) and not flags.guide_run:
        parser.error("--guide_step and --guide_scale go with --guide_run RUN (autoguidance)")
    if flags.guide_run and (flags.guide_scale is None or flags.guidance_interval or flags.guidance not in (None, 1)):
        parser.error(
            "--guide_run RUN needs --guide_scale S, and replaces classifier-free guidance: leave out "
            "--guidance and --guidance_interval"
        )
    if flags.fid and (flags.num < 2 or flags.batch_size < 1):
        parser.error("--fid needs --num >= 2 and --batch_size >= 1")
    return flags


def balanced_labels(num: int, classes: list[int]) -> np.ndarray:
    """`num` labels cycling through `classes`, grouped in the order of `classes` so a grid shows one
    class per block, as asked."""
    return np.asarray(classes, np.int32)[np.sort(np.resize(np.arange(len(classes)), num))]


def class_indices(classes: str, names: list[str] | None, num_classes: int) -> list[int]:
    """--classes ("cat,dog", "3,5", or "" for all) -> label indices: each item a class name of `names`
    (the run's, index = label) or an index in 0..num_classes-1; anything else is refused in one line
    naming the classes there are."""
    if not classes:
        return list(range(num_classes))
    if not num_classes:
        raise SystemExit(f"--classes {classes}: this run is not class-conditional (it has no classes).")
    indices = []
    for item in (c.strip() for c in classes.split(",")):
        if names and item in names:
            indices.append(names.index(item))
        elif item.isdigit() and int(item) < num_classes:
            indices.append(int(item))
        else:
            known = ", ".join(f"{k}={n}" for k, n in enumerate(names[:30])) if names else f"0..{num_classes - 1}"
            more = f", ... ({num_classes} in all)" if names and num_classes > 30 else ""
            raise SystemExit(f"--classes: this run has no class {item!r}; its classes are {known}{more}.")
    return indices


def grid_rows(keys: np.ndarray, names: list[str], max_cols: int = 20) -> tuple[np.ndarray, int, list[str]]:
    """A grid of one block of rows per group of images: `keys` [n] (grouped) gives each image's group,
    `names[key]` its label. Returns (the image index at each tile, -1 for a blank one; ncols =
    the largest group, or the width up to max_cols that leaves fewest blanks; one label per grid row: its group's
    name)."""
    groups = [np.flatnonzero(keys == k) for k in dict.fromkeys(keys.tolist())]  # in order of first appearance
    blanks = lambda c: sum(-(-len(g) // c) * c - len(g) for g in groups)  # noqa: E731
    # A group wider than max_cols wraps: into rows as full as can be (50 a class: 5 rows of 10, not 20, 20, 10)
    largest = max(len(g) for g in groups)
    widths = range(-(-max_cols // 2), max_cols + 1)
    ncols = largest if largest <= max_cols else min(widths, key=lambda c: (blanks(c), -c))
    tiles, labels = [], []
    for key, group in zip(dict.fromkeys(keys.tolist()), groups):
        rows = -(-len(group) // ncols)
        tiles.append(np.concatenate([group, np.full(rows * ncols - len(group), -1)]))
        labels += [names[key]] * rows
    return np.concatenate(tiles), ncols, labels


def builtin_dataset(name: str):
    """The built-in dataset `name` names (eqxdiff/data/specs.py's BUILTIN_SOURCES), opened to ask what it offers
    (captioned_digits: its scoring prompts and the digits a prompt asks for); None for any other (a folder...)."""
    return open_source(name) if name in BUILTIN_SOURCES else None


def check_eval(stored: dict) -> None:
    """--eval's scores are a digits classifier's: a class-conditional digits run's, or a text run's whose
    dataset says which digits each prompt asks for (`prompt_digits`); any other run is refused before
    anything loads."""
    dataset = stored.get("image_dataset", stored["dataset"])  # latents: the images they encode
    kind = stored_condition(stored)["kind"]
    if kind in ("none", "labels"):
        scored = kind == "labels" and dataset == "digits"
    else:
        scored = hasattr(builtin_dataset(dataset), "prompt_digits")
    if not scored:
        raise SystemExit(
            "--eval scores class-conditional digits and captioned_digits runs with a digits classifier; "
            f"this run trained on {dataset}: measure it with --fid STATS.npz (train/fid_stats.py)."
        )


def main(flags: Flags, features_fn=None) -> None:
    """`features_fn`: --fid's feature network, a stand-in (tests); default InceptionV3 from --inception."""
    # What was asked is checked against the run first (--ema: the newest checkpoint describes the model).
    _, saved = stored_run(flags.run_dir, -1 if flags.ema is not None else flags.step)
    class_names = saved.get("class_names")  # a folder's sub-folders, latents' too (their meta.json)
    classes = class_indices(flags.classes, class_names, saved["num_classes"])
    if flags.eval:
        check_eval(saved)
    if flags.guide_run:  # the weak model's task checked from its config before anything loads
        _, guide_saved = stored_run(flags.guide_run, flags.guide_step)
        check_same_task(flags.run_dir, saved, flags.guide_run, guide_saved)
    if flags.format == "adm" and stored_condition(saved)["kind"] not in ("none", "labels"):
        raise SystemExit(
            "--format adm writes ADM's batch of images and class labels; this run is text-to-image: "
            "sample it with --prompts into eqxdiff's .npz (--format eqxdiff)."
        )
    if flags.process_id == 0 and flags.fid:  # the process that writes: its output's folder made and tried first
        check_writable(flags.fid_out or as_path(flags.run_dir) / "fid.jsonl", "--fid_out")  # a gs:// run: its bucket
    elif flags.process_id == 0:
        check_writable(flags.out, "--out")
    start_jax(flags)
    mesh = make_mesh(data=-1, fsdp=1)
    run = load_run(flags.run_dir, flags.step, mesh=mesh, ema=flags.ema)
    # The run's own sampler, guidance and interval (its grids'), but what the flags override (eqxdiff/run/sampling.py)
    sampling = run_sampling(
        run.cfg,
        method=flags.method,
        steps=flags.steps,
        guidance=flags.guidance,
        interval=flags.guidance_interval,
        guide_scale=flags.guide_scale,
        tiling=flags.vae_tiling,
    )
    how = sampling.record()  # for the records of how the samples were made
    weak_denoiser = None
    if flags.guide_run:  # autoguidance: the other run's EMA, with its own σ_data and schedule, in the same program
        weak = load_run(flags.guide_run, flags.guide_step, mesh=mesh)
        weak_denoiser = Denoiser(weak.ema, weak.schedule, weak.parameterization)
        how |= {"guide_run": flags.guide_run, "guide_step": weak.step}
    dataset = builtin_dataset(run.image_dataset)  # asked for its scoring prompts; None: not built in

    num_classes = run.stored["num_classes"]
    labels = balanced_labels(flags.num, classes) if num_classes else None
    prompts, digits, num = None, None, flags.num  # a text run: --per_prompt images for each prompt
    if isinstance(run.condition, TextCondition):
        prompts = flags.prompts or None
        if prompts is None and hasattr(dataset, "scoring_prompts"):  # the dataset's own, with the digits they ask for
            prompts, digits = dataset.scoring_prompts(max(1, flags.num // flags.per_prompt), seed=flags.seed)
        elif prompts is None:
            raise SystemExit('This run is text-to-image: pass --prompts "..." ["..." ...].')
        elif flags.eval:  # the digits each prompt asks for, in the dataset's grammar (check_eval)
            try:
                digits = dataset.prompt_digits(list(prompts))
            except ValueError as e:
                raise SystemExit(f"--eval: {e}") from e
        digits = None if digits is None else np.repeat(digits, flags.per_prompt, axis=0)
        cond, null_cond = run.condition.for_sampling(list(prompts), flags.per_prompt)
        num = len(prompts) * flags.per_prompt
    elif flags.prompts:
        raise SystemExit(f"--prompts: this run ({run.cfg.dataset}) was not trained on captions.")
    else:
        cond, null_cond = run.condition.for_sampling(labels, 1)  # class runs: one image per label; else none
    # (cond, num, seed=) -> (images [num, h, w, c] in about [-1, 1], the samples as drawn: a latent run's latents)
    sample_images = functools.partial(
        sampling.images,
        run.ema,
        run.codec,
        run.schedule,
        run.parameterization,
        run.image_shape,
        mesh=mesh,
        null_cond=null_cond,
        weak_denoiser=weak_denoiser,
    )

    if flags.fid:
        measure_fid(
            flags,
            run.step,
            mesh,
            sample_images,
            cond,
            run.codec.image_shape(run.image_shape),
            how,
            features_fn,
            run.image_dataset,
            num=num,
            ema=flags.ema,
        )
        return
    if flags.format == "adm":
        write_adm_batch(flags, run.step, mesh, sample_images, run.condition, classes if num_classes else None, how)
        return
    images, drawn = sample_images(cond, num, seed=flags.seed)
    step = run.step
    if jax.process_index() == 0:
        out = Path(flags.out)
        if out.suffix == ".png" and prompts is None and labels is None:
            save_image_grid(out, images, ncols=10, upscale=4)
        elif out.suffix == ".png":  # a block of rows per class (labels are grouped) or per prompt, labelled
            keys, names = labels, class_names or [str(k) for k in range(num_classes)]
            if prompts is not None:
                keys, names = np.repeat(np.arange(len(prompts)), flags.per_prompt), list(prompts)
            tiles, ncols, row_labels = grid_rows(keys, names)
            blank = np.full((1, *images.shape[1:]), -1.0, np.float32)  # black, as the grid's padding
            tiled = np.concatenate([np.asarray(images, np.float32), blank])[tiles]  # -1: the blank tile
            save_image_grid(out, tiled, ncols=ncols, upscale=4, row_labels=row_labels)
        else:  # one label (class runs) or prompt (text runs) per image
            out.parent.mkdir(parents=True, exist_ok=True)
            arrays = dict(images=to_uint8(images))
            if prompts is not None:
                arrays["prompts"] = np.repeat(np.asarray(prompts, dtype=str), flags.per_prompt)
            elif labels is not None:
                arrays["labels"] = labels
            np.savez(out, **arrays, **({} if drawn is images else {"latents": drawn}))  # a latent run's, as drawn
        print(f"step {step}: {num} samples -> {out}")
        if flags.eval:  # imported here: scipy's import is start-up time the other paths need not pay
            from eqxdiff.eval import digits_sample_metrics, format_metrics, two_digit_accuracy

            interval = sampling.interval_text()
            guided = f"guidance {sampling.guidance:g}" + (f" for σ in ({interval}]" if interval else "")
            if flags.guide_run:
                guided = f"autoguidance {sampling.guide_scale:g} by {flags.guide_run} step {how['guide_step']}"
            scored = (
                f"{flags.run_dir} step {step}: {num} samples, {sampling.method} {sampling.steps} steps, "
                f"{guided}, seed {flags.seed}"
            )
            record = {"step": step, "num": num, **how, "seed": flags.seed}  # --json's line
        if flags.eval and digits is not None:
            scores = two_digit_accuracy(to_uint8(images), digits)  # the digits classifier on each half
            if flags.json:
                print(json.dumps({**record, **scores}))
            else:
                print(
                    f"{scored}\ntwo digits: "
                    + ", ".join(f"{k} {v:.3f}" for k, v in scores.items())
                    + " (fraction classified as prompted, per half and both; higher is better; real digits: ~0.98 per half)"
                )
        elif flags.eval:  # a digits run (check_eval)
            scores = digits_sample_metrics(to_uint8(images), labels)  # scored as saved: clipped
            if flags.json:
                print(json.dumps({**record, **scores}))
            else:
                print(f"{scored}; real = held-out real digits scored the same way\n{format_metrics(scores)}")


def cli() -> None:
    try:
        main(parse_args())
    except CheckpointError as e:  # a checkpoint that does not fit: one line, as for every user error
        raise SystemExit(str(e)) from e


if __name__ == "__main__":
    exit_on_user_error(cli)
