"""Training: the sharded TrainState, the donated NaN-guarded step, precision, optimizer, MFU, logging."""

from eqxdiff.training.logging import MetricsLogger
from eqxdiff.training.metrics import PEAK_FLOPS_PER_DEVICE, mfu, peak_flops_per_device, process_age_s, step_flops
from eqxdiff.training.optimizer import adam_edm2, adamw_cosine, edm2_lr_schedule, ema_warmup, run_optimizer
from eqxdiff.training.precision import PRECISIONS, cast_for_compute, compute_dtype
from eqxdiff.training.state import TrainState, abstract_train_state, create_train_state, init_train_state
from eqxdiff.training.step import make_train_step
from eqxdiff.training.windows import LogWindow, ProfileWindow, parse_step_range

__all__ = [
    "PEAK_FLOPS_PER_DEVICE",
    "MetricsLogger",
    "mfu",
    "peak_flops_per_device",
    "process_age_s",
    "step_flops",
    "adam_edm2",
    "adamw_cosine",
    "edm2_lr_schedule",
    "ema_warmup",
    "run_optimizer",
    "PRECISIONS",
    "cast_for_compute",
    "compute_dtype",
    "TrainState",
    "abstract_train_state",
    "create_train_state",
    "init_train_state",
    "make_train_step",
    "LogWindow",
    "ProfileWindow",
    "parse_step_range",
]
