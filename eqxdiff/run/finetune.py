"""train/main.py --init RUN_DIR: a run of this network's weights as the start (`FromRun`, below; docs/meanflow.md).
train/main.py --init sd:FOLDER: fine-tune a pretrained Stable Diffusion UNet (a diffusers folder), all of it or,
with --lora_rank R, low-rank adapters around its layers (eqxdiff/nn/lora.py; Hu et al. 2021).

FOLDER is a pipeline folder as diffusers saves it (model_index.json, unet/, vae/, text_encoder/, tokenizer/,
scheduler/) or its bare unet/ (the rest then read beside it, when there). The folder decides, and a flag that
disagrees is refused naming the fix (train/finetune.py, before JAX starts): the network (its unet/ config, loaded
straight into the run's shardings), the frozen text tower (--text_encoder: its text_encoder/; an SDXL folder's is
the folder itself, whose two towers, tokenizers and size/crop time_ids eqxdiff/run/open_condition.py makes the
run's condition, eqxdiff/run/sdxl_condition.py), the data (--dataset latents:DIR encoded by train/encode.py with
its vae/; a folder without vae/ is a pixel-space UNet, trained on images of its in_channels) and the noise (its
scheduler config: SD 1.x's ε-prediction on the scaled_linear VP schedule, eqxdiff/sd/scheduler.py,
in place of --schedule and --parameterization). A bare SDXL unet/ (no pipeline folder around it) and the refiner are refused.

With --lora_rank the TRAINED state (model, optimizer, EMA, post-hoc EMAs, gradient) is the adapters alone; the base
rides in the step's frozen argument as "unet" (laid out by SHARDING_RULES as `unet.<path>`, read again from FOLDER
on resume) and `model_of` combines the two for `loss_fn` (eqxdiff.training.make_train_step). Sample grids use the
combined EMA; each checkpoint also writes RUN_DIR/lora/pytorch_lora_weights.safetensors (the EMA's adapters, in
the format diffusers' `load_lora_weights` reads).

The run's fine-tuning kind (`open_init`: `Scratch`, `FromRun`, `Pretrained` or `LoRA`) is where its weights come from and what
trains, asked four questions: `network` (its constructor arguments, sharding rules and training noise), `training`
(what the step trains, its frozen argument, how the two make the network, and a new run's state), `whole` (the
network of a trained part: what the grids, FID and train/sample.py sample) and `outputs` (what the grids,
checkpoints and FID write). A new kind is a class and its FINETUNE_KINDS entry (docs/edits.md, edit (h)).
"""

import contextlib
import dataclasses
import json
import tempfile
from pathlib import Path
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from tqdm import tqdm

from eqxdiff.checkpoint import CheckpointError, Checkpoints
from eqxdiff.data.latents import LatentSource
from eqxdiff.nn.layers import TimestepEmbedding, TwoTimeEmbedding
from eqxdiff.local_copies import upload
from eqxdiff.sd import SDUNet
from eqxdiff.nn.lora import DEFAULT_TARGETS, add_lora, lora_frozen, partition_lora
from eqxdiff.sd.lora_files import save_lora
from eqxdiff.paths import as_path, is_url, what_path_is
from eqxdiff.sd.scheduler import scheduler_from_diffusers
from eqxdiff.run.models import changed_args
from eqxdiff.run.run_dir import saved_config
from eqxdiff.run.sdxl_condition import is_sdxl_folder
from eqxdiff.sharding import HEAD_LAYOUT_RULES, placement, state_shardings
from eqxdiff.training import create_train_state
from eqxdiff.training.state import state_around

PREFIX = "sd:"
SDXL_TEXT = ("text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2")  # an SDXL folder's text side


# A bare unet/ folder with no scheduler/ beside it: Stable Diffusion 1.x's training noise (its DDPMScheduler).
SD1_SCHEDULER = {
    "_class_name": "DDIMScheduler",
    "beta_schedule": "scaled_linear",
    "beta_start": 0.00085,
    "beta_end": 0.012,
    "num_train_timesteps": 1000,
    "prediction_type": "epsilon",
    "clip_sample": False,
    "set_alpha_to_one": False,
    "steps_offset": 1,
}


def parts(init: str) -> dict[str, Path | None]:
    """--init sd:FOLDER -> the folders of its parts (None: absent): unet, vae, text_encoder (SDXL: the pipeline
    folder, which holds both towers), scheduler."""
    if not init.startswith(PREFIX):
        hint = f" (did you mean --init sd:{init}?)" if (Path(init).expanduser() / "model_index.json").is_file() else ""
        raise SystemExit(
            f"--init {init}: give sd:FOLDER, a diffusers Stable Diffusion pipeline folder or its unet/{hint}."
        )
    folder = Path(init.removeprefix(PREFIX)).expanduser().resolve()
    config = folder / "config.json"
    bare = config.is_file() and json.loads(config.read_text()).get("_class_name") == "UNet2DConditionModel"
    root = folder.parent if bare else folder
    if not (folder if bare else folder / "unet").is_dir() or not (bare or (folder / "model_index.json").is_file()):
        raise SystemExit(
            f"--init {init}: {folder} is neither a diffusers pipeline folder (model_index.json, unet/, "
            f"...) nor a UNet folder (config.json of a UNet2DConditionModel): it {what_path_is(folder)}."
        )
    unet = folder if bare else folder / "unet"
    sdxl = is_sdxl_folder(root)  # its text side: the whole folder (both towers and tokenizers)
    if sdxl and not all((root / name).is_dir() for name in SDXL_TEXT):
        raise SystemExit(
            f"--init {init}: the SDXL folder {root} lacks one of {', '.join(SDXL_TEXT)}; SDXL fine-tunes "
            "from the base model's whole pipeline folder."
        )
    unet_config = json.loads((unet / "config.json").read_text())
    if not sdxl and unet_config.get("addition_embed_type") == "text_time":
        raise SystemExit(
            f"--init {init}: an SDXL UNet (addition_embed_type text_time) conditions on two text towers "
            "and the images' sizes: give the StableDiffusionXLPipeline folder it came in."
        )
    found = {name: root / name for name in ("vae", "text_encoder", "scheduler")}
    found = {k: p if p.is_dir() else None for k, p in found.items()}
    return {"unet": unet} | found | ({"text_encoder": root} if sdxl else {})


def check_data(cfg, source, vae: Path | None, unet_config: dict) -> None:
    """A SystemExit naming the fix unless `source` is what --init's UNet was trained on: latents of its `vae`, or,
    for a folder without vae/ (a pixel-space UNet, as diffusers' pipelines without a VAE), images with the UNet's
    in_channels."""
    if vae is None:
        channels = unet_config.get("in_channels", 4)
        if isinstance(source, LatentSource):
            raise SystemExit(
                f"--init {cfg.init} has no vae/: its UNet works in pixels; train it on images of its "
                f"in_channels ({channels}), not --dataset {cfg.dataset}."
            )
        if source.image_shape[-1] != channels:
            raise SystemExit(
                f"--dataset {cfg.dataset} holds {source.image_shape[-1]}-channel images; --init "
                f"{cfg.init}'s pixel-space UNet (no vae/) takes in_channels {channels}."
            )
        return
    if not isinstance(source, LatentSource):
        raise SystemExit(
            f"--init {cfg.init} trains on latents of its VAE: encode the images first (python "
            f"{encode_command(cfg, cfg.dataset, vae)}) and pass --dataset latents:DIR."
        )
    used = source.meta["vae"]["path"]  # the encode's VAE folder
    if not used or Path(used).resolve() != vae:
        raise SystemExit(
            f"--dataset {cfg.dataset} holds latents of {used or source.meta['vae']['spec']}, not of "
            f"--init's {vae}: encode with train/encode.py --vae {vae}."
        )
    if "caption" not in source.record_fields and not source.meta.get("text"):  # the UNet cross-attends to text
        raise SystemExit(
            f"--dataset {cfg.dataset} holds latents without captions; --init {cfg.init}'s UNet is "
            f"conditioned on text: encode captioned images (a .txt beside each) with python "
            f"{encode_command(cfg, source.meta['source'], vae, source.meta['image_shape'][0])}."
        )


def encode_command(cfg, dataset: str, vae: Path, image_size: int | None = None) -> str:
    """The train/encode.py command that writes what this fine-tune reads: `dataset`'s images at `image_size`
    (default --image_size), latents of the folder's `vae`, the captions kept for its text tower (an SDXL folder's:
    its text_encoder/)."""
    tower = Path(cfg.text_encoder)
    tower = tower / "text_encoder" if is_sdxl_folder(tower) else tower
    return (
        f"train/encode.py --dataset {dataset} --image_size {image_size or cfg.image_size} --vae {vae} "
        f"--text_encoder {tower} --out DIR"
    )


def open_init(cfg, mesh, min_size: int, rules=(), source=None, *, base: bool = True):
    """The run's fine-tuning kind, where its weights come from and what trains: --finetune's of FINETUNE_KINDS, else
    `Scratch` (no --init), `FromRun` (--init RUN_DIR), `Pretrained` (--init sd:FOLDER) or `LoRA` (with --lora_rank). `rules`: SHARDING_RULES;
    `source`: the training data, checked to be what the folder's UNet takes (`check_data`; None: a rebuild for
    sampling, which reads no data). `base`: read a LoRA run's base (False: the state's structure is all that is
    asked)."""
    name = cfg.finetune  # a checkpoint from before --finetune: "" (LATER_FLAGS)
    if name and name not in FINETUNE_KINDS:
        known = ", ".join(FINETUNE_KINDS) or "none yet"
        raise SystemExit(
            f"--finetune {name}: no such kind in FINETUNE_KINDS of eqxdiff/run/finetune.py (there: "
            f"{known}); add its class there, or leave --finetune off."
        )
    if name:
        kind = FINETUNE_KINDS[name]
    elif not cfg.init:
        kind = Scratch
    else:
        kind = (LoRA if cfg.lora_rank else Pretrained) if cfg.init.startswith(PREFIX) else FromRun
    return kind(cfg, mesh, min_size, rules, source, base=base)


@dataclasses.dataclass(frozen=True)
class Network:
    """The network a run trains, as its fine-tuning kind decides it."""

    args: dict  # its constructor arguments (eqxdiff/run/models.py; each checkpoint stores them)
    rules: list  # the sharding rules of the state and the step's frozen argument: SHARDING_RULES, then the kind's
    schedule: Any  # the training noise (eqxdiff/diffusion/schedules.py)
    parameterization: Any  # what the network predicts


@dataclasses.dataclass(frozen=True)
class Training:
    """What the step trains, and a new run's state."""

    make_model: Callable  # key -> the trained part: the network, or a LoRA run's adapters
    frozen: Any  # the step's frozen argument: the condition's (a text tower, its null), a LoRA run's base beside
    model_of: Callable | None  # (trained part, frozen) -> the network, make_train_step's (None: the trained part)
    start: Callable | None  # (optimizer, the state's shardings) -> a new run's state (None: a rebuild's structure)


class Scratch:
    """Weights drawn from --seed, the whole network trained: --model, --schedule and --parameterization as given.
    Every kind is made as `open_init` makes it, `Kind(cfg, mesh, min_size, rules, source, base=)`."""

    def __init__(self, cfg, mesh, min_size: int, rules=(), source=None, *, base: bool = True):
        self.cfg, self.mesh, self.min_size = cfg, mesh, min_size

    def network(self, args: dict, schedule, parameterization, rules) -> Network:
        """The run's network as its flags give it (`args`: --model's entry), laid out by `rules` (SHARDING_RULES)."""
        return Network(args, list(rules), schedule, parameterization)

    def training(self, make_model: Callable, frozen) -> Training:
        """`make_model` (key -> the network) trained whole; a new run's drawn from --seed."""

        def start(optimizer, shardings):
            key = jax.random.key(self.cfg.seed)
            return create_train_state(make_model, optimizer, key, self.mesh, self.min_size, shardings=shardings)[0]

        return Training(make_model, frozen, None, start)

    def whole(self, model):
        """The network of a trained part (the EMA's, for sampling)."""
        return model

    def outputs(self, write_samples: Callable, save_checkpoint: Callable, evaluate: Callable | None = None) -> tuple:
        """(write_samples, save_checkpoint, evaluate) of train/loop.py, each `(step, state)`, as this kind writes them:
        the grids and FID of the state's `whole` EMA, the checkpoint as it is."""

        def of_whole(fn):
            return fn and (lambda step, state: fn(step, dataclasses.replace(state, ema=self.whole(state.ema))))

        return of_whole(write_samples), save_checkpoint, of_whole(evaluate)


def is_two_time(node) -> bool:
    return isinstance(node, TwoTimeEmbedding)


def one_time(model):
    """`model` with each time embedding of two times (`TwoTimeEmbedding`) replaced by its t's: the network of one
    time it extends, leaf for leaf (eqxdiff/nn/layers.py)."""
    return jax.tree.map(lambda node: node.time if is_two_time(node) else node, model, is_leaf=is_two_time)


def with_intervals(source, fresh):
    """`source` (a network of one time) as the network of two times `fresh` is: at each of fresh's TwoTimeEmbedding,
    source's time embedding beside fresh's interval embedding with its output layer zero. The interval's output
    zero makes the network start as the source at every (t, r): its instantaneous velocity, MeanFlow's target at
    r = t and the one-step Euler guess of the average velocity elsewhere; a drawn one would add a constant to
    every time embedding and undo what the source learned. fc1 keeps its draw, so fc2's gradient is not zero."""
    fresh_nodes = jax.tree_util.tree_flatten_with_path(fresh, is_leaf=is_two_time)[0]
    intervals = {path: node.interval for path, node in fresh_nodes if is_two_time(node)}

    def extend(path, node):
        if path not in intervals:
            return node
        interval = eqx.tree_at(lambda e: (e.fc2.weight, e.fc2.bias), intervals[path], replace_fn=jnp.zeros_like)
        return TwoTimeEmbedding(node, interval)

    is_embedding = lambda node: isinstance(node, TimestepEmbedding)  # noqa: E731
    return jax.tree_util.tree_map_with_path(extend, source, is_leaf=is_embedding)


def without_interval(args: dict) -> dict:
    """Constructor arguments (`model_args`) without the option of a second time."""
    return {**args, "kwargs": {k: v for k, v in args["kwargs"].items() if k != "interval_embedding"}}


def source_run(init: str, cfg) -> tuple[int, dict]:
    """(newest step, stored config) of --init RUN_DIR, a train/main.py run whose whole network this run can start
    from: a SystemExit naming the fix for a folder without checkpoints, a LoRA run, or another noise."""
    found = saved_config(init) if not init.startswith(PREFIX) else None
    if found is None:
        hint = f" (did you mean --init sd:{init}?)" if (Path(init).expanduser() / "model_index.json").is_file() else ""
        raise SystemExit(
            f"--init {init}: no checkpoint under {init}/checkpoints: give a train/main.py run that saved one, or "
            f"sd:FOLDER for a diffusers Stable Diffusion pipeline folder or its unet/{hint}."
        )
    step, stored = found
    if stored.get("lora_rank"):
        raise SystemExit(
            f"--init {init} trained LoRA adapters alone, not a whole network: start from its --init "
            f"{stored.get('init')} or from a run that trained its whole network."
        )
    if "model_args" not in stored:
        raise SystemExit(f"--init {init}: its checkpoints predate stored constructor arguments; train it again.")
    other = [f"--{n} {stored.get(n)}" for n in ("schedule", "parameterization") if stored.get(n) != getattr(cfg, n)]
    if other:  # the network's time input is its schedule's, its output the parameterization's
        raise SystemExit(
            f"--init {init} trained with {' '.join(other)}, whose network sees another time or predicts another "
            f"thing: start from a run of this run's --schedule {cfg.schedule} --parameterization "
            f"{cfg.parameterization}."
        )
    return step, stored


class FromRun(Scratch):
    """--init RUN_DIR: a train/main.py run's weights as the start, the whole network trained under this run's flags.
    The source's newest checkpoint gives its EMA (the weights it samples with; every train/main.py run keeps one),
    not its raw weights. The network is this run's --model, which must be the source's: the same constructor
    arguments but a second time, so that a flow-matching run starts a MeanFlow one (--objective meanflow), its
    interval embedding added as `with_intervals` says. Only a new run reads the source's weights (the EMA alone of
    its saved state, on the run's devices and layout); a resumed one starts from its own checkpoint and reads the
    source's config only to check it again, and a rebuild (train/sample.py) reads nothing of it. The drawn interval
    layers are put in place by `jax.device_put`: one process (several: untested)."""

    def __init__(self, cfg, mesh, min_size: int, rules=(), source=None, *, base: bool = True):
        super().__init__(cfg, mesh, min_size)
        self.rules = list(rules)
        self.source = None if source is None else source_run(cfg.init, cfg)  # None: a rebuild, nothing read

    def network(self, args: dict, schedule, parameterization, rules) -> Network:
        """--model's network as the flags give it, refused in one line unless it is the source's (up to a time)."""
        if self.source is not None:
            stored = self.source[1]
            changed = changed_args(without_interval(stored["model_args"]), without_interval(args))
            if changed:
                raise SystemExit(
                    f"--init {self.cfg.init} trained another network ({'; '.join(changed)}): pass its --model "
                    f"{stored.get('model')} and --dataset {stored.get('dataset')}, or start from a run of this one."
                )
        return super().network(args, schedule, parameterization, rules)

    def training(self, make_model: Callable, frozen) -> Training:
        """The network trained whole; a new run's is the source's EMA (with a second time as `with_intervals` adds
        it), laid out in the state's shardings."""
        if self.source is None:  # the state's structure alone
            return Training(make_model, frozen, None, None)
        step, stored = self.source
        fresh = eqx.filter_eval_shape(make_model, jax.random.key(0))
        two_times = any(is_two_time(node) for node in jax.tree.leaves(fresh, is_leaf=is_two_time))
        source_two = bool(stored["model_args"]["kwargs"].get("interval_embedding"))
        if source_two and not two_times:
            raise SystemExit(
                f"--init {self.cfg.init} is a network of two times (--objective meanflow): fine-tune it with "
                "--objective meanflow too."
            )
        make_source = make_model if source_two or not two_times else (lambda key: one_time(make_model(key)))

        def start(optimizer, shardings):
            cfg = self.cfg
            abstract = eqx.filter_eval_shape(make_source, jax.random.key(0))  # the source's EMA, laid out as ours
            layout = state_shardings(abstract, self.mesh, self.min_size, rules=self.rules, strict=False)
            with Checkpoints(as_path(cfg.init) / "checkpoints", read_only=True) as saved:
                try:
                    model = saved.restore_part(step, "ema", abstract, layout)  # not its model's or optimizer's arrays
                except CheckpointError as e:
                    raise SystemExit(f"--init {cfg.init}: {e}") from e
            if two_times and not source_two:
                host = jax.local_devices(backend="cpu")[0]
                with jax.default_device(host):  # drawn as a new run's network is (create_train_state)
                    drawn = make_model(jax.device_put(jax.random.key(cfg.seed), host))
                model = with_intervals(model, drawn)
            if jax.process_index() == 0:
                tqdm.write(f"--init {cfg.init}: starting from the EMA of its step {step}")
            return state_around(jax.device_put(model, shardings.model), optimizer, shardings)

        return Training(make_model, frozen, None, start)


def host_value(x: jax.Array) -> np.ndarray:
    """A global array's value on the host; one spread over several processes gathered (all of them call this)."""
    return np.asarray(x) if x.is_fully_addressable else multihost_utils.process_allgather(x)


def with_base(trained, frozen: dict):
    """`model_of` of a LoRA run: the adapters (the trained part) put back into the frozen base."""
    return eqx.combine(trained, frozen["unet"])


class Pretrained(Scratch):
    """--init sd:FOLDER (module docstring): the folder's UNet trained whole, its config the network, its scheduler
    the noise, its weights the start."""

    def __init__(self, cfg, mesh, min_size: int, rules=(), source=None, *, base: bool = True):
        super().__init__(cfg, mesh, min_size)
        self.folders = parts(cfg.init)
        self.unet_config = json.loads((self.folders["unet"] / "config.json").read_text())
        if source is not None:
            check_data(cfg, source, self.folders["vae"], self.unet_config)
        scheduler = self.folders["scheduler"] / "scheduler_config.json" if self.folders["scheduler"] else SD1_SCHEDULER
        if scheduler is SD1_SCHEDULER and source is not None and jax.process_index() == 0:
            tqdm.write(
                f"--init {cfg.init}: no scheduler/ beside its unet/; training SD 1.x's noise (scaled_linear "
                "betas 0.00085..0.012, epsilon)"
            )
        with self.refusing():
            self.scheduler = scheduler_from_diffusers(scheduler)

    @contextlib.contextmanager
    def refusing(self):
        """A config this port refuses, or weights that do not fit it: one line naming --init."""
        try:
            yield
        except (FileNotFoundError, ValueError) as e:
            raise SystemExit(f"--init {self.cfg.init}: {e}") from e

    def network(self, args: dict, schedule, parameterization, rules) -> Network:
        """SDUNet of the folder's config (as checkpoints store it), trained on its scheduler's VP schedule and
        prediction type; laid out by `rules`, then HEAD_LAYOUT_RULES (eqxdiff/sharding.py: the attention output
        projections split along their output axis, so that GSPMD keeps the heads whole, SDXL's 20 over 8 devices)."""
        args = {"constructor": "SDUNet", "kwargs": {"config": self.unet_config}}
        return Network(args, [*rules, *HEAD_LAYOUT_RULES], self.scheduler.schedule, self.scheduler.parameterization)

    def training(self, make_model: Callable, frozen) -> Training:
        """The UNet trained whole; a new run's is the folder's, read straight into the model's shardings (its EMA and
        optimizer state made on the devices)."""

        def start(optimizer, shardings):
            place = lambda _: shardings.model  # noqa: E731 — the abstract UNet's layout is the state's model's
            model = SDUNet.from_diffusers(self.folders["unet"], place=place, remat=self.cfg.remat)
            return state_around(jax.device_put(model, shardings.model), optimizer, shardings)

        return Training(make_model, frozen, None, start)


class LoRA(Pretrained):
    """--init sd:FOLDER --lora_rank R (module docstring): rank-R adapters trained (--lora_targets, --lora_alpha),
    the folder's UNet frozen as the step's frozen `unet`; each checkpoint also writes the EMA's adapters as
    diffusers reads them."""

    def __init__(self, cfg, mesh, min_size: int, rules=(), source=None, *, base: bool = True):
        super().__init__(cfg, mesh, min_size, rules, source)
        rules = [*rules, *HEAD_LAYOUT_RULES]  # the frozen `unet`'s layout: the network's rules (`network`)
        with self.refusing():  # the folder's UNet and the frozen base (the rest), or both None
            self.unet, self.base = self.lora_base(mesh, min_size, rules) if base else (None, None)

    def lora_base(self, mesh, min_size: int, rules) -> tuple:
        """(the folder's UNet, frozen base): the UNet read into the layout SHARDING_RULES give the step's frozen
        `unet`, wrapped as the adapters wrap it (--lora_rank, --lora_targets, --lora_alpha) with none drawn: a rebuilt
        run's come from its checkpoint, a new run's from `fresh_adapters`."""
        place = placement(mesh, min_size, rules=rules, name="unet")
        unet = SDUNet.from_diffusers(self.folders["unet"], place=place, remat=self.cfg.remat)
        return unet, lora_frozen(unet, self.cfg.lora_rank, **self.lora_options())

    def lora_options(self) -> dict:
        """add_lora's `targets` and `alpha` of --lora_targets and --lora_alpha."""
        return {"targets": self.cfg.lora_targets or DEFAULT_TARGETS, "alpha": self.cfg.lora_alpha or None}

    def adapted(self, unet, key):
        return add_lora(unet, self.cfg.lora_rank, **self.lora_options(), key=key)

    def fresh_adapters(self):
        """A new run's adapters around the folder's UNet, drawn from --seed."""
        return partition_lora(self.adapted(self.unet, jax.random.fold_in(jax.random.key(self.cfg.seed), 31)))[0]

    def training(self, make_model: Callable, frozen) -> Training:
        """The adapters trained (key -> the adapters of `make_model`'s UNet; with the base read, of the folder's UNet
        it came from, which is that network), the base frozen beside `frozen` as "unet" and put back around them by
        `model_of`; a new run's adapters the fresh ones, drawn from --seed."""
        unet = make_model if self.unet is None else (lambda key: self.unet)  # read: its init is not traced again
        adapters = lambda key: partition_lora(self.adapted(unet(key), key))[0]  # noqa: E731
        if self.base is None:  # the state's structure alone (train/posthoc_ema.py)
            return Training(adapters, frozen, None, None)

        def start(optimizer, shardings):
            return state_around(jax.device_put(self.fresh_adapters(), shardings.model), optimizer, shardings)

        return Training(adapters, {**(frozen or {}), "unet": self.base}, with_base, start)

    def whole(self, model):
        """The network of a trained part (the EMA's, for sampling): the adapters put into the base."""
        return model if self.base is None else with_base(model, {"unet": self.base})

    def outputs(self, write_samples: Callable, save_checkpoint: Callable, evaluate: Callable | None = None) -> tuple:
        """Scratch's, where each checkpoint also writes the EMA's adapters as
        RUN_DIR/lora/pytorch_lora_weights.safetensors."""
        write, save_checkpoint, evaluate = super().outputs(write_samples, save_checkpoint, evaluate)
        if self.base is None:  # no base read: nothing whole to write
            return write, save_checkpoint, evaluate

        def save(step: int, state) -> None:
            save_checkpoint(step, state)
            adapters = jax.tree.map(host_value, eqx.filter(state.ema, eqx.is_array))  # every process takes part
            if jax.process_index() == 0:
                path = self.write_lora(self.whole(adapters))
                tqdm.write(f"step {step}: LoRA -> {path}")

        return write, save, evaluate

    def write_lora(self, model):
        """RUN_DIR/lora/pytorch_lora_weights.safetensors, in a gs:// run's bucket as one upload of a local file."""
        run_dir = as_path(self.cfg.run_dir)
        if not is_url(run_dir):
            return save_lora(model, run_dir / "lora", overwrite=True)
        with tempfile.TemporaryDirectory() as tmp:
            local = save_lora(model, Path(tmp))
            upload(local, run_dir / "lora" / local.name)
        return run_dir / "lora" / local.name


# Fine-tuning kinds a run names with --finetune NAME (train/finetune.py), each made as `open_init` makes them; a
# checkpoint stores the name, so train/sample.py rebuilds the run with its kind (docs/edits.md, edit (h)).
FINETUNE_KINDS: dict[str, type] = {}
