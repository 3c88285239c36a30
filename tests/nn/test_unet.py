"""UNet: shapes, trace-time shape/dtype checks, FlaxDiff parameter count, remat, training."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jaxtyping import TypeCheckError

from eqxdiff.nn import ResBlock, UNet


def tiny(**kw):
    cfg = dict(channels=(8, 16), num_res_blocks=1, emb_features=16, norm_groups=4, key=jax.random.key(0))
    return UNet(3, **(cfg | kw))


def perturbed(model, scale=0.1):
    """Move every parameter off its (partly zero) init so gradients reach every layer."""
    params, static = eqx.partition(model, eqx.is_inexact_array)
    rng = np.random.default_rng(42)  # numpy: eager jax.random would compile per shape
    # The sum in numpy too: an eager jnp add (or jnp.asarray) compiles one program per shape.
    params = jax.tree.map(
        lambda p: jax.device_put(np.asarray(p) + scale * rng.normal(size=p.shape).astype(p.dtype)), params
    )
    return eqx.combine(params, static)


def count(model):
    return sum(x.size for x in jax.tree.leaves(model) if isinstance(x, jax.ShapeDtypeStruct | jax.Array))


call = eqx.filter_jit(lambda m, x, t, cond=None, key=None: m(x, t, cond, key=key))
# Test data from numpy: eager jax.random on 4-D shapes compiles slowly on CPU.
RNG = np.random.default_rng(0)
X = jnp.asarray(RNG.normal(size=(2, 8, 8, 3)), jnp.float32)
T = jnp.array([3.0, 700.0])


def test_shapes_labels_attention_and_null_cond():
    model = perturbed(tiny(num_classes=5, attention_levels=(1,), num_middle_res_blocks=0))
    np.testing.assert_array_equal(model.null_cond(3), [5, 5, 5])
    assert eqx.filter_eval_shape(tiny).null_cond(3) is None  # unconditional: no null condition (no weights needed)
    with_labels = call(model, X, T, jnp.array([0, 4]))
    without = call(model, X, T)
    assert with_labels.shape == without.shape == X.shape
    # int32 like the labels above (jnp.full alone is weakly typed): the same compiled call.
    np.testing.assert_allclose(without, call(model, X, T, jnp.full((2,), 5, jnp.int32)), rtol=1e-6, atol=1e-6)
    assert not np.allclose(with_labels, without)


def test_bf16_model_runs_in_bf16():
    model = perturbed(tiny(channels=(8,), attention_levels=(0,)))
    # Cast in numpy: an eager astype compiles one program per parameter shape.
    to_bf16 = lambda a: jax.device_put(np.asarray(a).astype(jnp.bfloat16)) if eqx.is_inexact_array(a) else a  # noqa: E731
    model = jax.tree.map(to_bf16, model)
    y = call(model, X.astype(jnp.bfloat16), T)
    assert y.dtype == jnp.bfloat16 and bool(jnp.isfinite(y).all())


def test_wrong_rank_dtype_or_config_raises_at_trace_time():
    model = tiny()
    with pytest.raises(TypeCheckError):
        call(model, X[0], T)  # [h w c]
    with pytest.raises(TypeCheckError):
        call(model, X.astype(jnp.int32), T)
    with pytest.raises(TypeCheckError):
        call(model, X, T[:1])  # batch mismatch
    with pytest.raises(ValueError, match="channels|divisible"):
        call(model, X[..., :1], T)
    with pytest.raises(ValueError, match="unconditional"):
        call(model, X, T, jnp.array([0, 1]))


def test_flaxdiff_simple_parameter_count():
    # FlaxDiff 0.2.x simple_unet.Unet(emb 128, depths (32, 64, 128), 2 res blocks, 1 middle).
    for channels, want in [(3, 2_141_379), (1, 2_140_225)]:
        model = eqx.filter_eval_shape(UNet.flaxdiff_simple, channels, key=jax.random.key(0))
        assert count(model) == want


def _loss(model, x, t, target):
    return jnp.mean((model(x, t) - target) ** 2)


@pytest.mark.slow
def test_remat_gives_identical_gradients_and_adam_step_reduces_loss():
    # One level, no middle blocks: the two gradient compiles dominate this file's run time.
    plain = perturbed(tiny(channels=(8,), num_middle_res_blocks=0))
    remat = perturbed(tiny(channels=(8,), num_middle_res_blocks=0, remat=True))
    target = jnp.asarray(RNG.normal(size=X.shape), jnp.float32)
    value_and_grad = eqx.filter_jit(eqx.filter_value_and_grad(_loss))
    loss0, grads = value_and_grad(plain, X, T, target)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(value_and_grad(remat, X, T, target)[1])):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)

    opt = optax.adam(1e-3)

    @eqx.filter_jit  # one program: op by op, init and apply would compile one per parameter shape
    def adam_step(model, grads):
        params = eqx.filter(model, eqx.is_inexact_array)
        updates, _ = opt.update(grads, opt.init(params), params)
        return eqx.apply_updates(model, updates)

    loss1, _ = value_and_grad(adam_step(plain, grads), X, T, target)
    assert float(loss1) < float(loss0)


def test_dropout_only_with_key():
    block = perturbed(ResBlock(8, 8, 16, 4, 0.5, False, key=jax.random.key(0)))
    no_dropout = ResBlock(8, 8, 16, 4, 0.0, False, key=jax.random.key(0))
    reference = jax.tree.unflatten(jax.tree.structure(no_dropout), jax.tree.leaves(block))  # same params
    x, emb = X[..., :1].repeat(8, axis=-1), jnp.ones((2, 16))
    run = eqx.filter_jit(lambda blk, key=None: blk(x, emb, key=key))
    np.testing.assert_allclose(run(block), run(reference), rtol=1e-6, atol=1e-6)
    a, b = run(block, jax.random.key(1)), run(block, jax.random.key(2))
    assert not np.allclose(a, run(reference)) and not np.allclose(a, b)
