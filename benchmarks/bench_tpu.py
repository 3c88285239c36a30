"""Per-chip figures on an accelerator, one JSON line per case (BENCHMARKS.md "On a TPU v5e"):

    python benchmarks/bench_tpu.py                       # every case of the record, on the chip
    python benchmarks/bench_tpu.py dit_train:size=XL,batch=32,attention=flash dit_sample:steps=250
    python benchmarks/bench_tpu.py --tiny dit_train sd_forward   # the same programs at toy sizes (a CPU check)
    python benchmarks/bench_tpu.py dit_train:size=B,batch=256 dit_train:size=B,batch=256,repa=1   # REPA's cost

A case is NAME[:key=value,...] (the keywords of the function NAME below). Each line holds the case, the device,
images (or steps) per second, model-FLOP utilisation (MFU: the papers' FLOP counts, multiply-adds ×2, over the
device's datasheet bf16 peak), XLA's own count (`cost_analysis`, which also counts the optimizer, the EMA and
elementwise work, so it reads higher), and memory: XLA's `memory_analysis` of the compiled program (arguments,
outputs, temporaries) and the device's peak bytes in use where the runtime reports them.

Model FLOPs: DiT's forward per image is what the DiT paper tables (Peebles & Xie 2023, Table 4: XL/2 118.6, B/2
23.0 GMACs), here counted from the shapes (`dit_forward_macs`), a training image 3× its forward; sampling counts
one forward per image per network evaluation (two with guidance). The SD UNets have no paper count: XLA's count
of their forward is reported alone.
"""

import argparse
import contextlib
import datetime
import functools
import json
import sys
import time
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sd_unet_configs import SD15_UNET, SDXL_BASE_UNET  # noqa: E402

from eqxdiff.diffusion import EDMSchedule, parameterization_by_name  # noqa: E402
from eqxdiff.diffusion.guidance import drop_condition  # noqa: E402
from eqxdiff.diffusion.loss import denoising_prediction, draw_sigma_and_noise  # noqa: E402
from eqxdiff.diffusion.parameterization import loss_weight  # noqa: E402
from eqxdiff.nn import DiT, Dinov2Model  # noqa: E402
from eqxdiff.sd import SDUNet  # noqa: E402
from eqxdiff.nn.attention import attention, attention_form  # noqa: E402
from eqxdiff.nn.remat import DEFAULT_REMAT_POLICY, set_remat_policy  # noqa: E402
from eqxdiff.sharding import batch_sharding, make_mesh, state_shardings  # noqa: E402
from eqxdiff.training import abstract_train_state, create_train_state, make_train_step, peak_flops_per_device  # noqa: E402
from eqxdiff.training import step as step_module  # noqa: E402
from eqxdiff.training.optimizer import adamw_cosine  # noqa: E402
from eqxdiff.training.repa import default_block, dinov2_targets, repa_loss, with_projector  # noqa: E402

# hidden, depth, heads (DiT's Table 1); "tiny" keeps 256 tokens at 32² so every attention form applies.
DIT_SIZES = {"XL": (1152, 28, 16), "L": (1024, 24, 16), "B": (768, 12, 12), "S": (384, 12, 6), "tiny": (144, 2, 2)}
# REPA's frozen tower: transformers' Dinov2Config of facebook/dinov2-base (REPA's dinov2-vit-b), random weights
DINOV2_BASE = {"model_type": "dinov2", "hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12,
               "image_size": 518, "patch_size": 14}  # fmt: skip
DINOV2_TINY = {**DINOV2_BASE, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2}
TINY = False  # --tiny: toy sizes of every case, to check the programs on a CPU


def dit_forward_macs(hidden: int, depth: int, tokens: int, patch: int = 2, channels: int = 4) -> float:
    """Multiply-adds of one DiT forward per image: per block the qkv, out, and MLP projections (12·d² per token),
    the attention's two products (2·n·d per token) and adaLN's 6·d² per image; the patch embedding and the final
    layer per token; the timestep and label embeddings are left out, as the paper's count leaves them."""
    d, n, p2c = hidden, tokens, patch * patch * channels
    block = n * (12 * d * d + 2 * n * d) + 6 * d * d
    return depth * block + n * p2c * d + n * d * p2c + 2 * d * d


def vit_forward_macs(hidden: int, depth: int, tokens: int, patch: int = 14) -> float:
    """Multiply-adds of one ViT forward per image (REPA's DINOv2 tower): per block qkv, out and the 4× MLP (12·d² per
    token) and attention's two products (2·n·d per token), and the patch embedding."""
    return depth * tokens * (12 * hidden * hidden + 2 * tokens * hidden) + tokens * patch * patch * 3 * hidden


def device_record() -> dict:
    device = jax.devices()[0]
    peak, _ = peak_flops_per_device(device, "bf16") if device.platform != "cpu" else (float("nan"), "")
    return {
        "date": datetime.date.today().isoformat(),
        "device": device.device_kind,
        "platform": device.platform,
        "jax": jax.__version__,
        "peak_bf16_flops": peak,
    }


def memory(compiled) -> dict:
    m = compiled.memory_analysis()
    out = {}
    if m is not None:
        for name in ("argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes", "alias_size_in_bytes"):
            out[name.replace("_size_in_bytes", "_gib")] = round(getattr(m, name) / 2**30, 3)
    stats = jax.devices()[0].memory_stats() or {}
    if "peak_bytes_in_use" in stats:
        out["peak_in_use_gib"] = round(stats["peak_bytes_in_use"] / 2**30, 3)
    return out


def xla_flops(compiled) -> float:
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    return float((cost or {}).get("flops", float("nan")))


def jitted(fn, module):
    """jax.jit of `fn(module, *args)` over the module's arrays (equinox's Compiled has no cost analysis)."""
    arrays, static = eqx.partition(module, eqx.is_array)
    return jax.jit(lambda a, *args: fn(eqx.combine(a, static), *args)), arrays


def timed(fn, calls: int) -> float:
    """Seconds per call of `fn()` (each call's output blocked on before the next), after one warm-up call."""
    jax.block_until_ready(fn())
    start = time.perf_counter()
    for _ in range(calls):
        jax.block_until_ready(fn())
    return (time.perf_counter() - start) / calls


def forms(attention: str, remat_policy: str):
    """The context a case runs in: the attention form forced ("auto": chosen by backend and shape)."""
    if remat_policy:
        set_remat_policy(remat_policy)
    return attention_form(attention) if attention != "auto" else contextlib.nullcontext()


def dit_train(
    size="XL",
    batch=32,
    attention="auto",
    remat="",
    guard="",
    accum=1,
    steps=10,
    precision="bf16",
    fsdp=1,
    compile_only=0,
    profile=0,
    objective="edm",
    repa=0,
):
    """A DiT-{size}/2 training step on 32×32×4 latents (256²-image ImageNet's), 1000 classes: AdamW (lr 1e-4, no
    decay, as DiT) over fp32 masters with `precision` compute, EMA 0.9999, the NaN guard (`guard`: "cond" or
    "where", default by backend), `remat` a policy name ("" none), `accum` micro-batches per update. `fsdp` N:
    the state split over N devices (a mesh of N; `--cpu_devices 8` simulates them); `compile_only`: XLA's memory
    analysis per device, nothing run; `profile` N: N more steps traced, their op time by kind and phase
    (benchmarks/hlo_ops.py). `objective` "meanflow": a DiT of two times on MeanFlow's loss as train/main.py's
    `--objective meanflow` with its defaults (one jax.jvp through the network, guidance folded in with ω = 1,
    κ = 0.5: two more forward calls); its model FLOPs counted as the plain step's, so its MFU reads as the
    plain step's rate of images. `repa` 1: + 0.5·REPA's loss (eqxdiff/training/repa.py, as train/main.py's `loss_fn`
    adds it), the targets computed in the step by a frozen DINOv2-B/14 (random weights, facebook/dinov2-base's
    shape) from the 256² images the latents stand for, resized to 224² (16² tokens), REPA's projector (2048 wide)
    on the tokens after block round(depth·8/28); its model FLOPs add the tower's forward."""
    hidden, depth, heads = DIT_SIZES["tiny" if TINY else size]
    batch = min(batch, 4 * accum) if TINY else batch
    if guard:
        step_module.GUARD_FORM = guard
    schedule, parameterization = EDMSchedule(), parameterization_by_name("edm", 1.0)
    optimizer, lr = adamw_cosine(1e-4, 10**6, 0, 0.0)
    meanflow = objective == "meanflow"
    network = functools.partial(
        DiT, 32, 2, 4, hidden, depth, heads, num_classes=1000, remat=bool(remat), interval_embedding=meanflow
    )
    tower_config = DINOV2_TINY if TINY else DINOV2_BASE
    block = default_block(depth)
    if repa:  # the network beside REPA's projector, as train/main.py --repa_weight trains it
        make_network = lambda key: network(key=key)  # noqa: E731
        aligned = with_projector(make_network, block=block, z_dim=tower_config["hidden_size"], projector_dim=2048)
        make_model = lambda key: aligned(key)  # noqa: E731
    else:
        make_model = network

    def prepare(batch, key, frozen=None):
        k1, k2 = jax.random.split(key)
        sigma, noise = draw_sigma_and_noise(schedule, batch["x0"], k1)
        cond = drop_condition(k2, batch["label"], 0.1, jnp.full_like(batch["label"], 1000))
        out = dict(x0=batch["x0"], cond=cond, sigma=sigma, noise=noise)
        if repa:  # the clean images' DINOv2 patch tokens, by the frozen tower (main.py's `prepare`)
            out["repa_targets"] = dinov2_targets(frozen["repa_encoder"], batch["image"].astype(jnp.float32), 224)
        return out

    def loss_fn(model, batch, key):
        net = model.network if repa else model
        pred = denoising_prediction(
            net,
            schedule,
            parameterization,
            batch["x0"],
            batch["sigma"],
            batch["noise"],
            batch["cond"],
            key=key,
            tokens_after=block if repa else None,
        )
        loss = jnp.mean(loss_weight(batch["sigma"], parameterization, schedule) * pred.mse)
        return loss + 0.5 * repa_loss(batch["repa_targets"], model.projector(pred.tokens)) if repa else loss

    if meanflow:  # train/main.py's prepare_meanflow and meanflow_loss_fn, their defaults
        from eqxdiff.diffusion import draw_condition_drop, draw_times, meanflow_prediction

        def prepare(batch, key):  # noqa: F811
            k1, k2, k3 = jax.random.split(key, 3)
            b = batch["label"].shape[0]
            t, r = draw_times(k1, b, p_mean=-0.4, p_std=1.0, r_neq_t=0.25)
            noise = jax.random.normal(k2, batch["x0"].shape)
            null = jnp.full_like(batch["label"], 1000)
            drop = draw_condition_drop(k3, b, 0.1)
            return dict(x0=batch["x0"], cond=batch["label"], null=null, drop=drop, t=t, r=r, noise=noise)

        def loss_fn(model, batch, key):  # noqa: F811
            u, target = meanflow_prediction(
                model, batch["x0"], batch["noise"], batch["t"], batch["r"], batch["cond"], batch["null"],
                batch["drop"], omega=1.0, kappa=0.5, key=key,
            )  # fmt: skip
            error = jnp.sum((u - target) ** 2, axis=(1, 2, 3))
            return jnp.mean(error / jax.lax.stop_gradient(error + 0.01))

    mesh = make_mesh(data=1, fsdp=fsdp, devices=jax.devices()[:fsdp])
    frozen = frozen_shardings = None
    if repa:
        tower = Dinov2Model.from_config(tower_config, key=jax.random.key(1), interpolate_offset=0.1)
        frozen_shardings = state_shardings({"repa_encoder": tower}, mesh, 2**12)
        frozen = jax.device_put({"repa_encoder": tower}, frozen_shardings)
    with forms(attention, remat):
        abstract, shardings = abstract_train_state(lambda key: make_model(key=key), optimizer, mesh, 2**12)
        step = make_train_step(
            prepare=prepare,
            loss_fn=loss_fn,
            optimizer=optimizer,
            lr_schedule=lr,
            ema_decay=0.9999,
            state_shardings=shardings,
            batch_sharding=batch_sharding(mesh),
            seed=0,
            grad_accum_steps=accum,
            precision=precision,
            frozen_shardings=frozen_shardings,
        )
        spec = dict(
            x0=jax.ShapeDtypeStruct((batch, 32, 32, 4), jnp.float32), label=jax.ShapeDtypeStruct((batch,), jnp.int32)
        )
        if repa:  # the 256² images REPA's latents stand for
            spec["image"] = jax.ShapeDtypeStruct((batch, 256, 256, 3), jnp.uint8)
        start = time.perf_counter()
        compiled = step.compile(abstract, spec, frozen)
        compile_s = time.perf_counter() - start
    step_module.GUARD_FORM = None
    set_remat_policy(DEFAULT_REMAT_POLICY)
    out = dict(compile_s=round(compile_s, 1), xla_flops_per_step=xla_flops(compiled), **memory(compiled))
    if compile_only:
        return out
    state, _ = create_train_state(
        lambda key: make_model(key=key), optimizer, jax.random.key(0), mesh, 2**12, shardings=shardings
    )
    rng = np.random.default_rng(0)
    data = dict(
        x0=rng.normal(size=(batch, 32, 32, 4)).astype(np.float32),
        label=rng.integers(0, 1000, batch).astype(np.int32),
    )
    if repa:
        data["image"] = rng.integers(0, 256, (batch, 256, 256, 3), np.uint8)
    data = jax.device_put(data, batch_sharding(mesh))
    step = functools.partial(step, frozen=frozen)
    state, metrics = step(state, data)  # warm-up
    jax.block_until_ready(metrics)
    start = time.perf_counter()
    previous = None
    for _ in range(steps):  # as train/main.py's loop: at most 2 steps in flight
        state, metrics = step(state, data)
        if previous is not None:
            jax.block_until_ready(previous["loss"])
        previous = metrics
    jax.block_until_ready((state, metrics))
    seconds = (time.perf_counter() - start) / steps
    assert bool(metrics["finite"]), "non-finite step"
    macs = dit_forward_macs(hidden, depth, 256)
    tower_macs = vit_forward_macs(tower_config["hidden_size"], tower_config["num_hidden_layers"], 257) if repa else 0
    out.update(
        step_s=round(seconds, 4),
        images_per_s=round(batch / seconds, 2),
        model_flops_per_image=6 * macs + 2 * tower_macs,
        **({"repa_block": block, "tower_flops_per_image": 2 * tower_macs} if repa else {}),
        **utilisation((6 * macs + 2 * tower_macs) * batch, out["xla_flops_per_step"], seconds, compiled),
    )
    out.update(memory(compiled))  # the device's peak after the steps ran
    if profile:
        held = [state]  # the state is donated: each traced step takes the last one's

        def run_step():
            held[0], metrics = step(held[0], data)
            jax.block_until_ready(metrics)

        out["profile"] = profiled(run_step, profile, compiled)
    return out


def profiled(run_step, steps: int, compiled) -> dict:
    """Where `steps` calls of `run_step()` spend their device time, op by op (jax.profiler's trace read back with
    jax.profiler.ProfileData), grouped by kind and phase as benchmarks/hlo_ops.py classifies the compiled HLO."""
    import tempfile

    from hlo_ops import instructions, module_name, op_events, summarise, trace_layout

    text = compiled.as_text()
    with tempfile.TemporaryDirectory() as folder:
        jax.profiler.start_trace(folder)
        try:
            for _ in range(steps):
                run_step()
        finally:
            jax.profiler.stop_trace()
        trace = sorted(Path(folder).rglob("*.xplane.pb"))[-1]
        events, others = op_events(trace, module_name(text))
        layout = {} if events else {"trace_layout": trace_layout(trace)}  # nothing matched: say what is there
    summary = summarise(events, instructions(text, ("eqxdiff/training/step.py",)), steps)
    return {**summary, "other_modules_ms": {k: round(v / 1e6 / steps, 2) for k, v in others.items()}, **layout}


def utilisation(model_flops: float, xla: float, seconds: float, compiled=None) -> dict:
    peak = device_record()["peak_bf16_flops"]
    return {"mfu_model": round(model_flops / seconds / peak, 4), "mfu_xla": round(xla / seconds / peak, 4)}


def dit_forward(size="XL", batch=64, attention="auto"):
    """DiT-{size}/2's bf16 forward on a batch of 32×32×4 latents (labels), as sampling calls it."""
    hidden, depth, heads = DIT_SIZES["tiny" if TINY else size]
    batch = min(batch, 4) if TINY else batch
    model = DiT(32, 2, 4, hidden, depth, heads, num_classes=1000, learn_sigma=True, key=jax.random.key(0))
    model = jax.tree.map(lambda x: x.astype(jnp.bfloat16) if eqx.is_inexact_array(x) else x, model)
    x = jnp.asarray(np.random.default_rng(0).normal(size=(batch, 32, 32, 4)), jnp.bfloat16)
    t, y = jnp.full((batch,), 0.5), jnp.arange(batch) % 1000
    with forms(attention, ""):
        fn, arrays = jitted(lambda m, x, t, y: m(x, t, y), model)
        compiled = fn.lower(arrays, x, t, y).compile()
        seconds = timed(lambda: compiled(arrays, x, t, y), 20)
    macs = dit_forward_macs(hidden, depth, 256)
    return dict(
        images_per_s=round(batch / seconds, 2),
        **utilisation(2 * macs * batch, xla_flops(compiled), seconds),
        **memory(compiled),
    )


@contextlib.contextmanager
def flash_settings(block: int, lanes: int):
    """Traces inside take flash attention's forward blocks up to `block` queries and keys (0: eqxdiff's FLASH_BLOCK)
    and its forward reading the heads side by side where they tile: `lanes` -1 as eqxdiff chooses (from
    FLASH_LANES_FROM queries), 0 never, 1 at every length."""
    from eqxdiff.nn import attention as attention_module

    names = ("FLASH_BLOCK", "FLASH_LANES", "FLASH_LANES_FROM")
    before = {name: getattr(attention_module, name) for name in names}
    attention_module.FLASH_BLOCK = block or before["FLASH_BLOCK"]
    if lanes >= 0:
        attention_module.FLASH_LANES, attention_module.FLASH_LANES_FROM = bool(lanes), 0
    try:
        yield
    finally:
        for name, value in before.items():
            setattr(attention_module, name, value)


def attention_op(
    batch=32, n=256, heads=16, d=72, form="plain", calls=20, backward=1, repeat=1, flash_block=0, lanes=-1
):
    """One attention's forward and backward (the gradient of a weighted sum) in bf16 on `[batch, n, heads, d]`
    tokens, `form` forced: DiT-XL/2's layer by default (SDXL's 32² level: `n=1024,heads=20,d=64`); `backward` 0:
    the forward alone, as sampling calls it; `repeat` R: R forwards chained in one program (each output the next
    queries), so a small call's time is the chip's, not the host's dispatch (ms reported per forward);
    `flash_block`: flash's largest forward block (0: eqxdiff's); `lanes` 1: flash's forward with the heads side by
    side (eqxdiff/nn/attention_flash_lanes.py), 0: on the heads in front, -1: as eqxdiff chooses. Model FLOPs: the
    two matmuls forward (2·n²·d each), the four of the backward twice that."""
    batch = min(batch, 2) if TINY else batch
    rng = np.random.default_rng(0)
    q, k, v, g = (jnp.asarray(rng.normal(size=(batch, n, heads, d)), jnp.bfloat16) for _ in range(4))
    if backward and repeat > 1:
        raise SystemExit("attention_op: repeat chains forwards; use it with backward=0")

    def chained(q, k, v):
        return jax.lax.fori_loop(0, repeat, lambda _, x: attention(x, k, v), q)

    with attention_form(form), flash_settings(flash_block, lanes):
        loss = lambda q, k, v: jnp.sum((attention(q, k, v) * g).astype(jnp.float32))  # noqa: E731
        fn = jax.grad(loss, argnums=(0, 1, 2)) if backward else (chained if repeat > 1 else attention)
        compiled = jax.jit(fn).lower(q, k, v).compile()
    seconds = timed(lambda: compiled(q, k, v), calls) / repeat
    flops = (3 if backward else 1) * 2 * (2 * n * n * d) * batch * heads
    return dict(ms=round(seconds * 1e3, 3), **utilisation(flops, xla_flops(compiled), seconds), **memory(compiled))


def dit_sample(size="XL", batch=64, steps=250, cfg=1.5, attention="auto", calls=2, profile=0):
    """`sample_dit` as DiT's sample.py: DDPM over `steps` respaced steps, guidance `cfg` on 3 channels, bf16
    weights, one lax.scan; `calls` timed after a warm-up; `profile` N: N more calls traced, op time by kind."""
    from eqxdiff.pretrained.dit_sampling import sample_dit

    hidden, depth, heads = DIT_SIZES["tiny" if TINY else size]
    batch, steps = (min(batch, 4), min(steps, 5)) if TINY else (batch, steps)
    model = DiT(32, 2, 4, hidden, depth, heads, num_classes=1000, learn_sigma=True, key=jax.random.key(0))
    model = jax.tree.map(lambda x: x.astype(jnp.bfloat16) if eqx.is_inexact_array(x) else x, model)
    labels = jnp.arange(batch) % 1000
    noise = jnp.asarray(np.random.default_rng(0).normal(size=(batch, 32, 32, 4)), jnp.float32)
    with forms(attention, ""):
        run, arrays = jitted(lambda m, y, z, k: sample_dit(m, y, z, steps=steps, guidance=cfg, key=k), model)
        start = time.perf_counter()
        compiled = run.lower(arrays, labels, noise, jax.random.key(1)).compile()
        compile_s = time.perf_counter() - start
        seconds = timed(lambda: compiled(arrays, labels, noise, jax.random.key(1)), calls)
    evaluations = steps * batch * (2 if cfg > 1 else 1)
    macs = dit_forward_macs(hidden, depth, 256)
    out = dict(
        compile_s=round(compile_s, 1),
        images_per_s=round(batch / seconds, 3),
        **utilisation(2 * macs * evaluations, xla_flops(compiled), seconds),
    )
    if profile:
        print("before the profile:", json.dumps(out), flush=True)  # the timing survives a profile cut short
        call = lambda: jax.block_until_ready(compiled(arrays, labels, noise, jax.random.key(1)))  # noqa: E731
        out["profile"] = profiled(call, profile, compiled)
    return out


def dit_one_step(size="XL", batch=256, steps=1, calls=5):
    """MeanFlow sampling with a DiT-{size}/2 of two times, bf16: `steps` network calls (one: z_0 = z_1 − u) through
    the samplers table's `meanflow` step on its flow-time grid, unguided (MeanFlow folds guidance into training)."""
    from eqxdiff.diffusion import Denoiser, FlowSchedule, sample
    from eqxdiff.diffusion.grids import flow_time_sigmas

    hidden, depth, heads = DIT_SIZES["tiny" if TINY else size]
    batch = min(batch, 4) if TINY else batch
    model = DiT(32, 2, 4, hidden, depth, heads, num_classes=1000, interval_embedding=True, key=jax.random.key(0))
    model = jax.tree.map(lambda x: x.astype(jnp.bfloat16) if eqx.is_inexact_array(x) else x, model)
    schedule = FlowSchedule()
    sigmas = flow_time_sigmas(steps, schedule.sigma_max)
    labels = jnp.arange(batch) % 1000
    noise = jnp.asarray(np.random.default_rng(0).normal(size=(batch, 32, 32, 4)), jnp.float32)

    def generate(m, y, z):
        denoiser = Denoiser(m, schedule, parameterization_by_name("flow", 1.0))
        return sample(lambda x, s, **kw: denoiser(x, s, y, **kw), z * sigmas[0], sigmas, "meanflow")

    run, arrays = jitted(generate, model)
    compiled = run.lower(arrays, labels, noise).compile()
    seconds = timed(lambda: compiled(arrays, labels, noise), calls)
    macs = dit_forward_macs(hidden, depth, 256)
    return dict(
        images_per_s=round(batch / seconds, 1),
        **utilisation(2 * macs * batch * steps, xla_flops(compiled), seconds),
        **memory(compiled),
    )


def sd_forward(config="sd15", batch=8, attention="auto"):
    """The SD 1.5 (or SDXL base) UNet's bf16 forward at its native latent size (64², 128²) with a text context."""
    cfg = dict(SD15_UNET if config == "sd15" else SDXL_BASE_UNET)
    if TINY:
        cfg.update(
            block_out_channels=[32, 64] if config == "sd15" else [32, 64, 64],
            layers_per_block=1,
            sample_size=32,
            **(
                {"transformer_layers_per_block": [0, 1, 1], "attention_head_dim": [2, 2, 2]} if config != "sd15" else {}
            ),
        )
        cfg.update(
            down_block_types=cfg["down_block_types"][: len(cfg["block_out_channels"])],
            up_block_types=cfg["up_block_types"][-len(cfg["block_out_channels"]) :],
        )
        batch = 2
    unet = SDUNet.from_config(cfg, key=jax.random.key(0))
    unet = jax.tree.map(lambda x: x.astype(jnp.bfloat16) if eqx.is_inexact_array(x) else x, unet)
    size = cfg["sample_size"]
    x = jnp.asarray(np.random.default_rng(0).normal(size=(batch, size, size, 4)), jnp.bfloat16)
    t = jnp.full((batch,), 500.0)
    cond = sd_cond(unet, batch)
    with forms(attention, ""):
        fn, arrays = jitted(lambda m, x, t, c: m(x, t, c), unet)
        start = time.perf_counter()
        compiled = fn.lower(arrays, x, t, cond).compile()
        compile_s = time.perf_counter() - start
        seconds = timed(lambda: compiled(arrays, x, t, cond), 10)
    peak = device_record()["peak_bf16_flops"]
    return dict(
        compile_s=round(compile_s, 1),
        images_per_s=round(batch / seconds, 2),
        mfu_xla=round(xla_flops(compiled) / seconds / peak, 4),
        **memory(compiled),
    )


def sd_cond(unet, batch: int):
    """A random text condition of the UNet's kind: SD's context, or SDXL's context, pooled vector and time ids."""
    from eqxdiff.sd.sdxl_cond import SDXLCond
    from eqxdiff.nn.text_cond import TextCond

    config = json.loads(unet.config)
    rng = np.random.default_rng(1)
    context = jnp.asarray(rng.normal(size=(batch, 77, config["cross_attention_dim"])), jnp.bfloat16)
    mask = jnp.ones((batch, 77), jnp.int32)
    if config.get("addition_embed_type") != "text_time":
        return TextCond(context, mask, None)
    pooled_dim = config["projection_class_embeddings_input_dim"] - 6 * config["addition_time_embed_dim"]
    pooled = jnp.asarray(rng.normal(size=(batch, pooled_dim)), jnp.bfloat16)
    return SDXLCond(
        TextCond(context, mask, pooled), jnp.tile(jnp.array([[1024.0, 1024, 0, 0, 1024, 1024]]), (batch, 1))
    )


# SDXL base's towers and VAE (stabilityai/stable-diffusion-xl-base-1.0's config.json files, the fields eqxdiff reads).
SDXL_TEXT = dict(
    vocab_size=49408,
    hidden_size=768,
    intermediate_size=3072,
    num_hidden_layers=12,
    num_attention_heads=12,
    max_position_embeddings=77,
    hidden_act="quick_gelu",
    layer_norm_eps=1e-5,
    eos_token_id=2,
    bos_token_id=0,
    pad_token_id=1,
    projection_dim=768,
)
SDXL_TEXT_2 = dict(
    SDXL_TEXT,
    hidden_size=1280,
    intermediate_size=5120,
    num_hidden_layers=32,
    num_attention_heads=20,
    hidden_act="gelu",
    projection_dim=1280,
)
SDXL_VAE = {
    "_class_name": "AutoencoderKL",
    "act_fn": "silu",
    "block_out_channels": [128, 256, 512, 512],
    "down_block_types": ["DownEncoderBlock2D"] * 4,
    "force_upcast": True,
    "in_channels": 3,
    "latent_channels": 4,
    "latents_mean": None,
    "latents_std": None,
    "layers_per_block": 2,
    "mid_block_add_attention": True,
    "norm_num_groups": 32,
    "out_channels": 3,
    "sample_size": 1024,
    "scaling_factor": 0.13025,
    "shift_factor": None,
    "up_block_types": ["UpDecoderBlock2D"] * 4,
    "use_post_quant_conv": True,
    "use_quant_conv": True,
}
SDXL_SCHEDULER = {
    "_class_name": "EulerDiscreteScheduler",
    "beta_end": 0.012,
    "beta_schedule": "scaled_linear",
    "beta_start": 0.00085,
    "num_train_timesteps": 1000,
    "prediction_type": "epsilon",
    "steps_offset": 1,
    "timestep_spacing": "leading",
    "interpolation_type": "linear",
    "use_karras_sigmas": False,
}


def sdxl_t2i(
    batch=1, steps=20, guidance=8.0, size=1024, calls=2, profile=0, parts=0, vae_bf16=0, flash_block=0, lanes=-1
):
    """SDXL base text-to-image as its pipeline computes it, random weights of its shapes, bf16: both text towers on
    the prompts and the negative ones (penultimate layer, pooled projection), `steps` Euler steps (the folder's
    EulerDiscreteScheduler) with classifier-free guidance in one UNet call on the doubled batch, the VAE's decode
    at `size`² (its fp32 upcast, as diffusers' force_upcast; a batch's images one after another). Images per
    second over `calls` whole batches (MLPerf's Offline scenario: any batch);
    `profile` N: N more batches traced, op time by kind and source file; `parts` 1: the towers, one guided UNet
    call and the decode each compiled and timed alone (ms per batch); `vae_bf16` 1: the VAE in bf16 (diffusers'
    fp32 upcast guards fp16's range, which bf16 shares with fp32); `flash_block`, `lanes`: flash attention's
    largest block and its side-by-side forward (`flash_settings`)."""
    from eqxdiff.diffusion import ClassifierFreeGuidance, Denoiser
    from eqxdiff.nn import AutoencoderKL, CLIPTextModel
    from eqxdiff.nn.clip_text_projection import CLIPTextModelWithProjection
    from eqxdiff.sd.sdxl_cond import SDXLCond
    from eqxdiff.nn.text_cond import TextCond
    from eqxdiff.sd.scheduler import scheduler_from_diffusers

    unet_config, text, text2, vae_config = dict(SDXL_BASE_UNET), dict(SDXL_TEXT), dict(SDXL_TEXT_2), dict(SDXL_VAE)
    if TINY:
        unet_config.update(
            block_out_channels=[32, 64, 64],
            transformer_layers_per_block=[0, 1, 1],
            attention_head_dim=[2, 2, 2],
            layers_per_block=1,
            sample_size=16,
            projection_class_embeddings_input_dim=32 + 6 * 256,
            cross_attention_dim=32 + 32,
        )
        text.update(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, projection_dim=32)
        text2.update(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, projection_dim=32
        )
        vae_config.update(block_out_channels=[8, 8, 8, 8], norm_num_groups=4, layers_per_block=1)
        size, steps = 128, min(steps, 3)
    bf16 = lambda m: jax.tree.map(lambda x: x.astype(jnp.bfloat16) if eqx.is_inexact_array(x) else x, m)  # noqa: E731
    keys = jax.random.split(jax.random.key(0), 4)
    unet = bf16(SDUNet.from_config(unet_config, key=keys[0]))
    tower, tower2 = (
        bf16(CLIPTextModel.from_config(text, key=keys[1])),
        bf16(CLIPTextModelWithProjection.from_config(text2, key=keys[2])),
    )
    vae = AutoencoderKL.from_config(vae_config, key=keys[3])
    vae = bf16(vae) if vae_bf16 else vae
    vae_dtype = jnp.bfloat16 if vae_bf16 else jnp.float32
    scheduler = scheduler_from_diffusers(SDXL_SCHEDULER)
    f = 2 ** (len(vae_config["block_out_channels"]) - 1)

    def encode(towers, ids):  # [2b, 77] ids: the prompts, then the negative ones
        one, two = towers
        hidden, _ = one(ids, hidden_layer=-2)
        hidden2, pooled = two(ids, hidden_layer=-2)
        return jnp.concatenate([hidden, hidden2], axis=-1), pooled

    def generate(unet, towers, vae, ids, noise):
        context, pooled = encode(towers, ids)
        b = noise.shape[0]
        time_ids = jnp.tile(jnp.array([[size, size, 0, 0, size, size]], jnp.float32), (b, 1))
        cond = lambda rows: SDXLCond(TextCond(context[rows], jnp.ones((b, 77), jnp.int32), pooled[rows]), time_ids)  # noqa: E731
        denoiser = Denoiser(unet, scheduler.schedule, scheduler.parameterization)
        guided = ClassifierFreeGuidance(denoiser, cond(slice(0, b)), guidance, cond(slice(b, 2 * b)))
        latents = scheduler.sample(guided, noise, steps)
        if b == 1:
            return vae.decode((latents / vae.scaling_factor).astype(vae_dtype))
        # one image at a time: a 1024² decode's float32 activations are GiBs an image, the UNet's batch is not
        return jax.lax.map(lambda z: vae.decode((z[None] / vae.scaling_factor).astype(vae_dtype))[0], latents)

    ids = jnp.asarray(np.random.default_rng(0).integers(0, text["vocab_size"], (2 * batch, 77)), jnp.int32)
    noise = jnp.asarray(np.random.default_rng(1).normal(size=(batch, size // f, size // f, 4)), jnp.float32)
    run, arrays = jitted(lambda m, ids, noise: generate(m[0], m[1], m[2], ids, noise), (unet, (tower, tower2), vae))
    start = time.perf_counter()
    with flash_settings(flash_block, lanes):
        compiled = run.lower(arrays, ids, noise).compile()
    compile_s = time.perf_counter() - start
    seconds = timed(lambda: compiled(arrays, ids, noise), calls)
    peak = device_record()["peak_bf16_flops"]
    out = dict(
        compile_s=round(compile_s, 1),
        images_per_s=round(batch / seconds, 3),
        mfu_xla=round(xla_flops(compiled) / seconds / peak, 4),
        **memory(compiled),
    )
    if profile:
        print("before the profile:", json.dumps(out), flush=True)  # the timing survives a profile cut short
        out["profile"] = profiled(lambda: jax.block_until_ready(compiled(arrays, ids, noise)), profile, compiled)
    if parts:
        context, pooled = eqx.filter_jit(encode)((tower, tower2), ids)
        b, latents = batch, noise
        time_ids = jnp.tile(jnp.array([[size, size, 0, 0, size, size]], jnp.float32), (2 * b, 1))
        both = SDXLCond(TextCond(context, jnp.ones((2 * b, 77), jnp.int32), pooled), time_ids)
        t = jnp.full((2 * b,), 500.0)

        def unet_call(unet, x, t, both):  # the doubled batch in one call, as the guided sampler's
            return unet(jnp.concatenate([x, x]), t, both)

        pieces = {
            "towers": (eqx.filter_jit(encode), ((tower, tower2), ids)),
            "unet_call": (eqx.filter_jit(unet_call), (unet, latents, t, both)),
            "decode": (eqx.filter_jit(lambda vae, z: vae.decode(z.astype(vae_dtype))), (vae, latents)),
        }
        out["parts_ms"] = {}
        for name, (fn, args) in pieces.items():
            with flash_settings(flash_block, lanes):
                fn(*args)  # compile and warm up
            out["parts_ms"][name] = round(timed(lambda: fn(*args), calls) * 1e3, 2)
        out["parts_ms"]["unet_calls_x_steps"] = round(out["parts_ms"]["unet_call"] * steps, 1)
    return out


def sd_grad(config="sd15", batch=8, remat="", calls=5):
    """The SD 1.5 (or SDXL base) UNet's loss gradient alone (bf16 weights, no optimizer state: SD 1.5's AdamW state
    over fp32 masters does not fit one v5e beside its activations) at its native latent size, `remat` a policy
    name or "" (off): what remat saves of the activations and what it costs, on one chip."""
    cfg = dict(SD15_UNET if config == "sd15" else SDXL_BASE_UNET)
    if TINY:
        cfg.update(block_out_channels=[32, 64, 64, 64], attention_head_dim=2, sample_size=16, cross_attention_dim=32)
        cfg.pop("transformer_layers_per_block", None)
        batch = min(batch, 2)
    with forms("auto", remat):
        unet = SDUNet.from_config(cfg, remat=bool(remat), key=jax.random.key(0))
        unet = jax.tree.map(lambda x: x.astype(jnp.bfloat16) if eqx.is_inexact_array(x) else x, unet)
        size = cfg["sample_size"]
        x = jnp.asarray(np.random.default_rng(0).normal(size=(batch, size, size, 4)), jnp.bfloat16)
        t, cond = jnp.full((batch,), 500.0), sd_cond(unet, batch)
        arrays, static = eqx.partition(unet, eqx.is_array)

        def loss(arrays, x, t, cond):
            return jnp.mean(eqx.combine(arrays, static)(x, t, cond).astype(jnp.float32) ** 2)

        compiled = jax.jit(jax.grad(loss)).lower(arrays, x, t, cond).compile()
        seconds = timed(lambda: compiled(arrays, x, t, cond), calls)
    set_remat_policy(DEFAULT_REMAT_POLICY)
    return dict(
        images_per_s=round(batch / seconds, 2),
        mfu_xla=round(xla_flops(compiled) / seconds / device_record()["peak_bf16_flops"], 4),
        **memory(compiled),
    )


def sd_train(config="sdxl", batch=8, fsdp=8, remat="", precision="bf16", compile_only=1, steps=5):
    """The SD 1.5 or SDXL base UNet's training step (ε-prediction on diffusers' scaled-linear VP schedule, text
    conditions given pre-encoded, AdamW over fp32 masters, EMA, the NaN guard) on its native latents, the state
    split over `fsdp` devices. `compile_only`: XLA's memory analysis per device (FSDP on paper with
    `--cpu_devices 8`)."""
    from eqxdiff.diffusion import schedule_by_name

    cfg = dict(SD15_UNET if config == "sd15" else SDXL_BASE_UNET)
    if TINY:
        cfg.update(
            block_out_channels=[32, 64, 64],
            layers_per_block=1,
            sample_size=16,
            **(
                {"transformer_layers_per_block": [0, 1, 1], "attention_head_dim": [2, 2, 2]}
                if config != "sd15"
                else {"attention_head_dim": 2}
            ),
        )
        cfg.update(down_block_types=cfg["down_block_types"][:3], up_block_types=cfg["up_block_types"][-3:])
        batch = max(fsdp, 2)
    schedule, parameterization = schedule_by_name("vp_linear"), parameterization_by_name("eps", 1.0)
    optimizer, lr = adamw_cosine(1e-5, 10**6, 0, 1e-2)
    make_model = lambda key: SDUNet.from_config(cfg, remat=bool(remat), key=key)  # noqa: E731

    def prepare(batch, key):
        sigma, noise = draw_sigma_and_noise(schedule, batch["x0"], key)
        return dict(x0=batch["x0"], cond=batch["cond"], sigma=sigma, noise=noise)

    def loss_fn(model, batch, key):
        pred = denoising_prediction(
            model, schedule, parameterization, batch["x0"], batch["sigma"], batch["noise"], batch["cond"], key=key
        )
        return jnp.mean(loss_weight(batch["sigma"], parameterization, schedule) * pred.mse)

    mesh = make_mesh(data=1, fsdp=fsdp, devices=jax.devices()[:fsdp])
    size = cfg["sample_size"]
    abstract_model = eqx.filter_eval_shape(make_model, jax.random.key(0))
    cond = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, jnp.float32 if a.dtype == jnp.bfloat16 else a.dtype),
        sd_cond(abstract_model, batch),
    )
    with forms("auto", remat):
        abstract, shardings = abstract_train_state(make_model, optimizer, mesh, 2**12)
        step = make_train_step(
            prepare=prepare,
            loss_fn=loss_fn,
            optimizer=optimizer,
            lr_schedule=lr,
            ema_decay=0.9999,
            state_shardings=shardings,
            batch_sharding=batch_sharding(mesh),
            seed=0,
            precision=precision,
        )
        spec = dict(x0=jax.ShapeDtypeStruct((batch, size, size, 4), jnp.float32), cond=cond)
        start = time.perf_counter()
        compiled = step.compile(abstract, spec)
        compile_s = time.perf_counter() - start
    set_remat_policy(DEFAULT_REMAT_POLICY)
    params = sum(x.size for x in jax.tree.leaves(abstract.model) if hasattr(x, "size"))
    out = dict(params=int(params), compile_s=round(compile_s, 1), **memory(compiled))
    if compile_only:
        return out
    raise SystemExit("sd_train runs compile_only=1 only: the state of SDXL needs more than one chip")


CASES = {
    "attention_op": attention_op,
    "sd_train": sd_train,
    "sd_grad": sd_grad,
    "sdxl_t2i": sdxl_t2i,
    "dit_train": dit_train,
    "dit_forward": dit_forward,
    "dit_sample": dit_sample,
    "dit_one_step": dit_one_step,
    "sd_forward": sd_forward,
}
RECORD = [
    "dit_train:size=XL,batch=32",
    "dit_train:size=B,batch=256",
    "dit_forward:size=XL,batch=256",
    "dit_sample:size=XL,batch=64",
    "sd_forward:config=sd15,batch=8",
    "sdxl_t2i:batch=1",
]


def parse_case(text: str) -> tuple[str, dict]:
    name, _, rest = text.partition(":")
    if name not in CASES:
        raise SystemExit(f"unknown case {name!r}; choose from {sorted(CASES)}")
    kwargs = {}
    for item in filter(None, rest.split(",")):
        key, _, value = item.partition("=")
        kwargs[key] = int(value) if value.lstrip("-").isdigit() else float(value) if _is_float(value) else value
    return name, kwargs


def _is_float(value: str) -> bool:
    try:
        float(value)
        return True
    except ValueError:
        return False


def main(argv=None) -> None:
    global TINY
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("cases", nargs="*", default=RECORD, help="NAME[:key=value,...]; default: the record's")
    parser.add_argument("--tiny", action="store_true", help="toy sizes of every case (checks the programs on a CPU)")
    parser.add_argument("--out", default="", help="also append each JSON line to this file")
    parser.add_argument("--cpu_devices", type=int, default=0, help="simulate N CPU devices (fsdp=N, compile_only=1)")
    args = parser.parse_args(argv)
    if args.cpu_devices:  # FSDP on paper: XLA:CPU's memory-optimised scheduler frees buffers as a TPU's does
        from eqxdiff import xla_cpu

        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", args.cpu_devices)
        xla_cpu.enable(xla_cpu.shipped(remat=True))
    TINY = args.tiny
    record = device_record()
    for text in args.cases:
        name, kwargs = parse_case(text)
        try:
            result = CASES[name](**kwargs)
        except Exception as e:  # one case's failure (e.g. out of memory) is its line, the others still run
            result = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
        line = json.dumps({"bench": "tpu", "case": text, **record, **result})
        print(line, flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(line + "\n")


if __name__ == "__main__":
    main()
