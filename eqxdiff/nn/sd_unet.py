"""diffusers' `UNet2DConditionModel` as Stable Diffusion 1.x, 2.x and SDXL use it (Rombach et al. 2022;
Podell et al. 2023), in Equinox, NHWC, loading diffusers model folders (config.json +
diffusion_pytorch_model.safetensors, a variant such as `.fp16.safetensors`, or an index's shards).

The model keeps eqxdiff's contract `model(x[b,h,w,c], t[b], cond, *, key=None)`: `t` is diffusers'
timestep (0..999 for SD's schedulers, fractional allowed), `cond` a `TextCond` (SD 1.x/2.x; its mask
is not applied and its pooled vector not read, as diffusers' SD pipelines) or an `SDXLCond`
(`addition_embed_type="text_time"`: the pooled `text_embeds` and the size/crop `time_ids` too). The
output is what the UNet predicts (epsilon or v, per the scheduler's prediction_type). Field names are
diffusers', so leaf paths are state_dict keys; config parsing and refusals: eqxdiff/nn/sd_unet_config.py.
"""

import json
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import DTypeLike
from jaxtyping import Array, Float, PRNGKeyArray

from eqxdiff.nn.layers import Conv2d, GroupNorm
from eqxdiff.nn.sd_unet_blocks import DownBlock, MidBlock, TimestepEmbedding, UpBlock, timestep_features
from eqxdiff.nn.sd_unet_config import parse_config
from eqxdiff.nn.sdxl_cond import SDXLCond
from eqxdiff.nn.text_cond import TextCond
from eqxdiff.nn.torch_weights import Place, load_safetensors
from eqxdiff.nn.weight_files import weight_files

WEIGHTS_FILE = "diffusion_pytorch_model.safetensors"


class SDUNet(eqx.Module):
    """diffusers' `UNet2DConditionModel`: latents `[b, h, w, in_channels]`, timesteps `[b]` and a text
    condition -> `[b, h, w, out_channels]`. Any h, w: odd sizes are upsampled back to the skips' sizes.

    Build with `from_diffusers(folder)` (weights) or `from_config(config, key=...)` (random). Plain JAX:
    wrap calls in `eqx.filter_jit` (or call it inside a jitted step)."""

    conv_in: Conv2d
    time_embedding: TimestepEmbedding
    add_embedding: TimestepEmbedding | None  # SDXL's text_time: [text_embeds, features(time_ids)] -> temb
    down_blocks: list[DownBlock]
    mid_block: MidBlock
    up_blocks: list[UpBlock]
    conv_norm_out: GroupNorm
    conv_out: Conv2d
    config: str = eqx.field(static=True)  # the diffusers config.json it was built from (JSON, sorted keys)
    flip_sin_to_cos: bool = eqx.field(static=True)
    freq_shift: float = eqx.field(static=True)
    time_features: int = eqx.field(static=True)  # block_out_channels[0]
    addition_time_embed_dim: int | None = eqx.field(static=True)
    add_input_dim: int | None = eqx.field(static=True)  # projection_class_embeddings_input_dim (text_time)
    context_dim: int = eqx.field(static=True)

    def __init__(self, config: dict, *, key: PRNGKeyArray):
        cfg = parse_config(config)
        widths, levels = list(cfg["block_out_channels"]), len(cfg["block_out_channels"])
        groups, eps, temb = cfg["norm_num_groups"], cfg["norm_eps"], 4 * widths[0]
        keys = iter(jax.random.split(key, 2 * levels + 6))
        self.config = json.dumps(config, sort_keys=True)
        self.flip_sin_to_cos, self.freq_shift = bool(cfg["flip_sin_to_cos"]), float(cfg["freq_shift"])
        self.time_features, self.context_dim = widths[0], cfg["cross_attention_dim"][-1]
        if len(set(cfg["cross_attention_dim"])) != 1:
            raise ValueError(f"UNet2DConditionModel option cross_attention_dim={cfg['cross_attention_dim']}: one "
                             "text width for every level is supported")  # fmt: skip
        self.conv_in = Conv2d(cfg["in_channels"], widths[0], key=next(keys))
        self.time_embedding = TimestepEmbedding(widths[0], temb, key=next(keys))
        text_time = cfg["addition_embed_type"] == "text_time"
        self.addition_time_embed_dim = cfg["addition_time_embed_dim"] if text_time else None
        self.add_input_dim = cfg["projection_class_embeddings_input_dim"] if text_time else None
        self.add_embedding = TimestepEmbedding(self.add_input_dim, temb, key=next(keys)) if text_time else None

        def attention(level: int, used: bool) -> dict | None:  # Transformer2DModel's arguments at a level
            return None if not used else dict(
                heads=cfg["heads"][level], context_dim=cfg["cross_attention_dim"][level], groups=groups,
                depth=cfg["transformer_layers_per_block"][level], use_linear_projection=cfg["use_linear_projection"],
                only_cross_attention=cfg["only_cross_attention"][level])  # fmt: skip

        self.down_blocks, skip_widths = [], [widths[0]]
        for i, kind in enumerate(cfg["down_block_types"]):
            n = cfg["layers_per_block"][i]
            cin, last = widths[max(i - 1, 0)], i == levels - 1
            spec = attention(i, kind.startswith("CrossAttn"))
            self.down_blocks.append(DownBlock(cin, widths[i], n, temb, groups, eps, spec, not last, key=next(keys)))
            skip_widths += [widths[i]] * (n + (not last))
        mid = dict(attention(levels - 1, True), only_cross_attention=False)  # the mid block has no such option
        self.mid_block = MidBlock(widths[-1], temb, groups, eps, mid, key=next(keys))
        self.up_blocks, prev = [], widths[-1]
        for i, kind in enumerate(cfg["up_block_types"]):
            level, n = levels - 1 - i, cfg["layers_per_block"][levels - 1 - i] + 1
            cins = [prev] + [widths[level]] * (n - 1)
            skips = [skip_widths.pop() for _ in range(n)]
            self.up_blocks.append(UpBlock(cins, skips, widths[level], temb, groups, eps,
                                          attention(level, kind.startswith("CrossAttn")), i < levels - 1,
                                          key=next(keys)))  # fmt: skip
            prev = widths[level]
        self.conv_norm_out = GroupNorm(groups, widths[0], eps=eps)
        self.conv_out = Conv2d(widths[0], cfg["out_channels"], key=next(keys))

    @classmethod
    def from_config(cls, config: dict, *, key: PRNGKeyArray) -> "SDUNet":
        """Random weights (PyTorch's default init; norms 1/0) for a diffusers config dict."""
        return cls(config, key=key)

    @classmethod
    def from_diffusers(
        cls, path: str | Path, *, variant: str | None = None, place: Place | None = None, dtype: DTypeLike = np.float32
    ) -> "SDUNet":
        """A diffusers UNet folder (a pipeline's `unet/`: config.json + diffusion_pytorch_model.safetensors,
        or the shards of its `.safetensors.index.json`; fp32, fp16 or bf16 files), as `dtype` parameters
        (float32; bfloat16 casts each slice as it is read). `variant` (e.g. "fp16") loads
        `diffusion_pytorch_model.<variant>.safetensors` or its shards, as diffusers' `variant=`. With `place`
        (e.g. `eqxdiff.sharding.placement(mesh)`), each weight is read straight into its sharding in
        `place(abstract)`; without, onto the first device. Every key is read once; a missing or unexpected
        key raises naming it."""
        path = Path(path).expanduser()
        weights = weight_files(path, WEIGHTS_FILE, variant)
        config = json.loads((path / "config.json").read_text())
        abstract = eqx.filter_eval_shape(cls, config, key=jax.random.key(0))
        return load_safetensors(abstract, weights, place=place, conv1x1_as_dense=True, dtype=dtype)

    def null_cond(self, batch_size: int) -> Any:
        """None: the null condition of guidance is the text towers' encoding of "" (and, for SDXL, the
        request's time_ids), which the run makes, not the UNet; it is passed as `cond`."""
        del batch_size
        return None

    def __call__(
        self, x: Float[Array, "b h w ci"], t: Float[Array, " b"], cond: Any, *, key: PRNGKeyArray | None = None
    ) -> Float[Array, "b h w co"]:
        """`cond`: a `TextCond`, or an `SDXLCond` for SDXL (checked here, naming what is wrong); `key` is
        unused (no dropout at SD's configs)."""
        del key
        context, added = self._unpack(cond, x.shape[0])
        emb = self.time_embedding(timestep_features(t, self.time_features, self.flip_sin_to_cos, self.freq_shift))
        if self.add_embedding is not None:
            pooled, time_ids = added
            features = timestep_features(time_ids.reshape(-1), self.addition_time_embed_dim, self.flip_sin_to_cos,
                                         self.freq_shift).reshape(x.shape[0], -1)  # fmt: skip
            emb = emb + self.add_embedding(jnp.concatenate([pooled.astype(jnp.float32), features], axis=-1))
        h = self.conv_in(x)
        skips = [h]
        for block in self.down_blocks:
            h, made = block(h, emb, context)
            skips += made
        h = self.mid_block(h, emb, context)
        for block in self.up_blocks:
            n = len(block.resnets)
            level_skips, skips = skips[-n:], skips[:-n]
            h = block(h, level_skips, emb, context, skips[-1].shape[1:3] if skips else None)
        return self.conv_out(jax.nn.silu(self.conv_norm_out(h)))

    def _unpack(self, cond: Any, b: int) -> tuple[Array, tuple[Array, Array] | None]:
        """(context, (pooled, time_ids) for SDXL else None), checked at trace time with one clear error."""
        sdxl = self.add_embedding is not None
        want = "an SDXLCond(TextCond(context, mask, pooled), time_ids)" if sdxl else "a TextCond(context, mask)"
        text = cond.text if sdxl and isinstance(cond, SDXLCond) else cond
        if not isinstance(text, TextCond) or (sdxl and not isinstance(cond, SDXLCond)):
            raise ValueError(f"SDUNet ({'SDXL, text_time' if sdxl else 'SD 1.x/2.x'}) takes cond = {want} "
                             f"(eqxdiff.nn); got {type(cond).__name__}")  # fmt: skip
        if text.context.ndim != 3 or text.context.shape[0] != b or text.context.shape[2] != self.context_dim:
            raise ValueError(f"SDUNet: cond context must be [{b}, n, {self.context_dim}] (cross_attention_dim); "
                             f"got {text.context.shape}")  # fmt: skip
        if not sdxl:
            return text.context, None
        expected = self.add_input_dim
        pooled, time_ids = text.pooled, cond.time_ids
        got = None if pooled is None else pooled.shape[-1] + time_ids.shape[-1] * self.addition_time_embed_dim
        if pooled is None or pooled.shape[0] != b or time_ids.shape[0] != b or got != expected:
            shapes = (None if pooled is None else pooled.shape, time_ids.shape)
            raise ValueError(f"SDUNet (SDXL): pooled [b={b}, p] and time_ids [b, k] must give p + k * "
                             f"addition_time_embed_dim ({self.addition_time_embed_dim}) = "
                             f"projection_class_embeddings_input_dim ({expected}); got {shapes}")  # fmt: skip
        return text.context, (pooled, time_ids)
