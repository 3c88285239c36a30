"""diffusers' `AutoencoderKL` (Rombach et al. 2022, the KL-regularised VAE of latent diffusion) in
Equinox, NHWC, loading diffusers model folders (config.json + diffusion_pytorch_model.safetensors,
a variant such as `.fp16.safetensors`, or an index's shards) and single LDM-named files.

`encode` gives the posterior moments (mean, logvar clamped to [-30, 20] as diffusers'
`DiagonalGaussianDistribution` does); `decode` takes an unscaled latent. A diffusion model sees
`(z - shift_factor) * scaling_factor`. Field names are diffusers', so leaf paths are state_dict keys.
"""

import json
import warnings
from pathlib import Path
from typing import Any

import numpy as np
from safetensors import safe_open

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, PRNGKeyArray

from eqxdiff.nn.abstract_network import abstract_network
from eqxdiff.nn.layers import Conv2d, GroupNorm
from eqxdiff.nn.ldm_vae import config_from_shapes, diffusers_name, vae_prefix
from eqxdiff.nn.torch_weights import Place, load_safetensors
from eqxdiff.nn.vae_blocks import EPS, DownEncoderBlock, MidBlock, UpDecoderBlock
from eqxdiff.weights.weight_files import weight_files

WEIGHTS_FILE = "diffusion_pytorch_model.safetensors"
# diffusers' AutoencoderKL.__init__ defaults, for fields a config.json leaves out.
DEFAULTS: dict[str, Any] = {
    "in_channels": 3,
    "out_channels": 3,
    "down_block_types": ["DownEncoderBlock2D"],
    "up_block_types": ["UpDecoderBlock2D"],
    "block_out_channels": [64],
    "layers_per_block": 1,
    "act_fn": "silu",
    "latent_channels": 4,
    "norm_num_groups": 32,
    "sample_size": 32,
    "scaling_factor": 0.18215,
    "shift_factor": None,
    "latents_mean": None,
    "latents_std": None,
    "force_upcast": True,
    "use_quant_conv": True,
    "use_post_quant_conv": True,
    "mid_block_add_attention": True,
}
# Older checkpoints' attention names (diffusers' ModelMixin._fix_state_dict_keys_on_load).
OLD_ATTENTION_NAMES = {"query": "to_q", "key": "to_k", "value": "to_v", "proj_attn": "to_out.0"}


def parse_config(config: dict) -> dict:
    """diffusers' config with defaults filled in. A key diffusers' AutoencoderKL does not take is
    ignored with a warning, as diffusers' `ConfigMixin` does (it cannot change diffusers' network); a
    value of one it takes that this port does not implement raises a ValueError naming it. Keys
    starting with `_` are metadata (`_class_name` must be ours)."""
    if config.get("_class_name", "AutoencoderKL") != "AutoencoderKL":
        raise ValueError(f"_class_name {config['_class_name']!r}: only diffusers' AutoencoderKL is supported")
    unknown = sorted(k for k in config if k not in DEFAULTS and not k.startswith("_"))
    if unknown:
        warnings.warn(
            f"AutoencoderKL config keys {unknown} are not options of diffusers' AutoencoderKL: ignored, "
            "as diffusers ignores them",
            stacklevel=3,
        )
    cfg = {**DEFAULTS, **{k: v for k, v in config.items() if k in DEFAULTS}}
    levels = len(cfg["block_out_channels"])
    for name, block in (("down_block_types", "DownEncoderBlock2D"), ("up_block_types", "UpDecoderBlock2D")):
        if list(cfg[name]) != [block] * levels:
            raise ValueError(f"{name} {cfg[name]} not supported: only {block!r}, one per block_out_channels ({levels})")
    if cfg["act_fn"] not in ("silu", "swish"):
        raise ValueError(f"act_fn {cfg['act_fn']!r} not supported: only 'silu'")
    _check_latent_statistics(cfg)
    return cfg


def _check_latent_statistics(cfg: dict) -> None:
    """latents_mean/latents_std: one value per latent channel, and not with a shift_factor (no
    diffusers pipeline combines the two). SDXL's pipelines use them only together: one alone is
    ignored with a warning (set to None in `cfg`)."""
    given = [name for name in ("latents_mean", "latents_std") if cfg[name] is not None]
    if len(given) == 1:
        warnings.warn(
            f"{given[0]} without {({'latents_mean', 'latents_std'} - set(given)).pop()}: ignored, as "
            "diffusers' pipelines use them only together",
            stacklevel=4,
        )
        cfg[given[0]], given = None, []
    for name in given:
        values = np.asarray(cfg[name], np.float64)
        if values.shape != (cfg["latent_channels"],) or not np.isfinite(values).all():
            raise ValueError(f"{name} {cfg[name]} must be {cfg['latent_channels']} finite values (latent_channels)")
    if given and (np.asarray(cfg["latents_std"]) <= 0).any():
        raise ValueError(f"latents_std {cfg['latents_std']} must be positive")
    if given and cfg["shift_factor"]:
        raise ValueError(
            f"latents_mean/latents_std with shift_factor {cfg['shift_factor']}: no diffusers pipeline "
            "combines them (SDXL's use the statistics, SD3's and FLUX's the shift); keep one"
        )


class Encoder(eqx.Module):
    """diffusers' `Encoder(double_z=True)`: conv_in, down blocks, mid block, GN-SiLU-conv_out to
    2*latent channels (mean and logvar), `[b, h, w, cin] -> [b, h/f, w/f, 2*latent]`."""

    conv_in: Conv2d
    down_blocks: list[DownEncoderBlock]
    mid_block: MidBlock
    conv_norm_out: GroupNorm
    conv_out: Conv2d

    def __init__(self, cfg: dict, *, key: PRNGKeyArray):
        widths, groups, n = cfg["block_out_channels"], cfg["norm_num_groups"], cfg["layers_per_block"]
        keys = jax.random.split(key, len(widths) + 3)
        self.conv_in = Conv2d(cfg["in_channels"], widths[0], key=keys[0])
        cins = [widths[0], *widths[:-1]]
        self.down_blocks = [
            DownEncoderBlock(cin, cout, n, groups, i < len(widths) - 1, key=keys[1 + i])
            for i, (cin, cout) in enumerate(zip(cins, widths))
        ]
        self.mid_block = MidBlock(widths[-1], groups, cfg["mid_block_add_attention"], key=keys[-2])
        self.conv_norm_out = GroupNorm(groups, widths[-1], eps=EPS)
        self.conv_out = Conv2d(widths[-1], 2 * cfg["latent_channels"], key=keys[-1])

    def __call__(self, x: Float[Array, "b h w ci"]) -> Float[Array, "b hl wl c2"]:
        x = self.conv_in(x)
        for block in self.down_blocks:
            x = block(x)
        return self.conv_out(jax.nn.silu(self.conv_norm_out(self.mid_block(x))))


class Decoder(eqx.Module):
    """diffusers' `Decoder` (group norm): conv_in, mid block, up blocks of layers_per_block + 1
    resnets, GN-SiLU-conv_out, `[b, h/f, w/f, latent] -> [b, h, w, cout]`."""

    conv_in: Conv2d
    mid_block: MidBlock
    up_blocks: list[UpDecoderBlock]
    conv_norm_out: GroupNorm
    conv_out: Conv2d

    def __init__(self, cfg: dict, *, key: PRNGKeyArray):
        widths, groups, n = cfg["block_out_channels"][::-1], cfg["norm_num_groups"], cfg["layers_per_block"] + 1
        keys = jax.random.split(key, len(widths) + 3)
        self.conv_in = Conv2d(cfg["latent_channels"], widths[0], key=keys[0])
        self.mid_block = MidBlock(widths[0], groups, cfg["mid_block_add_attention"], key=keys[1])
        cins = [widths[0], *widths[:-1]]
        self.up_blocks = [
            UpDecoderBlock(cin, cout, n, groups, i < len(widths) - 1, key=keys[2 + i])
            for i, (cin, cout) in enumerate(zip(cins, widths))
        ]
        self.conv_norm_out = GroupNorm(groups, widths[-1], eps=EPS)
        self.conv_out = Conv2d(widths[-1], cfg["out_channels"], key=keys[-1])

    def __call__(self, z: Float[Array, "b hl wl c"]) -> Float[Array, "b h w co"]:
        x = self.mid_block(self.conv_in(z))
        for block in self.up_blocks:
            x = block(x)
        return self.conv_out(jax.nn.silu(self.conv_norm_out(x)))


class AutoencoderKL(eqx.Module):
    """diffusers' `AutoencoderKL`: images `[b, h, w, in_channels]` in [-1, 1] <-> latents
    `[b, h/f, w/f, latent_channels]`, f = 2^(len(block_out_channels) - 1).

    Build with `from_diffusers(folder)` (weights) or `from_config(config, key=...)` (random).
    The methods are plain JAX: wrap calls in `eqx.filter_jit` (or call them inside a jitted step).
    """

    encoder: Encoder
    decoder: Decoder
    quant_conv: Conv2d | None
    post_quant_conv: Conv2d | None
    latent_scale: float | tuple[float, ...] = eqx.field(static=True)  # per channel with latents_std
    latent_shift: float | tuple[float, ...] = eqx.field(static=True)  # per channel with latents_mean
    downsample_factor: int = eqx.field(static=True)
    tile_sample_size: int = eqx.field(static=True)  # config sample_size: diffusers' tile_sample_min_size

    def __init__(self, config: dict, *, key: PRNGKeyArray):
        cfg = parse_config(config)
        k_enc, k_dec, k_q, k_pq = jax.random.split(key, 4)
        latent = cfg["latent_channels"]
        self.encoder, self.decoder = Encoder(cfg, key=k_enc), Decoder(cfg, key=k_dec)
        self.quant_conv = Conv2d(2 * latent, 2 * latent, 1, key=k_q) if cfg["use_quant_conv"] else None
        self.post_quant_conv = Conv2d(latent, latent, 1, key=k_pq) if cfg["use_post_quant_conv"] else None
        if cfg["latents_mean"] is None:
            self.latent_scale, self.latent_shift = float(cfg["scaling_factor"]), float(cfg["shift_factor"] or 0.0)
        else:  # SDXL's pipelines: (z - latents_mean) * scaling_factor / latents_std, and back
            self.latent_scale = tuple(float(cfg["scaling_factor"]) / float(s) for s in cfg["latents_std"])
            self.latent_shift = tuple(float(m) for m in cfg["latents_mean"])
        self.downsample_factor = 2 ** (len(cfg["block_out_channels"]) - 1)
        size = cfg["sample_size"]  # diffusers tiles by the first entry of a [h, w] sample_size
        self.tile_sample_size = int(size[0] if isinstance(size, (list, tuple)) else size)

    @property
    def scaling_factor(self) -> float | np.ndarray:
        """What the diffusion model's latents are multiplied by, after `shift_factor` is taken off:
        the config's scaling_factor, or per channel `scaling_factor / latents_std` (float32 `[latent]`,
        broadcasting over NHWC latents) when the config has latents_mean and latents_std."""
        return self.latent_scale if isinstance(self.latent_scale, float) else np.asarray(self.latent_scale, np.float32)

    @property
    def shift_factor(self) -> float | np.ndarray:
        """The config's shift_factor (0 if none), or per channel its latents_mean (float32 `[latent]`)."""
        return self.latent_shift if isinstance(self.latent_shift, float) else np.asarray(self.latent_shift, np.float32)

    @classmethod
    def from_config(cls, config: dict, *, key: PRNGKeyArray) -> "AutoencoderKL":
        """Random weights (PyTorch's default init; GroupNorm 1/0) for a diffusers config dict."""
        return cls(config, key=key)

    @classmethod
    def from_diffusers(
        cls, path: str | Path, *, variant: str | None = None, place: Place | None = None
    ) -> "AutoencoderKL":
        """A diffusers model folder (config.json + diffusion_pytorch_model.safetensors, or the
        shards of its `.safetensors.index.json`; fp32, fp16 or bf16), as float32 parameters.
        `variant` (e.g. "fp16") loads `diffusion_pytorch_model.<variant>.safetensors` or its shards
        instead, as diffusers' `variant=`; None loads the plain weights (`weight_files` names the
        variants of a folder without them). With `place` (e.g. `eqxdiff.sharding.placement(mesh)`),
        each weight is read straight into its sharding in `place(abstract)`; without, onto the first device."""
        path = Path(path)
        weights = weight_files(path, WEIGHTS_FILE, variant)
        config = json.loads((path / "config.json").read_text())
        abstract = abstract_network(cls, config)
        return load_safetensors(abstract, weights, rename=_current_attention_name, place=place)

    @classmethod
    def from_single_file(
        cls, path: str | Path, *, config: dict | str | Path, place: Place | None = None
    ) -> "AutoencoderKL":
        """One safetensors file with the original LDM / FLUX names (`vae-ft-mse-840000-ema-pruned`,
        `sdxl_vae`, FLUX's `ae`, or a whole SD checkpoint, whose `first_stage_model.` keys are read
        and the rest left), mapped to diffusers' names as diffusers' `convert_ldm_vae_checkpoint` does.

        The file's shapes give the architecture. What they cannot tell comes from `config` (a
        diffusers config dict, a config.json, or a folder holding one), diffusers' defaults filling
        the rest: the latent scaling, which differs between VAEs of one shape (SD 1/2
        `{"scaling_factor": 0.18215}`, SDXL 0.13025, SD3 1.5305 with shift_factor 0.0609, FLUX 0.3611
        with 0.1159), and norm_num_groups (32 in every LDM VAE). An architecture key in `config`
        that the shapes contradict raises, naming it."""
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"{path} does not exist")
        if not isinstance(config, dict):
            config_path = Path(config) / "config.json" if Path(config).is_dir() else Path(config)
            config = json.loads(config_path.read_text())
        with safe_open(str(path), framework="numpy") as file:
            prefix = vae_prefix(list(file.keys()))
            shapes = {
                k.removeprefix(prefix): tuple(file.get_slice(k).get_shape())
                for k in file.keys()
                if k.startswith(prefix)
            }
        from_shapes = config_from_shapes(shapes)
        listed = lambda v: list(v) if isinstance(v, (list, tuple)) else v  # noqa: E731  (tuple or JSON list)
        contradicted = {k: (config[k], v) for k, v in from_shapes.items() if k in config and listed(config[k]) != v}
        if contradicted:
            raise ValueError(f"{path}: config options the file's shapes contradict (config, file): {contradicted}")
        config = {**config, **from_shapes}
        levels = len(from_shapes["block_out_channels"])

        def rename(key: str) -> str | None:  # another model's keys in the file (an SD checkpoint's UNet): None
            return diffusers_name(key.removeprefix(prefix), levels) if key.startswith(prefix) else None

        abstract = abstract_network(cls, config)
        return load_safetensors(abstract, path, rename=rename, conv1x1_as_dense=True, place=place)

    def encode(self, x: Float[Array, "b h w ci"]) -> tuple[Float[Array, "b hl wl c"], Float[Array, "b hl wl c"]]:
        """Images in [-1, 1] -> posterior (mean, logvar), logvar clamped to [-30, 20]. For large
        images with bounded memory: `eqxdiff.nn.vae_tiling.encode_in_pieces` (diffusers' tiling and slicing)."""
        return posterior(self.encode_moments(x))

    def encode_moments(self, x: Float[Array, "b h w ci"]) -> Float[Array, "b hl wl c2"]:
        """Images -> the encoder's raw moments (mean and logvar concatenated, logvar not yet clamped):
        what diffusers' tiled encode blends."""
        f = self.downsample_factor
        if x.shape[1] % f or x.shape[2] % f:
            raise ValueError(f"AutoencoderKL.encode: image size {x.shape[1:3]} must be divisible by {f}")
        moments = self.encoder(x)
        return moments if self.quant_conv is None else self.quant_conv(moments)

    def decode(self, z: Float[Array, "b hl wl c"]) -> Float[Array, "b h w co"]:
        """An unscaled latent (undo `(z - shift) * scale` first) -> images, about [-1, 1]."""
        if self.post_quant_conv is not None:
            z = self.post_quant_conv(z)
        return self.decoder(z)


def posterior(moments: Float[Array, "b hl wl c2"]) -> tuple[Float[Array, "b hl wl c"], Float[Array, "b hl wl c"]]:
    """Raw moments -> (mean, logvar clamped to [-30, 20]), as diffusers' `DiagonalGaussianDistribution`."""
    mean, logvar = jnp.split(moments, 2, axis=-1)
    return mean, jnp.clip(logvar, -30.0, 20.0)


def _current_attention_name(key: str) -> str:
    """`...attentions.0.query.weight` -> `...attentions.0.to_q.weight`; other keys unchanged."""
    parts = key.split(".")
    if len(parts) >= 2 and parts[-2] in OLD_ATTENTION_NAMES and "attentions" in parts:
        parts[-2] = OLD_ATTENTION_NAMES[parts[-2]]
    return ".".join(parts)
