"""The workloads benchmarks/bench_xla_cpu.py times under each set of XLA:CPU switches.

Training workloads (a step, its state and batches): `build(mesh, args, total_steps) -> TrainWork`.
- `digits`: the default digits job (`digits_job`: `UNet(1, (32, 64), 1, num_classes=10)`, 8×8×1,
  batch 64, EDM, label dropout 0.1, AdamW).
- `flaxdiff_unet`: FlaxDiff's simple UNet as bench_train_vs_flaxdiff.py trains it
  (`UNet.flaxdiff_simple(3)`, 32×32×3, batch 32, EDM, AdamW).
- `text_step`: the text-conditioned step with a frozen CLIP text tower in it (bench_text_step.py's
  `in_step` variant: UNet (64, 128) × 2 with cross-attention, 32×32×3, batch 16, caption tokens
  encoded by a 2-layer width-768 tower, the step's frozen argument).

Forward workloads (a jitted function of a network and an input, no gradient):
`build(args) -> ForwardWork`.
- `vae_encode` / `vae_decode`: the SD VAE (bench_vae.py's diffusers config, 83.7M params, random
  weights, nothing downloaded), `vae.encode` of 1×128×128×3 images / `vae.decode` of 1×16×16×4 latents.
- `inception`: pytorch-fid's FID Inception (random weights), pool3 features of 16 uint8 images of
  299×299 (`eqxdiff.eval.fid.rgb_features`, as FID extraction calls it).

Each workload's figures (batch, steps or calls per round, rounds) are sized so that a run over the
default sides stays around three minutes on a quiet 2-core box (the training steps' ten compiles, 10–20 s
each there, are half of it or more: `--sides` narrows a run); `--quick` shrinks each to a smoke run.
"""

import functools
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace

import jax
import numpy as np

from bench_text_step import TOKENS, TOWERS, variant  # benchmarks/ is on sys.path when run as a script
from bench_vae import SD_VAE, SMALL_VAE
from digits_job import digits_job
from eqxdiff.data import batch_stream
from eqxdiff.eval import InceptionV3
from eqxdiff.eval.fid import rgb_features
from eqxdiff.nn import AutoencoderKL, CLIPTextModel, UNet
from eqxdiff.sharding import batch_sharding
from eqxdiff.training import adamw_cosine, create_train_state, make_train_step
from unconditional_edm import unconditional_edm


@dataclass
class TrainWork:
    state: object
    step: object  # eqxdiff.training.TrainStep
    next_batch: Callable[[], dict]  # a host (or device) batch
    frozen: object = None  # the step's frozen argument (a text tower), or None


@dataclass
class ForwardWork:
    network: object  # an eqx.Module: the forward's first argument
    forward: Callable  # forward(network, x) -> output
    input: object  # x (a host array)
    items: int  # images per call


@dataclass
class Workload:
    build: Callable
    kind: str  # "train" | "forward"
    batch: int  # images per step or call
    steps: int  # steps (train) or calls (forward) per timed round
    rounds: int
    warmup: int  # untimed steps or calls per side after the first
    what: str


def digits_workload(mesh, args, total_steps) -> TrainWork:
    job = digits_job(mesh, total_steps=total_steps, seed=args.seed)
    host = batch_stream(job.digits, args.batch, args.seed)
    return TrainWork(job.state, job.train_step, lambda: next(host))


def flaxdiff_unet_workload(mesh, args, total_steps) -> TrainWork:
    optimizer, lr_schedule = adamw_cosine(2e-4, max(1000, total_steps + 1), 10, 1e-4)
    make_model = lambda key: UNet.flaxdiff_simple(3, key=key)  # noqa: E731
    state, shardings = create_train_state(make_model, optimizer, jax.random.key(args.seed), mesh, 2**14)
    prepare, loss_fn = unconditional_edm()
    step = make_train_step(
        prepare=prepare,
        loss_fn=loss_fn,
        optimizer=optimizer,
        lr_schedule=lr_schedule,
        ema_decay=0.995,
        state_shardings=shardings,
        batch_sharding=batch_sharding(mesh),
        seed=args.seed,
    )
    rng = np.random.default_rng(args.seed)
    size = 8 if args.quick else 32
    return TrainWork(state, step, lambda: {"image": rng.integers(0, 256, (args.batch, size, size, 3), dtype=np.uint8)})


@functools.cache
def _text_tower() -> CLIPTextModel:
    """bench_text_step.py's small tower (key 1), drawn once: every side's step reads the same weights."""
    config = {"vocab_size": 49408, "max_position_embeddings": TOKENS, "eos_token_id": 49407, **TOWERS["small"]}
    return CLIPTextModel.from_config(config, key=jax.random.key(1))


def text_step_workload(mesh, args, total_steps) -> TrainWork:
    sized = SimpleNamespace(batch=args.batch, image_size=8 if args.quick else 32)
    step, state, batch, frozen = variant("in_step", sized, mesh, _text_tower())
    return TrainWork(state, step, lambda: batch, frozen)


def _vae(args) -> AutoencoderKL:
    return AutoencoderKL.from_config(SMALL_VAE if args.quick else SD_VAE, key=jax.random.key(args.seed))


def vae_encode_workload(args) -> ForwardWork:
    size = 32 if args.quick else 128
    x = np.random.default_rng(args.seed).uniform(-1, 1, (args.batch, size, size, 3)).astype(np.float32)
    return ForwardWork(_vae(args), lambda vae, x: vae.encode(x), x, args.batch)


def vae_decode_workload(args) -> ForwardWork:
    vae = _vae(args)
    size = (32 if args.quick else 128) // vae.downsample_factor
    latent = vae.decoder.conv_in.weight.shape[2]
    z = np.random.default_rng(args.seed).standard_normal((args.batch, size, size, latent)).astype(np.float32)
    return ForwardWork(vae, lambda vae, z: vae.decode(z), z, args.batch)


def inception_workload(args) -> ForwardWork:
    size = 32 if args.quick else 299
    images = np.random.default_rng(args.seed).integers(0, 256, (args.batch, size, size, 3), dtype=np.uint8)
    return ForwardWork(InceptionV3(key=jax.random.key(args.seed)), rgb_features, images, args.batch)


WORKLOADS = {  # build, kind, batch, steps (calls) per round, rounds, warm-up, what
    "digits": Workload(digits_workload, "train", 64, 20, 4, 3, "default digits job step, 8x8x1"),
    "flaxdiff_unet": Workload(flaxdiff_unet_workload, "train", 32, 3, 3, 3, "UNet.flaxdiff_simple(3) step, 32x32x3"),
    "text_step": Workload(text_step_workload, "train", 16, 2, 3, 1, "text-conditioned step, frozen tower, 32x32x3"),
    "vae_encode": Workload(vae_encode_workload, "forward", 1, 6, 4, 1, "SD VAE encode, 128x128x3"),
    "vae_decode": Workload(vae_decode_workload, "forward", 1, 3, 4, 1, "SD VAE decode, 16x16x4 -> 128x128x3"),
    "inception": Workload(inception_workload, "forward", 16, 4, 4, 1, "FID Inception pool3, uint8 299x299x3"),
}
