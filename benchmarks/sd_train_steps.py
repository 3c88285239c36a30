"""What bench_sd_lora_step.py and bench_sdxl_lora.py share: SD's training loss, one optimizer step that
trains part of a model and takes the rest as a frozen argument, and the memory figures.

`eps_loss` is diffusers' train_text_to_image.py objective: t ~ U{0..999}, x_t = √ᾱ_t·x0 + √(1-ᾱ_t)·ε with SD's
scaled_linear ᾱ (the pipelines' scheduler_config.json: β 0.00085..0.012), mean (UNet(x_t, t, cond) - ε)²
in float32. `make_step(optimizer)` is the step written out by hand (`eqx.partition` of the model): the
gradient, the optimizer and the update see only `trained` (the adapters, or every parameter for a full
fine-tune); `frozen` (the base) is an argument, differentiated through but never for its own gradient;
`trained` and the optimizer state are donated and keep their shardings; compiled with the XLA:CPU switches'
options as eqxdiff's TrainStep (`xla_cpu.compiler_options()`).
"""

import resource
import sys
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from eqxdiff import xla_cpu
from eqxdiff.sd.scheduler import diffusers_alphas_cumprod

SD_SCHEDULER = {"beta_schedule": "scaled_linear", "beta_start": 0.00085, "beta_end": 0.012, "num_train_timesteps": 1000}


def eps_loss(unet, x0, cond, key) -> jax.Array:
    """The epsilon-prediction loss of a batch of latents `x0 [b, h, w, 4]` under `cond` (a TextCond or SDXLCond)."""
    alpha_bar = jnp.asarray(diffusers_alphas_cumprod(SD_SCHEDULER), jnp.float32)
    k_t, k_noise = jax.random.split(key)
    t = jax.random.randint(k_t, (x0.shape[0],), 0, 1000)
    noise = jax.random.normal(k_noise, x0.shape, jnp.float32)
    a = alpha_bar[t][:, None, None, None]
    x_t = (jnp.sqrt(a) * x0 + jnp.sqrt(1 - a) * noise).astype(x0.dtype)
    return jnp.mean((unet(x_t, t.astype(jnp.float32), cond).astype(jnp.float32) - noise) ** 2)


def make_step(optimizer):
    """`step(trained, opt_state, frozen, x0, cond, key) -> (trained, opt_state, loss)`, jitted; `trained` and
    `opt_state` donated, their outputs in their inputs' shardings (the rest: GSPMD's choice from the inputs)."""

    def step(trained, opt_state, frozen, x0, cond, key):
        loss, grads = eqx.filter_value_and_grad(lambda p: eps_loss(eqx.combine(p, frozen), x0, cond, key))(trained)
        updates, opt_state = optimizer.update(grads, opt_state, trained)
        return eqx.apply_updates(trained, updates), opt_state, loss

    def jitted(trained, opt_state, *rest):
        kept = jax.tree.map(lambda x: x.sharding, (trained, opt_state))
        fn = jax.jit(step, donate_argnums=(0, 1), out_shardings=(*kept, None))
        return fn.lower(trained, opt_state, *rest).compile(xla_cpu.compiler_options())  # as TrainStep compiles

    return jitted


def tree_bytes(tree) -> int:
    """Bytes of the arrays in `tree`, all devices together."""
    return int(sum(x.nbytes for x in jax.tree.leaves(tree) if eqx.is_array(x)))


def bytes_per_device(tree) -> int:
    """Bytes of the arrays in `tree` that the first device holds (its shards; a replicated leaf whole)."""
    device = jax.devices()[0]
    return int(
        sum(
            s.data.nbytes
            for x in jax.tree.leaves(tree)
            if eqx.is_array(x)
            for s in x.addressable_shards
            if s.device == device
        )
    )


def memory_of(compiled) -> dict:
    """XLA's buffer plan of a compiled step: temporaries (activations, gradients, updates), arguments, outputs (MiB)
    of the program ONE device runs (SPMD: each device runs it on its shards; a host simulating 8 holds 8 of them)."""
    stats = compiled.memory_analysis()
    mib = lambda n: round(n / 2**20, 1)  # noqa: E731
    return {
        "temp_mib": mib(stats.temp_size_in_bytes),
        "argument_mib": mib(stats.argument_size_in_bytes),
        "output_mib": mib(stats.output_size_in_bytes),
    }


def peak_rss() -> int:
    """This process's resident peak in bytes (Linux's VmHWM, else ru_maxrss)."""
    status = Path("/proc/self/status")
    if status.is_file():
        line = next(ln for ln in status.read_text().splitlines() if ln.startswith("VmHWM:"))
        return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)


def random_latents(rng: np.random.Generator, batch: int, size: int) -> np.ndarray:
    """SD-scaled latents' stand-in: N(0, 1) `[batch, size, size, 4]` float32."""
    return rng.standard_normal((batch, size, size, 4)).astype(np.float32)
