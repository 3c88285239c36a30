"""MFU pieces: XLA's FLOP count against textbook formulas, the peak table, the CPU measurement."""

import math
import types

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from eqxdiff.nn import Conv2d, SelfAttention
from eqxdiff.training import metrics, mfu, peak_flops_per_device, step_flops
from eqxdiff.training.metrics import CPU_MATMUL_FLOPS_ENV


def test_conv_flops_match_analytic_count():
    b, h, w, k, cin, cout = 4, 16, 16, 3, 64, 64
    forward = eqx.filter_jit(lambda m, x: m(x))
    x = jnp.zeros((b, h, w, cin))
    bias_adds = lambda ho, wo: b * ho * wo * cout  # XLA counts one FLOP per output element
    # No padding: exactly the textbook 2·B·Ho·Wo·K·K·Cin·Cout.
    valid = Conv2d(cin, cout, kernel_size=k, padding=0, key=jax.random.key(0))
    ho, wo = h - k + 1, w - k + 1
    assert step_flops(forward, valid, x) == 2 * b * ho * wo * k * k * cin * cout + bias_adds(ho, wo)
    # "Same" padding: XLA skips taps that fall on the zero padding, so it counts fewer FLOPs than
    # 2·B·H·W·K·K·Cin·Cout — per axis 14 outputs see 3 taps, the 2 border ones see 2 (46 of 48).
    same = Conv2d(cin, cout, kernel_size=k, key=jax.random.key(0))
    in_bounds_taps = (h * k - 2) * (w * k - 2)  # sum over outputs of valid taps, over both axes
    assert step_flops(forward, same, x) == 2 * b * in_bounds_taps * cin * cout + bias_adds(h, w)
    textbook = 2 * b * h * w * k * k * cin * cout
    assert step_flops(forward, same, x) == pytest.approx(textbook * (46 / 48) ** 2, rel=1e-3)


def test_attention_flops_match_analytic_count():
    b, n, d, heads = 2, 64, 128, 4
    attn = SelfAttention(d, heads, key=jax.random.key(0))
    x = jnp.zeros((b, n, d))
    projections = 2 * b * n * d * 3 * d + 2 * b * n * d * d
    qk_and_av = 2 * 2 * b * n * n * d
    got = step_flops(eqx.filter_jit(lambda m, x: m(x)), attn, x)
    # The rest (bias adds, 1/sqrt(d) scaling, softmax) is O(b·n·(n·heads + d)): ~2% here.
    assert got == pytest.approx(projections + qk_and_av, rel=0.03)
    assert got >= projections + qk_and_av


def test_step_flops_is_global_not_per_device():
    m, k, n = 256, 512, 128
    mesh = Mesh(np.array(jax.devices()).reshape(8), ("data",))
    a = jax.device_put(jnp.ones((m, k)), NamedSharding(mesh, PartitionSpec("data")))
    bmat = jnp.ones((k, n))
    matmul = jax.jit(jnp.matmul)
    assert step_flops(matmul, a, bmat) == 2 * m * k * n  # sharded 8 ways: still the whole matmul
    assert step_flops(matmul, jnp.ones((m, k)), bmat) == 2 * m * k * n  # one device: the same
    # The compiled, partitioned program does one eighth of it on each device.
    per_device = matmul.lower(a, bmat).compile().cost_analysis()["flops"]
    assert per_device == 2 * m * k * n / 8


def test_step_flops_does_not_force_a_retrace():
    @eqx.filter_jit
    @eqx.debug.assert_max_traces(max_traces=1)
    def f(x):
        return x @ x

    x = jnp.ones((8, 8))
    assert step_flops(f, x) == 2 * 8**3
    f(x)
    f(x)


def test_peak_flops_from_table_by_device_kind():
    def fake(kind):
        return types.SimpleNamespace(platform="gpu", device_kind=kind)

    assert peak_flops_per_device(fake("NVIDIA H200"))[0] == 989e12
    assert peak_flops_per_device(fake("NVIDIA H100 80GB HBM3"))[0] == 989e12
    assert peak_flops_per_device(fake("NVIDIA H100 PCIe"))[0] == 756e12
    assert peak_flops_per_device(fake("NVIDIA A100-SXM4-80GB"))[0] == 312e12
    tpu = types.SimpleNamespace(platform="tpu", device_kind="TPU v5 lite")
    assert peak_flops_per_device(tpu)[0] == 197e12
    assert peak_flops_per_device(types.SimpleNamespace(platform="tpu", device_kind="TPU v5"))[0] == 459e12
    value, source = peak_flops_per_device(fake("NVIDIA L40S"))  # must not match "L4"
    assert math.isnan(value) and source.startswith("unknown")
    assert math.isnan(peak_flops_per_device(fake("NVIDIA H200"), dtype="fp32")[0])
    with pytest.raises(ValueError, match="dtype"):
        peak_flops_per_device(fake("NVIDIA H200"), dtype="int4")


def test_cpu_peak_is_measured_and_split_over_simulated_devices(monkeypatch):
    monkeypatch.delenv(CPU_MATMUL_FLOPS_ENV, raising=False)  # conftest hands its figure to the suite's scripts
    value, source = peak_flops_per_device()
    assert jax.devices()[0].platform == "cpu"
    assert math.isfinite(value) and value > 0 and "measured" in source
    n = len(jax.local_devices(backend="cpu"))
    assert f"{n} devices" in source
    assert peak_flops_per_device(jax.devices()[3]) == (value, source)  # cached, same for all


def test_mfu_arithmetic():
    assert mfu(1e12, 0.5, 4e12) == pytest.approx(0.5)
    assert math.isnan(mfu(1e12, 0.0, 4e12))
    assert math.isnan(mfu(1e12, 1.0, math.nan))


def test_step_flops_counts_a_scan_body_once():
    # Documented limitation of XLA's cost analysis: loop bodies are not multiplied by trip count.
    a = jnp.ones((64, 64))
    scan4 = jax.jit(lambda x: jax.lax.scan(lambda c, _: (c @ a, None), x, None, length=4)[0])
    assert step_flops(scan4, a) == pytest.approx(2 * 64**3, rel=1e-4)  # +2 for the loop counter


def test_a_parent_processs_cpu_figure_is_taken_not_measured_again(monkeypatch):
    """A child process (the suite's scripts, conftest's figure) divides the host's handed figure by its devices."""
    monkeypatch.setattr(metrics, "measured_cpu_matmul_flops", lambda repeats: pytest.fail("measured again"))
    monkeypatch.setenv(CPU_MATMUL_FLOPS_ENV, "8e11")
    value, source = peak_flops_per_device()
    n = len(jax.local_devices(backend="cpu"))
    assert value == 8e11 / n and CPU_MATMUL_FLOPS_ENV in source
