"""AdamW with linear warmup, cosine decay and global-norm clipping (optax)."""

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
