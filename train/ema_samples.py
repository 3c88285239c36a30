"""train/main.py's samples of the EMA model during training (`cfg`: its Config): the sample grids in
RUN_DIR/samples and --eval_every's FID. Every process samples (the EMA is sharded over all of them)."""

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


def evaluate_fid(step: int, state, *, cfg, sampling: Sampling, codec, condition, schedule, parameterization,
                 sample_shape: tuple, mesh: Mesh, num_classes: int, network, reference) -> dict:  # fmt: skip
    """FID of --eval_num EMA samples by `sampling` (every class alike, the same noise at every evaluation) against
    `reference` through `network` (`open_eval_fid`), and precision/recall if the reference keeps
    features, as eval/* metrics; made --batch_size at a time (the last batch padded: one sampler program)."""
    from eqxdiff.eval.fid import chunk_seed, fid_of_samples

    cond, null_cond = condition.for_sampling(np.arange(cfg.eval_num) % max(num_classes, 1), 1)  # every class alike

    def sample_chunk(start: int, size: int) -> np.ndarray:
        rows = np.minimum(np.arange(start, start + cfg.batch_size), cfg.eval_num - 1)
        images, _ = sampling.images(state.ema, codec, schedule, parameterization, sample_shape,
                                    jax.tree.map(lambda a: a[rows], cond), cfg.batch_size, mesh=mesh,
                                    null_cond=null_cond, seed=chunk_seed(cfg.seed, start))  # fmt: skip
        return to_uint8(images[:size])

    result = fid_of_samples(sample_chunk, cfg.eval_num, network, reference, chunk_size=cfg.batch_size, seed=cfg.seed)
    return {f"eval/{name}": value for name, value in result.items() if name != "num"}
