"""Samples from a trained run's EMA model: a PNG grid or an .npz, and (digits) quality numbers.

    python train/sample.py --run_dir runs/digits-unet --out samples.png
    python train/sample.py --run_dir runs/digits-unet --num 1000 --out samples.npz --eval
    python train/sample.py --run_dir runs/captioned_digits-unet --prompts "a 3 left of a 7" --cfg 4 --out g.png
    python train/sample.py --run_dir runs/pets --num 50000 --fid pets_256.npz --inception pt_inception-2015-12-05-6726825d.pth

The model is rebuilt from the config stored with the checkpoint and restored onto whatever
devices are present (the run may have trained on another mesh or on several processes).
`--classes` takes class names (a folder's sub-folders) or indices; the grid has a row per class
(or per prompt), labelled with its name (or index, or prompt). `.npz` holds `images` (uint8 NHWC,
the dataset's resolution and channels) and, one per image, `labels` (class-conditional runs) or
`prompts` (text-to-image runs); for a run on latents (train/encode.py) also `latents` (as the
model drew them, before decoding), and the images are decoded with the autoencoder the
checkpoint names. A text-to-image run samples `--per_prompt` images for each of `--prompts`,
guided against the null text the run trained with; a captioned_digits run without `--prompts`
draws that dataset's prompts, and `--eval` scores both digits of each sample (with `--prompts`
too, when they are in that dataset's grammar). `--eval` scores digits and captioned_digits runs
only; any other run is refused before anything loads.

`--fid STATS.npz` (train/fid_stats.py's) measures FID instead of writing images: the `--num` samples
are made `--batch_size` at a time on every device of every process and streamed through
pytorch-fid's InceptionV3 (`--inception pt_inception-2015-12-05-6726825d.pth`), grayscale
repeated to RGB, latents decoded first; `FID <value>` is printed and a JSON line (step, num, fid,
precision and recall when the statistics keep features, ref, sampler) appended to `--fid_out`.
"""

import argparse
import dataclasses
import json
from pathlib import Path

import jax
import numpy as np
from tqdm import tqdm

from main import Config, sigma_data  # train/ is on sys.path as a script
from models import build_model, model_args
from outputs import check_writable
from run_condition import condition_from_config, stored_condition
from resume import checkpoint_steps, close_runs, saved_config
from startup import HelpFormatter, exit_on_user_error, start_jax

from eqxdiff.autoencoders import TILING_MODES
from eqxdiff.codecs import codec_from_config
from eqxdiff.conditions import TextCondition
from eqxdiff.checkpoint import CheckpointError, Checkpoints
from eqxdiff.data.captioned_digits import caption_digits, captioned_digits_prompts
from eqxdiff.diffusion import METHODS, parameterization_by_name, schedule_by_name
from eqxdiff.generate import generate
from eqxdiff.images import save_image_grid, to_uint8
from eqxdiff.sharding import make_mesh
from eqxdiff.training import abstract_train_state, adamw_cosine


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--run_dir", required=True,
                        help="a train/main.py run directory (read only, but for --fid's default --fid_out)")
    parser.add_argument("--step", type=int, default=-1, help="checkpoint step (default: the newest)")
    parser.add_argument("--num", type=int, default=100, help="number of images")
    parser.add_argument("--classes", default="",
                        help="comma-separated class names (a folder's sub-folders) or indices to draw (default: all, "
                             "balanced)")  # fmt: skip
    parser.add_argument("--prompts", nargs="+", default=None, help="text-to-image runs: one grid row per prompt")
    parser.add_argument("--per_prompt", type=int, default=10, help="images per prompt (text-to-image runs)")
    parser.add_argument("--method", default=None, choices=METHODS,
                        help="sampler (default: the run's --sample_method)")  # fmt: skip
    parser.add_argument("--steps", type=int, default=18, help="sampler steps")
    parser.add_argument("--cfg", type=float, default=None,
                        help="classifier-free guidance scale (1: none; default: the run's --cfg_scale)")  # fmt: skip
    parser.add_argument("--seed", type=int, default=0, help="the sampler's noise")
    parser.add_argument("--out", default="samples.png", help="a .png grid or an .npz of images and labels")
    parser.add_argument("--eval", action="store_true", help="print sample-quality numbers (digits runs)")
    parser.add_argument("--json", action="store_true", help="--eval: one JSON line instead of the table")
    parser.add_argument("--fid", default="", help="FID of --num samples against this .npz (train/fid_stats.py)")
    parser.add_argument("--inception", default="", help="--fid: pytorch-fid's Inception weights, pt_inception-2015-12-05-6726825d.pth")
    parser.add_argument("--fid_out", default="", help="--fid: append a JSON line here (default: RUN_DIR/fid.jsonl)")
    parser.add_argument("--batch_size", type=int, default=500,
                        help="--fid: samples per sampler call (rounded up to a multiple of the devices)")  # fmt: skip
    parser.add_argument("--vae_tiling", default="auto", choices=TILING_MODES,
                        help="latent runs: decode tile by tile (diffusers' tiling); auto: images above 768²")  # fmt: skip
    parser.add_argument("--cpu_devices", type=int, default=0, help=">0: simulate this many CPU devices")
    parser.add_argument("--coordinator", default="",
                        help="HOST:PORT of process 0 joins a jax.distributed job (train/launch_local.py --script "
                             "sample.py); \"auto\": cluster env")  # fmt: skip
    parser.add_argument("--num_processes", type=int, default=1, help="with --coordinator: processes in the job")
    parser.add_argument("--process_id", type=int, default=0, help="with --coordinator: this process's index")
    args = parser.parse_args(argv)
    if Path(args.out).suffix not in (".png", ".npz"):
        parser.error(f"--out must end in .png or .npz, got {args.out!r}")
    if args.num < 1 or args.steps < 1 or args.per_prompt < 1:
        parser.error("--num, --steps and --per_prompt must be >= 1")
    if args.fid and not args.inception:
        parser.error("--fid needs --inception FILE: pytorch-fid's weights, pt_inception-2015-12-05-6726825d.pth")
    if args.fid and args.eval:
        parser.error("--fid and --eval are separate runs: --fid streams its samples and keeps none")
    if args.json and not args.eval:
        parser.error("--json prints --eval's scores: pass --eval too")
    if args.fid and (args.num < 2 or args.batch_size < 1):
        parser.error("--fid needs --num >= 2 and --batch_size >= 1")
    return args


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
    min(largest group, max_cols); one label per grid row: its group's name)."""
    groups = [np.flatnonzero(keys == k) for k in dict.fromkeys(keys.tolist())]  # in order of first appearance
    ncols = min(max(len(g) for g in groups), max_cols)
    tiles, labels = [], []
    for key, group in zip(dict.fromkeys(keys.tolist()), groups):
        rows = -(-len(group) // ncols)
        tiles.append(np.concatenate([group, np.full(rows * ncols - len(group), -1)]))
        labels += [names[key]] * rows
    return np.concatenate(tiles), ncols, labels


def stored_run(run_dir: str | Path, step: int) -> tuple[int, dict]:
    """(the step, the config train/main.py saved with it) of checkpoint `step` (< 0: the newest), read as
    plain JSON before JAX starts; a missing run or step named in one line."""
    saved = checkpoint_steps(run_dir)  # before orbax opens anything
    if not saved:
        close = close_runs(run_dir)  # a mistyped --run_dir
        hint = f"did you mean {' or '.join(map(str, close))}? Else train" if close else "train"
        raise SystemExit(f"No checkpoint under {Path(run_dir).absolute() / 'checkpoints'}: {hint} first "
                         f"(train/main.py --run_dir {run_dir}).")  # fmt: skip
    if step >= 0 and step not in saved:
        raise SystemExit(f"--step {step}: {run_dir} holds checkpoints of steps {', '.join(map(str, saved))}.")
    return saved_config(run_dir, step)


def check_eval(stored: dict) -> None:
    """--eval's scores are a digits classifier's: refused, before anything loads, for any other run."""
    dataset = stored.get("image_dataset", stored["dataset"])  # latents: the images they encode
    kind = stored_condition(stored)["kind"]
    scored = "digits" if kind in ("none", "labels") else "captioned_digits"
    if dataset != scored or kind == "none":
        raise SystemExit("--eval scores class-conditional digits and captioned_digits runs with a digits classifier; "
                         f"this run trained on {dataset}: measure it with --fid STATS.npz (train/fid_stats.py).")


def stored_codec(run_dir, stored: dict, mesh):
    """The codec a checkpoint's config describes (before codecs were stored: its `autoencoder`, if any)."""
    config = stored.get("codec") or ({"kind": "latents", "autoencoder": stored["autoencoder"]}
                                     if "autoencoder" in stored else None)  # fmt: skip
    try:
        return codec_from_config(config, mesh=mesh)
    except (FileNotFoundError, ValueError) as e:  # the VAE folder moved since the encode
        raise SystemExit(f"{run_dir} decodes with the VAE {config['autoencoder']}, which cannot be read now ({e}); "
                         "put it back there.") from e  # fmt: skip


def load_ema(run_dir: str | Path, step: int, mesh) -> tuple:
    """(EMA model, the run's Config, its stored config dict, the step, its condition) from a
    checkpoint, the model rebuilt from the stored config and replicated over `mesh`; step < 0: the
    newest."""
    step, _ = stored_run(run_dir, step)
    with Checkpoints(Path(run_dir) / "checkpoints", read_only=True) as checkpoints:
        stored = checkpoints.restore_config(step)
        cfg = Config(**{f.name: stored[f.name] for f in dataclasses.fields(Config) if f.name in stored})
        config = stored_condition(stored)  # the condition the run trained with: its tower and null text
        try:
            condition = condition_from_config(config, mesh=mesh)
        except (FileNotFoundError, ValueError) as e:  # the folders moved since training
            raise SystemExit(f"{run_dir} trained with the text tower {config['text_encoder']}, which cannot be read "
                             f"now ({e}); put it back there.") from e  # fmt: skip

        # The network as trained; a checkpoint from before `model_args` were stored: its MODELS entry now.
        args = stored.get("model_args") or model_args(cfg.model, tuple(stored["image_shape"]), condition)

        def make_model(key):
            return build_model(args, False, key, condition)

        # The optimizer only gives the state its structure; min_size 2**62: everything replicated.
        optimizer = adamw_cosine(cfg.lr, cfg.steps, 0, cfg.weight_decay)[0]
        abstract, shardings = abstract_train_state(make_model, optimizer, mesh, 2**62)
        state, _, _ = checkpoints.restore(step, abstract, shardings)
    return state.ema, cfg, stored, step, condition


def measure_fid(args: argparse.Namespace, step: int, mesh, sample_images, cond, image_shape: tuple, features_fn=None,
                dataset: str | None = None) -> dict:  # fmt: skip
    """FID (and precision/recall, when the reference keeps features) of `args.num` samples made in
    chunks of `args.batch_size` (the last one padded: one sampler program), each streamed through
    the network as it comes; process 0 prints `FID <value>` and appends a JSON line to --fid_out.
    `sample_images(num, cond, seed)` -> (images in [-1, 1], ...); `cond`: `args.num` rows or None;
    `image_shape`: the images' (a latent run's: decoded) [h, w, c], as FID sees them;
    `dataset`: the images the run trained on (statistics of others warn)."""
    # Imported here: scipy's import is start-up time the other paths need not pay.
    from eqxdiff.eval.fid import chunk_seed, fid_of_samples, open_fid

    try:
        net, reference = open_fid(args.inception, args.fid, image_shape, features_fn, dataset=dataset)
    except (ValueError, FileNotFoundError) as e:
        raise SystemExit(f"--fid: {e}") from e
    chunk = -(-min(args.batch_size, args.num) // mesh.size) * mesh.size  # rows split over every device
    bar = tqdm(total=args.num, unit="img", desc="fid", disable=jax.process_index() != 0)

    def sample_chunk(start: int, size: int) -> np.ndarray:
        rows = np.minimum(np.arange(start, start + chunk), args.num - 1)  # past the end: the last row again
        chunk_cond = None if cond is None else jax.tree.map(lambda a: a[rows], cond)
        images, _ = sample_images(chunk, chunk_cond, chunk_seed(args.seed, start))
        bar.update(size)
        return to_uint8(images[:size])

    result = fid_of_samples(sample_chunk, args.num, net, reference, chunk_size=chunk, seed=args.seed)
    bar.close()
    if jax.process_index() == 0:
        record = {"step": step, **result, "ref": reference.path, "method": args.method, "steps": args.steps,
                  "cfg": args.cfg, "seed": args.seed}  # fmt: skip
        print("FID " + "  ".join(f"{result[k]:.4f}" if k == "fid" else f"{k} {result[k]:.4f}"
                                 for k in ("fid", "precision", "recall") if k in result))  # fmt: skip
        out = Path(args.fid_out or Path(args.run_dir) / "fid.jsonl")
        out.parent.mkdir(parents=True, exist_ok=True)
        with open(out, "a") as f:
            f.write(json.dumps(record) + "\n")
        print(f"step {step}: {args.num} samples against {reference.path} -> {out}")
    return result


def main(args: argparse.Namespace, features_fn=None) -> None:
    """`features_fn`: --fid's feature network, a stand-in (tests); default InceptionV3 from --inception."""
    _, saved = stored_run(args.run_dir, args.step)  # what was asked is checked against the run first
    class_names = saved.get("class_names")  # a folder's sub-folders, latents' too (their meta.json)
    classes = class_indices(args.classes, class_names, saved["num_classes"])
    if args.eval:
        check_eval(saved)
    if args.process_id == 0 and args.fid:  # the process that writes: its output's folder made and tried first
        check_writable(args.fid_out or Path(args.run_dir) / "fid.jsonl", "--fid_out")
    elif args.process_id == 0:
        check_writable(args.out, "--out")
    start_jax(Config(cpu_devices=args.cpu_devices, coordinator=args.coordinator, num_processes=args.num_processes,
                     process_id=args.process_id))  # fmt: skip
    mesh = make_mesh(data=-1, fsdp=1)
    ema, cfg, stored, step, condition = load_ema(args.run_dir, args.step, mesh)
    args.cfg = cfg.cfg_scale if args.cfg is None else args.cfg  # the guidance of the run's own grids
    image_shape, num_classes = tuple(stored["image_shape"]), stored["num_classes"]
    image_dataset = stored.get("image_dataset", cfg.dataset)  # latents: the images they encode

    labels = balanced_labels(args.num, classes) if num_classes else None
    prompts, digits = None, None
    if isinstance(condition, TextCondition):
        prompts = args.prompts
        if prompts is None and image_dataset == "captioned_digits":
            prompts, digits = captioned_digits_prompts(max(1, args.num // args.per_prompt), seed=args.seed)
            digits = np.repeat(digits, args.per_prompt, axis=0)
        elif prompts is None:
            raise SystemExit("This run is text-to-image: pass --prompts \"...\" [\"...\" ...].")
        elif args.eval and image_dataset == "captioned_digits":  # the digits each prompt asks for
            try:
                digits = np.repeat(np.array([caption_digits(p) for p in prompts], np.int32), args.per_prompt, axis=0)
            except ValueError as e:
                raise SystemExit(f"--eval: {e}") from e
        cond, null_cond = condition.for_sampling(list(prompts), args.per_prompt)
        args.num = len(prompts) * args.per_prompt
    elif args.prompts:
        raise SystemExit(f"--prompts: this run ({cfg.dataset}) was not trained on captions.")
    else:
        cond, null_cond = condition.for_sampling(labels, 1)  # class runs: one image per label; else none
    codec = stored_codec(args.run_dir, stored, mesh)
    parameterization = parameterization_by_name(cfg.parameterization, sigma_data(cfg, codec))

    def sample_images(num: int, cond, seed: int) -> tuple[np.ndarray, np.ndarray | None]:
        """(images [num, h, w, c] in about [-1, 1], the latents they decode or None)."""
        images = generate(
            ema, schedule_by_name(cfg.schedule), parameterization, cond,
            num, image_shape, mesh=mesh, steps=args.steps, method=args.method or cfg.sample_method,
            cfg_scale=args.cfg, null_cond=null_cond, seed=seed,
        )  # fmt: skip
        decoded = codec.decode(images, mesh=mesh, tiling=args.vae_tiling)
        return decoded, None if decoded is images else images

    if args.fid:
        args.method = args.method or cfg.sample_method  # recorded with the FID
        measure_fid(args, step, mesh, sample_images, cond, codec.image_shape(image_shape), features_fn, image_dataset)
        return
    images, latents = sample_images(args.num, cond, args.seed)
    if jax.process_index() == 0:
        out = Path(args.out)
        if out.suffix == ".png" and prompts is None and labels is None:
            save_image_grid(out, images, ncols=10, upscale=4)
        elif out.suffix == ".png":  # a block of rows per class (labels are grouped) or per prompt, labelled
            keys, names = labels, class_names or [str(k) for k in range(num_classes)]
            if prompts is not None:
                keys, names = np.repeat(np.arange(len(prompts)), args.per_prompt), list(prompts)
            tiles, ncols, row_labels = grid_rows(keys, names)
            blank = np.full((1, *images.shape[1:]), -1.0, np.float32)  # black, as the grid's padding
            tiled = np.concatenate([np.asarray(images, np.float32), blank])[tiles]  # -1: the blank tile
            save_image_grid(out, tiled, ncols=ncols, upscale=4, row_labels=row_labels)
        else:  # one label (class runs) or prompt (text runs) per image
            out.parent.mkdir(parents=True, exist_ok=True)
            arrays = dict(images=to_uint8(images))
            if prompts is not None:
                arrays["prompts"] = np.repeat(np.asarray(prompts, dtype=str), args.per_prompt)
            elif labels is not None:
                arrays["labels"] = labels
            np.savez(out, **arrays, **({} if latents is None else {"latents": latents}))
        print(f"step {step}: {args.num} samples -> {out}")
        if args.eval:  # imported here: scipy's import is start-up time the other paths need not pay
            from eqxdiff.eval import digits_sample_metrics, format_metrics, two_digit_accuracy

            scored = (f"{args.run_dir} step {step}: {args.num} samples, {args.method or cfg.sample_method} {args.steps} "
                      f"steps, guidance {args.cfg:g}, seed {args.seed}")  # fmt: skip
        if args.eval and digits is not None:
            scores = two_digit_accuracy(to_uint8(images), digits)  # the digits classifier on each half
            if args.json:
                print(json.dumps({"step": step, "num": args.num, "cfg": args.cfg, "seed": args.seed, **scores}))
            else:
                print(f"{scored}\ntwo digits: " + ", ".join(f"{k} {v:.3f}" for k, v in scores.items())
                      + " (fraction classified as prompted, per half and both; higher is better; real digits: ~0.98 per half)")  # fmt: skip
        elif args.eval:  # a digits run (check_eval)
            scores = digits_sample_metrics(to_uint8(images), labels)  # scored as saved: clipped
            if args.json:
                print(json.dumps({"step": step, "num": args.num, "cfg": args.cfg, "seed": args.seed, **scores}))
            else:
                print(f"{scored}; real = held-out real digits scored the same way\n{format_metrics(scores)}")


def cli() -> None:
    try:
        main(parse_args())
    except CheckpointError as e:  # a checkpoint that does not fit: one line, as for every user error
        raise SystemExit(str(e)) from e


if __name__ == "__main__":
    exit_on_user_error(cli)
