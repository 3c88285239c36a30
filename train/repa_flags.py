"""train/main.py's --repa_* flags: REPA (Yu et al. 2025; eqxdiff/training/repa.py) on a DiT run — which block aligns,
DINOv2's input side, the frozen tower and the projector the state trains beside the network — each mistake one line
that names the fix, before anything compiles."""

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path

import equinox as eqx
import jax

from eqxdiff.nn import Dinov2Model
from eqxdiff.run.codecs import Latents
from eqxdiff.training.repa import default_block, network_of, with_projector

DIT_CONSTRUCTORS = ("DiT", "DiT.small")  # eqxdiff/run/models.py's: the networks with `tokens_after`
FEATURES = "repa_features"  # the latent records' field train/encode.py --repa_encoder writes
DOWNLOAD = "huggingface-cli download facebook/dinov2-base --local-dir ~/dinov2-base"


def repa_flag_error(cfg) -> str | None:
    """What is wrong with the --repa_* values alone (train/checks.py's flag_value_error), or None."""
    if cfg.repa_weight < 0:
        return f"--repa_weight is REPA's λ, >= 0 (0.5 in the paper; 0: off), got {cfg.repa_weight}"
    if cfg.repa_block < 0 or cfg.repa_projector_dim < 1:
        return f"--repa_block >= 0 (0: REPA's rule) and --repa_projector_dim >= 1, got {cfg.repa_block}, {cfg.repa_projector_dim}"
    if cfg.repa_weight and not cfg.repa_encoder:
        return (f"--repa_weight {cfg.repa_weight:g} aligns to DINOv2's features: pass --repa_encoder FOLDER, a "
                f"transformers Dinov2Model folder (e.g. {DOWNLOAD})")  # fmt: skip
    return None


@dataclasses.dataclass(frozen=True)
class Repa:
    """REPA as a run trains it: λ, the block (1..depth) whose tokens align, the side² DINOv2 sees the clean images
    at, the target's width and the projector's, and the frozen tower (None: the records hold its features)."""

    weight: float
    block: int
    side: int
    z_dim: int
    projector_dim: int
    encoder: Dinov2Model | None

    def make_model(self, make_network: Callable) -> Callable:
        """`key -> Aligned(network, projector, block)`: the state trains the projector beside the network."""
        return with_projector(make_network, block=self.block, z_dim=self.z_dim, projector_dim=self.projector_dim)

    def frozen(self) -> dict:
        """The step's frozen argument's share: the tower, when the step computes the features."""
        return {} if self.encoder is None else {"repa_encoder": self.encoder}

    def to_config(self) -> dict:
        """What a checkpoint stores to rebuild the state (eqxdiff/run/rebuild.py)."""
        return dict(block=self.block, z_dim=self.z_dim, projector_dim=self.projector_dim)


def open_repa(cfg, args: dict, make_network: Callable, codec, source) -> Repa | None:
    """--repa_weight's `Repa` for the network `args` describes (`make_network(key)` builds it), or None when off.
    DINOv2's side is its patch size times the DiT's token grid, so both give the same tokens (REPA: 256² images,
    32² latents, patch 2 -> 224²); the features come from the records when train/encode.py wrote them."""
    if not cfg.repa_weight:
        return None
    if args["constructor"] not in DIT_CONSTRUCTORS:
        raise SystemExit(f"--repa_weight aligns a DiT's tokens: --model {cfg.model} builds {args['constructor']}; "
                         f"use a DiT (e.g. --model dit_s or dit_tiny), or leave --repa_weight off.")  # fmt: skip
    if cfg.objective != "denoising":
        raise SystemExit(f"--repa_weight adds to the denoising loss: leave it off with --objective {cfg.objective}.")
    network = eqx.filter_eval_shape(make_network, jax.random.key(0))
    depth = len(network.blocks)
    block = cfg.repa_block or default_block(depth)
    if block > depth:
        raise SystemExit(f"--repa_block {cfg.repa_block}: --model {cfg.model} has {depth} blocks; pass one of "
                         f"1..{depth} (or 0: REPA's round(depth·8/28) = {default_block(depth)}).")  # fmt: skip
    config = Path(cfg.repa_encoder).expanduser() / "config.json"
    if not config.is_file():
        raise SystemExit(f"--repa_encoder {cfg.repa_encoder}: no config.json there; pass a transformers Dinov2Model "
                         f"folder (e.g. {DOWNLOAD}).")  # fmt: skip
    precomputed = FEATURES in source.fields
    if isinstance(codec, Latents) and not precomputed:
        raise SystemExit(f"--repa_weight aligns to DINOv2's features of the clean images, which {cfg.dataset} does "
                         f"not hold: encode it again with python train/encode.py ... --repa_encoder "
                         f"{cfg.repa_encoder} (they are written beside the latents).")  # fmt: skip
    if precomputed and cfg.hflip:
        raise SystemExit("--hflip flips the latents but not the DINOv2 features train/encode.py wrote beside them: "
                         "leave --hflip off with --repa_weight.")  # fmt: skip
    encoder = None if precomputed else Dinov2Model.from_transformers(config.parent, interpolate_offset=0.1)
    patch = json.loads(config.read_text())["patch_size"]
    z_dim = json.loads(config.read_text())["hidden_size"]
    grid = network.image_size // network.patch_size
    if precomputed and source.fields[FEATURES].shape != (grid * grid, z_dim):
        raise SystemExit(f"{cfg.dataset}'s DINOv2 features are {tuple(source.fields[FEATURES].shape)}, not the "
                         f"{grid}² tokens × {z_dim} of --model {cfg.model} and --repa_encoder {cfg.repa_encoder}: "
                         f"encode again with this --repa_encoder, or pass the one it was encoded with.")  # fmt: skip
    return Repa(cfg.repa_weight, block, patch * grid, z_dim, cfg.repa_projector_dim, encoder)


def sampled_network(fn: Callable) -> Callable:
    """`fn(step, state)` (the grids, FID) given the state with its EMA's network alone, without the projector."""
    return lambda step, state: fn(step, dataclasses.replace(state, ema=network_of(state.ema)))
