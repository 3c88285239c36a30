"""train/sample.py --pretrained dit:FILE | sit:FILE: a published DiT or SiT checkpoint, sampled by its
paper's protocol and decoded by the SD VAE, as DiT's and SiT's `sample_ddp.py` do.

    python train/sample.py --pretrained dit:DiT-XL-2-256x256.pt --vae sd-vae-ft-ema/ --num 50000 \\
        --method ddpm --steps 250 --cfg 1.5 --out dit_xl2.npz
    python train/sample.py --pretrained sit:SiT-XL-2-256x256.pt --vae sd-vae-ft-ema/ --num 50000 \\
        --method sde --steps 250 --cfg 1.5 --out sit_xl2.npz

What each flag means for each family, with their official scripts' defaults:
- dit: `--method` ddpm (ancestral, the learned variance) or ddim; `--steps` the respacing (250);
  `--cfg` 1.5 (guidance on the first 3 latent channels); `eqxdiff.pretrained.sample_dit`.
- sit: `--method` ode or sde, `--sampler` (ode: dopri5 (default), heun, euler; sde: euler (default),
  heun), `--steps` the time grid's points (250; dopri5 needs none); `--cfg` 1.0;
  `eqxdiff.pretrained.sample_sit`.
Latents decode as `vae.decode(z / 0.18215)` (the folder's `scaling_factor`), images become uint8 as
theirs do, `clamp(127.5·x + 128, 0, 255)` truncated. An .npz is ADM's sample batch, made in chunks a
restart skips (eqxdiff/eval/sample_batches.py: labels balanced over `--classes`, each chunk's noise from
(seed, chunk)); a .png is a grid of the `--num` images, a row per class. FID and the rest of ADM's
table: `train/evaluate.py REF.npz OUT.npz`.
"""

import argparse
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

import sample_sd  # train/sample_sd.py: --pretrained sd:FOLDER, a diffusers Stable Diffusion pipeline
from startup import Parser, start_jax

from eqxdiff.paths import what_path_is
from eqxdiff.autoencoders import open_autoencoder
from eqxdiff.eval.sample_batches import balanced_labels, chunk_key, write_sample_batches
from eqxdiff.generate import decode_latents
from eqxdiff.images import save_image_grid
from eqxdiff.pretrained import load_dit, load_sit, sample_dit, sample_sit
from eqxdiff.sharding import batch_sharding, make_mesh, placement

FAMILIES = {"dit": (load_dit, ("ddpm", "ddim"), 1.5), "sit": (load_sit, ("ode", "sde"), 1.0)}  # loader, methods, cfg


def parse_pretrained(spec: str) -> tuple[str, Path]:
    """`dit:FILE` / `sit:FILE` -> (family, path), or a one-line error naming the fix."""
    family, _, path = spec.partition(":")
    if family not in FAMILIES or not path:
        raise SystemExit(f"--pretrained {spec!r}: give dit:FILE or sit:FILE (a published .pt or .safetensors), or "
                         "sd:FOLDER (a diffusers Stable Diffusion pipeline).")  # fmt: skip
    if not Path(path).is_file():
        given = what_path_is(path) + (f" (did you mean sd:{path}?)" if (Path(path) / "model_index.json").is_file()
                                      else "")  # fmt: skip
        raise SystemExit(f"--pretrained {family}:{path}: no file {path}: it {given}; give {family}:FILE "
                         f"(DiT-XL-2-256x256.pt, SiT-XL-2-256x256.pt, a train.py checkpoint, or one as "
                         f".safetensors).")  # fmt: skip
    return family, Path(path)


def check_args(args: argparse.Namespace) -> str:
    """The family; the flags a pretrained checkpoint takes checked, its defaults filled in, before JAX starts."""
    family, _ = parse_pretrained(args.pretrained)
    _, methods, cfg = FAMILIES[family]
    if args.run_dir:
        raise SystemExit("--pretrained and --run_dir name two models: pass one.")
    if not args.vae or not Path(args.vae, "config.json").is_file():
        raise SystemExit(f"--pretrained needs --vae FOLDER: the diffusers SD VAE its paper decodes with "
                         f"(sd-vae-ft-ema/ or sd-vae-ft-mse/, config.json + weights); got {args.vae or 'none'}.")  # fmt: skip
    if args.eval or args.fid or args.prompts:
        raise SystemExit("--pretrained writes images (--out .npz for ADM's evaluator, or a .png grid); measure "
                         "them with train/evaluate.py REF.npz OUT.npz, not --eval/--fid/--prompts.")  # fmt: skip
    args.method = args.method or methods[0]
    if args.method not in methods:
        raise SystemExit(f"--method {args.method}: a {family.upper()} samples with {' or '.join(methods)}.")
    if args.sampler and family != "sit":
        raise SystemExit("--sampler chooses SiT's integrator (ode: dopri5, heun, euler; sde: euler, heun).")
    args.steps = args.steps or 250
    args.guidance = cfg if args.guidance is None else args.guidance
    return family


def latents_fn(family: str, model, args: argparse.Namespace):
    """(labels [b], x_T [b, s, s, c]) -> latents, one jitted program (the sampler's own scan inside)."""
    if family == "dit":
        def run(model, labels, noise, key):
            return sample_dit(model, labels, noise, steps=args.steps, method=args.method, guidance=args.guidance,
                              key=key)  # fmt: skip
    else:
        def run(model, labels, noise, key):
            return sample_sit(model, labels, noise, steps=args.steps, method=args.method, sampler=args.sampler,
                              guidance=args.guidance, key=key)  # fmt: skip
    return eqx.filter_jit(run)


def to_uint8_official(images: np.ndarray) -> np.ndarray:
    """DiT's and SiT's sample_ddp.py: `torch.clamp(127.5 * x + 128.0, 0, 255).to(torch.uint8)` (truncation)."""
    return np.clip(127.5 * np.asarray(images, np.float32) + 128.0, 0, 255).astype(np.uint8)


def main(args: argparse.Namespace) -> None:
    if args.pretrained.partition(":")[0] == "sd":
        return sample_sd.main(args)
    family = check_args(args)
    _, path = parse_pretrained(args.pretrained)
    start_jax(args)
    mesh = make_mesh(data=-1, fsdp=1)
    loader = FAMILIES[family][0]
    try:
        model = loader(path, args.num_heads, place=placement(mesh))
        vae = open_autoencoder(args.vae, mesh=mesh)
    except (ValueError, OSError) as e:  # not a DiT/SiT state_dict, an unofficial size without --num_heads, a bad VAE
        raise SystemExit(str(e)) from e
    size, channels, num_classes = model.image_size, model.in_channels, model.num_classes
    classes = [int(c) for c in args.classes.split(",")] if args.classes else list(range(num_classes))
    if not all(0 <= c < num_classes for c in classes):
        raise SystemExit(f"--classes: indices in 0..{num_classes - 1} (this checkpoint's classes).")
    chunk_size = -(-args.batch_size // mesh.size) * mesh.size  # rows split evenly over every device
    rows = batch_sharding(mesh)
    latents_of = latents_fn(family, model, args)

    def sample_chunk(labels: np.ndarray, key) -> np.ndarray:
        noise_key, sampler_key = jax.random.split(key)
        noise = jax.device_put(jax.random.normal(noise_key, (len(labels), size, size, channels)), rows)
        latents = latents_of(model, jax.device_put(jnp.asarray(labels, jnp.int32), rows), noise, sampler_key)
        latents = np.asarray(multihost_utils.process_allgather(latents, tiled=True))
        return to_uint8_official(decode_latents(vae, latents, mesh=mesh, tiling=args.vae_tiling))

    flags = {"--pretrained": str(path.resolve()), "--vae": str(Path(args.vae).resolve()), "--num": args.num,
             "--seed": args.seed, "--batch_size": chunk_size, "--classes": classes, "--method": args.method,
             "--sampler": args.sampler, "--steps": args.steps, "--guidance": args.guidance}  # fmt: skip
    if Path(args.out).suffix == ".npz":
        write_sample_batches(sample_chunk, args.out, num=args.num, chunk_size=chunk_size, seed=args.seed,
                             classes=classes, flags=flags)  # fmt: skip
    else:  # a grid: --num images in one chunk, grouped by class
        labels = np.sort(balanced_labels(args.num, classes, args.seed))
        padded = np.concatenate([labels, np.full(-len(labels) % mesh.size, labels[-1], labels.dtype)])
        images = sample_chunk(padded, chunk_key(args.seed, 0))[: len(labels)]
        if jax.process_index() == 0:
            save_image_grid(args.out, images.astype(np.float32) / 127.5 - 1, ncols=min(10, len(images)))
    if jax.process_index() == 0:
        print(f"{args.pretrained}: {args.num} samples ({args.method}{f' {args.sampler}' if args.sampler else ''}, "
              f"{args.steps} steps, cfg {args.guidance:g}) -> {args.out}")  # fmt: skip


if __name__ == "__main__":  # sample.py's --pretrained part: --help says what it does, anything else where to run it
    parser = Parser(description=__doc__, usage="python train/sample.py --pretrained dit:FILE|sit:FILE --vae VAE ...")
    parser.parse_known_args()
    parser.error("this file is train/sample.py's --pretrained part: run python train/sample.py --pretrained "
                 "dit:FILE|sit:FILE --vae VAE ... (python train/sample.py --help lists the flags)")
