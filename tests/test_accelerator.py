"""The accelerator tier (`pytest -m accelerator`): what eqxdiff runs on the machine's TPU or GPU, each against the
same computation on the CPU. Skipped where JAX sees no accelerator (CI); docs/tpu.md records the last run on
a chip. Run it there whenever a change touches what it covers: the training step, the samplers, the SD pipeline,
DiT sampling, checkpoints, the attention forms.

The CPU is the default backend (tests/conftest.py starts the accelerator beside it), so each test puts its
arrays and meshes on the device it means. Tolerances: bf16 where the step computes in bf16; float32 elsewhere,
with matmuls at 'highest' precision on both sides (a TPU's default float32 matmul takes bf16 passes).
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eqxdiff import xla_cpu
from eqxdiff.checkpoint import Checkpoints
from eqxdiff.diffusion import METHODS, EDMSchedule, karras_sigmas, parameterization_by_name, sample
from eqxdiff.diffusion.loss import denoising_prediction, draw_sigma_and_noise
from eqxdiff.diffusion.parameterization import loss_weight
from eqxdiff.nn import DiT
from eqxdiff.nn import attention as attention_module
from eqxdiff.nn.attention import attention, attention_form, chosen_form
from eqxdiff.nn.attention_flash_lanes import takes as flash_lanes_takes
from eqxdiff.nn.attention_one_block import ONE_BLOCK_UP_TO
from eqxdiff.sharding import batch_sharding, make_mesh
from eqxdiff.training import abstract_train_state, adamw_cosine, create_train_state, make_train_step


def _accelerators() -> list:
    devices = []
    for platform in ("tpu", "cuda", "rocm"):
        try:
            devices += jax.devices(platform)
        except RuntimeError:  # no such backend started
            pass
    return devices


ACCELERATORS = _accelerators()
pytestmark = [
    pytest.mark.accelerator,
    pytest.mark.skipif(not ACCELERATORS, reason="no TPU or GPU backend started (tests/conftest.py)"),
]
CPU = jax.devices("cpu")[0]


def both(fn, *args):
    """fn(*args) on the CPU and on the first accelerator, each with its arguments put there, as numpy."""
    outs = []
    for device in (CPU, ACCELERATORS[0]):
        with jax.default_device(device), jax.default_matmul_precision("highest"):
            outs.append(jax.tree.map(np.asarray, fn(*jax.device_put(args, device))))
    return outs


def tiny_dit(key, learn_sigma=False):
    """A DiT of 256 tokens at 32² (patch 2): a TPU takes its one_block attention, the CPU XLA's."""
    model = DiT(32, 2, 4, 128, 2, 2, num_classes=10, learn_sigma=learn_sigma, key=key)
    noise = jax.random.split(jax.random.key(7), 1)[0]  # adaLN-Zero starts at zero output: perturb every leaf
    leaves, tree = jax.tree.flatten(model)
    keys = jax.random.split(noise, len(leaves))
    return jax.tree.unflatten(
        tree, [x + 0.05 * jax.random.normal(k, x.shape) if eqx.is_inexact_array(x) else x for x, k in zip(leaves, keys)]
    )


def test_train_step_on_the_accelerator_matches_the_cpu():
    """Three bf16 steps of a DiT (AdamW, EMA, the NaN guard): finite on the chip and the CPU's losses within bf16."""
    schedule, parameterization = EDMSchedule(), parameterization_by_name("edm", 1.0)
    optimizer, lr = adamw_cosine(1e-3, 10, 1, 0.0)

    def prepare(batch, key):
        sigma, noise = draw_sigma_and_noise(schedule, batch["x0"], key)
        return dict(x0=batch["x0"], cond=batch["label"], sigma=sigma, noise=noise)

    def loss_fn(model, batch, key):
        pred = denoising_prediction(
            model, schedule, parameterization, batch["x0"], batch["sigma"], batch["noise"], batch["cond"], key=key
        )
        return jnp.mean(loss_weight(batch["sigma"], parameterization, schedule) * pred.mse)

    rng = np.random.default_rng(0)
    batches = [
        dict(x0=rng.normal(size=(4, 32, 32, 4)).astype(np.float32), label=rng.integers(0, 10, 4).astype(np.int32))
        for _ in range(3)
    ]
    losses = {}
    for device in (CPU, ACCELERATORS[0]):
        losses[device.platform] = run_steps(device, batches, prepare, loss_fn, optimizer, lr)
    cpu, chip = np.array(losses["cpu"]), np.array(losses[ACCELERATORS[0].platform])
    np.testing.assert_allclose(chip, cpu, rtol=3e-2)


def run_steps(device, batches, prepare, loss_fn, optimizer, lr) -> list[float]:
    """The losses of a bf16 step over `batches` on a mesh of `device`, each finite; the attention in the form that
    device takes (`jax.default_device`)."""
    with jax.default_device(device):
        mesh = make_mesh(devices=[device])
        _, shardings = abstract_train_state(tiny_dit, optimizer, mesh, 2**12)
        state, _ = create_train_state(tiny_dit, optimizer, jax.random.key(0), mesh, 2**12, shardings=shardings)
        step = make_train_step(
            prepare=prepare,
            loss_fn=loss_fn,
            optimizer=optimizer,
            lr_schedule=lr,
            ema_decay=0.9,
            state_shardings=shardings,
            batch_sharding=batch_sharding(mesh),
            seed=0,
            precision="bf16",
        )
        losses = []
        for batch in batches:
            state, metrics = step(state, jax.device_put(batch, batch_sharding(mesh)))
            assert bool(metrics["finite"]), device
            losses.append(float(metrics["loss"]))
    return losses


@pytest.mark.parametrize("method", sorted(METHODS))
def test_every_sampler_on_the_accelerator_matches_the_cpu(method):
    """Each sampler on a Gaussian's closed-form denoiser, one lax.scan: the same samples on both (float32)."""
    mu, var = jnp.array([0.3, -1.0, 0.0]), jnp.array([0.25, 0.04, 1.0])
    # meanflow's step also passes sigma_end (where its average velocity ends): the same closed form serves both
    denoise = lambda x, sigma, sigma_end=None: mu + var / (var + sigma**2) * (x - mu)  # noqa: E731
    sigmas = np.asarray(karras_sigmas(12, 0.02, 20.0))
    x = 20.0 * np.random.default_rng(1).normal(size=(64, 3)).astype(np.float32)
    run = lambda x, key: sample(denoise, x, sigmas, method, key)  # noqa: E731
    cpu, chip = both(run, x, jax.random.key(3))
    np.testing.assert_allclose(chip, cpu, rtol=1e-4, atol=1e-4)


def test_dit_sampling_on_the_accelerator_matches_the_cpu():
    from eqxdiff.pretrained.dit_sampling import sample_dit

    model = tiny_dit(jax.random.key(0), learn_sigma=True)  # DiT's protocol: the published models' variance
    labels, noise = jnp.arange(4) % 10, np.random.default_rng(2).normal(size=(4, 32, 32, 4)).astype(np.float32)
    run = lambda m, y, z: sample_dit(m, y, z, steps="ddim10", method="ddim", guidance=1.5)  # noqa: E731
    cpu, chip = both(run, model, labels, noise)
    assert np.isfinite(chip).all()
    np.testing.assert_allclose(chip, cpu, rtol=0, atol=2e-3 * np.abs(cpu).max())


def test_meanflow_gradient_on_the_accelerator_matches_the_cpu():
    """MeanFlow's loss takes jax.jvp through the DiT (a TPU's one_block attention has no jvp rule: its target is
    traced in forward_mode, XLA's form); its gradient against the CPU's, float32."""
    from eqxdiff.diffusion import meanflow_prediction

    model = DiT(32, 2, 4, 128, 2, 2, num_classes=10, interval_embedding=True, key=jax.random.key(0))
    rng = np.random.default_rng(3)
    x0, noise = (rng.normal(size=(4, 32, 32, 4)).astype(np.float32) for _ in range(2))
    t, r, labels = np.array([0.9, 0.6, 0.4, 0.2], np.float32), np.array([0.1, 0.6, 0.0, 0.2], np.float32), np.arange(4)

    def loss(model, x0, noise, t, r, labels):
        u, target = meanflow_prediction(model, x0, noise, t, r, labels, labels * 0 + 10, jnp.zeros(4, bool))
        return jnp.mean((u - target) ** 2)

    grads = lambda *args: eqx.filter_jit(eqx.filter_grad(loss))(*args)  # noqa: E731
    with xla_cpu.only(xla_cpu.switched_on() - xla_cpu.NO_FORWARD_MODE):  # as train/main.py runs MeanFlow
        cpu, chip = both(lambda *a: jax.tree.leaves(grads(*a)), model, x0, noise, t, r, labels)
    for c, a in zip(cpu, chip, strict=True):
        assert np.isfinite(a).all()
        np.testing.assert_allclose(a, c, rtol=0, atol=2e-3 * max(np.abs(c).max(), 1e-6))


def test_sd_pipeline_on_the_accelerator_matches_the_cpu(tmp_path):
    """The tiny SD 1.x pipeline of tests/data (4 steps, cfg 5): the same latents on both."""
    from tests.sd.test_sd_pipeline import NEGATIVE, PROMPTS, assemble

    from eqxdiff.sd import load_sd

    pipe = load_sd(assemble("sd1", tmp_path / "sd1"))
    unit = np.random.default_rng(3).normal(size=(len(PROMPTS), 8, 8, 4)).astype(np.float32)
    outs = []
    for device in (CPU, ACCELERATORS[0]):
        with jax.default_device(device), jax.default_matmul_precision("highest"):  # uncommitted weights follow
            outs.append(np.asarray(pipe.latents(PROMPTS, NEGATIVE, steps=4, guidance=5.0, initial_latents=unit)))
    np.testing.assert_allclose(outs[1], outs[0], rtol=0, atol=1e-3 * np.abs(outs[0]).max())


def test_checkpoint_saved_and_restored_on_the_accelerator(tmp_path):
    """A state laid out on the chip, saved, restored onto the chip: bitwise the same, on the chip."""
    optimizer, _ = adamw_cosine(1e-3, 10, 1, 0.0)
    mesh = make_mesh(devices=ACCELERATORS[:1])
    abstract, shardings = abstract_train_state(tiny_dit, optimizer, mesh, 2**12)
    state, _ = create_train_state(tiny_dit, optimizer, jax.random.key(0), mesh, 2**12, shardings=shardings)
    with Checkpoints(tmp_path) as checkpoints:
        assert checkpoints.save(1, state, {"examples_consumed": 0}, {}) == "saved"
        checkpoints.wait()
        restored, _, _ = checkpoints.restore(1, abstract, shardings)
    for a, b in zip(
        jax.tree.leaves(eqx.filter(state, eqx.is_array)), jax.tree.leaves(eqx.filter(restored, eqx.is_array))
    ):
        assert b.devices() == {ACCELERATORS[0]}
        np.testing.assert_array_equal(np.asarray(b), np.asarray(a))


@pytest.mark.parametrize(
    ("n", "m", "heads", "d"), [(256, 256, 16, 72), (256, 256, 6, 72), (1024, 1024, 10, 64), (1024, 77, 5, 64)]
)
def test_each_attention_form_on_the_accelerator_matches_the_plain_one(n, m, heads, d):
    """Every form the chip can take for these shapes (the Pallas ones where n and m are whole blocks of 128; flash
    also with FLASH_LANES where the heads tile the lanes: SDXL's 10 heads of 64), forward and gradient, against the
    plain form on the same chip; bf16 inputs as a bf16 step feeds them."""
    keys = jax.random.split(jax.random.key(0), 3)
    q, k, v = (
        jax.device_put(jax.random.normal(kk, (2, length, heads, d), jnp.bfloat16), ACCELERATORS[0])
        for kk, length in zip(keys, (n, m, m))
    )
    loss = lambda q, k, v: jnp.sum(attention(q, k, v).astype(jnp.float32) ** 2)  # noqa: E731
    with attention_form("plain"):
        ref = jax.jit(attention)(q, k, v), jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    forms = ["flash", "one_block"][: 1 + (n * m <= ONE_BLOCK_UP_TO)] if n % 128 == 0 and m % 128 == 0 else []
    with jax.default_device(ACCELERATORS[0]):
        chosen = chosen_form(n, m, masked=False)
    assert chosen in ("plain", *forms)
    lanes = [("flash", True)] if "flash" in forms and flash_lanes_takes(n, m, heads, d) else []
    for form, side_by_side in [(form, False) for form in forms] + lanes:
        with attention_form(form), pytest.MonkeyPatch.context() as patch:
            patch.setattr(attention_module, "FLASH_LANES", side_by_side)
            patch.setattr(attention_module, "FLASH_LANES_FROM", 0)  # the side-by-side forward at this test's length
            out = jax.jit(attention)(q, k, v), jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
        for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(ref)):
            a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
            assert np.abs(a - b).max() <= 2e-2 * np.abs(b).max(), (form, side_by_side)
