"""train/main.py's samples of the EMA model during training (`cfg`: its Config): the sample grids in
RUN_DIR/samples and --eval_every's FID (and with --dinov2 FD-DINOv2 of the same samples). Every process samples (the
EMA is sharded over all of them)."""

import jax
import numpy as np
from jax.sharding import Mesh
from tqdm import tqdm

from eqxdiff.images import save_image_grid, to_uint8
from eqxdiff.paths import as_path
from eqxdiff.run.sampling import Sampling


def write_sample_grid(step: int, state, *, cfg, sampling: Sampling, codec, condition, schedule, parameterization,
                      sample_shape: tuple, mesh: Mesh, rows: list, row_labels: list[str] | None) -> None:  # fmt: skip
    """Ten images of each of `rows` (a label or prompt each, `condition.for_sampling`'s rows) from the EMA by
    `sampling` (the run's: --sample_steps, --sample_method, --guidance, --guidance_interval), noise seed --seed + `step`;
    process 0 writes them as RUN_DIR/samples/step_STEP.png, a grid row per row, labelled `row_labels` (None:
    unlabelled)."""
    cond, null_cond = condition.for_sampling(rows, 10)
    images, _ = sampling.images(state.ema, codec, schedule, parameterization, sample_shape, cond, len(rows) * 10,
                                mesh=mesh, null_cond=null_cond, seed=cfg.seed + step)  # fmt: skip
    if jax.process_index() == 0:
        path = save_image_grid(as_path(cfg.run_dir) / "samples" / f"step_{step:06d}.png", images, ncols=10, upscale=4,
                               row_labels=row_labels)  # fmt: skip
        tqdm.write(f"step {step}: samples -> {path}")


def open_eval_fid(cfg, image_shape: tuple, image_dataset: str, features_fn=None) -> tuple:
    """(--eval_every's feature network, its --fid_ref statistics), checked against each other and against
    the images FID sees (`image_shape`: a latent run's decoded) before anything compiles; a mismatch is
    a SystemExit. `features_fn`: a stand-in feature network (tests); default InceptionV3 from --inception."""
    from eqxdiff.eval.fid import open_fid  # scipy: only when --eval_every asks

    try:
        return open_fid(cfg.inception, cfg.fid_ref, image_shape, features_fn, dataset=image_dataset)
    except (ValueError, FileNotFoundError) as e:
        raise SystemExit(f"--eval_every: {e}") from e


def open_eval_fd_dinov2(cfg, image_shape: tuple, image_dataset: str) -> tuple | None:
    """(EDM2's DINOv2 detector from --dinov2, its --fd_dinov2_ref statistics) checked as `open_eval_fid` checks FID's
    (eqxdiff/eval/fid.py's open_fid), or None without --dinov2."""
    if not cfg.dinov2:
        return None
    from eqxdiff.eval.fd_dinov2 import DINOv2Features
    from eqxdiff.eval.fid import open_fid

    try:
        detector = DINOv2Features.from_transformers(cfg.dinov2)
    except (ValueError, FileNotFoundError) as e:
        raise SystemExit(f"--dinov2: {e}") from e
    try:
        return open_fid("", cfg.fd_dinov2_ref, image_shape, detector, dataset=image_dataset)
    except (ValueError, FileNotFoundError) as e:
        raise SystemExit(f"--fd_dinov2_ref: {e}") from e


def evaluate_fid(step: int, state, *, cfg, sampling: Sampling, codec, condition, schedule, parameterization,
                 sample_shape: tuple, mesh: Mesh, num_classes: int, network, reference,
                 fd_dinov2: tuple | None = None) -> dict:  # fmt: skip
    """FID of --eval_num EMA samples by `sampling` (every class alike, the same noise at every evaluation) against
    `reference` through `network` (`open_eval_fid`), and precision/recall if the reference keeps
    features, as eval/* metrics; made --batch_size at a time (the last batch padded: one sampler program).
    `fd_dinov2`: `open_eval_fd_dinov2`'s (detector, reference): also eval/fd_dinov2 of the same samples."""
    from eqxdiff.eval.fid import chunk_seed, fids_of_samples

    cond, null_cond = condition.for_sampling(np.arange(cfg.eval_num) % max(num_classes, 1), 1)  # every class alike

    def sample_chunk(start: int, size: int) -> np.ndarray:
        rows = np.minimum(np.arange(start, start + cfg.batch_size), cfg.eval_num - 1)
        images, _ = sampling.images(state.ema, codec, schedule, parameterization, sample_shape,
                                    jax.tree.map(lambda a: a[rows], cond), cfg.batch_size, mesh=mesh,
                                    null_cond=null_cond, seed=chunk_seed(cfg.seed, start))  # fmt: skip
        return to_uint8(images[:size])

    measures = [(network, reference), *([fd_dinov2] if fd_dinov2 else [])]
    result, *dino = fids_of_samples(sample_chunk, cfg.eval_num, measures, chunk_size=cfg.batch_size, seed=cfg.seed)
    scores = {f"eval/{name}": value for name, value in result.items() if name != "num"}
    return scores | {"eval/fd_dinov2": d["fid"] for d in dino}
