"""AdamW with linear warmup, cosine decay and global-norm clipping (optax); EDM2's Adam and inverse-square-root
schedule; the EMA's decay warm-up."""

import jax.numpy as jnp
import optax


def adamw_cosine(
    lr: float, steps: int, warmup_steps: int, weight_decay: float = 0.0, clip_norm: float = 1.0
) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """Returns (optimizer, lr_schedule). Warmup is linear from 0 over `warmup_steps`, then a
    cosine decay to 0 at `steps` (Loshchilov & Hutter 2017)."""
    if not 0 <= warmup_steps < steps:
        raise ValueError(f"Need 0 <= warmup_steps < steps, got warmup_steps={warmup_steps}, steps={steps}.")
    schedule = optax.warmup_cosine_decay_schedule(0.0, lr, warmup_steps, steps)
    optimizer = optax.chain(optax.clip_by_global_norm(clip_norm), optax.adamw(schedule, weight_decay=weight_decay))
    return optimizer, schedule


def edm2_lr_schedule(lr_ref: float, ref_steps: int | float, rampup_steps: int | float) -> optax.Schedule:
    """EDM2's `learning_rate_schedule` (Karras et al. 2024, eq. 10) counted in optimizer updates t = 0, 1, ...:
    lr_ref / sqrt(max(t / ref_steps, 1)), times min(t / rampup_steps, 1) (EDM2 ramps up over rampup_Mimg
    images: rampup_Mimg·1e6 / batch steps; its ref_batches is `ref_steps`). 0 for either: that factor off."""

    def schedule(t):
        t = jnp.asarray(t, jnp.float32)
        lr = lr_ref / jnp.sqrt(jnp.maximum(t / ref_steps, 1.0)) if ref_steps > 0 else jnp.full_like(t, lr_ref)
        return lr * jnp.minimum(t / rampup_steps, 1.0) if rampup_steps > 0 else lr

    return schedule


def adam_edm2(
    lr_ref: float,
    ref_steps: int | float,
    rampup_steps: int | float,
    betas: tuple[float, float] = (0.9, 0.99),
    eps: float = 1e-8,
) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """Returns (optimizer, lr_schedule): EDM2's Adam (β = (0.9, 0.99), no weight decay, no clipping: its
    weights are normalised, eqxdiff.nn.force_weight_normalization) on `edm2_lr_schedule`."""
    schedule = edm2_lr_schedule(lr_ref, ref_steps, rampup_steps)
    return optax.adam(schedule, b1=betas[0], b2=betas[1], eps=eps), schedule


def run_optimizer(
    lr: float, steps: int, warmup_steps: int, weight_decay: float, lr_ref_steps: int = 0
) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """train/main.py's optimizer: `adamw_cosine`, or with `lr_ref_steps` > 0 EDM2's `adam_edm2` (`lr` its lr_ref,
    `warmup_steps` its ramp-up; no weight decay). One place, so a run's checkpoint is rebuilt with its own."""
    if lr_ref_steps > 0:
        return adam_edm2(lr, lr_ref_steps, warmup_steps)
    return adamw_cosine(lr, steps, warmup_steps, weight_decay)


def ema_warmup(decay: float) -> optax.Schedule:
    """The EMA decay at update t = 0, 1, ...: min(decay, (1 + t) / (10 + t)), TensorFlow's
    `ExponentialMovingAverage(decay, num_updates=t)`. The average starts short (0.1 at t = 0, 0.5
    at t = 8) and reaches `decay` at t = (10·decay - 1) / (1 - decay), so a short run's EMA is
    not dominated by the initial weights (at decay 0.999 a constant one would keep
    0.999^600 = 55% of them after 600 steps)."""
    return lambda t: jnp.minimum(decay, (1.0 + t) / (10.0 + t))
