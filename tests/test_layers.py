"""NHWC layers against independent references (Equinox's CHW conv, numpy formulas)."""

import functools
import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eqxdiff.nn import Conv2d, GroupNorm, SelfAttention, sincos_pos_embed_2d, timestep_embedding
from eqxdiff.nn.conv import conv2d
from eqxdiff.nn.layers import _flat


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


# (cin, cout, kernel, stride, padding): both branches of the matmul weight gradient (shift dy
# when cout < cin and stride 1, else shift x), strides, no padding, DiT's patch embedding.
@pytest.mark.parametrize(
    "cin, cout, kernel, stride, padding",
    [(6, 4, 3, 1, 1), (4, 6, 3, 1, 1), (6, 4, 3, 2, 1), (5, 3, 3, 1, 0), (4, 4, 1, 1, 0), (3, 8, 2, 2, 0), (4, 2, 5, 1, 2)],
)
def test_conv2d_gradients_match_xla_autodiff(cin, cout, kernel, stride, padding):
    # eqxdiff.nn.conv computes the weight gradient as matmuls on CPU; XLA's own conv transpose
    # (autodiff of lax.conv_general_dilated) is the independent reference.
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(2, 9, 9, cin)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(kernel, kernel, cin, cout)), jnp.float32)

    def plain(x, w, s, p):
        return jax.lax.conv_general_dilated(x, w, (s, s), [(p, p)] * 2, dimension_numbers=("NHWC", "HWIO", "NHWC"))

    def loss(conv, x, w):
        return jnp.sum(jnp.sin(conv(x, w, stride, padding)))

    assert jax.default_backend() == "cpu"  # the custom rule is the one under test
    got = jax.grad(functools.partial(loss, conv2d), (0, 1))(x, w)
    want = jax.grad(functools.partial(loss, plain), (0, 1))(x, w)
    for g, r in zip(got, want):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-4)
    # bf16 in, bf16 gradients out (accumulated in float32).
    gx, gw = jax.grad(functools.partial(loss, conv2d), (0, 1))(x.astype(jnp.bfloat16), w.astype(jnp.bfloat16))
    assert gx.dtype == gw.dtype == jnp.bfloat16
    np.testing.assert_allclose(gw.astype(jnp.float32), want[1], rtol=0.05, atol=0.05 * float(jnp.abs(want[1]).max()))


def test_init_draws_do_not_depend_on_the_padded_length():
    # Parameters are cut from flat draws padded to a few lengths (eqxdiff.nn.layers._draw);
    # changing the padding scheme must not change any model's initial values.
    key = jax.random.key(7)
    short, long = (np.asarray(_flat(key, n, jnp.bool_(True), jnp.float32(1.0))) for n in (256, 4096))
    np.testing.assert_array_equal(short, long[:256])


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
