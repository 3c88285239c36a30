"""The training step: parity across meshes, donation, no host sync, NaN guard, EMA,
gradient accumulation, remat memory and the bf16 policy."""

import contextlib
import functools
import io
import re
from concurrent.futures import ThreadPoolExecutor

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.ad_checkpoint import print_saved_residuals
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from eqxdiff import xla_cpu
from eqxdiff.data import open_source
import train_scripts  # noqa: F401 — puts train/ on sys.path: a test of the scripts
import main as train_main  # train/main.py
from eqxdiff.diffusion import EDMPreconditioning, EDMSchedule
from eqxdiff.run.conditions import Labels
from eqxdiff.nn import UNet
from eqxdiff.nn.layers import Dense, Embedding
from eqxdiff.sharding import batch_sharding, make_mesh
from eqxdiff.training import abstract_train_state, adamw_cosine, create_train_state, make_train_step

pytestmark = pytest.mark.quick  # the quick tier, the edit loop (tests/README.md)

SCHEDULE, PARAM = EDMSchedule(), EDMPreconditioning()
BATCH = 16


def prepare(batch, key):
    """train/main.py's prepare; the test-only field "poison" (0 or NaN per example) is added to x0."""
    batch = dict(batch)
    poison = batch.pop("poison")
    out = train_main.prepare(batch, key, schedule=SCHEDULE, cond_dropout=0.1, condition=Labels(10))
    return dict(out, x0=out["x0"] + poison[:, None, None, None])


loss_fn = functools.partial(train_main.loss_fn, schedule=SCHEDULE, parameterization=PARAM)


def tiny_unet(key, remat=False, channels=(16, 32), blocks=1):
    return UNet(1, channels, blocks, num_classes=10, norm_groups=4, remat=remat, key=key)


def build_step(mesh, k=1, precision="fp32", make_model=tiny_unet, lr=3e-3, min_size=256):
    """(optimizer, abstract state, state shardings, step): everything but the state's arrays.
    One per configuration: tests of the same configuration share its compiled step."""
    return _build_step(mesh, k, precision, make_model, lr, min_size)  # one cache key however called


@functools.cache
def _build_step(mesh, k, precision, make_model, lr, min_size):
    optimizer, schedule = adamw_cosine(lr, 100, 2)
    abstract, shardings = abstract_train_state(make_model, optimizer, mesh, min_size)
    step = make_train_step(
        prepare=prepare,
        loss_fn=loss_fn,
        optimizer=optimizer,
        lr_schedule=schedule,
        ema_decay=0.9,
        state_shardings=shardings,
        batch_sharding=batch_sharding(mesh),
        seed=0,
        grad_accum_steps=k,
        precision=precision,
    )
    return optimizer, abstract, shardings, step


def build(mesh, *, k=1, precision="fp32", make_model=tiny_unet, lr=3e-3, min_size=256, compile_for=None):
    """(state, step). With `compile_for` (a batch), the step compiles in a thread from the
    abstract state while the real state is built, as in train/main.py."""
    optimizer, abstract, shardings, step = build_step(mesh, k, precision, make_model, lr, min_size)
    with ThreadPoolExecutor(1) as pool:
        if compile_for is not None:
            spec = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), compile_for)
            compiling = pool.submit(step.compile, abstract, spec)
        state, _ = create_train_state(make_model, optimizer, jax.random.key(0), mesh, min_size, shardings=shardings)
        if compile_for is not None:
            compiling.result()
    return state, step


@functools.cache
def digit_batches(n, batch=BATCH):
    digits = open_source("digits")
    rng = np.random.default_rng(0)
    out = []
    for _ in range(n):
        idx = rng.choice(len(digits), batch, replace=False)
        out.append({"image": digits.images[idx], "label": digits.labels[idx], "poison": np.zeros(batch, np.float32)})
    return out


def put(batch, mesh):
    return jax.tree.map(lambda x: jax.device_put(x, batch_sharding(mesh)), batch)


class PixelMLP(eqx.Module):
    """model(x[b,h,w,1], t[b], labels[b]) -> [b,h,w,1]: an MLP on each pixel's value, t and the
    label's embedding. The model contract in matmuls only: its step compiles quickly on XLA:CPU
    (a conv's backward pass does not), and its [32, 32] weight and [11, 32] embedding are large
    enough (min_size 256) for FSDP to shard."""

    embed: Embedding
    fc_in: Dense
    fc_hidden: Dense
    fc_out: Dense

    def __init__(self, key):
        k_embed, k_in, k_hidden, k_out = jax.random.split(key, 4)
        self.embed = Embedding(11, 32, key=k_embed)  # 10 digits and the null label
        self.fc_in, self.fc_hidden = Dense(2, 32, key=k_in), Dense(32, 32, key=k_hidden)
        self.fc_out = Dense(32, 1, key=k_out)

    def __call__(self, x, t, cond, *, key=None):
        inputs = jnp.concatenate([x, jnp.broadcast_to(t[:, None, None, None], x.shape)], axis=-1)
        h = jax.nn.gelu(self.fc_in(inputs) + self.embed(cond)[:, None, None])
        return self.fc_out(jax.nn.gelu(self.fc_hidden(h)))


def one_level_unet(key):
    return tiny_unet(key, channels=(16,))  # the multi-step runs below: same parts, a quicker compile


def one_level_remat_unet(key):
    return tiny_unet(key, channels=(16,), remat=True)


def bf16_unet(key):
    # The bf16 run compiles a step of its own: one ResBlock (the final one, with its 1x1 skip)
    # between convs, norms and the time and label embeddings already has every kind of layer the
    # precision policy casts, at under half the kernels of one_level_unet's step.
    return UNet(1, (16,), 0, num_middle_res_blocks=0, num_classes=10, norm_groups=4, key=key)


def run(mesh, steps, **kw):
    state, step = build(mesh, **{"make_model": PixelMLP, "compile_for": digit_batches(1)[0], **kw})
    losses = []
    for batch in digit_batches(steps):
        state, metrics = step(state, put(batch, mesh))
        losses.append(float(metrics["loss"]))
    assert step.traces == 1  # the ahead-of-time compile served the whole run
    return state, np.array(losses)


def arrays(state):
    """Model, EMA and optimizer state as host arrays: what a skipped step must keep bitwise."""
    return [np.asarray(x) for x in jax.tree.leaves(eqx.filter((state.model, state.ema, state.opt_state), eqx.is_array))]


def params_of(state):
    return [np.asarray(x) for x in jax.tree.leaves(eqx.filter(state.model, eqx.is_inexact_array))]


# The parity runs: the pixel MLP in the quick tier (one small compile per mesh); the conv UNet,
# whose kernels FSDP shards too, in the slow tier: XLA:CPU compiles a conv's backward pass slowly,
# once per mesh. Accumulation is the MLP's alone: the step's micro-batch loop and its FSDP-sharded
# gradient sum are the same code for any network (a conv UNet's cost 12 s of compile for nothing new).
# The UNet's runs are 10 steps, the MLP's 20 (30 unoptimised conv steps fewer, ~5 s): a sharding
# that computed otherwise shows in the first step's loss and update. The pure data-parallel mesh (data=8) is
# the MLP's alone: the UNet's reference mesh (data=2, fsdp=4) already splits its batch over a data axis and
# sums its gradients across it, beside the FSDP-sharded conv kernels (a third conv compile checked no other code).
PARITY_MODELS = [pytest.param(PixelMLP, id="mlp"), pytest.param(one_level_unet, id="unet", marks=pytest.mark.slow)]
PARITY_STEPS = {PixelMLP: 20, one_level_unet: 10}
DATA_PARALLEL_TOO = {PixelMLP: True, one_level_unet: False}


@pytest.fixture(scope="module", params=PARITY_MODELS)
def reference_run(request):
    """(make_model, state, losses) of PARITY_STEPS steps on (data=2, fsdp=4): the run other meshes and
    accumulation must reproduce."""
    return request.param, *run(make_mesh(-1, 4), PARITY_STEPS[request.param], make_model=request.param)


def test_one_device_eight_devices_and_fsdp_agree(reference_run):
    make_model, fsdp_state, fsdp_losses = reference_run
    steps = PARITY_STEPS[make_model]
    single_state, single_losses = run(make_mesh(1, 1, jax.devices()[:1]), steps, make_model=make_model)
    others = [(fsdp_state, fsdp_losses)]
    if DATA_PARALLEL_TOO[make_model]:
        others.append(run(make_mesh(8, 1), steps, make_model=make_model))
    assert np.all(np.isfinite(single_losses))
    for state, losses in others:
        np.testing.assert_allclose(losses, single_losses, rtol=1e-5)
        for a, b in zip(params_of(single_state), params_of(state), strict=True):
            np.testing.assert_allclose(
                b, a, rtol=1e-4, atol=2e-5
            )  # Adam divides by sqrt(v): tiny grad noise moves a weight by ~lr·1e-3


@pytest.mark.parametrize("reference_run", PARITY_MODELS[:1], indirect=True)
def test_grad_accumulation_matches_one_big_batch(reference_run):
    make_model, fsdp_state, fsdp_losses = reference_run
    # k=2: two micro-batches interleaved over the devices (examples i, i+2, ...); the step is
    # unrolled on XLA:CPU, so each extra micro-batch is one more backward pass to compile.
    accum_state, accum_losses = run(make_mesh(-1, 4), PARITY_STEPS[make_model], k=2, make_model=make_model)
    np.testing.assert_allclose(accum_losses, fsdp_losses, rtol=1e-5)
    for a, b in zip(params_of(fsdp_state), params_of(accum_state)):
        np.testing.assert_allclose(
            b, a, rtol=1e-4, atol=2e-5
        )  # Adam divides by sqrt(v): tiny grad noise moves a weight by ~lr·1e-3


@pytest.fixture(scope="module")
def fsdp_setup():
    mesh = make_mesh(-1, 4)
    state, step = build(mesh, make_model=PixelMLP)  # reference_run[mlp]'s configuration: its step
    return mesh, state, step


@pytest.fixture
def fsdp_step(fsdp_setup):
    """A fresh copy of the state for each test: the step donates (deletes) what it is given."""
    mesh, state, step = fsdp_setup
    arrays, static = eqx.partition(state, eqx.is_array)
    return mesh, eqx.combine(jax.tree.map(jnp.copy, arrays), static), step


def test_state_is_donated_and_metrics_are_not_synced(fsdp_step):
    mesh, state, step = fsdp_step
    batch = put(digit_batches(1)[0], mesh)
    state, _ = step(state, batch)  # compile outside the checks
    jax.block_until_ready(state)
    before = jax.tree.leaves(eqx.filter(state, eqx.is_array))
    # One input still being computed: a step call that waited on the device (a host sync) would
    # return only after that computation and the step itself had finished.
    big = jnp.ones((1024, 1024))
    slow_zeros = jax.jit(
        lambda m: jnp.zeros(BATCH) * jnp.sum(m @ m @ m @ m @ m @ m), out_shardings=batch_sharding(mesh)
    )
    jax.block_until_ready(slow_zeros(big))  # compiled outside the checks
    new_state, metrics = step(state, dict(batch, poison=slow_zeros(big)))
    assert not metrics["loss"].is_ready()  # dispatch returned before the step finished
    jax.block_until_ready(metrics)
    assert all(x.is_deleted() for x in before), "every state leaf must be donated"
    assert int(new_state.step) == 2


def test_nan_batch_leaves_state_bitwise_unchanged_and_counts(fsdp_step):
    mesh, state, step = fsdp_step
    good = digit_batches(1)[0]
    state, _ = step(state, put(good, mesh))
    kept = arrays(state)
    step_before = int(state.step)
    poisoned = dict(good, poison=np.where(np.arange(BATCH) == 3, np.nan, 0.0).astype(np.float32))
    for i in range(1, 4):
        state, metrics = step(state, put(poisoned, mesh))
        assert not bool(metrics["finite"]) and int(metrics["bad_steps"]) == i
        for a, b in zip(kept, arrays(state)):
            np.testing.assert_array_equal(a, b)
    assert int(state.step) == step_before + 3  # the bad batches are consumed, not retried
    state, metrics = step(state, put(good, mesh))
    assert bool(metrics["finite"]) and int(metrics["bad_steps"]) == 0
    # The lr this update used: the 2nd of the warm-up (lr 3e-3 over 2 steps), not the 5th step's.
    assert float(metrics["lr"]) == pytest.approx(3e-3 * 1 / 2)


def sqrt_term_loss(model, batch, key):
    """A finite loss whose gradient is NaN where p = 0: d/dw sqrt(|w|·p) = sign(w)·p / (2 sqrt(|w|·p))
    is 0/0 there, and 0·NaN is NaN, while the loss term 0·sqrt(0) is 0."""
    fit = jnp.mean((jax.vmap(model)(batch["x"]) - 1.0) ** 2)
    return fit + 0.0 * jnp.sum(jnp.sqrt(jnp.abs(model.weight[0, 0]) * batch["p"]))


@pytest.mark.parametrize("guard", ["cond", "where"])  # the CPU's form and the accelerators'
def test_a_finite_loss_with_a_non_finite_gradient_is_skipped_bitwise(guard, monkeypatch):
    from eqxdiff.training import step as step_module

    monkeypatch.setattr(step_module, "GUARD_FORM", guard)
    mesh = make_mesh(-1, 4)
    make_model = lambda key: eqx.nn.Linear(4, 4, key=key)  # noqa: E731 — a one-matmul step: a quick compile
    optimizer, schedule = adamw_cosine(1e-2, 100, 2)
    state, shardings = create_train_state(make_model, optimizer, jax.random.key(0), mesh, 256)
    step = make_train_step(
        prepare=lambda batch, key: batch,
        loss_fn=sqrt_term_loss,
        optimizer=optimizer,
        lr_schedule=schedule,
        ema_decay=0.9,
        state_shardings=shardings,
        batch_sharding=batch_sharding(mesh),
        seed=0,
    )
    x = np.random.default_rng(0).normal(size=(8, 4)).astype(np.float32)
    good, bad = ({"x": x, "p": np.full(8, p, np.float32)} for p in (1.0, 0.0))
    state, metrics = step(state, put(good, mesh))  # moments and EMA away from their init
    assert bool(metrics["finite"]) and float(metrics["grad_norm"]) > 0
    kept = arrays(state)
    for i in (1, 2):
        state, metrics = step(state, put(bad, mesh))
        assert np.isfinite(float(metrics["loss"])) and not np.isfinite(float(metrics["grad_norm"]))
        assert not bool(metrics["finite"]) and int(metrics["bad_steps"]) == i
        for a, b in zip(kept, arrays(state), strict=True):
            np.testing.assert_array_equal(a, b)
    assert int(state.step) == 3
    state, metrics = step(state, put(good, mesh))
    assert bool(metrics["finite"]) and int(metrics["bad_steps"]) == 0
    assert not np.array_equal(kept[0], arrays(state)[0])  # a good step still updates


@pytest.mark.slow  # 40 steps of a conv UNet: its bf16 step compiles a conv backward pass
def test_bf16_policy_keeps_fp32_master_weights_and_trains():
    mesh = make_mesh(-1, 1)
    state, losses = run(mesh, 40, precision="bf16", make_model=bf16_unet)
    for tree in (state.model, state.ema, state.opt_state):
        for leaf in jax.tree.leaves(eqx.filter(tree, eqx.is_inexact_array)):
            assert leaf.dtype == jnp.float32
    assert np.all(np.isfinite(losses))
    assert losses[-10:].mean() < 0.8 * losses[:10].mean(), losses


def test_remat_keeps_far_fewer_activations_for_the_backward_pass():
    # What the backward pass keeps is what remat controls, as jax itself reports it.
    x0 = jnp.zeros((8, 16, 16, 1))
    saved = {}
    for remat in (False, True):
        # One level, two blocks: remat keeps each block's input only, which the ratio shows
        # without a second level (jax only traces here; nothing compiles).
        model = tiny_unet(jax.random.key(0), remat=remat, channels=(32,), blocks=2)
        params, static = eqx.partition(model, eqx.is_array)
        loss = lambda p: jnp.mean(eqx.combine(p, static)(x0, jnp.ones(8)) ** 2)  # noqa: E731
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):  # jax's public view of the residuals
            print_saved_residuals(loss, params)
        shapes = re.findall(r"^f32\[8,([\d,]+)\]", printed.getvalue(), re.MULTILINE)  # per-example ones
        saved[remat] = sum(8 * 4 * np.prod([int(d) for d in shape.split(",")]) for shape in shapes)
    assert saved[True] < 0.3 * saved[False], saved


@pytest.mark.slow  # compiles two conv UNet steps (memory_analysis needs the compiled program, not the lowering)
def test_remat_shrinks_the_compiled_steps_temp_memory():
    # The real step (clipped AdamW, EMA, NaN guard), compiled from shapes only: XLA's scratch
    # memory for it, activations kept for the backward pass among it.
    mesh = make_mesh(1, 1, jax.devices()[:1])
    batch = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), digit_batches(1)[0])
    temp = {}
    # One level, one block per level, each step under the XLA:CPU switches train/main.py ships without and with
    # --remat: XLA's memory-optimized scheduler comes with remat. Without it the switches are the suite's own
    # (conftest's `enable()`), so that step is build_step's shared one, compiled already by the one-device parity run.
    assert xla_cpu.switched_on() == xla_cpu.shipped(False)
    for remat, make_model in ((False, one_level_unet), (True, one_level_remat_unet)):
        with xla_cpu.only(xla_cpu.shipped(remat)):
            build = build_step if not remat else _build_step.__wrapped__  # the remat step: built under its switches
            _, abstract, _, step = build(mesh, 1, "fp32", make_model, 3e-3, 256)
            temp[remat] = step.compile(abstract, batch).memory_analysis().temp_size_in_bytes
    assert temp[True] < 0.8 * temp[False], temp  # measured 0.76 (without the scheduler 1.0: remat saves nothing)


@pytest.mark.parametrize("prefix", [False, True])
def test_model_of_trains_the_trained_part_and_reads_the_frozen_one(prefix):
    """make_train_step(model_of=...): the loss sees eqx.combine(trained, frozen part), the gradient, optimizer and EMA
    hold the trained part alone (here a Dense's bias; LoRA's adapters in eqxdiff/run/finetune.py), the frozen weight is the
    step's argument, left as it was. `prefix`: frozen_shardings a prefix of the frozen argument, as jit's
    in_shardings take them (one sharding for a whole module, None for a subtree of two arrays)."""
    mesh = make_mesh(data=-1, fsdp=1)
    whole = Dense(3, 2, key=jax.random.key(0))
    is_bias = eqx.tree_at(lambda d: (d.weight, d.bias), jax.tree.map(lambda _: False, whole), (False, True))
    trained, base = eqx.partition(whole, is_bias)
    optimizer, schedule = adamw_cosine(1e-2, 10, 0)
    abstract, shardings = abstract_train_state(lambda key: trained, optimizer, mesh, 2**20)
    step = make_train_step(
        prepare=lambda batch, key, frozen: batch,
        loss_fn=lambda m, b, key: jnp.mean((m(b["x"]) - b["y"]) ** 2),
        optimizer=optimizer,
        lr_schedule=schedule,
        ema_decay=0.5,
        state_shardings=shardings,
        batch_sharding=batch_sharding(mesh),
        seed=0,
        model_of=lambda t, frozen: eqx.combine(t, frozen["base"]),
        frozen_shardings={"base": NamedSharding(mesh, P()), "other": None} if prefix else None,
    )
    state, _ = create_train_state(lambda key: trained, optimizer, jax.random.key(0), mesh, 2**20, shardings=shardings)
    rng = np.random.default_rng(0)
    batch = {"x": rng.normal(size=(8, 3)).astype(np.float32), "y": rng.normal(size=(8, 2)).astype(np.float32)}
    frozen = (
        {"base": base, "other": {"a": np.ones(2, np.float32), "b": np.ones(3, np.float32)}}
        if prefix
        else {"base": base}
    )
    weight = np.asarray(base.weight)
    want_loss, want_grad = jax.value_and_grad(lambda bias: jnp.mean((batch["x"] @ weight + bias - batch["y"]) ** 2))(
        whole.bias
    )
    new, metrics = step(state, jax.device_put(batch, batch_sharding(mesh)), frozen)
    np.testing.assert_allclose(metrics["loss"], want_loss, rtol=1e-6)  # the whole layer's loss
    np.testing.assert_allclose(metrics["grad_norm"], jnp.linalg.norm(want_grad), rtol=1e-5)  # the bias's alone
    moments = [x.shape for x in jax.tree.leaves(new.opt_state) if x.ndim]
    assert moments and all(shape == (2,) for shape in moments)  # Adam's moments: the bias's shape only
    assert new.model.weight is None and new.ema.weight is None
    assert not np.array_equal(new.model.bias, whole.bias)
    np.testing.assert_array_equal(frozen["base"].weight, weight)  # an argument, not donated, not changed


class _Affine(eqx.Module):
    w: jax.Array
    b: jax.Array

    def __call__(self, x):
        return jnp.tanh(x @ self.w + self.b)


@pytest.mark.parametrize("k", [1, 2])
def test_a_bf16_steps_gradient_is_the_float32_masters_through_the_cast(k):
    """The step takes a micro-batch's gradient at the bf16 model and sums it in float32: the same values as
    differentiating the float32 master through the cast (the cast's transpose converts the gradient back), which
    this reference does; summed in bf16 instead, they differ."""
    import optax

    mesh = make_mesh(data=1, fsdp=1, devices=jax.devices()[:1])
    rng = np.random.default_rng(0)
    batch = {name: jnp.asarray(rng.normal(size=(8, 16)), jnp.float32) for name in ("x", "y")}

    def loss(model, batch, key):
        return jnp.mean((model(batch["x"].astype(model.w.dtype)) - batch["y"]).astype(jnp.float32) ** 2)

    def make(key):
        k1, k2 = jax.random.split(key)
        return _Affine(jax.random.normal(k1, (16, 16)) * 0.5, jax.random.normal(k2, (16,)) * 0.1)

    optimizer = optax.sgd(1.0)
    state, shardings = create_train_state(make, optimizer, jax.random.key(0), mesh, 2**20)
    master = jax.device_get(state.model)
    step = make_train_step(
        prepare=lambda batch, key: batch,
        loss_fn=loss,
        optimizer=optimizer,
        lr_schedule=lambda _: 1.0,
        ema_decay=0.9,
        state_shardings=shardings,
        batch_sharding=batch_sharding(mesh),
        seed=0,
        grad_accum_steps=k,
        precision="bf16",
    )
    state, _ = step(state, batch)

    through_cast = jax.jit(jax.grad(lambda m, mb: loss(jax.tree.map(lambda x: x.astype(jnp.bfloat16), m), mb, None)))
    grads = [through_cast(master, {n: v[i::k] for n, v in batch.items()}) for i in range(k)]
    total = jax.tree.map(lambda *g: functools.reduce(jnp.add, g, jnp.zeros_like(g[0])) / k, *grads)
    expected = jax.tree.map(lambda p, g: p - g, master, total)
    for got, want in zip(jax.tree.leaves(state.model), jax.tree.leaves(expected), strict=True):
        assert got.dtype == jnp.float32
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
