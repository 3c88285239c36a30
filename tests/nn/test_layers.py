"""NHWC layers against independent references (Equinox's CHW conv, numpy formulas)."""

import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eqxdiff.nn import Conv2d, GroupNorm, SelfAttention, nearest_upsample_conv, sincos_pos_embed_2d, timestep_embedding


@pytest.mark.parametrize("stride", [1, 2])
def test_conv2d_matches_equinox_chw(stride):
    ours = Conv2d(3, 5, 3, stride=stride, key=jax.random.key(0))
    # Abstract construction (its own weights are replaced; eager 4-D init compiles slowly).
    ref = eqx.filter_eval_shape(eqx.nn.Conv2d, 3, 5, 3, stride=stride, padding=1, key=jax.random.key(1))
    # Same weights: HWIO -> OIHW.
    ref = eqx.tree_at(lambda c: (c.weight, c.bias), ref, (ours.weight.transpose(3, 2, 0, 1), ours.bias[:, None, None]))
    x = jnp.asarray(np.random.default_rng(2).normal(size=(2, 8, 8, 3)), jnp.float32)
    want = jax.vmap(ref)(x.transpose(0, 3, 1, 2)).transpose(0, 2, 3, 1)
    np.testing.assert_allclose(ours(x), want, rtol=1e-5, atol=1e-5)


def test_groupnorm_matches_numpy():
    gn = GroupNorm(2, 6)
    w, b = np.linspace(0.5, 1.5, 6, dtype=np.float32), np.linspace(-1, 1, 6, dtype=np.float32)
    gn = eqx.tree_at(lambda m: (m.weight, m.bias), gn, (jnp.asarray(w), jnp.asarray(b)))
    x = np.random.default_rng(0).normal(size=(2, 4, 5, 6)).astype(np.float32) * 3 + 1
    xg = x.reshape(2, 4, 5, 2, 3)
    mean, var = xg.mean(axis=(1, 2, 4), keepdims=True), xg.var(axis=(1, 2, 4), keepdims=True)
    want = ((xg - mean) / np.sqrt(var + 1e-5)).reshape(x.shape) * w + b
    np.testing.assert_allclose(gn(jnp.asarray(x)), want, rtol=1e-5, atol=1e-5)


def test_groupnorm_bf16_keeps_dtype_with_fp32_statistics():
    gn = GroupNorm(2, 4)
    # A large offset: bf16 statistics would lose the variance entirely.
    x = jnp.asarray(100.0 + 4.0 * np.random.default_rng(0).normal(size=(2, 8, 8, 4)), jnp.bfloat16)
    y = gn(x)
    assert y.dtype == jnp.bfloat16
    xg = np.asarray(x, np.float64).reshape(2, 8, 8, 2, 2)
    mean, var = xg.mean(axis=(1, 2, 4), keepdims=True), xg.var(axis=(1, 2, 4), keepdims=True)
    want = ((xg - mean) / np.sqrt(var + 1e-5)).reshape(x.shape)
    np.testing.assert_allclose(np.asarray(y, np.float64), want, atol=0.03)


def test_attention_matches_manual_softmax():
    b, n, d, heads = 2, 5, 8, 2
    attn = SelfAttention(d, heads, key=jax.random.key(0))
    x = np.random.default_rng(1).normal(size=(b, n, d)).astype(np.float32)
    qkv = x @ np.asarray(attn.qkv.weight) + np.asarray(attn.qkv.bias)
    q, k, v = (qkv[..., i * d : (i + 1) * d].reshape(b, n, heads, d // heads).transpose(0, 2, 1, 3) for i in range(3))
    logits = q @ k.transpose(0, 1, 3, 2) / math.sqrt(d // heads)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    o = (p @ v).transpose(0, 2, 1, 3).reshape(b, n, d)
    want = o @ np.asarray(attn.proj.weight) + np.asarray(attn.proj.bias)
    np.testing.assert_allclose(attn(jnp.asarray(x)), want, rtol=1e-5, atol=1e-5)


def test_timestep_embedding_adm_formula():
    t = np.array([0.0, 1.5, -1.2, 999.0], np.float32)
    emb = np.asarray(timestep_embedding(jnp.asarray(t), 9))
    assert emb.shape == (4, 9)
    for i in range(4):  # half = 4: freqs_i = 10000^(-i/4); [cos..., sin...], zero pad
        f = 10000.0 ** (-i / 4)
        np.testing.assert_allclose(emb[:, i], np.cos(t * f), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(emb[:, 4 + i], np.sin(t * f), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(emb[:, 8], 0.0)


def test_sincos_pos_embed_mae_layout():
    pe = sincos_pos_embed_2d(8, 3)  # token k = (row k // 3, col k % 3); omega = [1, 0.01]
    assert pe.shape == (9, 8)
    row, col = 2, 1
    omega = np.array([1.0, 0.01])
    want = np.concatenate([np.sin(col * omega), np.cos(col * omega), np.sin(row * omega), np.cos(row * omega)])
    np.testing.assert_allclose(pe[row * 3 + col], want, rtol=1e-6, atol=1e-6)


def _conv_of_repeated_map(x: np.ndarray, weight: np.ndarray, bias: np.ndarray) -> np.ndarray:
    """float64 numpy: x repeated 2× along h and w, zero-padded by one, every 3×3 window times the kernel."""
    up = np.pad(np.repeat(np.repeat(x, 2, 1), 2, 2), ((0, 0), (1, 1), (1, 1), (0, 0)))
    windows = np.lib.stride_tricks.sliding_window_view(up, (3, 3), axis=(1, 2))  # [b, 2h, 2w, i, 3, 3]
    return np.einsum("bhwipq,pqio->bhwo", windows, weight) + bias


@pytest.mark.parametrize("shape", [(2, 3, 5, 4), (1, 1, 1, 2)], ids=["3x5", "1x1"])
def test_nearest_upsample_conv_is_the_conv_of_the_repeated_map(shape):
    """The 2×2 phase kernels give the conv of the upsampled map (numpy's, in float64), and the same gradients
    as the conv of `jnp.repeat` (its own autodiff) for the input, the kernel and the bias."""
    conv = Conv2d(shape[-1], 6, key=jax.random.key(0))
    conv = eqx.tree_at(lambda c: c.bias, conv, jax.random.normal(jax.random.key(1), (6,)))  # torch's init is small
    x = jax.random.normal(jax.random.key(2), shape)
    want = _conv_of_repeated_map(np.float64(x), np.float64(conv.weight), np.float64(conv.bias))
    got = nearest_upsample_conv(conv, x)
    assert got.shape == (shape[0], 2 * shape[1], 2 * shape[2], 6)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())

    cotangent = jax.random.normal(jax.random.key(3), got.shape)
    repeated = lambda conv, x: conv(jnp.repeat(jnp.repeat(x, 2, axis=1), 2, axis=2))  # noqa: E731
    grad = lambda f: eqx.filter_grad(lambda cx: jnp.sum(f(*cx) * cotangent))((conv, x))  # noqa: E731
    grads = [grad(nearest_upsample_conv), grad(repeated)]
    for a, b in zip(jax.tree.leaves(grads[0]), jax.tree.leaves(grads[1]), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * np.abs(b).max())


def test_nearest_upsample_conv_refuses_other_convs_and_calls_other_modules_on_the_repeated_map():
    from eqxdiff.nn.lora import lora_init

    x = jax.random.normal(jax.random.key(1), (1, 4, 4, 2))
    adapted = lora_init(Conv2d(2, 3, key=jax.random.key(0)), 2, 2, key=jax.random.key(2))
    adapted = eqx.tree_at(lambda c: c.lora_B, adapted, jnp.ones((3, 2)))  # a nonzero low-rank branch
    want = adapted(jnp.repeat(jnp.repeat(x, 2, axis=1), 2, axis=2))
    assert np.array_equal(nearest_upsample_conv(adapted, x), want)  # its adapter kept, in its own dtype
    for conv in (Conv2d(2, 3, 1, key=jax.random.key(0)), Conv2d(2, 3, stride=2, key=jax.random.key(0))):
        with pytest.raises(ValueError, match="a 3×3 conv of stride 1 and padding 1"):
            nearest_upsample_conv(conv, x)
