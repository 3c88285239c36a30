"""eqxdiff.nn.attention: every form against the plain one (XLA's `jax.nn.dot_product_attention`), which is itself held
to softmax(q kᵀ/√d) v written out in float64; the form each backend and shape takes; the remat policies."""

import contextlib
import io
import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.ad_checkpoint import print_saved_residuals

from eqxdiff.nn import attention as attention_module
from eqxdiff.nn.attention import attention, attention_form, chosen_form
from eqxdiff.nn.dit import DiTBlock
from eqxdiff.nn.remat import REMAT_POLICIES, checkpointed, remat_policy, set_remat_policy
from eqxdiff.sharding import batch_sharding, make_mesh
from eqxdiff.training import adamw_cosine, create_train_state, make_train_step


def qkv(n, m, heads=2, d=72, seed=0, dtype=jnp.float32):
    keys = jax.random.split(jax.random.key(seed), 3)
    return tuple(jax.random.normal(k, (2, length, heads, d), dtype) for k, length in zip(keys, (n, m, m)))


def written_out(q, k, v, mask=None):
    """softmax(q kᵀ / sqrt(d)) v per head in float64 numpy, a masked key's weight exactly 0."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    logits = np.einsum("bnhd,bmhd->bhnm", q, k) / np.sqrt(q.shape[-1])
    if mask is not None:
        logits = np.where(np.asarray(mask), logits, -np.inf)
    weights = np.exp(logits - logits.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    return np.einsum("bhnm,bmhd->bnhd", weights, v)


def grads(form, q, k, v, mask=None):
    """The form's output and the gradient of sum(sin(output)) by q, k, v (the pullback of cos(output)), in one
    jitted program: its forward pass is the output (two programs, the forward compiled twice, took ~30% longer)."""

    def both(q, k, v):
        out, pullback = jax.vjp(lambda q, k, v: attention(q, k, v, mask), q, k, v)
        return out, pullback(jnp.cos(out).astype(out.dtype))

    with attention_form(form):
        return jax.jit(both)(q, k, v)


def test_the_plain_form_is_the_softmax_written_out():
    q, k, v = qkv(40, 24, d=8)
    mask = jax.random.bernoulli(jax.random.key(1), 0.7, (2, 1, 40, 24)).at[..., 0].set(True)
    for m in (None, mask):
        with attention_form("plain"):  # jitted: op by op, each of its ops compiled on its own
            np.testing.assert_allclose(jax.jit(attention)(q, k, v, m), written_out(q, k, v, m), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("masked", [False, True])
def test_query_blocks_equal_the_plain_form(masked, monkeypatch):
    """Blocks of 24 queries over 64 (24, 24, 16): the same rows, forward and gradient, with and without a mask."""
    monkeypatch.setattr(attention_module, "QUERY_BLOCK", 24)
    q, k, v = qkv(64, 40, d=8)
    mask = jax.random.bernoulli(jax.random.key(1), 0.7, (2, 1, 64, 40)).at[..., 0].set(True) if masked else None
    (out, g), (ref, g_ref) = grads("query_blocks", q, k, v, mask), grads("plain", q, k, v, mask)
    np.testing.assert_allclose(out, ref, rtol=0, atol=1e-6)
    for a, b in zip(g, g_ref):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)


def test_flash_equals_the_plain_form_in_pallas_interpreter():
    """Pallas' TPU flash kernel, forward and gradient, run by its interpreter on the CPU: DiT-XL's head size 72
    (not a multiple of the TPU's 128 lanes), keys fewer than queries (one block of each, as 256 of both would be;
    several blocks: test_flash_blocks_divide_lengths_off_its_largest_block)."""
    q, k, v = qkv(256, 128)
    (out, g), (ref, g_ref) = grads("flash", q, k, v), grads("plain", q, k, v)
    np.testing.assert_allclose(out, ref, rtol=0, atol=2e-5)
    for a, b in zip(g, g_ref):
        np.testing.assert_allclose(a, b, rtol=0, atol=2e-5 * float(jnp.abs(b).max()))


@pytest.mark.parametrize(
    ("n", "m", "heads", "dtype"), [(256, 256, 6, jnp.float32), (128, 256, 3, jnp.bfloat16), (128, 128, 16, jnp.float32)]
)
def test_one_block_equals_the_plain_form_in_pallas_interpreter(n, m, heads, dtype):
    """The one-block kernels (forward; backward writing dq, dk, dv in one pass) by Pallas' interpreter: DiT-XL's
    head size 72, so heads straddle 128-lane tiles; 6 and 3 heads padded to whole tiles, 16 (DiT-XL's 1152 lanes)
    not; keys more than queries; in bfloat16 to its rounding."""
    q, k, v = qkv(n, m, heads=heads, dtype=dtype)
    (out, g), (ref, g_ref) = grads("one_block", q, k, v), grads("plain", q, k, v)
    tol = 2e-5 if dtype == jnp.float32 else 1e-2
    np.testing.assert_allclose(np.asarray(out, np.float32), written_out(q, k, v), rtol=0, atol=tol)
    for a, b in zip(g, g_ref):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        np.testing.assert_allclose(a, b, rtol=0, atol=tol * float(np.abs(b).max()))


@pytest.mark.parametrize(("heads", "d", "dtype"), [(4, 64, jnp.float32), (2, 128, jnp.float32), (2, 64, jnp.bfloat16)])
def test_flash_reading_the_heads_side_by_side_equals_the_plain_form(heads, d, dtype, monkeypatch):
    """FLASH_LANES' forward kernel by Pallas' interpreter: heads of 64 two to a 128-lane window (SDXL's), of 128
    one; blocks of 128 over 256 queries and 384 keys, so each row's softmax runs online over three
    key blocks; in bfloat16 to its rounding. Its gradient (one case: Pallas' flash kernel's, tested above) is the
    plain form's."""
    monkeypatch.setattr(attention_module, "FLASH_LANES", True)
    monkeypatch.setattr(attention_module, "FLASH_LANES_FROM", 256)
    monkeypatch.setattr(attention_module, "FLASH_LANES_BLOCK", 128)
    q, k, v = qkv(256, 384, heads=heads, d=d, dtype=dtype)
    tol = 2e-5 if dtype == jnp.float32 else 1e-2
    if dtype == jnp.bfloat16:
        (out, g), (_, g_ref) = grads("flash", q, k, v), grads("plain", q, k, v)
        for a, b in zip(g, g_ref):
            a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
            np.testing.assert_allclose(a, b, rtol=0, atol=tol * float(np.abs(b).max()))
    else:
        with attention_form("flash"):
            out = jax.jit(attention)(q, k, v)
    np.testing.assert_allclose(np.asarray(out, np.float32), written_out(q, k, v), rtol=0, atol=tol)


def test_flash_forward_takes_its_lanes_form_from_flash_lanes_from(monkeypatch):
    """flash dispatches: the side-by-side forward where the queries reach FLASH_LANES_FROM and the heads tile the
    lanes; Pallas' kernel on the heads in front below it, for heads of 72, and with FLASH_LANES off."""
    calls = []
    monkeypatch.setattr(attention_module, "flash_lanes", lambda q, *args: calls.append(q.shape) or q)
    monkeypatch.setattr(attention_module, "heads_in_front_flash", lambda q, k, v: calls.append("front") or q)
    shape = lambda n, heads, d: jax.ShapeDtypeStruct((2, n, heads, d), jnp.bfloat16)  # noqa: E731
    for n, heads, d in [(4096, 10, 64), (1024, 20, 64), (4096, 16, 72), (8192, 2, 128)]:
        jax.eval_shape(attention_module.flash, *(shape(n, heads, d),) * 3)
    assert calls == [(2, 4096, 10, 64), "front", "front", (2, 8192, 2, 128)]
    monkeypatch.setattr(attention_module, "FLASH_LANES", False)
    jax.eval_shape(attention_module.flash, *(shape(4096, 4, 64),) * 3)  # a new shape: eval_shape caches traces
    assert calls[-1] == "front"


def test_flash_blocks_divide_lengths_off_its_largest_block(monkeypatch):
    """640 queries and 384 keys: the blocks are the largest whole numbers of 128 dividing each length, forward (up to
    384: 128 and 384) and backward (up to 256: 128 and 128); forward and gradient are the plain form's by Pallas'
    interpreter."""
    monkeypatch.setattr(attention_module, "FLASH_BLOCK", 384)
    monkeypatch.setattr(attention_module, "FLASH_BACKWARD_BLOCK", 256)
    assert attention_module.block_size(640, 256) == 128 and attention_module.block_size(384, 256) == 128
    assert attention_module.block_size(1152, 512) == 384 and attention_module.block_size(4096, 1024) == 1024
    q, k, v = qkv(640, 384, heads=1, d=8)
    (out, g), (ref, g_ref) = grads("flash", q, k, v), grads("plain", q, k, v)
    np.testing.assert_allclose(out, ref, rtol=0, atol=2e-5)
    for a, b in zip(g, g_ref):
        np.testing.assert_allclose(a, b, rtol=0, atol=2e-5 * float(jnp.abs(b).max()))


class Scale(eqx.Module):
    a: jax.Array


def test_a_pallas_form_runs_per_device_under_the_steps_mesh():
    """A train step traces under its mesh (2 × 4 devices), so a Pallas attention runs on each device's quarter of
    the batch (shard_map): the loss and the updated weights equal XLA's form's, the batch stays split."""
    mesh = make_mesh(data=2, fsdp=4)
    q0, k0, v0 = (np.asarray(a) for a in qkv(16, 16, heads=2, d=8))
    x = np.concatenate([q0, k0, v0, q0, k0, v0, q0, k0], axis=0)  # 16 rows, 2 a device
    seen = []

    def loss_fn(model, batch, key):
        seen.append(jax.sharding.get_abstract_mesh())
        out = attention(batch["x"] * model.a, batch["x"], batch["x"])
        return jnp.mean(jnp.sin(out))

    def one_step(form):
        optimizer, schedule = adamw_cosine(1e-2, 10, 0)
        state, shardings = create_train_state(lambda key: Scale(jnp.ones(8)), optimizer, jax.random.key(0), mesh, 2**20)
        step = make_train_step(
            prepare=lambda batch, key: batch,
            loss_fn=loss_fn,
            optimizer=optimizer,
            lr_schedule=schedule,
            ema_decay=0.5,
            state_shardings=shardings,
            batch_sharding=batch_sharding(mesh),
            seed=0,
        )
        with attention_form(form):
            state, metrics = step(state, jax.device_put({"x": x}, batch_sharding(mesh)))
        return float(metrics["loss"]), np.asarray(state.model.a)

    (loss, a), (loss_ref, a_ref) = one_step("one_block"), one_step("plain")
    assert seen[0].axis_names == ("data", "fsdp") and seen[0].size == 8
    with attention_form("one_block"), jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        assert "shard_map" in str(jax.make_jaxpr(attention)(x, x, x))  # one kernel per device, not GSPMD's split
    np.testing.assert_allclose(loss, loss_ref, rtol=1e-6)
    np.testing.assert_allclose(a, a_ref, rtol=1e-6)
    assert not np.allclose(a, 1.0)  # the step did move the weights


def test_flash_refuses_what_it_cannot_take():
    q, k, v = qkv(256, 77)
    with pytest.raises(ValueError, match="whole blocks of 128"), attention_form("flash"):
        attention(q, k, v)
    with pytest.raises(ValueError, match="takes no mask"), attention_form("flash"):
        attention(*qkv(256, 256), mask=jnp.ones((2, 1, 256, 256), bool))
    with pytest.raises(ValueError, match="one_block takes up to"), attention_form("one_block"):
        attention(*qkv(2048, 1024, heads=1, d=8))
    with pytest.raises(ValueError, match="Unknown attention form"), attention_form("fast"):
        pass


def test_each_backend_takes_its_form(monkeypatch):
    """CPU: query blocks where a head's logits reach QUERY_BLOCKS_FROM (SD's 32² and 64² levels), else XLA's.
    TPU, unmasked, whole blocks of 128, on one device: flash from FLASH_FROM queries, one_block up to 256² logits;
    else XLA's. Others: XLA's."""
    monkeypatch.setattr(attention_module, "platform", lambda: "cpu")
    assert chosen_form(4096, 4096, False) == chosen_form(1024, 1024, True) == "query_blocks"
    assert chosen_form(256, 256, False) == chosen_form(4096, 77, False) == chosen_form(64, 2**15, False) == "plain"
    monkeypatch.setattr(attention_module, "platform", lambda: "tpu")
    monkeypatch.setattr(jax, "device_count", lambda backend=None: 1)
    assert chosen_form(4096, 4096, False) == chosen_form(1024, 1024, False) == "flash"
    assert chosen_form(256, 256, False) == chosen_form(128, 256, False) == "one_block"  # DiT's 256 tokens
    assert chosen_form(512, 512, False) == chosen_form(4096, 77, False) == chosen_form(4096, 4096, True) == "plain"
    assert chosen_form(256, 256, True) == chosen_form(200, 200, False) == "plain"  # masked; not whole blocks
    with attention_module.forward_mode():  # jax.jvp ahead: no custom_vjp kernel
        assert chosen_form(256, 256, False) == chosen_form(4096, 4096, False) == "plain"
    monkeypatch.setattr(jax, "device_count", lambda backend=None: 4)
    assert chosen_form(4096, 4096, False, 8) == "plain"  # GSPMD does not split a Pallas call: no mesh in context
    mesh = make_mesh(data=1, fsdp=4, devices=jax.devices()[:4])
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):  # as the train step traces: a kernel per device
        assert chosen_form(4096, 4096, False, 8) == "flash"
        assert chosen_form(4096, 4096, False, 6) == "plain"  # 6 rows do not split over 4 devices
    monkeypatch.setattr(attention_module, "platform", lambda: "gpu")
    assert chosen_form(4096, 4096, False) == "plain"
    with attention_form("flash"):
        assert chosen_form(8, 8, False) == "flash"  # forced, whatever the shape


def test_platform_follows_a_default_device_block():
    assert attention_module.platform() == jax.default_backend()
    with jax.default_device(jax.devices("cpu")[0]):
        assert attention_module.platform() == "cpu"


def block_and_inputs():
    block = DiTBlock(32, 2, 4.0, key=jax.random.key(0))
    block = jax.tree.map(lambda a: a + 0.1 if eqx.is_inexact_array(a) else a, block)  # adaLN-Zero: not zero
    x = jax.random.normal(jax.random.key(1), (2, 16, 32))
    c = jax.random.normal(jax.random.key(2), (2, 32))
    return block, x, c


def block_gradient(block, x, c, remat: bool):
    """The DiT block's parameter gradient of sum(sin(out)), one jitted program: a fresh wrapper per call, since the
    remat policy is read when it traces (op by op, the eager gradient compiled each of its ops: ~7 s alone)."""
    loss = lambda blk, x: jnp.sum(jnp.sin(checkpointed(blk, remat)(x, c)))  # noqa: E731
    return eqx.filter_jit(eqx.filter_grad(loss))(block, x)


@pytest.fixture(scope="module")
def plain_gradient():
    block, x, c = block_and_inputs()
    return block_gradient(block, x, c, False)


@pytest.mark.parametrize("policy", sorted(REMAT_POLICIES))
def test_every_remat_policy_keeps_the_gradient(policy, plain_gradient):
    """Within 1e-5 of each leaf's largest value (measured 2.2e-6 for every policy: the two programs round
    differently; a policy that dropped or stopped a residual's gradient moves leaves by their own size)."""
    block, x, c = block_and_inputs()
    set_remat_policy(policy)
    try:
        rematted = block_gradient(block, x, c, True)
    finally:
        set_remat_policy(attention_module_default())
    for a, b in zip(jax.tree.leaves(plain_gradient), jax.tree.leaves(rematted), strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5 * float(np.abs(b).max()))


def attention_module_default():
    from eqxdiff.nn.remat import DEFAULT_REMAT_POLICY

    return DEFAULT_REMAT_POLICY


def saved_shapes(policy: str) -> list[tuple]:
    """The shapes of what a rematerialised DiT block keeps for its backward pass under `policy`, its own
    input and parameters left out."""
    block, x, c = block_and_inputs()
    params, static = eqx.partition(block, eqx.is_array)
    set_remat_policy(policy)
    try:
        fn = lambda p, x, c: jnp.sum(checkpointed(eqx.combine(p, static), True)(x, c))  # noqa: E731
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):  # jax's public view of the residuals: "f32[2,16,96] from ..."
            print_saved_residuals(fn, params, x, c)
    finally:
        set_remat_policy(attention_module_default())
    lines = [line for line in printed.getvalue().splitlines() if "argument" not in line]
    return [
        tuple(int(d) for d in shape.split(",")) for line in lines for shape in re.findall(r"^f32\[([\d,]+)\]", line)
    ]


def test_the_policies_keep_what_their_names_say():
    """nothing_saveable keeps nothing of the block's own; attention_saveable its attention's output [b, n, h, d]
    alone; dots_with_no_batch_dims_saveable every per-token projection too (qkv [b, n, 3·32], the MLP's
    [b, n, 128])."""
    assert saved_shapes("nothing_saveable") == []
    assert saved_shapes("attention_saveable") == [(2, 16, 2, 16)]
    dots = saved_shapes("dots_with_no_batch_dims_saveable")
    assert (2, 16, 96) in dots and (2, 16, 128) in dots and len(dots) > 3


def test_an_unknown_remat_policy_is_refused_by_name():
    with pytest.raises(ValueError, match="Unknown remat policy 'fast'.*nothing_saveable"):
        set_remat_policy("fast")
    assert remat_policy() == attention_module_default()
