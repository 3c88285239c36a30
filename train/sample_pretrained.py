"""Samples a published checkpoint by its authors' protocol: a DiT or SiT (`dit:FILE`, `sit:FILE`: class labels, decoded
by the SD VAE, as DiT's and SiT's `sample_ddp.py`) or a diffusers Stable Diffusion 1.x/2.x or XL pipeline folder
(`sd:FOLDER`: prompts, as diffusers' pipeline makes them from the same noise). A run of train/main.py samples with
train/sample.py instead.

    python train/sample_pretrained.py --pretrained dit:DiT-XL-2-256x256.pt --vae sd-vae-ft-ema/ --num 50000 \\
        --method ddpm --steps 250 --guidance 1.5 --out dit_xl2.npz
    python train/sample_pretrained.py --pretrained sit:SiT-XL-2-256x256.pt --vae sd-vae-ft-ema/ --num 50000 \\
        --method sde --steps 250 --guidance 1.5 --out sit_xl2.npz
    python train/sample_pretrained.py --pretrained sd:stable-diffusion-v1-5/ --prompts "a photo of a cat" "a red car" \\
        --negative_prompts "blurry" "" --guidance 7.5 --steps 30 --method dpmpp_2m --out grid.png

What each flag means for each family; a flag left off is the family's official default (FAMILIES):
- dit: `--method` ddpm (ancestral, the learned variance) or ddim; `--steps` the respacing (250);
  `--guidance` 1.5 (on the first 3 latent channels); `eqxdiff.pretrained.sample_dit`.
- sit: `--method` ode or sde, `--sampler` (ode: dopri5 (default), heun, euler; sde: euler (default), heun), `--steps`
  the time grid's points (250; dopri5 needs none); `--guidance` 1.0; `eqxdiff.pretrained.sample_sit`.
- sd: `--method` swaps the folder's scheduler for another class made from its config (diffusers' `from_config`): ddim,
  euler, euler_ancestral or dpmpp_2m (default: the folder's own); `--steps` 30, `--guidance` 7.5.

dit/sit: latents decode as `vae.decode(z / 0.18215)` (the folder's `scaling_factor`), images become uint8 as theirs
do, `clamp(127.5·x + 128, 0, 255)` truncated. An .npz is ADM's sample batch, made in chunks a restart skips
(eqxdiff/eval/sample_batches.py: labels balanced over `--classes`, each chunk's noise from (seed, chunk)); a .png is
a grid of the `--num` images, a row per class. FID and the rest of ADM's table: `train/evaluate.py REF.npz OUT.npz`.

sd: `--per_prompt` images for each of `--prompts` (default 1; or `--num` in all, a multiple of the prompts);
`--negative_prompts` one per prompt, or one for all (default: SD 1.x/2.x "", SDXL zeros when its model_index.json
says force_zeros_for_empty_prompt). `--seed` draws each image's noise (image i's from fold_in(seed's noise key, i),
whatever --batch_size: images per pipeline call); `--out` a .png grid (a row per prompt) or an .npz of `images`
(uint8 NHWC), `latents` and `prompts` (one per image). `--clip_score FOLDER` (a transformers CLIP folder:
openai/clip-vit-large-patch14 with its tokenizer and preprocessor_config.json) also prints the images' CLIP score
against their prompts, as torchmetrics computes it (eqxdiff/eval/clip_score.py). Runs on the first device.
"""

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from outputs import check_writable  # train/outputs.py
from startup import Launch, dataclass_parser, exit_on_user_error, parsed_flags, start_jax

from eqxdiff.autoencoders import TILING_MODES, open_autoencoder
from eqxdiff.eval.sample_batches import balanced_labels, chunk_key, write_sample_batches
from eqxdiff.generate import decode_latents
from eqxdiff.images import save_image_grid, to_uint8
from eqxdiff.paths import what_path_is
from eqxdiff.pretrained import load_dit, load_sit, sample_dit, sample_sit
from eqxdiff.sd import load_sd
from eqxdiff.sharding import batch_sharding, make_mesh, placement


# A table the formatter leaves as written: each field's comment is its flag's --help line.
# fmt: off
@dataclass(frozen=True)
class Flags(Launch):
    """train/sample_pretrained.py's flags: each field is `--name`, its comment the flag's help, each `# section:` line
    a group of --help (train/startup.py); the launch flags (--cpu_devices, ...) are `Launch`'s."""

    # checkpoint: the published model
    pretrained: str = ""  # dit:FILE | sit:FILE (a published .pt or .safetensors) | sd:FOLDER (a diffusers pipeline)
    vae: str = ""  # dit:, sit: the diffusers SD VAE folder their papers decode with (sd-vae-ft-ema/)
    num_heads: int | None = None  # dit:, sit: attention heads of a checkpoint not of an official size
    # draw: what is sampled
    num: int | None = None  # images (default: dit:, sit: 100; sd: --per_prompt for each prompt)
    classes: str = ""  # dit:, sit: comma-separated class indices (default: all, balanced)
    prompts: tuple[str, ...] = ()  # sd: one grid row per prompt
    negative_prompts: tuple[str, ...] = ()  # sd: one per prompt, or one for all
    per_prompt: int | None = None  # sd: images per prompt (default 1, or --num / prompts)
    seed: int = 0  # the sampler's noise
    # sampler: each one left off the family's official default
    method: str = ""  # dit: ddpm|ddim; sit: ode|sde; sd: ddim|euler|euler_ancestral|dpmpp_2m (default: its scheduler)
    sampler: str = ""  # sit: ode dopri5|heun|euler, sde euler|heun
    steps: int | None = None  # sampler steps (default: dit:, sit: 250; sd: 30)
    guidance: float | None = None  # classifier-free guidance scale (1: none; default: dit: 1.5, sit: 1.0, sd: 7.5)
    vae_tiling: str = "auto"  # dit:, sit: decode tile by tile (diffusers' tiling); auto: images above 768²
    # output: where the samples go
    out: str = "samples.png"  # a .png grid, or an .npz (dit:, sit: ADM's sample batch; sd: images, latents, prompts)
    clip_score: str = ""  # sd: also the images' CLIP score against their prompts, with this CLIP folder
    batch_size: int = 500  # samples per sampler call (dit:, sit: rounded up to a multiple of the devices; sd: images per pipeline call)
# fmt: on


# A table the formatter leaves as written: each field's comment is its flag's --help line.
# fmt: off
@dataclass(frozen=True)
class Family:
    """A published family's official defaults (its sample_ddp.py's, diffusers' pipeline's) and its loader."""

    name: str
    methods: tuple[str, ...]  # what --method may be
    method: str  # --method's default ("": the folder's own scheduler)
    steps: int
    guidance: float
    load: Callable | None = None  # (file, num_heads, place=) -> the network (dit:, sit:)
# fmt: on


FAMILIES = {
    "dit": Family("DiT", ("ddpm", "ddim"), "ddpm", 250, 1.5, load_dit),
    "sit": Family("SiT", ("ode", "sde"), "ode", 250, 1.0, load_sit),
    "sd": Family("Stable Diffusion pipeline", ("ddim", "euler", "euler_ancestral", "dpmpp_2m"), "", 30, 7.5),
}
SIT_SAMPLERS = {"ode": "dopri5", "sde": "euler"}  # each SiT method's default integrator
# Flags of train/sample.py's runs: one line saying where they belong.
MOVED = {
    **{
        f"--{name}": f"--{name} measures samples of a run (train/sample.py); measure a published checkpoint's batch "
        f"with train/evaluate.py REF.npz OUT.npz"
        for name in ("eval", "fid")
    },
    "--run_dir": "--run_dir: a run of train/main.py samples with python train/sample.py --run_dir RUN",
}


def parse_args(argv: list[str] | None = None) -> Flags:
    """The command line as one frozen `Flags`, each default the family's (`resolved`), checked before JAX starts."""
    parser = dataclass_parser(Flags, __doc__, {"vae_tiling": list(TILING_MODES)}, required=("pretrained",), moved=MOVED)
    flags = parsed_flags(Flags, parser.parse_args(argv))
    if Path(flags.out).suffix not in (".png", ".npz"):
        parser.error(f"--out must end in .png or .npz, got {flags.out!r}")
    if min(flags.num or 1, flags.steps or 1, flags.per_prompt or 1, flags.batch_size) < 1:
        parser.error("--num, --steps, --per_prompt and --batch_size must be >= 1")
    return resolved(flags)


def resolved(flags: Flags) -> Flags:
    """`flags` with every default the family's, after the checks that need no JAX; a flag that does not fit is one
    line naming the fix."""
    family, _, path = flags.pretrained.partition(":")
    if family not in FAMILIES or not path:
        raise SystemExit(
            f"--pretrained {flags.pretrained!r}: give dit:FILE or sit:FILE (a published .pt or "
            ".safetensors), or sd:FOLDER (a diffusers Stable Diffusion pipeline)."
        )
    defaults = FAMILIES[family]
    method = flags.method or defaults.method
    if method and method not in defaults.methods:
        methods = (" or " if len(defaults.methods) == 2 else ", ").join(defaults.methods)
        raise SystemExit(
            f"--method {method}: a {defaults.name} samples with {methods}"
            + (" (default: its scheduler's)." if family == "sd" else ".")
        )
    if flags.clip_score and family != "sd":
        raise SystemExit("--clip_score scores --pretrained sd:FOLDER's images against their prompts")
    if flags.sampler and family != "sit":
        raise SystemExit("--sampler chooses SiT's integrator (ode: dopri5, heun, euler; sde: euler, heun).")
    common = dict(
        method=method,
        steps=flags.steps or defaults.steps,
        guidance=defaults.guidance if flags.guidance is None else flags.guidance,
    )
    if family == "sd":
        return dataclasses.replace(flags, **common, **sd_counts(flags))
    check_class_conditional(flags, family, Path(path))
    sampler = (flags.sampler or SIT_SAMPLERS[method]) if family == "sit" else ""
    return dataclasses.replace(flags, **common, sampler=sampler, num=flags.num or 100)


def check_class_conditional(flags: Flags, family: str, path: Path) -> None:
    """A dit:/sit: file, its VAE, and no flag of sd:'s, or a one-line error naming the fix."""
    if not path.is_file():
        given = what_path_is(path) + (f" (did you mean sd:{path}?)" if (path / "model_index.json").is_file() else "")
        raise SystemExit(
            f"--pretrained {family}:{path}: no file {path}: it {given}; give {family}:FILE "
            f"(DiT-XL-2-256x256.pt, SiT-XL-2-256x256.pt, a train.py checkpoint, or one as "
            f".safetensors)."
        )
    if not flags.vae or not Path(flags.vae, "config.json").is_file():
        raise SystemExit(
            f"--pretrained {family}: needs --vae FOLDER: the diffusers SD VAE its paper decodes with "
            f"(sd-vae-ft-ema/ or sd-vae-ft-mse/, config.json + weights); got {flags.vae or 'none'}."
        )
    if flags.prompts or flags.negative_prompts or flags.per_prompt:
        raise SystemExit(
            f"--pretrained {family}: draws class labels (--classes); --prompts, --negative_prompts and "
            "--per_prompt are for sd:FOLDER."
        )


def sd_counts(flags: Flags) -> dict:
    """sd:'s folder checked, and its `num` and `per_prompt`: --per_prompt images for each prompt (default 1), or
    --num in all, as many for each."""
    folder = Path(flags.pretrained.partition(":")[2]).expanduser()
    if not (folder / "model_index.json").is_file():
        given = what_path_is(folder) + (f" (did you mean dit:{folder} or sit:{folder}?)" if folder.is_file() else "")
        raise SystemExit(
            f"--pretrained sd:{folder}: no model_index.json there: {folder} {given}; give a diffusers "
            "pipeline folder (model_index.json, unet/, vae/, text_encoder/, tokenizer/, "
            "scheduler/)."
        )
    if flags.vae or flags.classes or flags.num_heads:
        raise SystemExit(
            "--pretrained sd: takes --prompts, --negative_prompts, --guidance, --steps, --method, --seed "
            "and --out; the pipeline brings its own VAE (no --vae, --classes, --num_heads)."
        )
    prompts, negative = flags.prompts, flags.negative_prompts
    if not prompts:
        raise SystemExit('--pretrained sd: needs --prompts "a photo of a cat" ... (one image each).')
    if flags.clip_score and not (Path(flags.clip_score).expanduser() / "preprocessor_config.json").is_file():
        raise SystemExit(
            f"--clip_score {flags.clip_score}: no preprocessor_config.json there; give a transformers CLIP "
            "folder (openai/clip-vit-large-patch14: config.json, model.safetensors, its tokenizer and "
            "preprocessor_config.json)."
        )
    if negative and len(negative) not in (1, len(prompts)):
        raise SystemExit(
            f"--negative_prompts: one for all prompts or one per prompt ({len(prompts)}), got {len(negative)}."
        )
    per_prompt = flags.per_prompt or 1
    if flags.num is not None:  # --num images in all: as many for each prompt
        per_prompt, rest = divmod(flags.num, len(prompts))
        if rest or (flags.per_prompt is not None and per_prompt != flags.per_prompt):
            raise SystemExit(
                f"--num {flags.num}: --pretrained sd: makes --per_prompt images for each of the "
                f"{len(prompts)} prompts; pass --per_prompt N alone, or --num a multiple of "
                f"{len(prompts)}."
            )
    return dict(
        num=len(prompts) * per_prompt,
        per_prompt=per_prompt,
        negative_prompts=negative * len(prompts) if len(negative) == 1 else negative,
    )


def main(flags: Flags) -> None:
    """`flags`: parse_args' (every default resolved)."""
    if flags.pretrained.startswith("sd:"):
        sample_sd(flags)
    else:
        sample_class_conditional(flags)


# ---- dit:, sit: a batch of class-conditional samples, as their sample_ddp.py makes it ----
def latents_fn(family: str, flags: Flags):
    """(model, labels [b], x_T [b, s, s, c], key) -> latents, one jitted program (the sampler's own scan inside)."""
    if family == "dit":

        def run(model, labels, noise, key):
            return sample_dit(
                model, labels, noise, steps=flags.steps, method=flags.method, guidance=flags.guidance, key=key
            )
    else:

        def run(model, labels, noise, key):
            return sample_sit(
                model,
                labels,
                noise,
                steps=flags.steps,
                method=flags.method,
                sampler=flags.sampler,
                guidance=flags.guidance,
                key=key,
            )

    return eqx.filter_jit(run)


def to_uint8_official(images: np.ndarray) -> np.ndarray:
    """DiT's and SiT's sample_ddp.py: `torch.clamp(127.5 * x + 128.0, 0, 255).to(torch.uint8)` (truncation)."""
    return np.clip(127.5 * np.asarray(images, np.float32) + 128.0, 0, 255).astype(np.uint8)


def sample_class_conditional(flags: Flags) -> None:
    family, _, file = flags.pretrained.partition(":")
    path = Path(file)
    start_jax(flags)
    mesh = make_mesh(data=-1, fsdp=1)
    try:
        model = FAMILIES[family].load(path, flags.num_heads, place=placement(mesh))
        vae = open_autoencoder(flags.vae, mesh=mesh)
    except (ValueError, OSError) as e:  # not a DiT/SiT state_dict, an unofficial size without --num_heads, a bad VAE
        raise SystemExit(str(e)) from e
    size, channels, num_classes = model.image_size, model.in_channels, model.num_classes
    classes = [int(c) for c in flags.classes.split(",")] if flags.classes else list(range(num_classes))
    if not all(0 <= c < num_classes for c in classes):
        raise SystemExit(f"--classes: indices in 0..{num_classes - 1} (this checkpoint's classes).")
    chunk_size = -(-flags.batch_size // mesh.size) * mesh.size  # rows split evenly over every device
    rows = batch_sharding(mesh)
    latents_of = latents_fn(family, flags)

    def sample_chunk(labels: np.ndarray, key) -> np.ndarray:
        noise_key, sampler_key = jax.random.split(key)
        noise = jax.device_put(jax.random.normal(noise_key, (len(labels), size, size, channels)), rows)
        latents = latents_of(model, jax.device_put(jnp.asarray(labels, jnp.int32), rows), noise, sampler_key)
        latents = np.asarray(multihost_utils.process_allgather(latents, tiled=True))
        return to_uint8_official(decode_latents(vae, latents, mesh=mesh, tiling=flags.vae_tiling))

    recorded = {
        "--pretrained": str(path.resolve()),
        "--vae": str(Path(flags.vae).resolve()),
        "--num": flags.num,
        "--seed": flags.seed,
        "--batch_size": chunk_size,
        "--classes": classes,
        "--method": flags.method,
        "--sampler": flags.sampler or None,
        "--steps": flags.steps,
        "--guidance": flags.guidance,
    }
    if Path(flags.out).suffix == ".npz":
        write_sample_batches(
            sample_chunk,
            flags.out,
            num=flags.num,
            chunk_size=chunk_size,
            seed=flags.seed,
            classes=classes,
            flags=recorded,
        )
    else:  # a grid: --num images in one chunk, grouped by class
        labels = np.sort(balanced_labels(flags.num, classes, flags.seed))
        padded = np.concatenate([labels, np.full(-len(labels) % mesh.size, labels[-1], labels.dtype)])
        images = sample_chunk(padded, chunk_key(flags.seed, 0))[: len(labels)]
        if jax.process_index() == 0:
            save_image_grid(flags.out, images.astype(np.float32) / 127.5 - 1, ncols=min(10, len(images)))
    if jax.process_index() == 0:
        sampler = f" {flags.sampler}" if flags.sampler else ""
        print(
            f"{flags.pretrained}: {flags.num} samples ({flags.method}{sampler}, {flags.steps} steps, guidance "
            f"{flags.guidance:g}) -> {flags.out}"
        )


# ---- sd: a Stable Diffusion pipeline's images of prompts, as diffusers' pipeline makes them ----
def sample_sd(flags: Flags) -> None:
    folder = Path(flags.pretrained.partition(":")[2]).expanduser()
    check_writable(flags.out, "--out")  # its folder made (the README's runs/sd15/), before the pipeline loads
    start_jax(flags)
    try:
        pipe = load_sd(folder)
        if flags.method:
            pipe = pipe.with_scheduler(flags.method)
    except (ValueError, OSError) as e:  # another pipeline class, a missing part, an unported scheduler option
        raise SystemExit(f"--pretrained sd:{folder}: {e}") from e
    prompts = [p for p in flags.prompts for _ in range(flags.per_prompt)]  # prompt-major: a grid row per prompt
    negative = [n for n in flags.negative_prompts for _ in range(flags.per_prompt)] or None
    config = json.loads(pipe.unet.config)
    side = config["sample_size"]  # latents, as diffusers' default height/width
    noise_key, step_key = jax.random.split(jax.random.key(flags.seed))
    noise = [
        jax.random.normal(jax.random.fold_in(noise_key, i), (1, side, side, config["in_channels"]))
        for i in range(len(prompts))
    ]
    latents = []
    for start in range(0, len(prompts), flags.batch_size):  # images per pipeline call
        rows = slice(start, start + flags.batch_size)
        latents.append(
            pipe.latents(
                prompts[rows],
                None if negative is None else negative[rows],
                steps=flags.steps,
                guidance=flags.guidance,
                initial_latents=np.concatenate(noise[rows]),
                key=jax.random.fold_in(step_key, start),
            )
        )
    latents = np.concatenate([np.asarray(x) for x in latents])
    images = np.asarray(pipe.decode(latents))
    if Path(flags.out).suffix == ".npz":
        np.savez(flags.out, images=to_uint8(images), latents=latents, prompts=np.asarray(prompts))
    else:
        save_image_grid(flags.out, images, ncols=flags.per_prompt, row_labels=list(flags.prompts))
    print(
        f"{flags.pretrained}: {len(prompts)} {'image' if len(prompts) == 1 else 'images'} ({flags.per_prompt} per "
        f"prompt, {pipe.scheduler.method}, {flags.steps} steps, guidance {flags.guidance:g}) -> {flags.out}"
    )
    if flags.clip_score:
        from eqxdiff.eval.clip_score import CLIPScorer, clip_score  # imported here: only this flag needs it

        try:
            scorer = CLIPScorer.from_transformers(flags.clip_score)
        except (ValueError, OSError) as e:
            raise SystemExit(f"--clip_score {flags.clip_score}: {e}") from e
        scores = scorer.scores(list(to_uint8(images)), prompts)
        print(f"CLIP score {clip_score(scores):.4f} ({len(prompts)} images against their prompts, {flags.clip_score})")


if __name__ == "__main__":
    exit_on_user_error(lambda: main(parse_args()))
