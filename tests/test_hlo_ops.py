"""benchmarks/hlo_ops.py, which profile_steps.py's per-op tables rest on: a conv's forward, input gradient and
weight gradient are told apart in a compiled program, with their phases, and a profiler trace's op events
are found by instruction name."""

import jax
import jax.numpy as jnp

from runs import script_module


def hlo_ops():
    return script_module("benchmarks/hlo_ops.py")


def loss(w, x):
    y = jax.lax.conv_general_dilated(x, w, (1, 1), [(1, 1)] * 2, dimension_numbers=("NHWC", "HWIO", "NHWC"))
    return jnp.mean(jnp.tanh(y) ** 2)


grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
W, X = jnp.ones((3, 3, 4, 8)) / 9, jnp.ones((2, 16, 16, 4))


def test_a_conv_gradients_kinds_and_phases():
    table = hlo_ops().instructions(grads.lower(W, X).compile().as_text())
    convs = {(e["kind"], e["phase"]) for e in table.values() if e["kind"].startswith("conv")}
    # the 3×3 forward conv, dL/dx as a conv with the kernel's window, dL/dW as one whose window spans the map
    assert convs == {("conv fwd", "forward"), ("conv input-grad", "backward"), ("conv weight-grad", "backward")}


def test_a_bias_gradient_as_a_matvec_with_ones_is_its_own_kind():
    from eqxdiff import xla_cpu

    def bias_loss(b, x):  # the per-channel and per-sample sums of xla_cpu.sum_to
        return jnp.mean(jnp.tanh(xla_cpu.add_bias(x, b[0])) ** 2) + jnp.mean(jnp.tanh(xla_cpu.add_bias(x, b[1])) ** 2)

    bias = (jnp.ones(4), jnp.ones((2, 1, 1, 4)))
    table = hlo_ops().instructions(jax.jit(jax.grad(bias_loss)).lower(bias, X).compile().as_text())
    sums = [e for e in table.values() if e["kind"] == "channel sum (as matmul)"]
    assert len(sums) == 2 and {e["op"] for e in sums} <= {"dot", "fusion"}
    assert {e["phase"] for e in sums} == {"backward"}


def test_trace_events_are_summed_per_instruction(tmp_path):
    ops = hlo_ops()
    text = grads.lower(W, X).compile().as_text()
    table = ops.instructions(text)
    jax.block_until_ready(grads(W, X))
    jax.profiler.start_trace(str(tmp_path))
    for _ in range(2):
        jax.block_until_ready(grads(W, X))
    jax.profiler.stop_trace()
    events, _ = ops.op_events(next(tmp_path.rglob("*.xplane.pb")), ops.module_name(text))
    summary = ops.summarise(events, table, steps=2)
    kinds = summary["by_kind"]
    assert {"conv fwd", "conv input-grad", "conv weight-grad"} <= kinds.keys()
    assert abs(sum(k["share"] for k in kinds.values()) - 1) < 0.01
    assert abs(sum(p["ms_per_step"] for p in summary["by_phase"].values()) - summary["op_ms_per_step"]) < 0.05
