"""The prompt embeddings diffusers' Stable Diffusion pipelines take from their CLIP towers, from token ids.

SD 1.x/2.x (`StableDiffusionPipeline.encode_prompt`): the tower's `last_hidden_state`, or with `clip_skip`
k its `hidden_states[-(k + 1)]` put through the final LayerNorm (k = 1: the penultimate layer, normed).

SDXL (`StableDiffusionXLPipeline.encode_prompt`, Podell et al. 2023 §2.1): each tower's `hidden_states[-2]`,
the penultimate layer WITHOUT the final LayerNorm (`hidden_states[-(k + 2)]` with `clip_skip` k),
concatenated on the feature axis (CLIP-L's 768 then OpenCLIP bigG's 1280 = 2048); the pooled vector is
tower 2's projected `text_embeds`. The refiner has tower 2 only. No attention mask reaches the towers or the
UNet: every one of the 77 positions, padding included, is context.
"""

from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray

from eqxdiff.nn.abstract_network import abstract_network
from eqxdiff.nn.clip_text import CLIPTextModel, text_config
from eqxdiff.nn.clip_text_projection import CLIPTextModelWithProjection
from eqxdiff.nn.text_cond import TextCond
from eqxdiff.nn.torch_weights import Place

Ids = Int[Array | np.ndarray, "b n"]


def check_clip_skip(clip_skip: int | None, num_layers: int, skipped_by_default: int) -> None:
    """A clip_skip that indexes none of the tower's layers raises, naming the range (diffusers would index
    past the embeddings, or, for a negative value, from the front)."""
    if clip_skip is not None and not 0 <= clip_skip <= num_layers - skipped_by_default:
        raise ValueError(
            f"clip_skip {clip_skip}: this {num_layers}-layer tower takes 0..{num_layers - skipped_by_default} "
            f"(layers skipped from the {'penultimate' if skipped_by_default else 'last'} one), or None"
        )


def sd_prompt_embeds(
    encoder: CLIPTextModel,
    input_ids: Ids,
    attention_mask: Int[Array | np.ndarray, "b n"] | Bool[Array | np.ndarray, "b n"] | None = None,
    *,
    clip_skip: int | None = None,
) -> Float[Array, "b n d"]:
    """SD 1.x/2.x's prompt_embeds `[b, n, d]`: `last_hidden_state`, or with `clip_skip` k (0..num_layers)
    `final_layer_norm(hidden_states[-(k + 1)])`, as `StableDiffusionPipeline.encode_prompt`. diffusers passes
    `attention_mask` only for a tower whose config sets `use_attention_mask`; SD's do not."""
    check_clip_skip(clip_skip, encoder.num_layers, 0)
    if clip_skip is None:
        return encoder(input_ids, attention_mask)[0]
    hidden, _ = encoder(input_ids, attention_mask, hidden_layer=-(clip_skip + 1))
    return encoder.final_layer_norm(hidden)


class SDXLTextEncoders(eqx.Module):
    """SDXL's two text towers, token ids -> `TextCond(context [b, n, d1 + d2], mask [b, n] (all 1), pooled
    [b, p])`, the `text` of the `SDXLCond` an `SDUNet` with `addition_embed_type="text_time"` takes.

    `text_encoder`: CLIP-L (`text_encoder/`, a CLIPTextModel), None for the refiner; `text_encoder_2`: the
    projected tower (`text_encoder_2/`, a CLIPTextModelWithProjection). Field names are the pipeline's
    folders, so leaf paths read `text_encoder_2.text_model.…`.
    """

    text_encoder: CLIPTextModel | None
    text_encoder_2: CLIPTextModelWithProjection

    @classmethod
    def from_config(cls, config: dict | None, config_2: dict, *, key: PRNGKeyArray) -> "SDXLTextEncoders":
        """Random towers for two transformers CLIPTextConfig dicts (`config` None: no tower 1, the refiner's)."""
        k1, k2 = jax.random.split(key)
        tower_1 = None if config is None else CLIPTextModel.from_config(config, key=k1)
        return cls(tower_1, CLIPTextModelWithProjection.from_config(config_2, key=k2))

    @classmethod
    def from_diffusers(
        cls, folder: str | Path, *, variant: str | None = None, place: Place | None = None
    ) -> "SDXLTextEncoders":
        """An SDXL pipeline folder's `text_encoder/` (absent: the refiner, which has none) and
        `text_encoder_2/`, as float32; `variant` (e.g. "fp16") as `CLIPTextModel.from_transformers`. `place`
        lays out the whole module (leaves `text_encoder.…`, `text_encoder_2.text_model.…`, so that one rule list
        names either tower): each weight is read straight into its sharding in `place(abstract)`."""
        folder = Path(folder).expanduser()
        if not (folder / "text_encoder_2").is_dir():
            held = sorted(p.name for p in folder.iterdir()) if folder.is_dir() else "nothing: it is not a folder"
            raise FileNotFoundError(
                f"{folder} has no text_encoder_2/ (it holds {held}): SDXL's pipeline folder, as diffusers saves it, "
                "has text_encoder/ and text_encoder_2/ (the refiner only the second)"
            )
        has_1 = (folder / "text_encoder").is_dir()
        configs = [
            text_config(folder / name)[0] if has else None
            for name, has in (("text_encoder", has_1), ("text_encoder_2", True))
        ]
        abstract = abstract_network(cls.from_config, *configs)
        whole = None if place is None else place(abstract)
        part = lambda name: None if whole is None else lambda _: getattr(whole, name)  # noqa: E731
        tower_1 = None
        if has_1:
            path = folder / "text_encoder"
            tower_1 = CLIPTextModel.from_transformers(path, variant=variant, place=part("text_encoder"))
        tower_2 = CLIPTextModelWithProjection.from_transformers(
            folder / "text_encoder_2", variant=variant, place=part("text_encoder_2")
        )
        return cls(tower_1, tower_2)

    def __call__(self, input_ids: Ids | None, input_ids_2: Ids, *, clip_skip: int | None = None) -> TextCond:
        """`input_ids` for tower 1 (tokenizer/, None for the refiner) and `input_ids_2` for tower 2
        (tokenizer_2/), int[b, n] each -> TextCond(context f32[b, n, d1 + d2], mask int32[b, n] of ones,
        pooled f32[b, p]): `hidden_states[-(clip_skip + 2)]` of each (clip_skip None: 0), and text_embeds."""
        layers = self.text_encoder_2.text_model.num_layers
        if self.text_encoder is not None:
            layers = min(layers, self.text_encoder.num_layers)
        check_clip_skip(clip_skip, layers, 1)
        layer = -(2 + (clip_skip or 0))
        hidden_2, pooled = self.text_encoder_2(input_ids_2, hidden_layer=layer)
        context = [hidden_2]
        if self.text_encoder is not None:
            if input_ids is None:
                raise ValueError(
                    "SDXLTextEncoders: text_encoder takes input_ids (tokenizer/'s); None is for the "
                    "refiner, which has text_encoder_2 only"
                )
            context.insert(0, self.text_encoder(input_ids, hidden_layer=layer)[0])
        mask = jnp.ones(hidden_2.shape[:2], jnp.int32)  # diffusers hands the UNet no mask: all positions count
        return TextCond(jnp.concatenate(context, axis=-1), mask, pooled)

    @property
    def context_dim(self) -> int:
        """The context's width, d1 + d2 (the UNet's cross_attention_dim): 2048 for SDXL, 1280 for its refiner."""
        width = lambda clip: clip.final_layer_norm.weight.shape[-1]  # noqa: E731
        return width(self.text_encoder_2.text_model) + (0 if self.text_encoder is None else width(self.text_encoder))

    @property
    def pooled_dim(self) -> int:
        """text_embeds' width (projection_dim): 1280 for SDXL."""
        return self.text_encoder_2.text_projection.out_features
