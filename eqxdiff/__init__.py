"""eqxdiff: diffusion models in JAX + Equinox.

Sub-packages: `eqxdiff.diffusion` (sigma-space schedules, parameterizations, loss,
samplers, guidance) and `eqxdiff.nn` (NHWC layers, UNet, DiT).
"""

__version__ = "0.1.0"
