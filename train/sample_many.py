"""What train/sample.py makes of many samples of a run: FID (and precision/recall) streamed through the
feature network with a JSON record (`--fid`), or ADM's sample batch in resumable chunks (`--format adm`)."""

import json
from pathlib import Path

import jax
import numpy as np
from tqdm import tqdm

from eqxdiff.eval.sample_batches import write_sample_batches

from eqxdiff.images import to_uint8
from eqxdiff.paths import append_text, as_path, is_url


def open_fid_flags(args, image_shape: tuple, features_fn=None, dataset: str | None = None):
    """(feature network, reference) of --inception (or `features_fn`, a stand-in) and --fid, for images
    `image_shape` of `dataset` (eqxdiff/eval/fid.py's open_fid); a bad file is one line naming --fid."""
    from eqxdiff.eval.fid import open_fid  # imported here: scipy's import is start-up time others need not pay

    if features_fn is None and getattr(args, "dinov2", ""):  # FD-DINOv2: EDM2's detector is the feature network
        from eqxdiff.eval.fd_dinov2 import DINOv2Features

        try:
            features_fn = DINOv2Features.from_transformers(args.dinov2)
        except (ValueError, FileNotFoundError) as e:
            raise SystemExit(f"--dinov2: {e}") from e
    try:
        return open_fid(args.inception, args.fid, image_shape, features_fn, dataset=dataset)
    except (ValueError, FileNotFoundError) as e:
        raise SystemExit(f"--fid: {e}") from e


def measure_fid(
    args,
    step: int,
    mesh,
    sample_images,
    cond,
    image_shape: tuple,
    how: dict,
    features_fn=None,
    dataset: str | None = None,
    opened: tuple | None = None,
    *,
    num: int,
    ema: float | None,
) -> dict:
    """FID (and precision/recall, when the reference keeps features) of `num` samples made in
    chunks of `args.batch_size` (the last one padded: one sampler program), each streamed through
    the network as it comes; process 0 prints `FID <value>` (`FD-DINOv2 <value>` with --dinov2, the record's
    "fid" then FD-DINOv2 and its "metric" "fd_dinov2") and appends a JSON line to --fid_out.
    `args`: the script's flags (--batch_size, --seed, --fid, --inception or --dinov2, --fid_out, --run_dir);
    `sample_images(cond, num, seed=)` -> (images in [-1, 1], ...); `cond`: `num` rows or None; `how`: how
    they are made, for the record (`Sampling.record()`, autoguidance's weak run);
    `image_shape`: the images' (a latent run's: decoded) [h, w, c], as FID sees them;
    `dataset`: the images the run trained on (statistics of others warn); `opened`: open_fid_flags'
    (network, reference), when several measures share them (train/posthoc_ema.py --sweep); `ema`: the post-hoc
    EMA's σ_rel sampled, if one (recorded)."""
    from eqxdiff.eval.fid import chunk_seed, fid_of_samples  # imported here: scipy, as in open_fid_flags

    net, reference = opened or open_fid_flags(args, image_shape, features_fn, dataset)
    chunk = -(-min(args.batch_size, num) // mesh.size) * mesh.size  # rows split over every device
    bar = tqdm(total=num, unit="img", desc="fid", disable=jax.process_index() != 0)

    def sample_chunk(start: int, size: int) -> np.ndarray:
        rows = np.minimum(np.arange(start, start + chunk), num - 1)  # past the end: the last row again
        chunk_cond = None if cond is None else jax.tree.map(lambda a: a[rows], cond)
        images, _ = sample_images(chunk_cond, chunk, seed=chunk_seed(args.seed, start))
        bar.update(size)
        return to_uint8(images[:size])

    result = fid_of_samples(sample_chunk, num, net, reference, chunk_size=chunk, seed=args.seed)
    bar.close()
    dinov2 = bool(getattr(args, "dinov2", ""))  # the distance in DINOv2's features, not Inception's: said in the record
    if jax.process_index() == 0:
        record = {"step": step, **result, "ref": reference.path, **how, "seed": args.seed,
                  **({"metric": "fd_dinov2"} if dinov2 else {})}  # fmt: skip
        if ema is not None:  # sample.py --ema sigma_rel=S, posthoc_ema.py --sweep --fid: which post-hoc EMA
            record["ema"] = f"sigma_rel={ema:g}"
        values = [f"{result[k]:.4f}" if k == "fid" else f"{k} {result[k]:.4f}"
                  for k in ("fid", "precision", "recall") if k in result]  # fmt: skip
        print(("FD-DINOv2 " if dinov2 else "FID ") + "  ".join(values))
        out = as_path(args.fid_out or as_path(args.run_dir) / "fid.jsonl")  # a local file or an object in a bucket
        if not is_url(out):
            out.parent.mkdir(parents=True, exist_ok=True)
        append_text(out, json.dumps(record) + "\n")
        print(f"step {step}: {num} samples against {reference.path} -> {out}")
    return result


def write_adm_batch(args, step: int, mesh, sample_images, condition, classes: list[int] | None,
                    how: dict) -> None:  # fmt: skip
    """--format adm: `args.num` samples as ADM's batch at --out, in resumable chunks of --batch_size rows (rounded
    up to a multiple of the devices); the flags that decide the samples (`how`: as measure_fid's) are recorded with
    the chunks."""
    chunk_size = -(-args.batch_size // mesh.size) * mesh.size

    def sample_chunk(labels: np.ndarray | None, key) -> np.ndarray:
        seed = int(jax.random.bits(key, dtype=np.uint32))  # generate_images draws its noise from an int seed
        return to_uint8(sample_images(condition.for_sampling(labels, 1)[0], chunk_size, seed=seed)[0])

    run_dir = args.run_dir if is_url(args.run_dir) else str(Path(args.run_dir).resolve())
    flags = {"--run_dir": run_dir, "--step": step, "--num": args.num, "--seed": args.seed,
             "--batch_size": chunk_size, "--classes": classes, **{f"--{name}": value for name, value in how.items()},
             "--vae_tiling": args.vae_tiling}  # fmt: skip
    write_sample_batches(sample_chunk, args.out, num=args.num, chunk_size=chunk_size, seed=args.seed, classes=classes,
                         flags=flags)  # fmt: skip
    if jax.process_index() == 0:
        print(f"step {step}: {args.num} samples -> {args.out} (ADM's arr_0{', arr_1' * (classes is not None)})")
