"""The σ-space diffusion core: schedules, parameterizations, loss, σ grids, samplers, guidance.

Every noise process is x = s(σ)·(x0 + σ·ε) (Karras et al. 2022): a schedule says how σ is drawn
and what the network sees, a parameterization turns its output into D(x; σ), and every sampler
integrates D down a σ grid (docs/core.md, "One idea: everything speaks σ").
"""

from .autoguidance import AutoGuidance
from .denoiser import Denoiser, LearnedVarianceDenoiser, WithoutVariance
from .grids import (
    flow_time_sigmas,
    karras_sigmas,
    logsnr_sigmas,
    spaced_sigmas,
    spaced_timesteps,
    vp_sigmas,
    vp_timesteps,
)
from .guidance import ClassifierFreeGuidance, condition_where, drop_condition
from .loss import DenoisingPrediction, denoising_loss, denoising_prediction, draw_sigma_and_noise, uncertainty_weighted
from .meanflow import average_velocity, draw_condition_drop, draw_times, guided_velocity, meanflow_prediction
from .parameterization import (
    PARAMETERIZATIONS,
    DataPrediction,
    EDMPreconditioning,
    EpsilonPrediction,
    FlowVelocity,
    Parameterization,
    VPrediction,
    loss_weight,
    parameterization_by_name,
)
from .samplers import METHODS, SAMPLERS, Step, learned_range_posterior, pf_ode_slope, sample
from .schedules import SCHEDULES, EDMSchedule, FlowSchedule, Schedule, VPSchedule, schedule_by_name

__all__ = [
    "AutoGuidance",
    "Denoiser",
    "LearnedVarianceDenoiser",
    "WithoutVariance",
    "flow_time_sigmas",
    "karras_sigmas",
    "logsnr_sigmas",
    "spaced_sigmas",
    "spaced_timesteps",
    "vp_sigmas",
    "vp_timesteps",
    "ClassifierFreeGuidance",
    "drop_condition",
    "condition_where",
    "average_velocity",
    "draw_condition_drop",
    "draw_times",
    "guided_velocity",
    "meanflow_prediction",
    "DenoisingPrediction",
    "denoising_loss",
    "denoising_prediction",
    "uncertainty_weighted",
    "draw_sigma_and_noise",
    "PARAMETERIZATIONS",
    "DataPrediction",
    "EDMPreconditioning",
    "EpsilonPrediction",
    "FlowVelocity",
    "Parameterization",
    "VPrediction",
    "loss_weight",
    "parameterization_by_name",
    "METHODS",
    "SAMPLERS",
    "Step",
    "learned_range_posterior",
    "pf_ode_slope",
    "sample",
    "SCHEDULES",
    "EDMSchedule",
    "FlowSchedule",
    "Schedule",
    "VPSchedule",
    "schedule_by_name",
]
