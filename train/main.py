"""Train a class-conditional diffusion model on scikit-learn's 8×8 digits and write sample grids.

    python train/main.py                       # a few minutes on a 2-core CPU
    python train/main.py --steps 3000 --lr 1e-3

Edit freely: the Config, the model, the loss and the loop are all below. This is the first
version of the script (one device, in-memory data); sharding, checkpoints, prefetch and
logging arrive with the training engine.
"""

import argparse
import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from sklearn.datasets import load_digits
from tqdm import tqdm

from eqxdiff.diffusion import (
    PARAMETERIZATIONS,
    SCHEDULES,
    ClassifierFreeGuidance,
    Denoiser,
    denoising_loss,
    drop_labels,
    karras_sigmas,
    parameterization_by_name,
    sample,
    schedule_by_name,
)
from eqxdiff.images import save_image_grid
from eqxdiff.nn import UNet


@dataclass
class Config:
    run_dir: str = "runs/digits"
    steps: int = 600
    batch_size: int = 64
    lr: float = 2e-3
    seed: int = 0
    schedule: str = "edm"
    parameterization: str = "edm"
    label_dropout: float = 0.1  # classifier-free guidance training
    ema_decay: float = 0.995
    log_every: int = 100
    sample_every: int = 200
    sample_steps: int = 18
    cfg_scale: float = 1.5


CHOICES = {"schedule": sorted(SCHEDULES), "parameterization": sorted(PARAMETERIZATIONS)}


def parse_config() -> Config:
    """Every Config field is a flag `--name value`; booleans are `--name` / `--no-name`."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for field in dataclasses.fields(Config):
        if field.type is bool:
            parser.add_argument(f"--{field.name}", action=argparse.BooleanOptionalAction, default=field.default)
        else:
            parser.add_argument(f"--{field.name}", type=field.type, default=field.default, choices=CHOICES.get(field.name))
    return Config(**vars(parser.parse_args()))


def load_digit_images() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's 1,797 handwritten digits as [-1, 1] float32 NHWC (8×8×1), and their labels."""
    digits = load_digits()
    images = (digits.images.astype(np.float32) / 16.0 * 2 - 1)[..., None]
    return images, digits.target.astype(np.int32)


def main(cfg: Config) -> None:
    run_dir = Path(cfg.run_dir)
    images, labels = load_digit_images()
    schedule = schedule_by_name(cfg.schedule)
    parameterization = parameterization_by_name(cfg.parameterization)
    key_model, key_train, key_data = jax.random.split(jax.random.key(cfg.seed), 3)

    model = UNet(1, channels=(32, 64), num_res_blocks=2, emb_features=128, num_classes=10, key=key_model)
    optimizer = optax.adamw(optax.warmup_cosine_decay_schedule(0.0, cfg.lr, min(100, cfg.steps // 10), max(cfg.steps, 2)), weight_decay=1e-4)
    opt_state = optimizer.init(eqx.filter(model, eqx.is_array))
    ema = jax.tree.map(jnp.copy, model)  # its own buffers: both are donated to the step
    null = model.null_label

    @eqx.filter_jit(donate="all")
    def train_step(model, ema, opt_state, x0, y, key):
        key_drop, key_loss = jax.random.split(key)
        y = drop_labels(key_drop, y, cfg.label_dropout, null)
        loss_fn = lambda m: denoising_loss(m, schedule, parameterization, x0, key_loss, y)  # noqa: E731
        loss, grads = eqx.filter_value_and_grad(loss_fn)(model)
        updates, opt_state = optimizer.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        model = eqx.apply_updates(model, updates)
        ema = jax.tree.map(lambda e, p: cfg.ema_decay * e + (1 - cfg.ema_decay) * p, ema, model)
        return model, ema, opt_state, loss

    def write_samples(step: int) -> Path:
        classes = jnp.repeat(jnp.arange(10), 10)  # one row per digit
        denoise = ClassifierFreeGuidance(Denoiser(ema, schedule, parameterization), classes, cfg.cfg_scale, null)
        sigmas = karras_sigmas(cfg.sample_steps, schedule.sigma_min, schedule.sigma_max)
        x = sigmas[0] * jax.random.normal(jax.random.key(step), (100, 8, 8, 1))
        out = sample(denoise, x, sigmas, "heun")
        return save_image_grid(run_dir / "samples" / f"step_{step:06d}.png", np.asarray(out), ncols=10, upscale=4)

    rng = np.random.default_rng(cfg.seed)
    start = time.perf_counter()
    bar = tqdm(range(1, cfg.steps + 1), desc="train", mininterval=2.0)
    for step in bar:
        idx = rng.choice(len(images), cfg.batch_size, replace=False)
        key = jax.random.fold_in(key_train, step)
        model, ema, opt_state, loss = train_step(model, ema, opt_state, images[idx], labels[idx], key)
        if step % cfg.log_every == 0:  # the only host read of the loss
            bar.set_postfix(loss=f"{float(loss):.4f}", img_s=f"{step * cfg.batch_size / (time.perf_counter() - start):.0f}")
        if step % cfg.sample_every == 0 or step == cfg.steps:
            bar.write(f"step {step}: samples -> {write_samples(step)}")


if __name__ == "__main__":
    main(parse_config())
