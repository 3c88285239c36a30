"""eqxdiff.xla_cpu: the library is plain JAX with the workarounds off (jvp works), and switching
them on changes no value: conv, remat and bias gradients match plain autodiff, init draws are bitwise
jax.random's. Every one is on here (`every_switch_on`), the shipped ones and the named ones."""

import functools
import os

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from eqxdiff import xla_cpu
from eqxdiff.nn import DiT, UNet, bias
from eqxdiff.nn.conv import conv2d
from eqxdiff.nn.layers import Conv2d, Dense, GroupNorm
from eqxdiff.nn.remat import checkpointed
from eqxdiff.sharding import make_mesh
from eqxdiff.training.step import TrainStep

assert jax.default_backend() == "cpu"  # the workarounds under test apply on CPU only


@pytest.fixture(autouse=True)
def every_switch_on():
    """Each workaround on, shipped or not (conftest switches on the shipped set, as the scripts do): each must
    change no value."""
    with xla_cpu.only(xla_cpu.SWITCHES):
        yield


# Initialising with the switch off compiles one jax.random draw per parameter shape (a 4-D one
# takes seconds), so the models repeat shapes: both take 8 input channels, the UNet's width and
# embedding size (conv_in and conv_out have the ResBlock convs' kernel shape, the time embedding
# the block projections' one); the DiT's final linear is then hidden × hidden, and its MLP
# (ratio 2) has the final adaLN's shape.


def one_level_unet(key, remat=False, scale_shift=False):
    # Every block kind the switch reaches (convs, ResBlocks with and without a 1x1 skip under
    # remat) in fewer programs to compile; a second level adds only more of the same Conv2d.
    sizes = dict(num_middle_res_blocks=0, emb_features=8, norm_groups=4)
    return UNet(8, (8,), 1, **sizes, scale_shift=scale_shift, remat=remat, key=key)


def tiny_dit(key, remat=False):
    return DiT(8, 2, 8, 32, 1, 4, mlp_ratio=2.0, remat=remat, key=key)


def perturbed(model, scale=0.1):
    """Every parameter moved off its (partly zero) init, so outputs and gradients are not 0."""
    params, static = eqx.partition(model, eqx.is_inexact_array)
    rng = np.random.default_rng(42)
    # numpy, not eager jnp: an eager add compiles one program per parameter shape.
    params = jax.tree.map(
        lambda p: jnp.asarray(np.asarray(p) + (scale * rng.normal(size=p.shape)).astype(p.dtype)), params
    )
    return eqx.combine(params, static)


X = jnp.asarray(np.random.default_rng(0).normal(size=(2, 8, 8, 8)), jnp.float32)
T = jnp.array([0.3, 2.0])


def unet_gradient(model):
    """The gradient of mean((model(X, T) - X)²) by every parameter, one program traced afresh (a switch is read when
    the program traces)."""
    return eqx.filter_jit(eqx.filter_grad(lambda m: jnp.mean(jnp.square(m(X, T) - X))))(model)


@pytest.fixture(scope="module")
def plain_unet_gradient():
    """scale_shift -> the perturbed one-level UNet's gradient with every workaround off (plain lax convs, plain
    autodiff, no remat): the reference of the remat and the channel-sum tests, each compiled once for the module."""

    @functools.cache
    def gradient(scale_shift: bool):
        model = perturbed(one_level_unet(jax.random.key(0), scale_shift=scale_shift))
        with xla_cpu.disabled():
            return unet_gradient(model)

    return gradient


def uses_custom_vjp(f, *args) -> bool:
    # A fresh function each time: make_jaxpr caches traces by function, and the switch is read
    # only when tracing.
    return "custom_vjp_call" in str(jax.make_jaxpr(lambda *a: f(*a))(*args))


def test_switch_is_on_in_tests_and_disabled_restores_it():
    assert xla_cpu.enabled()  # conftest.py
    xla_cpu.enable()  # idempotent
    with pytest.raises(RuntimeError), xla_cpu.disabled():
        assert not xla_cpu.enabled() and not xla_cpu.on_cpu()
        raise RuntimeError
    assert xla_cpu.enabled() and xla_cpu.on_cpu()


@pytest.mark.parametrize("make", [one_level_unet, tiny_dit], ids=["unet", "dit"])
def test_jvp_through_models_works_only_with_the_workarounds_off(make):
    model = perturbed(make(jax.random.key(0), remat=True))
    tangent = jnp.asarray(np.random.default_rng(1).normal(size=X.shape), jnp.float32)

    def jvp(x, v):
        return jax.jvp(lambda x: model(x, T), (x,), (v,))

    with xla_cpu.disabled():
        out, dout = eqx.filter_jit(jvp)(X, tangent)
        # Central difference along the tangent, an independent check of forward-mode autodiff.
        f, eps = jax.jit(lambda x: model(x, T)), 1e-2
        fd = (f(X + eps * tangent) - f(X - eps * tangent)) / (2 * eps)
        np.testing.assert_allclose(out, f(X), rtol=1e-5, atol=1e-5)
    assert float(jnp.abs(dout).max()) > 1e-3
    np.testing.assert_allclose(dout, fd, rtol=2e-2, atol=2e-2 * float(jnp.abs(fd).max()))
    # Why the switch is off by default: its custom_vjp rules have no forward mode.
    with pytest.raises(TypeError, match="custom_vjp"):
        jax.jvp(lambda x: model(x, T), (X,), (tangent,))


# (cin, cout, kernel, stride, padding): both branches of the matmul weight gradient (shift dy
# when cout < cin and stride 1, else shift x), strides, no padding, DiT's patch embedding. More
# shift-dy cases (no padding, 1x1, a 5x5 kernel) in the slow tier: each is seconds of compiling.
@pytest.mark.parametrize(
    "cin, cout, kernel, stride, padding",
    [
        (6, 4, 3, 1, 1),
        (4, 6, 3, 1, 1),
        (6, 4, 3, 2, 1),
        (3, 8, 2, 2, 0),
        *(pytest.param(*case, marks=pytest.mark.slow) for case in [(5, 3, 3, 1, 0), (4, 4, 1, 1, 0), (4, 2, 5, 1, 2)]),
    ],
)
def test_conv_matmul_weight_gradient_matches_xla_autodiff(cin, cout, kernel, stride, padding):
    # XLA's own conv transpose (autodiff of lax.conv_general_dilated) is the independent reference.
    rng = np.random.default_rng(0)  # cast in numpy: an eager astype compiles a program of its own
    x_np = rng.normal(size=(2, 9, 9, cin)).astype(np.float32)
    w_np = rng.normal(size=(kernel, kernel, cin, cout)).astype(np.float32)
    x, w = jnp.asarray(x_np), jnp.asarray(w_np)

    def plain(x, w, s, p):
        return jax.lax.conv_general_dilated(x, w, (s, s), [(p, p)] * 2, dimension_numbers=("NHWC", "HWIO", "NHWC"))

    def loss(conv, x, w):
        return jnp.sum(jnp.sin(conv(x, w, stride, padding)))

    assert uses_custom_vjp(functools.partial(loss, conv2d), x, w)  # the matmul rule is under test
    with xla_cpu.disabled():
        assert not uses_custom_vjp(functools.partial(loss, conv2d), x, w)
    # Jitted: op by op, every slice and matmul of the rule would compile on its own.
    got = jax.jit(jax.grad(functools.partial(loss, conv2d), (0, 1)))(x, w)
    want = jax.jit(jax.grad(functools.partial(loss, plain), (0, 1)))(x, w)
    for g, r in zip(got, want):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-4)
    # bf16 in, bf16 gradients out (accumulated in float32).
    grads = jax.jit(jax.grad(functools.partial(loss, conv2d), (0, 1)))
    gx, gw = grads(x_np.astype(jnp.bfloat16), w_np.astype(jnp.bfloat16))
    assert gx.dtype == gw.dtype == jnp.bfloat16
    np.testing.assert_allclose(gw.astype(jnp.float32), want[1], rtol=0.05, atol=0.05 * float(jnp.abs(want[1]).max()))


@pytest.mark.slow
def test_remat_gradients_with_the_workarounds_match_plain_autodiff(plain_unet_gradient):
    # Reference: no remat, workarounds off (plain lax convs, plain autodiff; remat with them off
    # is plain eqx.filter_checkpoint).
    model = perturbed(one_level_unet(jax.random.key(0)))
    remat = jax.tree.unflatten(
        jax.tree.structure(one_level_unet(jax.random.key(0), remat=True)), jax.tree.leaves(model)
    )
    want = plain_unet_gradient(False)
    got = unet_gradient(remat)
    for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-6)


def test_remat_block_dependency_is_added_only_when_on_and_keeps_input_gradients_finite():
    class Block(eqx.Module):
        dense: Dense
        w: jax.Array  # its gradient is 0·(1/(2·sqrt(0))) = NaN; the input's stays finite

        def __call__(self, x):
            return self.dense(x) + 0.0 * jnp.sqrt(self.w)

    block = Block(Dense(4, 4, key=jax.random.key(0)), jnp.zeros(4))
    x = jnp.asarray(np.random.default_rng(0).normal(size=(3, 4)), jnp.float32)

    def loss(x):
        return jnp.sum(jnp.sin(checkpointed(block, True)(x)))

    def reference(x):  # closed form: d/dx Σ sin(x W + b) = cos(x W + b) Wᵀ
        return (
            np.cos(np.asarray(x) @ np.asarray(block.dense.weight) + np.asarray(block.dense.bias))
            @ np.asarray(block.dense.weight).T
        )

    assert uses_custom_vjp(loss, x)
    with xla_cpu.disabled():
        assert not uses_custom_vjp(loss, x)
        np.testing.assert_allclose(jax.grad(loss)(x), reference(x), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(jax.grad(loss)(x), reference(x), rtol=1e-5, atol=1e-6)
    # No forward mode through the dependency.
    with pytest.raises(TypeError, match="custom_vjp"):
        jax.jvp(loss, (x,), (x,))


# 1-D and 2-D draws of both kinds; one 4-D draw (a conv kernel's, uniform as torch_uniform
# draws it), since a 4-D jax.random draw alone takes seconds to compile on XLA:CPU.
@pytest.mark.parametrize(
    "shape, normal", [((7,), False), ((7,), True), ((17, 33), False), ((17, 33), True), ((3, 3, 4, 5), False)]
)
def test_padded_draws_are_bitwise_plain_jax_random_draws(shape, normal):
    # threefry_partitionable: element i of a draw depends on the key and i only, not the shape.
    assert jax.config.jax_threefry_partitionable
    key = jax.random.key(7)
    if normal:
        plain = 0.37 * jax.random.normal(key, shape)
    else:
        plain = 0.37 * jax.random.uniform(key, shape, minval=np.nextafter(np.float32(-1), np.float32(0)), maxval=1.0)
    np.testing.assert_array_equal(xla_cpu.padded_draw(key, shape, normal, 0.37), plain)
    # The padded length does not change the values either.
    short, long = (np.asarray(xla_cpu._flat(key, n, jnp.bool_(normal), jnp.float32(1.0))) for n in (1024, 8192))
    np.testing.assert_array_equal(short, long[:1024])


@pytest.mark.slow
@pytest.mark.parametrize("make", [one_level_unet, tiny_dit], ids=["unet", "dit"])
def test_models_initialise_bitwise_the_same_with_the_workarounds_on_and_off(make):
    # Eagerly, as create_train_state draws. (Under jit XLA may fuse a draw's scaling into other
    # ops and round differently: the same distribution, not always the same bits.)
    on = make(jax.random.key(3))
    with xla_cpu.disabled():
        off = make(jax.random.key(3))  # one jax.random compile per parameter shape
    assert jax.tree.structure(on) == jax.tree.structure(off)
    for a, b in zip(jax.tree.leaves(on), jax.tree.leaves(off)):
        np.testing.assert_array_equal(a, b)
    assert any(float(jnp.std(a)) > 0 for a in jax.tree.leaves(on) if eqx.is_inexact_array(a))


def train_step_options() -> dict:
    """The compiler options a `TrainStep` on a 1-device CPU mesh takes when it is built."""
    return TrainStep(
        None, None, NamedSharding(make_mesh(1, 1, jax.devices()[:1]), PartitionSpec()), None
    ).compiler_options


def test_train_step_compiler_options_only_with_the_workarounds_on():
    assert train_step_options() == xla_cpu.compiler_options() and train_step_options()
    with xla_cpu.disabled():
        assert train_step_options() == {}


def test_the_switch_keeps_work_away_from_ynnpack():
    # This jaxlib gives a conv + bias + silu to YNNPACK by default; the switch's compiler options
    # keep every op with XLA's own kernels, and enable() put the same setting in XLA_FLAGS before
    # this session's backend started (conftest), so plain jit compiles follow it too.
    def block(x, w):
        return jax.nn.silu(
            jax.lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")) + 1.0
        )

    lowered = jax.jit(block).lower(jnp.zeros((2, 32, 32, 64)), jnp.zeros((3, 3, 64, 64)))  # big enough for YNNPACK
    assert (
        "__ynn_fusion" in lowered.compile({xla_cpu.YNN_OPTION: "LIBRARY_FUSION_TYPE_INDIVIDUAL_CONVOLUTION"}).as_text()
    )
    assert "__ynn_fusion" not in lowered.compile(xla_cpu.compiler_options()).as_text()
    assert "__ynn_fusion" not in lowered.compile().as_text()
    assert f"--{xla_cpu.YNN_OPTION}=" in os.environ["XLA_FLAGS"]


def test_llvm_o1_lowers_llvms_level_and_never_raises_it(optimised_compile):
    # -O1 in place of XLA's -O2 for a script's step; where jax is asked for most optimisations off (LLVM at -O0, as
    # conftest compiles the tests' programs) the option would raise the level, so the step leaves it out.
    o1 = {"xla_backend_optimization_level": 1, "xla_llvm_disable_expensive_passes": True}
    with xla_cpu.only({"llvm_o1"}):
        assert xla_cpu.compiler_options() == o1 == train_step_options()
        jax.config.update("jax_disable_most_optimizations", True)
        assert xla_cpu.compiler_options() == {} == train_step_options()


def test_each_switch_by_name_reaches_only_its_own_workaround():  # llvm_o1's options: the test above
    # Benchmarks measure one switch at a time (benchmarks/bench_xla_cpu.py), so a name must turn on
    # exactly its workaround: the conv's custom gradient, the remat dependency, the compiler options.
    w = jnp.zeros((3, 3, 8, 8))
    block = checkpointed(Dense(4, 4, use_bias=False, key=jax.random.key(0)), True)  # no bias: no rule 8
    conv_custom = lambda: uses_custom_vjp(lambda x: conv2d(x, w, 1, 1), X)  # noqa: E731
    remat_custom = lambda: uses_custom_vjp(lambda x: block(x), jnp.ones((3, 4)))  # noqa: E731
    dense = Dense(4, 4, key=jax.random.key(0))
    bias_custom = lambda: uses_custom_vjp(lambda x: dense(x), jnp.ones((3, 4)))  # noqa: E731
    with xla_cpu.only({"conv_grad_matmul"}):
        assert conv_custom() and not remat_custom() and not bias_custom() and xla_cpu.compiler_options() == {}
    with xla_cpu.only({"channel_sum_matmul"}):
        assert bias_custom() and not conv_custom() and not remat_custom() and xla_cpu.compiler_options() == {}
    with xla_cpu.only({"remat_order"}):
        assert remat_custom() and not conv_custom() and not bias_custom()
    with xla_cpu.only({"memory_scheduler", "no_ynnpack"}):
        assert xla_cpu.compiler_options() == {
            "xla_cpu_scheduler_type": "CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED",
            xla_cpu.YNN_OPTION: "",
        }
        assert xla_cpu.switched_on() == {"memory_scheduler", "no_ynnpack"}
    assert xla_cpu.switched_on() == xla_cpu.SWITCHES.keys()  # back to what the fixture switched on
    with pytest.raises(ValueError, match="conv_grad_matmul"):
        xla_cpu.only({"conv_grad_matmuls"}).__enter__()


def test_channel_sums_as_matmuls_match_plain_autodiff_in_the_layers():
    # Plain autodiff of the same layers with the switches off is the reference; each case sums over
    # all positions ([c] params) or per sample ([b, 1, 1, c]), and a Dense on [b, n, d] tokens.
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(2, 5, 6, 8)), jnp.float32)
    tokens = jnp.asarray(rng.normal(size=(2, 3, 8)), jnp.float32)
    per_sample = [jnp.asarray(rng.normal(size=(2, 1, 1, 8)), jnp.float32) for _ in range(2)]
    conv = perturbed(Conv2d(8, 8, key=jax.random.key(0)))
    norm, dense = perturbed(GroupNorm(4, 8)), perturbed(Dense(8, 8, key=jax.random.key(1)))

    def loss(args):
        (conv, norm, dense), x, tokens, w, b = args
        y = norm(bias.add_bias(conv(x), b)) + jnp.sum(dense(tokens))
        return jnp.sum(jnp.sin(bias.affine(y, w, b)))

    args = ((conv, norm, dense), x, tokens, *per_sample)
    # A fresh function each time: filter_jit would reuse one trace (the switch is read only when tracing).
    grad = lambda: eqx.filter_jit(eqx.filter_grad(lambda a: loss(a)))(args)  # noqa: E731
    # Only this switch, so the conv's own gradient is XLA's on both sides.
    with xla_cpu.only({"channel_sum_matmul"}):
        assert str(jax.make_jaxpr(lambda a: loss(a))(args)).count("custom_vjp_call") == 5
        got = grad()
    with xla_cpu.disabled():
        assert not uses_custom_vjp(loss, args)
        want = grad()
    leaves = jax.tree.leaves(want)
    assert len(leaves) == 10 and all(float(jnp.abs(g).max()) > 1e-3 for g in leaves)
    for g, r in zip(jax.tree.leaves(got), leaves, strict=True):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5)


def test_sum_to_is_the_sum_over_the_broadcast_axes_in_the_input_dtype():
    dy = np.random.default_rng(0).normal(size=(3, 4, 5, 6)).astype(np.float32)
    np.testing.assert_allclose(xla_cpu.sum_to(jnp.asarray(dy), (6,)), dy.sum((0, 1, 2)), rtol=1e-5, atol=1e-5)
    per_sample = xla_cpu.sum_to(jnp.asarray(dy), (3, 1, 1, 6))
    np.testing.assert_allclose(per_sample, dy.sum((1, 2), keepdims=True), rtol=1e-5, atol=1e-5)
    half = xla_cpu.sum_to(jnp.asarray(dy, jnp.bfloat16), (6,))
    assert half.dtype == jnp.bfloat16
    np.testing.assert_allclose(half.astype(jnp.float32), dy.sum((0, 1, 2)), rtol=0.02, atol=0.05)
    with pytest.raises(ValueError, match=r"neither \(6,\)"):
        xla_cpu.sum_to(jnp.asarray(dy), (4, 1, 6))


@pytest.mark.parametrize("scale_shift", [False, True])
def test_unet_gradients_with_channel_sum_matmuls_match_plain_autodiff(scale_shift, plain_unet_gradient):
    model = perturbed(one_level_unet(jax.random.key(0), scale_shift=scale_shift))
    with xla_cpu.only({"channel_sum_matmul"}):
        assert uses_custom_vjp(lambda x: model(x, T), X)
        got = unet_gradient(model)
    want = plain_unet_gradient(scale_shift)
    for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-6)


def test_the_xla_cpu_flag_names_switches_and_refuses_unknown_ones():
    assert xla_cpu.named_switches("on") == xla_cpu.DEFAULT and xla_cpu.named_switches("off") == frozenset()
    assert xla_cpu.named_switches("on", remat=True) == xla_cpu.DEFAULT | {"memory_scheduler"} != xla_cpu.DEFAULT
    assert xla_cpu.named_switches("llvm_o1, memory_scheduler") == {"llvm_o1", "memory_scheduler"}
    with pytest.raises(SystemExit, match="--xla_cpu: unknown switch.*'fast'.*conv_grad_matmul"):
        xla_cpu.named_switches("llvm_o1,fast")
