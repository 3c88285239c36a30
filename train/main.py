"""Train a diffusion model; by default a class-conditional UNet on scikit-learn's 8×8 digits.

    python train/main.py                                   # a few minutes on a 2-core CPU
    python train/main.py --cpu_devices 8 --fsdp_size 4     # FSDP over 8 simulated devices
    python train/main.py --precision bf16 --remat --grad_accum_steps 2
    python train/launch_local.py --num_processes 2 -- --cpu_devices 4   # multi-host on one machine

A run resumes by itself from the newest checkpoint in --run_dir (same command again); SIGTERM or
Ctrl-C finishes the current step, saves and exits 0.

Everything a researcher changes is in this file: the Config, the model table, the loss and
the loop. The step itself (sharding, donation, NaN guard, accumulation) is
`eqxdiff.training.make_train_step`; the loss is `denoising_loss_at` below.
"""

import time

PROCESS_START = time.perf_counter()  # startup/time_to_first_step_s counts the imports too

import argparse  # noqa: E402
import dataclasses  # noqa: E402
from concurrent.futures import ThreadPoolExecutor  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec  # noqa: E402
from tqdm import tqdm  # noqa: E402

from eqxdiff.checkpoint import Checkpoints  # noqa: E402
from eqxdiff.data import Prefetch, batch_spec, batch_stream, check_position, data_position, open_source  # noqa: E402
from eqxdiff.diffusion import (  # noqa: E402
    draw_sigma_and_noise,
    PARAMETERIZATIONS,
    SCHEDULES,
    ClassifierFreeGuidance,
    Denoiser,
    denoising_loss_at,
    drop_labels,
    karras_sigmas,
    parameterization_by_name,
    sample,
    schedule_by_name,
)
from eqxdiff.images import save_image_grid  # noqa: E402
from eqxdiff.nn import DiT, UNet  # noqa: E402
from eqxdiff.sharding import batch_sharding, make_mesh, sharding_summary  # noqa: E402
from eqxdiff.training import (  # noqa: E402
    PRECISIONS,
    MetricsLogger,
    abstract_train_state,
    adamw_cosine,
    create_train_state,
    make_train_step,
    mfu,
    peak_flops_per_device,
    step_flops,
)
from eqxdiff.training.logging import WANDB_MODES  # noqa: E402
from eqxdiff.training.preemption import StopRequest  # noqa: E402


@dataclass
class Config:
    run_dir: str = "runs/digits"
    steps: int = 600
    batch_size: int = 64  # global, per optimizer update
    lr: float = 2e-3
    warmup_steps: int = 60
    weight_decay: float = 1e-4
    seed: int = 0
    dataset: str = "digits"  # digits | npz:PATH | folder:PATH | arrayrecord:GLOB
    image_size: int = 32  # folder: and arrayrecord: images are resized to this; digits stay 8×8
    hflip: bool = False  # random horizontal flips (not for digits)
    model: str = "unet"
    schedule: str = "edm"
    parameterization: str = "edm"
    label_dropout: float = 0.1  # classifier-free guidance training
    fsdp_size: int = 1
    fsdp_min_param_size: int = 2**12  # leaves with fewer elements are replicated
    cpu_devices: int = 0  # >0: simulate this many CPU devices
    grad_accum_steps: int = 1
    remat: bool = False
    precision: str = "fp32"
    ema_decay: float = 0.995
    max_bad_steps: int = 5
    log_every: int = 50
    sample_every: int = 200  # 0: no sample grids
    sample_steps: int = 18
    cfg_scale: float = 1.5
    ckpt_every: int = 500  # and always at the end (or on SIGTERM/SIGINT)
    keep_checkpoints: int = 3
    resume_step: int = -1  # -1: the newest checkpoint in run_dir, if any
    profile_steps: str = ""  # "A:B" traces steps A..B-1 to run_dir/profile
    compilation_cache_dir: str = ""
    wandb: str = "offline"
    coordinator: str = ""  # HOST:PORT of process 0 joins a jax.distributed job; "auto": cluster env
    num_processes: int = 1
    process_id: int = 0


# name -> (image shape, num_classes, remat, key) -> model. Add yours here.
MODELS = {
    "unet": lambda shape, n, remat, key: UNet(shape[-1], (32, 64), 1, num_classes=n, remat=remat, key=key),
    "unet_tiny": lambda shape, n, remat, key: UNet(shape[-1], (16, 32), 1, num_classes=n, norm_groups=4, remat=remat, key=key),
    "unet_flaxdiff": lambda shape, n, remat, key: UNet.flaxdiff_simple(shape[-1], num_classes=n, remat=remat, key=key),
    "dit_s": lambda shape, n, remat, key: DiT.small(shape[0], shape[-1], 2, num_classes=n, remat=remat, key=key),
}
CHOICES = {
    "model": sorted(MODELS),
    "schedule": sorted(SCHEDULES),
    "parameterization": sorted(PARAMETERIZATIONS),
    "precision": sorted(PRECISIONS),
    "wandb": list(WANDB_MODES),
}


def parse_config(argv: list[str] | None = None) -> Config:
    """Every Config field is a flag `--name value`; booleans are `--name` / `--no-name`."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for field in dataclasses.fields(Config):
        if field.type is bool:
            parser.add_argument(f"--{field.name}", action=argparse.BooleanOptionalAction, default=field.default)
        else:
            parser.add_argument(
                f"--{field.name}", type=field.type, default=field.default, choices=CHOICES.get(field.name)
            )
    cfg = Config(**vars(parser.parse_args(argv)))
    if cfg.profile_steps and not _profile_range(cfg.profile_steps):
        parser.error(f"--profile_steps must look like A:B with 1 <= A < B, got {cfg.profile_steps!r}")
    return cfg


def _profile_range(text: str) -> tuple[int, int] | None:
    try:
        a, b = (int(v) for v in text.split(":"))
    except ValueError:
        return None
    return (a, b) if 1 <= a < b else None


def check_batch(cfg: Config, num_devices: int) -> None:
    """The global batch must split into micro-batches that split over every device."""
    if cfg.ckpt_every < 1:
        raise SystemExit(f"--ckpt_every must be >= 1, got {cfg.ckpt_every}.")
    per_update = num_devices * cfg.grad_accum_steps
    if cfg.batch_size % per_update:
        raise SystemExit(
            f"--batch_size {cfg.batch_size} must be a multiple of devices ({num_devices}) x "
            f"--grad_accum_steps ({cfg.grad_accum_steps}) = {per_update}."
        )


def generate(
    model, schedule, parameterization, labels: np.ndarray | None, num: int, image_shape, *,
    mesh, steps: int, method: str = "heun", cfg_scale: float = 1.0, seed: int = 0,
) -> np.ndarray:  # fmt: skip
    """`num` images (host float32 NHWC in about [-1, 1]) from `model`, e.g. the EMA, on a Karras
    grid of `steps` steps; `labels` (num,) ask for classes (None: unconditional), with
    classifier-free guidance at `cfg_scale` (1: none). Every process must call it (the model may
    be sharded over all of them) and every process gets all the images."""
    # Inputs as global arrays, split over the devices when the batch divides, built from the same
    # host values on every process (so the call is the same in 1 or N processes).
    split = batch_sharding(mesh) if num % mesh.size == 0 else NamedSharding(mesh, PartitionSpec())
    to_global = lambda a: jax.make_array_from_callback(a.shape, split, lambda index: a[index])  # noqa: E731
    denoise = Denoiser(model, schedule, parameterization)
    if labels is not None:
        denoise = ClassifierFreeGuidance(denoise, to_global(np.asarray(labels, np.int32)), cfg_scale, model.null_label)
    sigmas = karras_sigmas(steps, schedule.sigma_min, schedule.sigma_max)
    noise = np.random.default_rng(seed).standard_normal((num, *image_shape), np.float32)
    out = sample(denoise, to_global(np.float32(sigmas[0]) * noise), sigmas, method, jax.random.key(seed))
    return np.asarray(multihost_utils.process_allgather(out, tiled=True))


def start_jax(cfg: Config) -> None:
    """Device simulation, the compile cache and jax.distributed: all before the backend starts."""
    if cfg.cpu_devices:
        jax.config.update("jax_num_cpu_devices", cfg.cpu_devices)
    if cfg.compilation_cache_dir:
        jax.config.update("jax_compilation_cache_dir", cfg.compilation_cache_dir)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    if cfg.coordinator == "auto":  # SLURM, Open MPI, TPU pods, ...: jax reads the cluster's env
        jax.distributed.initialize()
    elif cfg.coordinator:
        jax.distributed.initialize(cfg.coordinator, num_processes=cfg.num_processes, process_id=cfg.process_id)


def main(cfg: Config) -> None:
    start_jax(cfg)
    run_dir = Path(cfg.run_dir)
    is_main = jax.process_index() == 0

    source = open_source(cfg.dataset, cfg.image_size)
    image_shape, num_classes = source.image_shape, source.num_classes
    mesh = make_mesh(data=-1, fsdp=cfg.fsdp_size)
    check_batch(cfg, mesh.size)
    schedule = schedule_by_name(cfg.schedule)
    parameterization = parameterization_by_name(cfg.parameterization)

    def make_model(key):
        return MODELS[cfg.model](image_shape, num_classes, cfg.remat, key)

    warmup = cfg.warmup_steps if cfg.warmup_steps < cfg.steps else cfg.steps // 10
    if warmup != cfg.warmup_steps:
        tqdm.write(f"--warmup_steps {cfg.warmup_steps} >= --steps {cfg.steps}: warming up for {warmup} steps")
    optimizer, lr_schedule = adamw_cosine(cfg.lr, cfg.steps, warmup, cfg.weight_decay)

    # The state's shapes and FSDP layout, nothing allocated: the step compiles from these.
    abstract, shardings = abstract_train_state(make_model, optimizer, mesh, cfg.fsdp_min_param_size)
    null_label = abstract.model.null_label

    # ---- the loss: per-example randomness for the whole batch, then EDM's weighted MSE ----
    def prepare(batch, key):
        key_draw, key_drop = jax.random.split(key)
        sigma, noise = draw_sigma_and_noise(schedule, batch["images"], key_draw)
        labels = drop_labels(key_drop, batch["labels"], cfg.label_dropout, null_label) if num_classes else None
        return dict(batch, sigma=sigma, noise=noise, labels=labels)

    def loss_fn(model, batch, key):
        return denoising_loss_at(
            model, schedule, parameterization, batch["images"], batch["sigma"], batch["noise"], batch["labels"], key=key
        )

    data_sharding = batch_sharding(mesh)
    train_step = make_train_step(
        prepare=prepare, loss_fn=loss_fn, optimizer=optimizer, lr_schedule=lr_schedule, ema_decay=cfg.ema_decay,
        state_shardings=shardings, batch_sharding=data_sharding, seed=cfg.seed,
        grad_accum_steps=cfg.grad_accum_steps, precision=cfg.precision,
    )  # fmt: skip

    # ---- a fresh state, or the newest checkpoint restored onto this run's mesh, while the step
    # compiles in a thread (it needs only shapes; XLA's compiler releases the GIL) ----
    checkpoints = Checkpoints(run_dir / "checkpoints", keep=cfg.keep_checkpoints)
    resume = checkpoints.latest() if cfg.resume_step < 0 else cfg.resume_step
    with ThreadPoolExecutor(1) as pool:
        compiling = pool.submit(train_step.compile, abstract, batch_spec(source, cfg.batch_size))
        if resume is None:
            state, _ = create_train_state(
                make_model, optimizer, jax.random.key(cfg.seed), mesh, cfg.fsdp_min_param_size, shardings=shardings
            )
            start_step, start_example = 0, 0
        else:
            state, position, _ = checkpoints.restore(resume, abstract, shardings)
            check_position(position, cfg.seed, source)
            start_step, start_example = resume, position["examples_consumed"]
            tqdm.write(f"resumed from {checkpoints.directory / str(resume)} ({start_example} examples consumed)")
        tqdm.write(f"mesh {dict(mesh.shape)}; " + sharding_summary(state, shardings))
        compiling.result()  # a compile error surfaces here

    def write_samples(step: int) -> Path | None:
        """Every process samples (the EMA is sharded over all of them); process 0 writes the PNG."""
        rows = num_classes or 10
        labels = np.repeat(np.arange(rows), 10) if num_classes else None  # one row per class
        out = generate(
            state.ema, schedule, parameterization, labels, rows * 10, image_shape, mesh=mesh,
            steps=cfg.sample_steps, method="heun", cfg_scale=cfg.cfg_scale, seed=cfg.seed + step,
        )  # fmt: skip
        if is_main:
            return save_image_grid(run_dir / "samples" / f"step_{step:06d}.png", out, ncols=10, upscale=4)
        return None

    def save_checkpoint(step: int) -> None:
        examples = start_example + batches.delivered * cfg.batch_size  # batches handed to the step
        config = dict(dataclasses.asdict(cfg), image_shape=list(image_shape), num_classes=num_classes)
        if not checkpoints.save(step, state, data_position(examples, cfg.seed, source), config):
            if step not in checkpoints.steps:
                tqdm.write(f"step {step}: the state holds a non-finite value; checkpoint not saved")

    stream = batch_stream(
        source, cfg.batch_size, cfg.seed, start_example=start_example, hflip=cfg.hflip,
        process_index=jax.process_index(), process_count=jax.process_count(),
    )  # fmt: skip
    to_global = lambda b: jax.tree.map(lambda x: jax.make_array_from_process_local_data(data_sharding, x), b)  # noqa: E731
    peak, peak_source = peak_flops_per_device(dtype="fp32" if cfg.precision == "fp32" else "bf16")
    profile = _profile_range(cfg.profile_steps)
    flops_per_device = float("nan")
    if start_step >= cfg.steps:
        tqdm.write(f"the checkpoint at step {start_step} already reaches --steps {cfg.steps}; nothing to train")

    with Prefetch(stream, to_global, depth=2) as batches, MetricsLogger(
        run_dir, wandb_mode=cfg.wandb, config=dataclasses.asdict(cfg), enabled=is_main
    ) as logger, checkpoints, StopRequest() as stop:
        logger.truncate_after(start_step)  # a resumed run logs each step once
        window, previous, step, timed = [], None, start_step, 0
        first = start_step + 1
        steps = range(first, cfg.steps + 1)
        bar = tqdm(steps, desc="train", total=cfg.steps, initial=start_step, mininterval=2.0, disable=not is_main)
        for step in bar:
            if profile and step == profile[0]:
                jax.profiler.start_trace(str(run_dir / "profile"))
            batch = next(batches)
            if step == first:  # the step's lowering (already compiled): FLOPs from XLA's cost analysis
                flops_per_device = step_flops(train_step, state, batch) / mesh.size
            state, metrics = train_step(state, batch)
            if previous is not None:  # at most 2 in flight: more deadlocks XLA:CPU's collective rendezvous
                jax.block_until_ready(previous["loss"])
            previous = metrics
            window.append(metrics)
            timed += 1
            if step == first:
                jax.block_until_ready(metrics)
                logger.log_once(
                    {
                        "startup/time_to_first_step_s": time.perf_counter() - PROCESS_START,
                        "startup/step_flops_per_device": flops_per_device,
                        "startup/peak_flops_per_device": peak,
                        "startup/peak_source": peak_source,
                    }
                )
                timed, window_start = 0, time.perf_counter()  # the compile is not a step time
            if profile and step == profile[1] - 1:
                jax.block_until_ready(metrics)
                jax.profiler.stop_trace()
            if step % cfg.log_every == 0 or step == cfg.steps:
                rows = jax.device_get(window)  # the one host read per log interval
                step_time = (time.perf_counter() - window_start) / timed if timed else float("nan")
                logged = {
                    "train/loss": float(np.mean([r["loss"] for r in rows if r["finite"]] or [np.nan])),
                    "train/grad_norm": float(rows[-1]["grad_norm"]),
                    "train/lr": float(rows[-1]["lr"]),
                    "train/bad_steps": int(rows[-1]["bad_steps"]),
                    "train/step_time_ms": 1000 * step_time,
                    "train/samples_per_sec": cfg.batch_size / step_time,
                    "train/mfu": mfu(flops_per_device, step_time, peak),
                }
                logger.log(step, logged)
                bar.set_postfix(loss=f"{logged['train/loss']:.4f}", img_s=f"{logged['train/samples_per_sec']:.0f}")
                worst = max(int(r["bad_steps"]) for r in rows)
                if worst >= cfg.max_bad_steps:
                    raise RuntimeError(
                        f"{worst} consecutive non-finite steps (loss or gradients) by step {step}; the state "
                        f"was kept from before them. Lower --lr, try --precision fp32, or raise --max_bad_steps."
                    )
                window, timed, window_start = [], 0, time.perf_counter()
            paused = time.perf_counter()
            if cfg.sample_every > 0 and (step % cfg.sample_every == 0 or step == cfg.steps):
                path = write_samples(step)
                if path:
                    bar.write(f"step {step}: samples -> {path}")
            stopping = stop.should_stop(step, cfg.log_every)
            if stopping or step % cfg.ckpt_every == 0 or step == cfg.steps:
                save_checkpoint(step)
            window_start += time.perf_counter() - paused  # sampling and saving are not training time
            if stopping:
                bar.write(f"{stop.received or 'another process'} received: saved step {step}, exiting")
                break
        checkpoints.wait()  # the final save is on disk before the process exits


if __name__ == "__main__":
    main(parse_config())
