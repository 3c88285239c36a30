"""Model FLOPs utilisation: step FLOPs from XLA's cost analysis over the peak FLOP/s of a chip.

MFU = (FLOPs of one step per device) / (step time) / (peak FLOP/s per device)
(Chowdhery et al. 2022, PaLM, Appendix B), with the FLOPs counted by XLA, not by hand.
"""

import functools
import os
import math
import re
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

# Dense (no 2:4 sparsity) peak FLOP/s per chip (= per JAX device on these parts), bf16 unless
# noted. Keys match `device.device_kind` as whole words, longest key first.
PEAK_FLOPS_PER_DEVICE: dict[str, float] = {
    # NVIDIA H100/H200 datasheets: 1979 TFLOPS bf16 "with sparsity" (SXM), 1513 (PCIe); dense is half.
    "H100": 989e12,
    "H100 PCIe": 756e12,
    "H200": 989e12,
    # NVIDIA A100 datasheet: bf16 tensor core 312 TFLOPS dense.
    "A100": 312e12,
    # NVIDIA V100 (SXM2) datasheet: 125 TFLOPS fp16 tensor core; V100 has no bf16 units.
    "V100": 125e12,
    # NVIDIA L4 datasheet: 242 TFLOPS bf16 with sparsity -> 121 dense.
    "L4": 121e12,
    # Cloud TPU system-architecture pages (cloud.google.com/tpu/docs/v4, v5e, v5p, v6e):
    # "Peak compute per chip (bf16)". JAX names v5e "TPU v5 lite", v5p "TPU v5", v6e "TPU v6 lite".
    "TPU v4": 275e12,
    "TPU v5 lite": 197e12,
    "TPU v5e": 197e12,
    "TPU v5": 459e12,
    "TPU v5p": 459e12,
    "TPU v6 lite": 918e12,
    "TPU v6e": 918e12,
}

_CPU_MATMUL_N = 2048  # big enough for XLA:CPU to reach its matmul peak, small enough to time quickly
# The host's measured figure handed to child processes (a test suite's scripts, a launcher's workers): each would
# otherwise spend its start measuring the same cores again.
CPU_MATMUL_FLOPS_ENV = "EQXDIFF_CPU_MATMUL_FLOPS"


def _lookup(device_kind: str) -> str | None:
    """The longest table key found in `device_kind` as whole words (so "L4" misses "L40S")."""
    for key in sorted(PEAK_FLOPS_PER_DEVICE, key=len, reverse=True):
        if re.search(rf"(?<![A-Za-z0-9]){re.escape(key)}(?![A-Za-z0-9])", device_kind, re.IGNORECASE):
            return key
    return None


@functools.cache
def measured_cpu_matmul_flops(repeats: int = 5) -> float:
    """Best fp32 FLOP/s of a jitted 2048×2048 matmul on one CPU device (measured once, cached).

    XLA:CPU's matmuls use every core, so this is the whole host's peak, not one device's.
    """
    n = _CPU_MATMUL_N
    device = jax.local_devices(backend="cpu")[0]
    a = jax.device_put(np.random.default_rng(0).standard_normal((n, n), np.float32), device)
    matmul = jax.jit(jnp.matmul)
    matmul(a, a).block_until_ready()  # compile + warm up
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        matmul(a, a).block_until_ready()
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


def peak_flops_per_device(device: Any = None, dtype: str = "bf16") -> tuple[float, str]:
    """Peak FLOP/s of one device and where the figure came from.

    `device`: a `jax.Device` (anything with `.platform` and `.device_kind`); default the first
    local device. `dtype`: "bf16" (table figures) or "fp32" (only the CPU measurement has one).

    - accelerator in `PEAK_FLOPS_PER_DEVICE` with bf16: the datasheet figure;
    - CPU: `measured_cpu_matmul_flops(repeats=2)` (or the figure a parent process measured on this host, in
      CPU_MATMUL_FLOPS_ENV) divided by the number of local CPU devices, since simulated CPU devices share the
      same cores (XLA:CPU runs bf16 matmuls no faster than fp32, so this serves for either dtype);
    - otherwise (nan, reason) — MFU then logs as nan instead of crashing a run.
    """
    if dtype not in ("bf16", "fp32"):
        raise ValueError(f"dtype must be 'bf16' or 'fp32', got {dtype!r}.")
    device = jax.local_devices()[0] if device is None else device
    kind = str(getattr(device, "device_kind", ""))
    if device.platform == "cpu":
        n = len(jax.local_devices(backend="cpu"))
        source = f"measured fp32 {_CPU_MATMUL_N}² matmul on CPU / {n} devices"
        if os.environ.get(CPU_MATMUL_FLOPS_ENV):
            return float(os.environ[CPU_MATMUL_FLOPS_ENV]) / n, f"{source} (the figure in {CPU_MATMUL_FLOPS_ENV})"
        # Best of 2, not more: every run pays for this measurement at start-up (BENCHMARKS.md, timings).
        return measured_cpu_matmul_flops(repeats=2) / n, source
    key = _lookup(kind)
    if key is None:
        return math.nan, f"unknown device kind {kind!r}: add it to PEAK_FLOPS_PER_DEVICE"
    if dtype != "bf16":
        return math.nan, f"unknown {dtype} peak for {kind!r}: PEAK_FLOPS_PER_DEVICE is bf16"
    return PEAK_FLOPS_PER_DEVICE[key], f"datasheet dense bf16 peak for {key!r}"


def step_flops(jitted_fn: Callable, *args: Any, **kwargs: Any) -> float:
    """FLOPs of one call `jitted_fn(*args, **kwargs)`, GLOBAL (whole program, all devices).

    Lowers (traces) but does not compile: XLA's cost analysis of the lowered, not yet
    SPMD-partitioned program, so the count is the same however the inputs are sharded; divide by
    the number of devices for the per-device figure MFU needs. A later call reuses the trace.
    Works for `jax.jit` and `eqx.filter_jit` functions (pass arrays, not ShapeDtypeStructs, to
    the latter). XLA counts 2·M·N·K per matmul and one FLOP per elementwise op. Caveats:
    - a padded conv counts only in-bounds taps: below the textbook 2·B·H·W·K²·Cin·Cout by the
      border share ((46/48)² = 8% less for 3×3 at 16×16; 16% at 8×8);
    - a `scan`/`fori_loop` body is counted ONCE, not once per iteration.
    Returns nan when the backend gives no cost analysis.
    """
    lowered = jitted_fn.lower(*args, **kwargs)
    lowered = getattr(lowered, "lowered", lowered)  # equinox wraps jax's Lowered
    cost = lowered.cost_analysis()
    if isinstance(cost, (list, tuple)):  # older jax: one dict per computation
        cost = cost[0] if cost else None
    if not cost or "flops" not in cost:
        return math.nan
    return float(cost["flops"])


def mfu(flops_per_step_per_device: float, step_time_s: float, peak_per_device: float) -> float:
    """Model FLOPs utilisation in [0, 1]: achieved FLOP/s per device over the peak."""
    if step_time_s <= 0 or not peak_per_device > 0:
        return math.nan
    return flops_per_step_per_device / step_time_s / peak_per_device


_IMPORTED = time.monotonic()


def process_age_s() -> float:
    """Seconds since this process started, imports included (Linux: /proc/self/stat's start
    time against the boot clock it counts from); elsewhere, since eqxdiff.training was imported."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, after "pid (comm)"
        return time.clock_gettime(time.CLOCK_BOOTTIME) - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return time.monotonic() - _IMPORTED
