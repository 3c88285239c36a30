"""A trained run rebuilt from its directory alone: `load_run(run_dir, step)` restores a checkpoint's EMA
model with everything needed to sample it (its flags, codec, condition, schedule, parameterization,
sample shape), as train/main.py stored them, without importing any script. Used by train/sample.py,
train/posthoc_ema.py and the notebooks."""

import os
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import equinox as eqx
import jax
from jax.sharding import Mesh

from eqxdiff.checkpoint import Checkpoints
from eqxdiff.diffusion import Parameterization, Schedule, parameterization_by_name, schedule_by_name
from eqxdiff.ema_snapshots import EmaSnapshots
from eqxdiff.nn.abstract_network import canonical_json, remembered_structure
from eqxdiff.nn.remat import DEFAULT_REMAT_POLICY
from eqxdiff.paths import absolute, as_path
from eqxdiff.run.codecs import codec_from_config
from eqxdiff.run.finetune import open_init
from eqxdiff.run.models import CONSTRUCTORS, build_model, model_args
from eqxdiff.run.open_condition import condition_from_config, stored_condition
from eqxdiff.run.run_dir import checkpoint_steps, close_runs, current_names, saved_config
from eqxdiff.sharding import state_shardings
from eqxdiff.training.repa import network_of, with_projector

# The flags train/main.py added after its first checkpoints, at the value their absence meant (their Config
# default): a checkpoint stores every flag of its day (`stored_flags`), so an older one lacks only these.
LATER_FLAGS = dict(
    init="",
    lora_rank=0,
    lora_targets="",
    lora_alpha=0.0,
    edm_p_std=1.2,
    lr_ref_steps=0,
    phema_sigma_rels="",
    phema_every=100,
    guidance_interval="",
    xla_cpu="on",
    remat_policy=DEFAULT_REMAT_POLICY,
    finetune="",
    objective="denoising",
    meanflow_p_mean=-0.4,
    meanflow_p_std=1.0,
    meanflow_r_neq_t=0.25,
    meanflow_norm_p=1.0,
    meanflow_norm_eps=0.01,
    meanflow_omega=1.0,
    meanflow_kappa=0.5,
    repa_weight=0.0,
    repa_block=0,
    repa_encoder="",
    repa_projector_dim=2048,
    dinov2="",
    fd_dinov2_ref="",
)


@dataclass(frozen=True)
class Run:
    """A checkpoint of a train/main.py run, ready to sample."""

    ema: Any  # the EMA model, replicated over the mesh it was loaded onto
    cfg: SimpleNamespace  # the run's flags (`stored_flags`): cfg.model, cfg.guidance, ...
    stored: dict  # the config the checkpoint stores (the flags, image_shape, model_args, codec, condition, ...)
    step: int
    condition: Any  # eqxdiff/run/conditions.py: what the network is conditioned on, with its tower and null
    codec: Any  # eqxdiff/run/codecs.py: what x0 is, and how samples decode to images
    schedule: Schedule  # the run's noise schedule (its σ range and scale s(σ))
    parameterization: Parameterization  # with the run's σ_data
    image_shape: tuple[int, ...]  # one sample as the model draws it, [h, w, c] (a latent run: the latent's)
    image_dataset: str  # the images it learned (a latent run: those its latents encode)
    class_names: list[str] | None  # a folder's sub-folders (index = label), else None


def stored_flags(stored: dict) -> SimpleNamespace:
    """The flags of a run as its checkpoint's config stores them (train/main.py's Config, as attributes, renamed
    ones by their current names), with LATER_FLAGS' values for those a checkpoint from before them lacks. The config's other entries (image_shape,
    model_args, codec, ...) come along; the rebuild reads them from `stored`."""
    return SimpleNamespace(**(LATER_FLAGS | current_names(stored)))


def sigma_data(flags: Any, codec) -> float:
    """--sigma_data, else the codec's: 0.5 for images in [-1, 1], 1.0 for scaled VAE latents (train/main.py's rule)."""
    return flags.sigma_data or codec.sigma_data


def stored_run(run_dir: str | os.PathLike, step: int) -> tuple[int, dict]:
    """(the step, the config train/main.py saved with it) of checkpoint `step` (< 0: the newest), read as
    plain JSON before JAX starts; a missing run or step named in one line."""
    saved = checkpoint_steps(run_dir)  # before orbax opens anything
    if not saved:
        close = close_runs(run_dir)  # a mistyped --run_dir
        hint = f"did you mean {' or '.join(map(str, close))}? Else train" if close else "train"
        raise SystemExit(
            f"No checkpoint under {absolute(run_dir) / 'checkpoints'}: {hint} first "
            f"(train/main.py --run_dir {run_dir})."
        )
    if step >= 0 and step not in saved:
        raise SystemExit(f"--step {step}: {run_dir} holds checkpoints of steps {', '.join(map(str, saved))}.")
    return saved_config(run_dir, step)


def stored_codec(run_dir: str | os.PathLike, stored: dict, mesh: Mesh):
    """The codec a checkpoint's config describes (before codecs were stored: its `autoencoder`, if any)."""
    config = stored.get("codec") or (
        {"kind": "latents", "autoencoder": stored["autoencoder"]} if "autoencoder" in stored else None
    )
    try:
        return codec_from_config(config, mesh=mesh)
    except (FileNotFoundError, ValueError) as e:  # the VAE folder moved since the encode
        raise SystemExit(
            f"{run_dir} decodes with the VAE {config['autoencoder']}, which cannot be read now ({e}); "
            "put it back there."
        ) from e


def stored_run_condition(run_dir: str | os.PathLike, stored: dict, mesh: Mesh):
    """The condition a checkpoint's config describes (`stored_condition`: also one from before they were stored)."""
    config = stored_condition(stored)
    try:
        return condition_from_config(config, mesh=mesh)
    except KeyError as e:  # a kind this checkout has no class for
        raise SystemExit(f"{run_dir} trained with {e.args[0]}.") from e
    except (FileNotFoundError, ValueError) as e:  # the folders moved since training
        raise SystemExit(
            f"{run_dir} trained with the text tower {config['text_encoder']}, which cannot be read "
            f"now ({e}); put it back there."
        ) from e


def posthoc_dir(run_dir: str | os.PathLike, sigma_rel: float) -> os.PathLike:
    """Where train/posthoc_ema.py keeps the post-hoc EMAs of `sigma_rel` (eqxdiff.ema_snapshots, by step)."""
    return as_path(run_dir) / "posthoc_ema" / f"{sigma_rel:g}"


def load_run(
    run_dir: str | os.PathLike,
    step: int = -1,
    *,
    mesh: Mesh,
    ema: float | None = None,
    constructors: dict | None = None,
) -> Run:
    """Checkpoint `step` (< 0: the newest) of `run_dir`: its EMA model rebuilt from the stored constructor
    arguments (a checkpoint from before they were stored: its MODELS entry now) and replicated over `mesh`
    (the run may have trained on another mesh); a run, step, tower or VAE that cannot be read is a
    SystemExit naming it; a checkpoint that does not fit raises CheckpointError. `ema`: a σ_rel; the model
    is then train/posthoc_ema.py's post-hoc EMA of that profile at `step` (< 0: its newest) instead, built
    as the newest checkpoint describes it. `constructors`: the networks by the name checkpoints store
    (default eqxdiff/run/models.py's CONSTRUCTORS; a script that registers its own passes its table)."""
    asked, (step, _) = step, stored_run(run_dir, -1 if ema is not None else step)
    with Checkpoints(as_path(run_dir) / "checkpoints", read_only=True) as checkpoints:
        stored = checkpoints.restore_config(step)
        cfg = stored_flags(stored)
        condition = stored_run_condition(run_dir, stored, mesh)  # its tower and null text
        # --init: its scheduler; a LoRA's base read again from the folder, without remat as the model here
        tune = open_init(SimpleNamespace(**vars(cfg) | {"remat": False}), mesh, 2**62)
        abstract, sharding = abstract_run_ema(cfg, stored, condition, mesh, tune, constructors)
        if ema is None:  # the EMA's arrays alone: not the model's, the optimizer's or the post-hoc EMAs'
            model = checkpoints.restore_part(step, "ema", abstract, sharding)
    if ema is not None:
        step, model = load_posthoc_ema(run_dir, ema, asked, abstract, sharding)
    codec = stored_codec(run_dir, stored, mesh)
    args = stored.get("model_args") or model_args(cfg.model, tuple(stored["image_shape"]), condition)  # older: MODELS'
    net = tune.network(
        args, schedule_by_name(cfg.schedule), parameterization_by_name(cfg.parameterization, sigma_data(cfg, codec)), ()
    )
    return Run(
        ema=network_of(tune.whole(model)),  # a REPA run's without its projector
        cfg=cfg,
        stored=stored,
        step=step,
        condition=condition,
        codec=codec,
        schedule=net.schedule,
        parameterization=net.parameterization,
        image_shape=tuple(stored["image_shape"]),
        image_dataset=stored.get("image_dataset", cfg.dataset),
        class_names=stored.get("class_names"),
    )


def abstract_run_ema(
    cfg: Any, stored: dict, condition, mesh: Mesh, tune=None, constructors: dict | None = None
) -> tuple:
    """(abstract EMA, its sharding: every leaf replicated over `mesh`) of a run, from its saved config (`cfg`:
    `stored_flags(stored)`): the structure of the part its state trains, which its EMA and post-hoc EMAs copy; no
    optimizer, whose state a rebuild for sampling never reads. `tune`: its fine-tuning kind (eqxdiff/run/finetune.py's
    `open_init`), which says that part (a LoRA run's adapters; None: the network); `constructors`: `load_run`'s.
    A whole network's structure is traced once per (constructor, arguments, condition, REPA projector): sample.py
    and the notebooks load a run again and again, and each trace runs every layer's init (an SD UNet's: seconds)."""
    image_shape = tuple(stored["image_shape"])
    args = stored.get("model_args") or model_args(cfg.model, image_shape, condition)
    construct = (constructors or CONSTRUCTORS)[args["constructor"]]

    def make_model(key):
        return build_model(args, False, key, condition, constructors or CONSTRUCTORS)

    if "repa" in stored:  # a REPA run's state trains its projector beside the network (eqxdiff/training/repa.py)
        make_model = with_projector(make_model, **stored["repa"])
    trained = make_model if tune is None else tune.training(make_model, None).make_model
    trace = lambda: eqx.filter_eval_shape(trained, jax.random.key(0))  # noqa: E731
    described = canonical_json((args, condition.to_config(), stored.get("repa")))
    if trained is not make_model or described is None:  # a part of the network (LoRA's adapters, a kind's own)
        abstract = trace()
    else:  # the network itself: what its constructor, arguments, condition and projector make
        abstract = remembered_structure((abstract_run_ema, construct, type(condition), described), trace)
    return abstract, state_shardings(abstract, mesh, 2**62)  # min_size 2**62: everything replicated


def load_posthoc_ema(
    run_dir: str | os.PathLike, sigma_rel: float, step: int, abstract_ema, sharding
) -> tuple[int, Any]:
    """(step, model) of train/posthoc_ema.py's post-hoc EMA of `sigma_rel` at `step` (< 0: its newest)."""
    folder = posthoc_dir(run_dir, sigma_rel)
    with EmaSnapshots(folder, read_only=True) as saved:
        if not saved.steps or (step >= 0 and step not in saved.steps):
            have = f"steps {', '.join(map(str, saved.steps))}" if saved.steps else "none"
            of_step, step_flag = (f" of step {step}", f" --step {step}") if step >= 0 else ("", "")
            raise SystemExit(
                f"--ema sigma_rel={sigma_rel:g}: no post-hoc EMA{of_step} in {folder} (there: {have}); "
                f"make it with python train/posthoc_ema.py --run_dir {run_dir} --sigma_rel {sigma_rel:g}"
                f"{step_flag}."
            )
        step = saved.steps[-1] if step < 0 else step
        return step, saved.restore(step, (abstract_ema,), (sharding,))[0]
