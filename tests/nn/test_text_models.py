"""Text conditioning: CrossAttention against a numpy reference, text UNet/DiT (zero-init text
path, padding masked out, errors: a dict or a wrong TextCond is refused), gradients through remat,
guidance over a TextCond, and what TextConditioned hands its network."""

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eqxdiff.diffusion import ClassifierFreeGuidance
from eqxdiff.nn import CLIPTextModel, DiT, TextCond, TextConditioned, UNet
from eqxdiff.nn.layers import CrossAttention, sincos_pos_embed_2d
from eqxdiff.nn.remat import checkpointed

B, N, CTX, POOLED = 2, 5, 12, 6
KEY = jax.random.key(0)
# Test data from numpy: eager jax.random on 3-/4-D shapes compiles slowly on CPU.
RNG = np.random.default_rng(0)
X = jnp.asarray(RNG.normal(size=(B, 8, 8, 1)), jnp.float32)
T = jnp.array([0.3, 2.0])


def text_cond(seed, mask=((1, 1, 1, 0, 0), (1, 1, 1, 1, 1))):
    rng = np.random.default_rng(seed)
    return TextCond(
        context=jnp.asarray(rng.normal(size=(B, N, CTX)), jnp.float32),
        mask=jnp.asarray(mask, jnp.int32),
        pooled=jnp.asarray(rng.normal(size=(B, POOLED)), jnp.float32),
    )


def perturbed(model, scale):
    """Move every parameter off its (partly zero) init so every layer affects the output."""
    params, static = eqx.partition(model, eqx.is_inexact_array)
    rng = np.random.default_rng(42)  # numpy: eager jax.random would compile per shape
    # Sums and the cast in numpy too: an eager jnp add or astype compiles once per parameter shape.
    moved = lambda p: jnp.asarray((np.asarray(p) + scale * rng.normal(size=p.shape)).astype(p.dtype))  # noqa: E731
    params = jax.tree.map(moved, params)
    return eqx.combine(params, static)


def with_cond_at(cond, name, index, value):
    return dataclasses.replace(cond, **{name: getattr(cond, name).at[index].set(value)})


def bypassing_init(cond, name, value):
    """`cond` with field `name` set to `value` without TextCond's constructor, whose annotations the
    tests' jaxtyping hook checks (a run without the hook reaches the model's own check)."""
    return eqx.tree_at(lambda c: getattr(c, name), cond, value, is_leaf=lambda x: x is None)


# One text UNet (an attention block on the way down and up, no middle; remat, so the text also
# travels through `checkpointed`) and one text DiT (depth 1), each compiled once for [2, 8, 8, 1]
# and reused by every test below.
UNET = UNet(
    1, (16,), 1, (0,), 0, 16, norm_groups=4, num_heads=2, remat=True, context_dim=CTX, pooled_dim=POOLED, key=KEY
)
DIT = DiT(8, 2, 1, 32, 1, 4, context_dim=CTX, pooled_dim=POOLED, key=KEY)
call = eqx.filter_jit(lambda m, x, t, cond: m(x, t, cond))
# Any layer or tower called as one program: called eagerly, each of its ops compiles on its own.
jitted = eqx.filter_jit(lambda f, *args, **kwargs: f(*args, **kwargs))


def unet_text_projections(m):
    """The zero-initialised layers through which the text enters the UNet."""
    return m.down_attn[0].cross.proj, m.up_attn[0].cross.proj, m.pooled_embed


def dit_text_projections(m):
    """The zero-initialised layers through which the text enters the DiT."""
    return *(block.cross.proj for block in m.blocks), m.pooled_embed


def test_cross_attention_matches_numpy_reference_and_ignores_padding():
    dim, heads, dh = 8, 2, 4
    attn = perturbed(CrossAttention(dim, CTX, heads, key=KEY), 0.1)  # non-zero biases too
    rng = np.random.default_rng(1)
    x, ctx = rng.normal(size=(3, 4, dim)), rng.normal(size=(3, N, CTX))
    mask = np.array([[1, 1, 0, 1, 0], [1, 1, 1, 1, 1], [0, 0, 0, 0, 0]], np.int32)
    as_f32 = lambda a: jnp.asarray(a, jnp.float32)  # noqa: E731
    got = eqx.filter_jit(lambda a, *args: a(*args))(attn, as_f32(x), as_f32(ctx), jnp.asarray(mask))

    w = jax.tree.map(lambda a: np.asarray(a, np.float64), attn)
    q = (x @ w.q.weight + w.q.bias).reshape(3, 4, heads, dh)
    kv = ctx @ w.kv.weight + w.kv.bias
    k, v = kv[..., :dim].reshape(3, N, heads, dh), kv[..., dim:].reshape(3, N, heads, dh)
    want = np.zeros((3, 4, heads, dh))
    for i in range(2):  # row 2 has no token: it attends to nothing and reads zero
        keep = mask[i] == 1
        for h in range(heads):
            logits = q[i, :, h] @ k[i, keep, h].T / np.sqrt(dh)
            p = np.exp(logits - logits.max(-1, keepdims=True))
            want[i, :, h] = (p / p.sum(-1, keepdims=True)) @ v[i, keep, h]
    want = want.reshape(3, 4, dim) @ w.proj.weight + w.proj.bias
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "model, projections", [(UNET, unet_text_projections), (DIT, dit_text_projections)], ids=["unet", "dit"]
)
def test_text_model_reads_the_text_only_through_its_zero_initialised_projections(model, projections):
    # Every other layer perturbed (so the output is not trivially zero: the DiT's final layer is
    # zero at init too), the text projections as initialised: two very different conditions give
    # the same output, bit for bit.
    init = projections(model)
    model = perturbed(model, 0.1)
    assert all(not np.any(leaf) for leaf in jax.tree.leaves(init))
    at_init = eqx.tree_at(projections, model, init)
    a, b = text_cond(1), text_cond(2, mask=((1, 0, 0, 0, 0), (1, 1, 0, 0, 0)))
    y = call(at_init, X, T, a)
    assert float(jnp.abs(y).max()) > 1e-2
    np.testing.assert_array_equal(y, call(at_init, X, T, b))
    # With the projections perturbed too, the text matters; through the context and the pooled vector each.
    y = call(model, X, T, a)
    assert not np.allclose(y, call(model, X, T, b), atol=1e-4)
    assert not np.allclose(y, call(model, X, T, dataclasses.replace(a, pooled=b.pooled)), atol=1e-4)
    assert not np.allclose(y, call(model, X, T, dataclasses.replace(a, context=b.context)), atol=1e-4)


@pytest.mark.parametrize("model", [UNET, DIT], ids=["unet", "dit"])
def test_padded_tokens_have_no_effect_unpadded_ones_do(model):
    model, cond = perturbed(model, 0.1), text_cond(3)
    y = call(model, X, T, cond)
    padded = with_cond_at(cond, "context", (0, slice(3, None)), 100.0)  # example 0's tokens 3, 4 are padding
    np.testing.assert_allclose(call(model, X, T, padded), y, rtol=0, atol=1e-6)
    token = with_cond_at(cond, "context", (0, 2), 1.0)
    changed = np.asarray(call(model, X, T, token))
    assert not np.allclose(changed[0], y[0], atol=1e-4)
    np.testing.assert_allclose(changed[1], y[1], rtol=0, atol=1e-6)  # examples do not mix


def test_dit_output_exactly_zero_at_init():
    assert bool((call(DIT, X, T, text_cond(4)) == 0).all())


@pytest.mark.parametrize("make", [UNet, DiT], ids=["unet", "dit"])
def test_wrong_text_conditions_raise(make):
    model = UNET if make is UNet else DIT
    cond = text_cond(5)
    with pytest.raises(ValueError, match="null condition"):
        call(model, X, T, None)
    # The dict-era condition, with every key it had: refused by type, naming TextCond.
    with pytest.raises(
        ValueError,
        match=r"takes cond = TextCond\(context, mask, pooled\).*got a dict with keys "
        r"\['context', 'mask', 'pooled'\]",
    ):
        call(model, X, T, {"context": cond.context, "mask": cond.mask, "pooled": cond.pooled})
    with pytest.raises(ValueError, match=r"takes cond = TextCond.*got an array int32\[2\] \(labels\?\)"):
        call(model, X, T, jnp.array([0, 1]))  # labels
    with pytest.raises(ValueError, match=r"no pooled vector; the model takes TextCond\(context, mask, pooled\)"):
        call(model, X, T, TextCond(cond.context, cond.mask))
    with pytest.raises(ValueError, match=r"context.*\[2, n, 12\]"):
        call(model, X, T, dataclasses.replace(cond, context=cond.context[..., :4]))
    with pytest.raises(ValueError, match=r"cond.pooled must be \[2, 6\]"):
        call(model, X, T, bypassing_init(cond, "pooled", cond.pooled[:1]))
    with pytest.raises(ValueError, match="mask must be int32"):
        call(model, X, T, bypassing_init(cond, "mask", cond.mask.astype(jnp.float32)))
    assert model.null_cond(B) is None  # the run's encoder makes the null text, not the model
    args = (1, (16,), 1, (0,)) if make is UNet else (8, 2, 1, 32, 1, 4)
    with pytest.raises(ValueError, match="one kind of condition"):
        make(*args, num_classes=3, context_dim=CTX, key=KEY)
    with pytest.raises(ValueError, match="context_dim > 0"):
        make(*args, pooled_dim=POOLED, key=KEY)
    name = make.__name__  # a label model refuses a text condition (traced only: the error comes first)
    with pytest.raises(ValueError, match=rf"A label {name} \(num_classes > 0\) takes int32\[b\] labels, got TextCond"):
        eqx.filter_eval_shape(make(*args, num_classes=3, key=KEY), X, T, cond)


def test_text_unet_without_attention_level_raises():
    with pytest.raises(ValueError, match="attention_levels"):
        UNet(1, (16,), 1, (), context_dim=CTX, key=KEY)


def test_a_cross_attention_only_level_has_no_self_attention():
    """`cross_attention_levels` beyond `attention_levels`: those blocks read the text without attending
    among pixels (x + CrossAttn(LN(x) + pos, context)); the other levels keep both."""
    unet = UNet(
        1, (8, 16), 1, (1,), context_dim=CTX, cross_attention_levels=(0, 1), norm_groups=4, num_heads=2, key=KEY
    )
    level0, level1 = unet.down_attn
    assert level0.attn is None and level0.norm is None and level0.cross is not None
    assert level1.attn is not None and level1.cross is not None and unet.middle_blocks[0][1].attn is not None
    block, cond = perturbed(level0, 0.1), text_cond(8)
    x = jnp.asarray(RNG.normal(size=(B, 4, 2, 8)), jnp.float32)
    tokens = np.asarray(x).reshape(B, 8, 8)  # the reference's LayerNorm in numpy, the cross-attention as called alone
    normed = (tokens - tokens.mean(-1, keepdims=True)) / np.sqrt(tokens.var(-1, keepdims=True) + 1e-6)
    queries = (normed + sincos_pos_embed_2d(8, 4, 2)).astype(np.float32)
    expected = tokens + np.asarray(jitted(block.cross, queries, cond.context, cond.mask))
    got = np.asarray(jitted(block, x, np.zeros((B, 16), np.float32), context=cond.context, mask=cond.mask))
    np.testing.assert_allclose(got.reshape(B, 8, 8), expected, rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="needs a text context"):
        UNet(1, (8, 16), 1, (1,), cross_attention_levels=(0, 1), key=KEY)
    with pytest.raises(ValueError, match=r"cross_attention_levels \(2,\) must index"):
        UNet(1, (8, 16), 1, (1,), context_dim=CTX, cross_attention_levels=(2,), key=KEY)


def test_gradients_reach_cross_attention_through_remat_but_not_padding():
    attn, mask = perturbed(DIT.blocks[0].cross, 0.1), text_cond(6).mask  # the layer alone: a cheap compile
    x, context = (jnp.asarray(RNG.normal(size=(B, n, 32)), jnp.float32) for n in (4, N))  # DiT width 32

    @eqx.filter_jit
    @eqx.filter_grad
    def grads(attn_and_context):
        layer, context = attn_and_context
        return jnp.sum(checkpointed(layer, True)(x, context=context, mask=mask) ** 2)

    g_attn, g_context = grads((attn, context))
    for g in (g_attn.q.weight, g_attn.kv.weight, g_attn.proj.weight):
        assert float(jnp.abs(g).max()) > 0
    g_context = np.asarray(g_context)
    assert np.abs(g_context[0, :3]).min() > 0 and np.abs(g_context[1]).min() > 0
    np.testing.assert_array_equal(g_context[0, 3:], 0)  # example 0's tokens 3, 4 are padding


def test_guidance_over_a_text_condition_with_a_one_row_null():
    # b = 1 sample: the guided call's concatenated batch is [2, ...], the shape compiled above.
    model, cond = perturbed(UNET, 0.1), jax.tree.map(lambda a: a[:1], text_cond(7))
    # A null condition as a run might build it: one row, zeros with a single unmasked token.
    null = TextCond(jnp.zeros((1, N, CTX)), jnp.asarray([[1, 0, 0, 0, 0]]), jnp.zeros((1, POOLED)))
    denoiser = lambda x, sigma, c: call(model, x, jnp.full((x.shape[0],), sigma), c)  # noqa: E731
    x, sigma, w = X[:1], jnp.float32(2.0), 3.0
    guided = ClassifierFreeGuidance(denoiser, cond, w, null)(x, sigma)
    twice = lambda c: jax.tree.map(lambda a: jnp.concatenate([a, a]), c)  # noqa: E731
    d_cond = denoiser(twice(x), sigma, twice(cond))[:1]
    d_null = denoiser(twice(x), sigma, twice(null))[:1]
    assert not np.allclose(d_cond, d_null, atol=1e-4)
    np.testing.assert_allclose(guided, d_null + w * (d_cond - d_null), rtol=1e-5, atol=1e-5)


def test_text_conditioned_hands_the_net_the_tower_states_and_the_pooled_vector_only_if_asked():
    """TextConditioned(pooled=False) passes `net` TextCond(hidden states, mask) and no pooled vector
    (captioned_digits' scratch wiring: a net built with pooled_dim=0); with the default (pooled) that
    same net refuses the pooled vector."""
    config = dict(
        vocab_size=20,
        hidden_size=CTX,
        intermediate_size=24,
        num_hidden_layers=1,
        num_attention_heads=2,
        max_position_embeddings=N,
        hidden_act="gelu",
        eos_token_id=2,
    )
    tower = CLIPTextModel.from_config(config, key=jax.random.key(1))
    net = perturbed(UNet(1, (16,), 1, (0,), 0, 16, norm_groups=4, num_heads=2, context_dim=CTX, key=KEY), 0.1)
    ids = np.asarray([[0, 5, 7, 2, 1], [0, 9, 2, 1, 1]], np.int32)
    mask = np.asarray([[1, 1, 1, 1, 0], [1, 1, 1, 0, 0]], np.int32)
    tokens = {"input_ids": ids, "attention_mask": mask}
    hidden, _ = jitted(tower, ids, mask)
    model = TextConditioned(tower, net, (0, 2), (1, 1), pooled=False)
    y = call(model, X, T, tokens)
    np.testing.assert_allclose(y, call(net, X, T, TextCond(hidden, mask)), rtol=1e-5, atol=1e-6)
    other_ids = ids.copy()
    other_ids[0, 1] = 6
    other = call(model, X, T, tokens | {"input_ids": other_ids})
    assert not np.allclose(np.asarray(other)[0], np.asarray(y)[0], atol=1e-4)  # the tokens reach the net
    with pytest.raises(ValueError, match=r"has a pooled vector; the model takes TextCond\(context, mask, pooled=None"):
        call(TextConditioned(tower, net, (0, 2), (1, 1)), X, T, tokens)
