"""diffusers' `AutoencoderKL` (Rombach et al. 2022, the KL-regularised VAE of latent diffusion) in
Equinox, NHWC, loading diffusers model folders (config.json + diffusion_pytorch_model.safetensors).

`encode` gives the posterior moments (mean, logvar clamped to [-30, 20] as diffusers'
`DiagonalGaussianDistribution` does); `decode` takes an unscaled latent. A diffusion model sees
`(z - shift_factor) * scaling_factor`. Field names are diffusers', so leaf paths are state_dict keys.
"""

import json
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jaxtyping import Array, Float, PRNGKeyArray

from eqxdiff.nn.layers import Conv2d, GroupNorm
from eqxdiff.nn.torch_weights import load_safetensors
from eqxdiff.nn.vae_blocks import EPS, DownEncoderBlock, MidBlock, UpDecoderBlock

WEIGHTS_FILE = "diffusion_pytorch_model.safetensors"
# diffusers' AutoencoderKL.__init__ defaults, for fields a config.json leaves out.
DEFAULTS: dict[str, Any] = {
    "in_channels": 3, "out_channels": 3, "down_block_types": ["DownEncoderBlock2D"],
    "up_block_types": ["UpDecoderBlock2D"], "block_out_channels": [64], "layers_per_block": 1, "act_fn": "silu",
    "latent_channels": 4, "norm_num_groups": 32, "sample_size": 32, "scaling_factor": 0.18215,
    "shift_factor": None, "latents_mean": None, "latents_std": None, "force_upcast": True,
    "use_quant_conv": True, "use_post_quant_conv": True, "mid_block_add_attention": True,
}  # fmt: skip
IGNORED = {"sample_size", "force_upcast"}  # tiling and fp16 policy in diffusers; no effect on the network
# Older checkpoints' attention names (diffusers' ModelMixin._fix_state_dict_keys_on_load).
OLD_ATTENTION_NAMES = {"query": "to_q", "key": "to_k", "value": "to_v", "proj_attn": "to_out.0"}


def parse_config(config: dict) -> dict:
    """diffusers' config with defaults filled in; an option this port does not implement raises
    a ValueError naming it. Keys starting with `_` are metadata (`_class_name` must be ours)."""
    if config.get("_class_name", "AutoencoderKL") != "AutoencoderKL":
        raise ValueError(f"_class_name {config['_class_name']!r}: only diffusers' AutoencoderKL is supported")
    unknown = sorted(k for k in config if k not in DEFAULTS and not k.startswith("_"))
    if unknown:
        raise ValueError(f"AutoencoderKL config options not supported: {unknown}")
    cfg = {**DEFAULTS, **{k: v for k, v in config.items() if not k.startswith("_")}}
    levels = len(cfg["block_out_channels"])
    for name, block in (("down_block_types", "DownEncoderBlock2D"), ("up_block_types", "UpDecoderBlock2D")):
        if list(cfg[name]) != [block] * levels:
            raise ValueError(f"{name} {cfg[name]} not supported: only {block!r}, one per block_out_channels ({levels})")
    if cfg["act_fn"] not in ("silu", "swish"):
        raise ValueError(f"act_fn {cfg['act_fn']!r} not supported: only 'silu'")
    for name in ("latents_mean", "latents_std"):
        if cfg[name] is not None:
            raise ValueError(f"{name} not supported: latents are normalised by scaling_factor and shift_factor only")
    return cfg


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
    scaling_factor: float = eqx.field(static=True)
    shift_factor: float = eqx.field(static=True)
    downsample_factor: int = eqx.field(static=True)

    def __init__(self, config: dict, *, key: PRNGKeyArray):
        cfg = parse_config(config)
        k_enc, k_dec, k_q, k_pq = jax.random.split(key, 4)
        latent = cfg["latent_channels"]
        self.encoder, self.decoder = Encoder(cfg, key=k_enc), Decoder(cfg, key=k_dec)
        self.quant_conv = Conv2d(2 * latent, 2 * latent, 1, key=k_q) if cfg["use_quant_conv"] else None
        self.post_quant_conv = Conv2d(latent, latent, 1, key=k_pq) if cfg["use_post_quant_conv"] else None
        self.scaling_factor = float(cfg["scaling_factor"])
        self.shift_factor = float(cfg["shift_factor"] or 0.0)
        self.downsample_factor = 2 ** (len(cfg["block_out_channels"]) - 1)

    @classmethod
    def from_config(cls, config: dict, *, key: PRNGKeyArray) -> "AutoencoderKL":
        """Random weights (PyTorch's default init; GroupNorm 1/0) for a diffusers config dict."""
        return cls(config, key=key)

    @classmethod
    def from_diffusers(cls, path: str | Path, *, mesh: Mesh | None = None, min_size: int = 2**12) -> "AutoencoderKL":
        """A diffusers model folder (config.json + diffusion_pytorch_model.safetensors; fp32, fp16
        or bf16), as float32 parameters. With `mesh`, each weight is read straight into its
        `eqxdiff.sharding` layout for `(mesh, min_size)`; without, onto the first device."""
        path = Path(path)
        if not (path / WEIGHTS_FILE).is_file():
            found = sorted(p.name for p in path.glob("*")) if path.is_dir() else []
            raise FileNotFoundError(f"{path / WEIGHTS_FILE} does not exist (the folder holds {found})")
        config = json.loads((path / "config.json").read_text())
        abstract = eqx.filter_eval_shape(cls, config, key=jax.random.key(0))
        weights = path / WEIGHTS_FILE
        return load_safetensors(abstract, weights, rename=_current_attention_name, mesh=mesh, min_size=min_size)

    def encode(
        self, x: Float[Array, "b h w ci"]
    ) -> tuple[Float[Array, "b hl wl c"], Float[Array, "b hl wl c"]]:
        """Images in [-1, 1] -> posterior (mean, logvar), logvar clamped to [-30, 20]."""
        f = self.downsample_factor
        if x.shape[1] % f or x.shape[2] % f:
            raise ValueError(f"AutoencoderKL.encode: image size {x.shape[1:3]} must be divisible by {f}")
        moments = self.encoder(x)
        if self.quant_conv is not None:
            moments = self.quant_conv(moments)
        mean, logvar = jnp.split(moments, 2, axis=-1)
        return mean, jnp.clip(logvar, -30.0, 20.0)

    def decode(self, z: Float[Array, "b hl wl c"]) -> Float[Array, "b h w co"]:
        """An unscaled latent (undo `(z - shift) * scale` first) -> images, about [-1, 1]."""
        if self.post_quant_conv is not None:
            z = self.post_quant_conv(z)
        return self.decoder(z)


def _current_attention_name(key: str) -> str:
    """`...attentions.0.query.weight` -> `...attentions.0.to_q.weight`; other keys unchanged."""
    parts = key.split(".")
    if len(parts) >= 2 and parts[-2] in OLD_ATTENTION_NAMES and "attentions" in parts:
        parts[-2] = OLD_ATTENTION_NAMES[parts[-2]]
    return ".".join(parts)
