"""AdamW with linear warmup, cosine decay and global-norm clipping (optax); the EMA's decay warm-up."""

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


def ema_warmup(decay: float) -> optax.Schedule:
    """The EMA decay at update t = 0, 1, ...: min(decay, (1 + t) / (10 + t)), TensorFlow's
    `ExponentialMovingAverage(decay, num_updates=t)`. The average starts short (0.1 at t = 0, 0.5
    at t = 8) and reaches `decay` at t = (10·decay - 1) / (1 - decay), so a short run's EMA is
    not dominated by the initial weights (at decay 0.999 a constant one would keep
    0.999^600 = 55% of them after 600 steps)."""
    return lambda t: jnp.minimum(decay, (1.0 + t) / (10.0 + t))
