"""diffusers' `UNet2DConditionModel` as Stable Diffusion 1.x, 2.x and SDXL use it (Rombach et al. 2022;
Podell et al. 2023), in Equinox, NHWC, loading diffusers model folders (config.json +
diffusion_pytorch_model.safetensors, a variant such as `.fp16.safetensors`, or an index's shards).

The model keeps eqxdiff's contract `model(x[b,h,w,c], t[b], cond, *, key=None)`: `t` is diffusers'
timestep (0..999 for SD's schedulers, fractional allowed), `cond` a `TextCond` (SD 1.x/2.x; its mask
is not applied and its pooled vector not read, as diffusers' SD pipelines), an `SDXLCond`
(`addition_embed_type="text_time"`: the pooled `text_embeds` and the size/crop `time_ids` too) or a
`ClassLabelCond` (a class embedding: the x4 upscaler's noise level, SD 2.x unCLIP's image embedding). The
output is what the UNet predicts (epsilon or v, per the scheduler's prediction_type). Field names are
diffusers', so leaf paths are state_dict keys; config parsing and refusals: eqxdiff/sd/unet_config.py.
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

from eqxdiff.nn.abstract_network import abstract_network
from eqxdiff.nn.class_label_cond import ClassLabelCond
from eqxdiff.nn.layers import Conv2d, Embedding, GroupNorm
from eqxdiff.nn.text_cond import TextCond
from eqxdiff.nn.torch_weights import Place, load_safetensors
from eqxdiff.sd.sdxl_cond import SDXLCond
from eqxdiff.sd.unet_blocks import DownBlock, MidBlock, TimestepEmbedding, UpBlock, timestep_features
from eqxdiff.sd.unet_config import parse_config
from eqxdiff.weights.weight_files import weight_files

WEIGHTS_FILE = "diffusion_pytorch_model.safetensors"


class SDUNet(eqx.Module):
    """diffusers' `UNet2DConditionModel`: latents `[b, h, w, in_channels]`, timesteps `[b]` and a text
    condition -> `[b, h, w, out_channels]`. Any h, w: odd sizes are upsampled back to the skips' sizes.

    Build with `from_diffusers(folder)` (weights) or `from_config(config, key=...)` (random). Plain JAX:
    wrap calls in `eqx.filter_jit` (or call it inside a jitted step)."""

    conv_in: Conv2d
    time_embedding: TimestepEmbedding
    class_embedding: Embedding | TimestepEmbedding | None  # class_labels -> temb (upscaler: table; unCLIP: MLP)
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
    remat: bool = eqx.field(static=True)  # each resnet and transformer recomputed in the backward pass

    def __init__(self, config: dict, *, remat: bool = False, key: PRNGKeyArray):
        cfg = parse_config(config)
        widths, levels = list(cfg["block_out_channels"]), len(cfg["block_out_channels"])
        groups, eps, temb = cfg["norm_num_groups"], cfg["norm_eps"], 4 * widths[0]
        keys = iter(jax.random.split(key, 2 * levels + 7))
        self.config, self.remat = json.dumps(config, sort_keys=True), remat
        self.flip_sin_to_cos, self.freq_shift = bool(cfg["flip_sin_to_cos"]), float(cfg["freq_shift"])
        self.time_features, self.context_dim = widths[0], cfg["cross_attention_dim"][-1]
        self.conv_in = Conv2d(cfg["in_channels"], widths[0], key=next(keys))
        self.time_embedding = TimestepEmbedding(widths[0], temb, key=next(keys))
        if cfg["class_embed_type"] == "projection":
            self.class_embedding = TimestepEmbedding(cfg["projection_class_embeddings_input_dim"], temb, key=next(keys))
        elif cfg["num_class_embeds"] is not None:
            self.class_embedding = Embedding(cfg["num_class_embeds"], temb, key=next(keys))
        else:
            self.class_embedding = None
        text_time = cfg["addition_embed_type"] == "text_time"
        self.addition_time_embed_dim = cfg["addition_time_embed_dim"] if text_time else None
        self.add_input_dim = cfg["projection_class_embeddings_input_dim"] if text_time else None
        self.add_embedding = TimestepEmbedding(self.add_input_dim, temb, key=next(keys)) if text_time else None

        def attention(level: int, used: bool) -> dict | None:  # Transformer2DModel's arguments at a level
            return (
                None
                if not used
                else dict(
                    heads=cfg["heads"][level],
                    context_dim=cfg["cross_attention_dim"][level],
                    groups=groups,
                    depth=cfg["transformer_layers_per_block"][level],
                    use_linear_projection=cfg["use_linear_projection"],
                    only_cross_attention=cfg["only_cross_attention"][level],
                )
            )

        self.down_blocks, skip_widths = [], [widths[0]]
        for i, kind in enumerate(cfg["down_block_types"]):
            n = cfg["layers_per_block"][i]
            cin, last = widths[max(i - 1, 0)], i == levels - 1
            spec = attention(i, kind.startswith("CrossAttn"))
            self.down_blocks.append(
                DownBlock(cin, widths[i], n, temb, groups, eps, spec, not last, remat=remat, key=next(keys))
            )
            skip_widths += [widths[i]] * (n + (not last))
        mid = dict(attention(levels - 1, True), only_cross_attention=False)  # the mid block has no such option
        self.mid_block = MidBlock(widths[-1], temb, groups, eps, mid, remat=remat, key=next(keys))
        self.up_blocks, prev = [], widths[-1]
        for i, kind in enumerate(cfg["up_block_types"]):
            level, n = levels - 1 - i, cfg["layers_per_block"][levels - 1 - i] + 1
            cins = [prev] + [widths[level]] * (n - 1)
            skips = [skip_widths.pop() for _ in range(n)]
            self.up_blocks.append(
                UpBlock(
                    cins,
                    skips,
                    widths[level],
                    temb,
                    groups,
                    eps,
                    attention(level, kind.startswith("CrossAttn")),
                    i < levels - 1,
                    remat=remat,
                    key=next(keys),
                )
            )
            prev = widths[level]
        self.conv_norm_out = GroupNorm(groups, widths[0], eps=eps)
        self.conv_out = Conv2d(widths[0], cfg["out_channels"], key=next(keys))

    @classmethod
    def from_config(cls, config: dict, *, remat: bool = False, key: PRNGKeyArray) -> "SDUNet":
        """Random weights (PyTorch's default init; norms 1/0) for a diffusers config dict. `remat`: each resnet
        and Transformer2DModel recomputes its activations in the backward pass (less memory, more compute)."""
        return cls(config, remat=remat, key=key)

    @classmethod
    def from_diffusers(
        cls,
        path: str | Path,
        *,
        variant: str | None = None,
        place: Place | None = None,
        dtype: DTypeLike = np.float32,
        remat: bool = False,
    ) -> "SDUNet":
        """A diffusers UNet folder (a pipeline's `unet/`: config.json + diffusion_pytorch_model.safetensors,
        or the shards of its `.safetensors.index.json`; fp32, fp16 or bf16 files), as `dtype` parameters
        (float32; bfloat16 casts each slice as it is read). `variant` (e.g. "fp16") loads
        `diffusion_pytorch_model.<variant>.safetensors` or its shards, as diffusers' `variant=`. With `place`
        (e.g. `eqxdiff.sharding.placement(mesh)`), each weight is read straight into its sharding in
        `place(abstract)`; without, onto the first device. Every key is read once; a missing or unexpected
        key raises naming it. `remat`: as `from_config`."""
        path = Path(path).expanduser()
        weights = weight_files(path, WEIGHTS_FILE, variant)
        config = json.loads((path / "config.json").read_text())
        abstract = abstract_network(cls, config, remat=remat)
        return load_safetensors(abstract, weights, place=place, conv1x1_as_dense=True, dtype=dtype)

    def null_cond(self, batch_size: int) -> Any:
        """None: the null condition of guidance is the text towers' encoding of "" (and, for SDXL, the
        request's time_ids), which the run makes, not the UNet; it is passed as `cond`."""
        del batch_size
        return None

    def __call__(
        self, x: Float[Array, "b h w ci"], t: Float[Array, " b"], cond: Any, *, key: PRNGKeyArray | None = None
    ) -> Float[Array, "b h w co"]:
        """`cond`: a `TextCond`, an `SDXLCond` for SDXL, a `ClassLabelCond` for a class embedding (checked
        here, naming what is wrong); `key` is unused (no dropout at SD's configs)."""
        del key
        context, added, labels = self._unpack(cond, x.shape[0])
        emb = self.time_embedding(timestep_features(t, self.time_features, self.flip_sin_to_cos, self.freq_shift))
        if self.class_embedding is not None:
            emb = emb + self.class_embedding(labels)
        if self.add_embedding is not None:
            pooled, time_ids = added
            features = timestep_features(
                time_ids.reshape(-1), self.addition_time_embed_dim, self.flip_sin_to_cos, self.freq_shift
            ).reshape(x.shape[0], -1)
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

    def _unpack(self, cond: Any, b: int) -> tuple[Array, tuple[Array, Array] | None, Array | None]:
        """(context, (pooled, time_ids) for SDXL, class_labels for a class embedding), checked at trace time
        with one clear error."""
        sdxl = self.add_embedding is not None
        kind = SDXLCond if sdxl else TextCond if self.class_embedding is None else ClassLabelCond
        if not isinstance(cond, kind):
            want = {
                SDXLCond: "an SDXLCond(TextCond(context, mask, pooled), time_ids)",
                ClassLabelCond: "a ClassLabelCond(TextCond(context, mask), class_labels)",
                TextCond: "a TextCond(context, mask)",
            }[kind]
            raise ValueError(f"SDUNet ({self._family()}) takes cond = {want} (eqxdiff.nn); got {type(cond).__name__}")
        text = cond if kind is TextCond else cond.text
        if text.context.ndim != 3 or text.context.shape[0] != b or text.context.shape[2] != self.context_dim:
            raise ValueError(
                f"SDUNet: cond context must be [{b}, n, {self.context_dim}] (cross_attention_dim); "
                f"got {text.context.shape}"
            )
        if kind is ClassLabelCond:
            return text.context, None, self._checked_labels(cond.class_labels, b)
        if kind is TextCond:
            return text.context, None, None
        expected = self.add_input_dim
        pooled, time_ids = text.pooled, cond.time_ids
        got = None if pooled is None else pooled.shape[-1] + time_ids.shape[-1] * self.addition_time_embed_dim
        if pooled is None or pooled.shape[0] != b or time_ids.shape[0] != b or got != expected:
            shapes = (None if pooled is None else pooled.shape, time_ids.shape)
            raise ValueError(
                f"SDUNet (SDXL): pooled [b={b}, p] and time_ids [b, k] must give p + k * "
                f"addition_time_embed_dim ({self.addition_time_embed_dim}) = "
                f"projection_class_embeddings_input_dim ({expected}); got {shapes}"
            )
        return text.context, (pooled, time_ids), None

    def _family(self) -> str:
        if self.add_embedding is not None:
            return "SDXL, text_time"
        return "SD 1.x/2.x" if self.class_embedding is None else "with a class embedding"

    def _checked_labels(self, labels: Any, b: int) -> Array:
        """int labels [b] for a table (num_class_embeds), float vectors [b, p] for a projection."""
        if isinstance(self.class_embedding, Embedding):
            rows = self.class_embedding.weight.shape[0]
            if labels.shape != (b,) or jnp.issubdtype(labels.dtype, jnp.floating):
                raise ValueError(
                    f"SDUNet: class_labels must be int [{b}] row indices < {rows} (num_class_embeds); "
                    f"got {labels.dtype}{labels.shape}"
                )
            return labels
        width = self.class_embedding.linear_1.in_features
        if labels.shape != (b, width):
            raise ValueError(
                f"SDUNet: class_labels must be float [{b}, {width}] "
                f"(projection_class_embeddings_input_dim); got {labels.shape}"
            )
        return labels.astype(jnp.float32)
