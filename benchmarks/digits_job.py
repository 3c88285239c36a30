"""The default digits job's model, state and step, built as train/main.py builds them.

Shared by the benchmarks that time that job (bench_loop.py, bench_checkpoint.py), so they
measure one thing: `UNet(1, (32, 64), 1, num_classes=10)` on 8×8×1 digits, EDM schedule and
preconditioning, label dropout for classifier-free guidance, AdamW with warmup + cosine.
"""

from dataclasses import dataclass

import jax

from eqxdiff.data import open_source
from eqxdiff.diffusion import EDMPreconditioning, EDMSchedule, denoising_loss_at, draw_sigma_and_noise, drop_labels
from eqxdiff.nn import UNet
from eqxdiff.sharding import batch_sharding
from eqxdiff.training import adamw_cosine, create_train_state, make_train_step

MODEL = "UNet(1, (32, 64), 1, num_classes=10)"


@dataclass
class DigitsJob:
    digits: object  # the ImageSource
    make_model: object
    optimizer: object
    state: object
    shardings: object
    train_step: object


def digits_job(mesh, *, total_steps: int, seed: int = 0, label_dropout: float = 0.1, min_size: int = 2**12):
    digits = open_source("digits")
    schedule, parameterization = EDMSchedule(), EDMPreconditioning()
    optimizer, lr_schedule = adamw_cosine(2e-3, max(600, total_steps + 1), 60, 1e-4)

    def make_model(key):
        return UNet(1, (32, 64), 1, num_classes=digits.num_classes, key=key)

    state, shardings = create_train_state(make_model, optimizer, jax.random.key(seed), mesh, min_size)
    null_label = state.model.null_label

    def prepare(batch, key):  # as train/main.py
        key_draw, key_drop = jax.random.split(key)
        sigma, noise = draw_sigma_and_noise(schedule, batch["images"], key_draw)
        labels = drop_labels(key_drop, batch["labels"], label_dropout, null_label)
        return dict(batch, sigma=sigma, noise=noise, labels=labels)

    def loss_fn(model, batch, key):
        return denoising_loss_at(
            model, schedule, parameterization, batch["images"], batch["sigma"], batch["noise"], batch["labels"], key=key
        )

    train_step = make_train_step(
        prepare=prepare, loss_fn=loss_fn, optimizer=optimizer, lr_schedule=lr_schedule, ema_decay=0.995,
        state_shardings=shardings, batch_sharding=batch_sharding(mesh), seed=seed,
    )  # fmt: skip
    return DigitsJob(digits, make_model, optimizer, state, shardings, train_step)
