"""FID reference statistics of a dataset: the mean and covariance of InceptionV3's 2048-d pool3
features (pytorch-fid's network and weights), written as the .npz pytorch-fid reads (`mu`, `sigma`).

    python train/fid_stats.py --dataset folder:~/data/pets --image_size 256 \\
        --inception ~/pt_inception-2015-12-05-6726825d.pth --out ~/fid/pets_256.npz
    python train/fid_stats.py --dataset digits --inception pt_inception-2015-12-05-6726825d.pth --out runs/digits_fid.npz

--inception is pytorch-fid's pt_inception-2015-12-05-6726825d.pth as downloaded (read as tensors
only, eqxdiff.weights.torch_pickle: nothing in the file runs), or a .safetensors copy of it.

Every example of the source goes through the network once, as uint8 RGB at the dataset's size
(grayscale repeated to three channels; the network resizes as pytorch-fid's does). Each process
reads its contiguous block of the examples and runs it over its own devices (the batch split over
them); the float64 partial sums (eqxdiff/eval/feature_stats.py) are merged across processes at the
end and process 0 writes the file. Multi-process flags as in train/main.py (`--coordinator`,
`--num_processes`, `--process_id`).

--dinov2 FOLDER writes FD-DINOv2's statistics instead (Stein et al. 2023; EDM2 reports them beside FID): a
transformers DINOv2 folder (facebook/dinov2-large as `save_pretrained` writes it), the features EDM2's
calculate_metrics.py takes (eqxdiff/eval/fd_dinov2.py: images resized to 224² bicubically, the normed CLS token,
1024-d); train/sample.py --fid FILE --dinov2 FOLDER measures against them.

    python train/fid_stats.py --dataset folder:~/data/pets --image_size 256 --dinov2 ~/dinov2-large \
        --out ~/fid/pets_256_dinov2.npz

--keep_features N also stores N of the feature vectors, a uniform random subset (in random order),
under the key `features`: train/sample.py --fid and training's --eval_every compute precision and
recall (Kynkäänniemi et al. 2019) against them. 10,000 of 2048-d features add 80 MB to the file.
The file also names the dataset and its image shape (keys `dataset`, `image_shape`, which pytorch-fid
ignores): FID against it warns for samples of another size or a model of other data, and statistics
of (almost) one image repeated warn here already.
"""

import time
from dataclasses import dataclass

import jax
import numpy as np

from eqxdiff.data.offline import run_offline  # a dataset through the devices once
from eqxdiff.eval.fd_dinov2 import DINOv2Features
from eqxdiff.eval.feature_stats import FeatureStats, gather_feature_stats
from eqxdiff.eval.fid import (
    KeptFeatures,
    feature_dim,
    load_inception,
    replicated,
    rgb_features,
    save_reference,
    warn_if_degenerate,
)
from eqxdiff.paths import as_path
from eqxdiff.sharding import batch_sharding, make_mesh
from offline import open_dataset  # train/offline.py: the dataset named, or one line why not
from outputs import check_writable  # train/outputs.py: the output's folder, before the long part
from startup import Launch, dataclass_parser, exit_on_user_error, start_jax  # train/startup.py: flags; JAX's start


# A table the formatter leaves as written: each field's comment is its flag's --help line.
# fmt: off
@dataclass(frozen=True)
class Config(Launch):
    """The flags: each field is `--name`, its comment the flag's help; the launch flags are `Launch`'s."""

    dataset: str = "digits"  # any image source of train/main.py: digits | npz:PATH | folder:PATH | arrayrecord:GLOB
    inception: str = ""  # pytorch-fid's FID Inception weights: pt_inception-2015-12-05-6726825d.pth (or a .safetensors copy)
    dinov2: str = ""  # FD-DINOv2's statistics instead: a transformers DINOv2 folder (facebook/dinov2-large)
    out: str = ""  # the statistics file, *.npz (written by process 0)
    image_size: int = 32  # folder: and arrayrecord: images are resized to this (the size samples are made at)
    batch_size: int = 200  # global: every process runs batch_size / num_processes at a time
    keep_features: int = 0  # >0: also keep this many random feature rows (key "features") for precision/recall
    seed: int = 0  # which rows --keep_features keeps
# fmt: on


def parse_config(argv: list[str] | None = None) -> Config:
    """Every Config field is a flag `--name value`; booleans are `--name` / `--no-name`."""
    parser = dataclass_parser(Config, __doc__, required=("out",))
    cfg = Config(**vars(parser.parse_args(argv)))
    if bool(cfg.inception) == bool(cfg.dinov2):
        parser.error(
            "pass --inception FILE (FID's statistics: pytorch-fid's pt_inception-2015-12-05-6726825d.pth) "
            "or --dinov2 FOLDER (FD-DINOv2's: a transformers DINOv2 folder), one of them"
        )
    if not cfg.out.endswith(".npz"):
        parser.error(f"--out must name an .npz file (pytorch-fid reads a path as statistics only then), got {cfg.out}")
    if cfg.batch_size < 1:
        parser.error(f"--batch_size must be >= 1, got {cfg.batch_size}")
    if cfg.keep_features < 0:
        parser.error(f"--keep_features must be >= 0, got {cfg.keep_features}")
    return cfg


def image_field(source):
    """The source's image field (its dtype and [h, w, c] shape), checked to be what FID takes."""
    if "image" not in source.fields:
        raise ValueError(f"{source.spec} has no image field to take features of (fields: {sorted(source.fields)}).")
    image = source.fields["image"]
    if image.dtype != np.uint8 or len(image.shape) != 3 or image.shape[-1] not in (1, 3):
        raise ValueError(f"{source.spec}'s images are {image.dtype} {image.shape}; FID takes uint8 [h, w, 1 or 3].")
    return image


def dataset_stats(
    source,
    features_fn,
    batch_size: int,
    *,
    process_index: int | None = None,
    process_count: int | None = None,
    progress: bool = True,
    keep: KeptFeatures | None = None,
) -> FeatureStats:
    """This process's partial feature statistics of `source` (merge them with gather_feature_stats);
    `keep`: also keep its chosen rows of the features (their indices are examples of `source`).

    `features_fn(images uint8 [b, h, w, 3]) -> float32 [b, d]`: InceptionV3.from_pytorch_fid(path),
    or any function or eqx.Module (its arrays are replicated over the devices). `batch_size` is
    global: this process runs batch_size / process_count images at a time over its local devices.
    The process owns examples [p N / P, (p + 1) N / P) of the N; `process_index`/`process_count`
    default to JAX's.
    """
    p = jax.process_index() if process_index is None else process_index
    processes = jax.process_count() if process_count is None else process_count
    image = image_field(source)
    devices = jax.local_devices()
    local = batch_size // processes
    if batch_size % processes or local % len(devices):
        raise ValueError(
            f"batch_size {batch_size} must split into {processes} processes x a multiple of {len(devices)} devices."
        )
    mesh = make_mesh(devices=devices)
    features_fn = replicated(features_fn, mesh)  # the network's weights on every device
    stats = FeatureStats(feature_dim(features_fn, image.shape, local))
    n = len(source)
    indices = range(p * n // processes, (p + 1) * n // processes)
    started = time.perf_counter()
    done = 0  # rows of `indices` summed so far

    def collect(_, features) -> None:
        nonlocal done
        stats.update(features)
        if keep is not None:
            keep.update(features, indices.start + done)
        done += len(features)

    run_offline(
        lambda g: source[g]["image"],
        indices,
        local,
        lambda images: (None, np.stack(images)),
        lambda images: rgb_features(features_fn, images),
        collect,
        sharding=batch_sharding(mesh),
        desc="fid stats",
        progress=progress and p == 0,
    )
    if progress and p == 0:
        print(f"{len(indices)} images of {source.spec} in {time.perf_counter() - started:.1f} s on process 0")
    return stats


def main(cfg: Config, features_fn=None) -> None:
    """`features_fn`: a stand-in feature network (tests); default InceptionV3 from --inception."""
    start_jax(cfg)
    if jax.process_index() == 0:  # the one that writes: its folder made (~/fid/) and tried before any image is read
        check_writable(cfg.out, "--out")
    source = open_dataset(cfg.dataset, cfg.image_size)
    if features_fn is None:
        flag = "--dinov2" if cfg.dinov2 else "--inception"
        try:
            features_fn = DINOv2Features.from_transformers(cfg.dinov2) if cfg.dinov2 else load_inception(cfg.inception)
        except (ValueError, FileNotFoundError) as e:  # a missing, wrong or refused weights file: one line
            raise SystemExit(f"{flag}: {e}") from e
    keep = None  # a random subset of the features, for precision and recall
    if cfg.keep_features:
        dim = feature_dim(features_fn, image_field(source).shape)
        keep = KeptFeatures(len(source), min(cfg.keep_features, len(source)), dim, cfg.seed)
    stats = gather_feature_stats(dataset_stats(source, features_fn, cfg.batch_size, keep=keep))
    features = None if keep is None else keep.gather()
    if jax.process_index() == 0:
        mu, sigma = stats.mean_cov()
        out = as_path(cfg.out)  # a URL: written locally, then uploaded (save_reference)
        warn_if_degenerate(mu, sigma, f"{cfg.dataset} ({stats.count} images)")
        # pytorch-fid's file plus keys it ignores: the kept rows, what the statistics are of
        save_reference(out, mu, sigma, features, dataset=cfg.dataset, image_shape=tuple(image_field(source).shape))
        kept = "" if features is None else f" and {len(features)} of their feature vectors"
        what = "FD-DINOv2" if cfg.dinov2 else "FID"
        print(f"{what} statistics of {stats.count} images of {cfg.dataset} ({len(mu)}-d features){kept} -> {cfg.out}")


if __name__ == "__main__":
    exit_on_user_error(lambda: main(parse_config()))
