"""SDXL's prompts -> its text condition, as diffusers' `StableDiffusionXLPipeline.encode_prompt` makes it
from a pipeline folder's `text_encoder[_2]/` and `tokenizer[_2]/`.

Each prompt is tokenized twice to 77 ids: by `tokenizer/` (padding <|endoftext|>) for CLIP-L and by
`tokenizer_2/` (padding "!") for OpenCLIP bigG; `prompts_2` (default: the same prompts) goes to the second.
Both towers' configs pool at the largest id, the end-of-text token under either padding. The unconditional
half of guidance: with no negative prompt and the pipeline's `force_zeros_for_empty_prompt` (model_index.json;
SDXL base: true) zeros, else the negative prompts ("" by default) encoded like prompts, always at
`hidden_states[-2]`: diffusers applies `clip_skip` to the prompts only.
"""

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path

import equinox as eqx
import numpy as np

from eqxdiff.data.tokenizer import TextTokenizer, load_tokenizer
from eqxdiff.nn.text_cond import TextCond
from eqxdiff.nn.torch_weights import Place
from eqxdiff.sd.prompt_embeds import SDXLTextEncoders

FORCE_ZEROS_DEFAULT = True  # StableDiffusionXLPipeline's own default, for a model_index.json without the field


@eqx.filter_jit
def _encode(encoders: SDXLTextEncoders, input_ids, input_ids_2, clip_skip: int | None) -> TextCond:
    return encoders(input_ids, input_ids_2, clip_skip=clip_skip)


@dataclasses.dataclass(frozen=True)
class SDXLPrompts:
    """SDXL's text side on the host: the two towers (`encoders`), their tokenizers (`tokenizer` None for the
    refiner, which has tower 2 only) and the pipeline's `force_zeros_for_empty_prompt`."""

    encoders: SDXLTextEncoders
    tokenizer: TextTokenizer | None
    tokenizer_2: TextTokenizer
    force_zeros_for_empty_prompt: bool = FORCE_ZEROS_DEFAULT

    @classmethod
    def from_diffusers(
        cls, folder: str | Path, *, variant: str | None = None, place: Place | None = None
    ) -> "SDXLPrompts":
        """An SDXL pipeline folder as diffusers saves it: `text_encoder[_2]/`, `tokenizer[_2]/` and
        `model_index.json` (for force_zeros_for_empty_prompt); `variant` and `place` as
        `SDXLTextEncoders.from_diffusers`."""
        folder = Path(folder).expanduser()
        encoders = SDXLTextEncoders.from_diffusers(folder, variant=variant, place=place)
        index = folder / "model_index.json"
        config = json.loads(index.read_text()) if index.is_file() else {}
        tokenizer = None if encoders.text_encoder is None else load_tokenizer(folder / "tokenizer")
        prompts = cls(
            encoders,
            tokenizer,
            load_tokenizer(folder / "tokenizer_2"),
            bool(config.get("force_zeros_for_empty_prompt", FORCE_ZEROS_DEFAULT)),
        )
        for name, tok, tower in (
            ("", tokenizer, encoders.text_encoder),
            ("_2", prompts.tokenizer_2, encoders.text_encoder_2.text_model),
        ):
            rows = 0 if tower is None else tower.embeddings.token_embedding.weight.shape[0]
            if tower is not None and tok.tokenizer.get_vocab_size() > rows:  # a larger id would be clamped in jit
                raise ValueError(
                    f"{folder}: tokenizer{name}/ has {tok.tokenizer.get_vocab_size()} ids but "
                    f"text_encoder{name}/ embeds {rows}: they are not a pair"
                )
        return prompts

    @property
    def max_length(self) -> int:
        """Tokens per prompt: tokenizer_2's model_max_length (77), which diffusers pads both tokenizers to."""
        return self.tokenizer_2.check_length(None)

    def encode(
        self, prompts: Sequence[str], prompts_2: Sequence[str] | None = None, *, clip_skip: int | None = None
    ) -> TextCond:
        """TextCond(context f32[b, 77, d1 + d2], mask int32[b, 77] of ones, pooled f32[b, p]) as host arrays,
        one row per prompt: `prompts` through tower 1, `prompts_2` (None or empty: `prompts`) through tower 2,
        `hidden_states[-(clip_skip + 2)]` (None: -2) of each, pooled = tower 2's text_embeds."""
        prompts_2 = list(prompts_2 or prompts)
        if len(prompts_2) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(prompts_2)} prompts_2: one of each per row")
        cond = _encode(self.encoders, *self.token_ids(prompts, prompts_2), clip_skip)
        host = lambda x: np.asarray(x, np.float32)  # noqa: E731
        return TextCond(host(cond.context), np.asarray(cond.mask), host(cond.pooled))

    def token_ids(self, prompts: Sequence[str], prompts_2: Sequence[str] | None = None) -> tuple:
        """(input_ids of tokenizer/ (None for the refiner), input_ids_2 of tokenizer_2/), int32[b, 77] each:
        `prompts` and `prompts_2` (None or empty: `prompts`) padded to `max_length` as the pipeline pads them."""
        ids = None if self.tokenizer is None else self.tokenizer(list(prompts), self.max_length)[0]
        return ids, self.tokenizer_2(list(prompts_2 or prompts), self.max_length)[0]

    def negative(
        self,
        batch_size: int,
        negative_prompts: Sequence[str] | None = None,
        negative_prompts_2: Sequence[str] | None = None,
    ) -> TextCond:
        """The unconditional TextCond for `batch_size` rows, as `encode_prompt`'s negative_prompt_embeds and
        negative_pooled_prompt_embeds: zeros when no negative prompt is given and force_zeros_for_empty_prompt
        is set (an explicit "" is encoded), else `negative_prompts` (None: "") encoded at hidden_states[-2]."""
        if negative_prompts is None and self.force_zeros_for_empty_prompt:
            shape = (batch_size, self.max_length)
            return TextCond(
                np.zeros((*shape, self.encoders.context_dim), np.float32),
                np.ones(shape, np.int32),
                np.zeros((batch_size, self.encoders.pooled_dim), np.float32),
            )
        negative = list(negative_prompts or [""] * batch_size)
        if len(negative) != batch_size:
            raise ValueError(f"{len(negative)} negative prompts for a batch of {batch_size}: give one per prompt")
        return self.encode(negative, negative_prompts_2 or negative)
