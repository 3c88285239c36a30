"""DiT: adaLN-Zero init, shapes, size errors, training, published parameter counts."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jaxtyping import TypeCheckError

from eqxdiff.nn import DiT


def perturbed(model, scale):
    """Move every parameter off its (partly zero) init so every layer affects the output."""
    params, static = eqx.partition(model, eqx.is_inexact_array)
    rng = np.random.default_rng(42)  # numpy: eager jax.random would compile per shape
    # The sum in numpy too: an eager jnp add (or jnp.asarray) compiles one program per shape.
    params = jax.tree.map(
        lambda p: jax.device_put(np.asarray(p) + scale * rng.normal(size=p.shape).astype(p.dtype)), params
    )
    return eqx.combine(params, static)


def count(model):
    return sum(x.size for x in jax.tree.leaves(model) if isinstance(x, jax.ShapeDtypeStruct | jax.Array))


# Test data from numpy: eager jax.random on 4-D shapes compiles slowly on CPU.
RNG = np.random.default_rng(0)
X = jnp.asarray(RNG.normal(size=(2, 8, 8, 3)), jnp.float32)
T = jnp.array([0.5, -1.2])
LABELS = jnp.array([3, 7])
call = eqx.filter_jit(lambda m, x, t, labels=None: m(x, t, labels))


def tiny(**kw):
    return DiT(8, 2, 3, 32, 1, 4, num_classes=10, key=jax.random.key(0), **kw)  # depth 1: fast compiles


def test_output_exactly_zero_at_init_and_shape():
    y = call(tiny(), X, T, LABELS)
    assert y.shape == X.shape
    assert bool((y == 0).all())


def test_null_cond_and_labels_change_output():
    model = perturbed(tiny(), 0.05)
    np.testing.assert_array_equal(model.null_cond(2), [10, 10])  # label num_classes: the table's last row
    assert eqx.filter_eval_shape(DiT, 8, 2, 3, 32, 1, 4, key=jax.random.key(0)).null_cond(2) is None  # unconditional
    # int32 like LABELS (jnp.full alone is weakly typed): the labelled call's compiled program.
    np.testing.assert_allclose(
        call(model, X, T), call(model, X, T, jnp.full((2,), 10, jnp.int32)), rtol=1e-6, atol=1e-6
    )
    assert not np.allclose(call(model, X, T), call(model, X, T, LABELS))


def test_wrong_sizes_raise():
    with pytest.raises(ValueError, match="divisible"):
        DiT(9, 2, 3, 32, 1, 4, key=jax.random.key(0))
    model = tiny()
    with pytest.raises(ValueError, match="built for"):
        call(model, jnp.zeros((2, 16, 16, 3)), T)
    with pytest.raises(TypeCheckError):
        call(model, X[0], T)


def test_tokens_after_a_block_are_a_manual_forwards():
    """REPA's `tokens_after=k`: the tokens after block k of a forward written out here (patchify as a reshape and a
    matmul, MAE's positions, t + label embedding, the blocks by hand); the output as without the option."""
    from eqxdiff.nn.layers import sincos_pos_embed_2d

    model = perturbed(DiT(8, 2, 3, 32, 2, 4, num_classes=10, key=jax.random.key(0)), 0.05)
    out, tokens = eqx.filter_jit(lambda m, x, t, y: m(x, t, y, tokens_after=1))(model, X, T, LABELS)
    np.testing.assert_array_equal(out, call(model, X, T, LABELS))
    patches = np.asarray(X).reshape(2, 4, 2, 4, 2, 3).transpose(0, 1, 3, 2, 4, 5).reshape(2, 16, 12)
    w = np.asarray(model.patch_embed.weight).reshape(12, 32)  # HWIO: (pi, pj, c) rows as the patches
    x = patches @ w + np.asarray(model.patch_embed.bias) + sincos_pos_embed_2d(32, 4)
    c = model.time_embed(T) + model.label_embed(LABELS)
    manual = model.blocks[0](jnp.asarray(x, jnp.float32), c)
    assert tokens.shape == (2, 16, 32)
    np.testing.assert_allclose(tokens, manual, rtol=1e-4, atol=1e-5)
    assert not np.allclose(tokens, model.blocks[1](manual, c), atol=1e-3)  # block 2's differ: k counts from 1
    with pytest.raises(ValueError, match=r"tokens_after=3, a block in 1..2"):
        model(X, T, LABELS, tokens_after=3)


@pytest.mark.slow
def test_gradient_steps_reduce_loss_and_remat_matches():
    model, target = tiny(), jnp.asarray(RNG.normal(size=X.shape), jnp.float32)
    opt = optax.adam(1e-2)

    @eqx.filter_jit
    def step(model, state):
        loss, grads = eqx.filter_value_and_grad(lambda m: jnp.mean((m(X, T, LABELS) - target) ** 2))(model)
        updates, state = opt.update(grads, state, eqx.filter(model, eqx.is_inexact_array))
        return eqx.apply_updates(model, updates), state, loss, grads

    state = opt.init(eqx.filter(model, eqx.is_inexact_array))
    losses = []
    for _ in range(5):  # the first step only reaches the zero-initialised final layer
        model, state, loss, _ = step(model, state)
        losses.append(float(loss))
    assert losses[-1] < losses[0]

    # The same (trained) parameters in the remat=True structure give the same gradients.
    remat = jax.tree.unflatten(jax.tree.structure(tiny(remat=True)), jax.tree.leaves(model))
    grads = [step(m, opt.init(eqx.filter(m, eqx.is_inexact_array)))[3] for m in (model, remat)]
    for a, b in zip(*map(jax.tree.leaves, grads)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_each_output_pixel_comes_from_its_own_patch_and_slot():
    # A DiT wired as an exact autoencoder, so out == x pins unpatchify: pixel (i, j, c) must come
    # from token (i//p, j//p), element ((i%p)·p + j%p)·C + c of the final linear's output.
    # patch_embed copies a patch's p·p·C pixels (that element order) into features [0, 12), their
    # negatives into [12, 24), scaled by S ≫ the sin-cos positions, so the token's LayerNorm is
    # [z, -z, 0]/(|z|/4) for patch pixels z; the blocks and final adaLN are the identity at init;
    # final_linear multiplies features [0, 12) by |z|/4. Every patch has the same |z| (rotations
    # of one vector) while all 192 pixel values differ, so a misplaced patch or slot shows.
    p, g, C, hidden, S = 2, 4, 3, 32, 1e5
    n = p * p * C
    model = tiny()  # num_classes=10; called unconditionally below
    rng = np.random.default_rng(7)
    base = rng.normal(size=n)
    patches = np.stack([np.linalg.qr(rng.normal(size=(n, n)))[0] @ base for _ in range(g * g)])  # [token, element]
    x = np.zeros((1, g * p, g * p, C), np.float32)
    for i, j, c in np.ndindex(g * p, g * p, C):
        token, element = (i // p) * g + (j // p), ((i % p) * p + j % p) * C + c
        x[0, i, j, c] = patches[token, element]
    assert len(np.unique(x)) == x.size

    kernel = np.zeros((p, p, C, hidden), np.float32)  # HWIO: one tap per (pi, pj, c)
    for pi, pj, c in np.ndindex(p, p, C):
        kernel[pi, pj, c, (pi * p + pj) * C + c] = S
        kernel[pi, pj, c, n + (pi * p + pj) * C + c] = -S
    readout = np.zeros((hidden, n), np.float32)
    readout[np.arange(n), np.arange(n)] = np.linalg.norm(base) / np.sqrt(hidden / 2)
    model = eqx.tree_at(
        lambda m: (m.patch_embed.weight, m.patch_embed.bias, m.final_linear.weight, m.final_linear.bias),
        model,
        (jnp.asarray(kernel), jnp.zeros(hidden), jnp.asarray(readout), jnp.zeros(n)),
    )
    y = call(model, jnp.asarray(x), jnp.zeros(1))
    np.testing.assert_allclose(np.asarray(y), x, rtol=0, atol=1e-3)


def test_bf16_model_runs_in_bf16():
    # Cast in numpy: an eager astype compiles one program per parameter shape.
    to_bf16 = lambda a: jax.device_put(np.asarray(a).astype(jnp.bfloat16)) if eqx.is_inexact_array(a) else a  # noqa: E731
    model = jax.tree.map(to_bf16, perturbed(tiny(), 0.05))
    y = call(model, X.astype(jnp.bfloat16), T, LABELS)
    assert y.dtype == jnp.bfloat16 and bool(jnp.isfinite(y).all())


@pytest.mark.parametrize("make, published", [(DiT.small, 33.0e6), (DiT.base, 130.5e6)])
def test_published_parameter_counts(make, published):
    # Peebles & Xie Table 1 (S/2 33.0M, B/2 130.5M; theirs also learns sigma and stores pos-embed).
    model = eqx.filter_eval_shape(make, 32, 4, 2, num_classes=1000, key=jax.random.key(0))
    assert abs(count(model) / published - 1) < 0.01
