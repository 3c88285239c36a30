"""ADM's evaluation table of a sample batch against a reference batch, as openai/guided-diffusion's
evaluations/evaluator.py prints it — Inception Score, FID, sFID, precision, recall — in JAX, with
pytorch-fid's Inception weights:

    python train/evaluate.py VIRTUAL_imagenet256_labeled.npz dit_xl2.npz \\
        --inception pt_inception-2015-12-05-6726825d.pth

A batch is an .npz with `arr_0`, uint8 images [n, h, w, 3] (`np.savez(path, images)` writes one; `arr_1`,
labels, is not read). ADM's reference batches also store `mu`/`sigma` (pool3) and `mu_s`/`sigma_s`
(sFID's spatial features) computed by its TF graph: FID and sFID are reported against those stored
statistics AND against statistics recomputed from the reference's images with this network, each
line saying which. A reference file without `arr_0` gives only the stored lines (no precision/recall).

Features (eqxdiff/eval/adm_inception.py): FID, precision and recall on pool3 (2048), sFID on the TF
graph's mixed_6/conv (Mixed_6d.branch1x1) first 7 channels at 17×17 (2023), IS on the 1008-way logits
(softmax, splits of 5000 images: 10 for 50,000). --preprocess adm (the default) resizes and scales as
the TF graph does inside (TF1 bilinear to 299², (x - 128)/128); pytorch_fid as pytorch-fid does.
Both batches run through the network `--batch_size` images at a time over every local device.

--dinov2 FOLDER (a transformers DINOv2 folder, facebook/dinov2-large) adds FD-DINOv2 as EDM2's
calculate_metrics.py computes it (eqxdiff/eval/fd_dinov2.py), between the two batches' images; without
--inception it is the only row:

    python train/evaluate.py ref_images.npz samples.npz --dinov2 ~/dinov2-large
"""

import argparse
import json
import sys
import time

import jax
from tqdm import tqdm

from eqxdiff.eval.adm_batches import IMAGES, STORED, array_names, image_shape, stored_stats
from eqxdiff.eval.adm_eval import adm_metrics, batch_features
from eqxdiff.eval.adm_inception import PREPROCESS, SPATIAL_DIM, ADMInception
from eqxdiff.local_copies import local_copy
from startup import Launch, Parser, add_flags, exit_on_user_error, start_jax  # train/startup.py

ROWS = (  # (key, the row's name, which statistics or features the row compares the samples with)
    ("inception_score", "Inception Score", "the samples alone (splits of 5000)"),
    ("fid_stored", "FID", "statistics stored in the reference batch (ADM's TF graph)"),
    ("fid_recomputed", "FID", "statistics recomputed from the reference images with this network"),
    ("sfid_stored", "sFID", "statistics stored in the reference batch (ADM's TF graph)"),
    ("sfid_recomputed", "sFID", "statistics recomputed from the reference images with this network"),
    ("precision", "Precision", "the reference images' pool3 features (k = 3)"),
    ("recall", "Recall", "the reference images' pool3 features (k = 3)"),
    ("fd_dinov2", "FD-DINOv2", "the reference images' DINOv2 features (EDM2's detector)"),
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = Parser(description=__doc__)
    parser.add_argument("ref_batch", help="reference batch .npz (arr_0 images; ADM's: also mu, sigma, mu_s, sigma_s)")
    parser.add_argument("sample_batch", help="the sample batch .npz (arr_0 uint8 images [n, h, w, 3])")
    parser.add_argument(
        "--inception",
        default="",
        help="pytorch-fid's weights pt_inception-2015-12-05-6726825d.pth (or a .safetensors copy)",
    )
    parser.add_argument(
        "--dinov2",
        default="",
        help="FD-DINOv2 too: a transformers DINOv2 folder (facebook/dinov2-large, EDM2's detector)",
    )
    parser.add_argument("--batch_size", type=int, default=256, help="images per step over all local devices")
    parser.add_argument(
        "--preprocess",
        default="adm",
        choices=PREPROCESS,
        help="adm: the TF graph's resize and scaling (ADM's numbers); pytorch_fid: pytorch-fid's",
    )
    parser.add_argument("--json", action="store_true", help="one JSON line instead of the table")
    add_flags(parser, Launch)  # --cpu_devices, ...: every script's (train/startup.py)
    args = parser.parse_args(argv)
    if args.batch_size < 1:
        parser.error(f"--batch_size must be >= 1, got {args.batch_size}")
    return args


def check_batches(args: argparse.Namespace) -> tuple[bool, dict]:
    """(whether the reference has images, its stored statistics), both files checked before any
    weights are read; a bad file stops the script in one line naming the fix."""
    try:
        image_shape(args.sample_batch)
        names = array_names(args.ref_batch)
        has_images = IMAGES in names
        if has_images:
            image_shape(args.ref_batch)
        stored = stored_stats(args.ref_batch, {"pool3": 2048, "spatial": SPATIAL_DIM})
    except (ValueError, FileNotFoundError) as e:
        raise SystemExit(str(e)) from e
    if not has_images and not stored:
        keys = ", ".join(f"'{k}'" for pair in STORED.values() for k in pair)
        raise SystemExit(f"{args.ref_batch} holds neither images '{IMAGES}' nor ADM's statistics ({keys}); it "
                         f"holds {sorted(names)}: pass ADM's reference batch or an .npz of uint8 images "
                         "[n, h, w, 3].")  # fmt: skip
    return has_images, stored


def format_table(metrics: dict[str, float], args: argparse.Namespace, counts: dict[str, int]) -> str:
    preprocess = f", preprocess {args.preprocess}" if set(metrics) - {"fd_dinov2"} else ""
    head = (f"{args.sample_batch} ({counts['samples']} images) against {args.ref_batch} "
            f"({counts['reference']} images){preprocess}")  # fmt: skip
    lines = [head, f"{'metric':<16} {'value':>12}  against"]
    lines += [f"{name:<16} {metrics[key]:>12.4f}  {what}" for key, name, what in ROWS if key in metrics]
    return "\n".join(lines)


def fd_dinov2(args: argparse.Namespace) -> float:
    """FD-DINOv2 between the two batches' images: EDM2's detector (--dinov2), the statistics of each batch in
    float64, their Fréchet distance (pytorch-fid's form, eqxdiff/eval/frechet.py)."""
    from eqxdiff.eval.fd_dinov2 import DINOv2Features
    from eqxdiff.eval.fid import reference_of_images
    from eqxdiff.eval.frechet import fid_from_stats

    try:
        detector = DINOv2Features.from_transformers(args.dinov2)
    except (ValueError, FileNotFoundError) as e:
        raise SystemExit(f"--dinov2: {e}") from e
    reference = reference_of_images(args.ref_batch, detector, args.batch_size)
    samples = reference_of_images(args.sample_batch, detector, args.batch_size)
    return fid_from_stats(samples.mu, samples.sigma, reference.mu, reference.sigma)


def main(args: argparse.Namespace, network: ADMInception | None = None) -> dict[str, float]:
    """The table (or one JSON line) on stdout; returns the metrics. `network`: a stand-in (tests)."""
    start_jax(args)
    if jax.process_count() > 1:
        raise SystemExit("evaluate.py runs in one process (over all its local devices): drop --coordinator.")
    has_images, stored = check_batches(args)
    if args.dinov2 and not has_images:
        raise SystemExit(f"--dinov2: FD-DINOv2 compares images and {args.ref_batch} holds none ('{IMAGES}'): pass a "
                         "reference batch of uint8 images [n, h, w, 3].")  # fmt: skip
    adm = network is not None or args.inception or not args.dinov2  # ADM's table, unless FD-DINOv2 alone is asked
    if adm and network is None:
        if not args.inception:
            raise SystemExit("--inception: pass pytorch-fid's pt_inception-2015-12-05-6726825d.pth (the FID weights), "
                             "or --dinov2 FOLDER for FD-DINOv2 alone.")  # fmt: skip
        try:
            network = ADMInception.from_pytorch_fid(local_copy(args.inception), args.preprocess)  # a URL: its copy
        except (ValueError, FileNotFoundError) as e:
            raise SystemExit(f"--inception: {e}") from e
    counts = {"samples": image_shape(args.sample_batch)[0],
              "reference": image_shape(args.ref_batch)[0] if has_images else 0}  # fmt: skip
    started = time.perf_counter()
    metrics = {}
    if adm:
        with tqdm(total=sum(counts.values()), unit="img", desc="inception", disable=args.json, file=sys.stderr) as bar:
            reference = batch_features(network, args.ref_batch, args.batch_size, bar.update) if has_images else None
            samples = batch_features(network, args.sample_batch, args.batch_size, bar.update)
        metrics = adm_metrics(samples, reference, stored)
    if args.dinov2:
        metrics["fd_dinov2"] = fd_dinov2(args)
    if args.json:
        print(json.dumps({**metrics, "num_samples": counts["samples"], "num_reference": counts["reference"],
                          "preprocess": args.preprocess}))  # fmt: skip
    else:
        print(format_table(metrics, args, counts))
        print(f"({time.perf_counter() - started:.1f} s on {len(jax.local_devices())} devices)")
    return metrics


if __name__ == "__main__":
    exit_on_user_error(lambda: main(parse_args()))
