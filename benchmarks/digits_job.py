"""The default digits job's model, state and step, built as train/main.py builds them.

Shared by the benchmarks that time that job (bench_loop.py, bench_checkpoint.py, bench_xla_cpu.py), so they
measure one thing: `UNet(1, (32, 64), 1, num_classes=10)` on 8×8×1 digits, EDM schedule and
preconditioning, label dropout for classifier-free guidance, AdamW with warmup + cosine. (Its
warm-up, label dropout and constant EMA decay are the default job's before issue 14; none of them
changes what a step computes or costs.)
"""

import functools
from dataclasses import dataclass

import jax

from unconditional_edm import train_main  # train/main.py (the module puts train/ on sys.path)
from eqxdiff.run.conditions import Labels
from eqxdiff.data import open_source
from eqxdiff.diffusion import EDMPreconditioning, EDMSchedule
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
    condition = Labels(digits.num_classes)  # its null: label num_classes, the model's extra row
    prepare = functools.partial(train_main.prepare, condition=condition, schedule=schedule, cond_dropout=label_dropout)
    loss_fn = functools.partial(train_main.loss_fn, schedule=schedule, parameterization=parameterization)

    train_step = make_train_step(
        prepare=prepare,
        loss_fn=loss_fn,
        optimizer=optimizer,
        lr_schedule=lr_schedule,
        ema_decay=0.995,
        state_shardings=shardings,
        batch_sharding=batch_sharding(mesh),
        seed=seed,
    )
    return DigitsJob(digits, make_model, optimizer, state, shardings, train_step)
