"""transformers' `CLIPTextModel` (Radford et al. 2021, CLIP's text tower) in Equinox, loading the
folders people have (config.json + model.safetensors: SD's `text_encoder/`, a save_pretrained dir).

A pre-LayerNorm causal transformer: token + position embeddings, `num_hidden_layers` blocks of
`x + attn(LN1(x))`, `x + MLP(LN2(x))`, a final LayerNorm; the pooled vector is the final state at
the end-of-text token. Field names are transformers', so leaf paths are state_dict keys; files
with the "text_model." prefix (transformers 4, SD) load as well as those without (transformers 5).
A full `CLIPModel` folder (openai's `clip-vit-large-patch14`: `text_config` and `vision_config` in one
config.json, both towers in one file) loads its text tower, as transformers' `CLIPTextModel.from_pretrained`
does: the `text_config` and the `text_model.*` keys, the other towers' keys left unread.
"""

import json
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray

from eqxdiff.nn.abstract_network import abstract_network
from eqxdiff.nn.layers import Dense, Embedding, layer_norm
from eqxdiff.nn.torch_weights import Place, load_safetensors
from eqxdiff.weights.weight_files import weight_files

WEIGHTS_FILE = "model.safetensors"
PREFIX = "text_model."
BUFFERS = ("embeddings.position_ids",)  # transformers' arange buffer, saved by transformers 4: not a weight
# transformers' CLIPTextConfig defaults, for the fields that shape the network.
DEFAULTS: dict[str, Any] = {
    "vocab_size": 49408,
    "hidden_size": 512,
    "intermediate_size": 2048,
    "num_hidden_layers": 12,
    "num_attention_heads": 8,
    "max_position_embeddings": 77,
    "hidden_act": "quick_gelu",
    "layer_norm_eps": 1e-5,
    "eos_token_id": 49407,
}
# Fields with no effect on this forward pass: metadata, other token ids, init and dropout (inference
# only), the projection size (CLIPTextModelWithProjection's head), and PreTrainedConfig's generic
# output/generation switches that transformers 4 wrote into every config.
IGNORED = {
    "architectures",
    "model_type",
    "transformers_version",
    "torch_dtype",
    "dtype",
    "bos_token_id",
    "pad_token_id",
    "attention_dropout",
    "dropout",
    "initializer_range",
    "initializer_factor",
    "projection_dim",
    "return_dict",
    "output_hidden_states",
    "output_attentions",
    "torchscript",
    "use_bfloat16",
    "tf_legacy_loss",
    "pruned_heads",
    "tie_word_embeddings",
    "chunk_size_feed_forward",
    "is_encoder_decoder",
    "is_decoder",
    "cross_attention_hidden_size",
    "add_cross_attention",
    "tie_encoder_decoder",
    "finetuning_task",
    "id2label",
    "label2id",
    "tokenizer_class",
    "prefix",
    "sep_token_id",
    "decoder_start_token_id",
    "task_specific_params",
    "problem_type",
    "max_length",
    "min_length",
    "do_sample",
    "early_stopping",
    "num_beams",
    "num_beam_groups",
    "diversity_penalty",
    "temperature",
    "top_k",
    "top_p",
    "typical_p",
    "repetition_penalty",
    "length_penalty",
    "no_repeat_ngram_size",
    "encoder_no_repeat_ngram_size",
    "bad_words_ids",
    "num_return_sequences",
    "output_scores",
    "return_dict_in_generate",
    "forced_bos_token_id",
    "forced_eos_token_id",
    "remove_invalid_values",
    "exponential_decay_length_penalty",
    "suppress_tokens",
    "begin_suppress_tokens",
}
LEGACY_EOS = 2  # transformers: eos_token_id 2 (configs before PR #24773) means "pool at the largest id"
# A full CLIPModel's keys that are not its text tower: left unread, as transformers' text models leave them.
# text_projection is the head of CLIPTextModelWithProjection (eqxdiff.nn.clip_text_projection), which reads it.
OTHER_TOWERS = ("vision_model.", "visual_projection.", "logit_scale", "text_projection.")


def quick_gelu(x: Float[Array, "*s"]) -> Float[Array, "*s"]:
    """CLIP's GELU approximation x·σ(1.702x) (transformers' `QuickGELUActivation`)."""
    return x * jax.nn.sigmoid(1.702 * x)


def gelu(x: Float[Array, "*s"]) -> Float[Array, "*s"]:
    """The exact, erf-based GELU (transformers' `"gelu"`, torch's default)."""
    return jax.nn.gelu(x, approximate=False)


ACTIVATIONS = {"quick_gelu": quick_gelu, "gelu": gelu}


def parse_config(config: dict) -> dict:
    """transformers' CLIPTextConfig fields that shape the network, defaults filled in; an option this
    port does not implement raises a ValueError naming it. Keys starting with `_` are metadata."""
    if "text_config" in config or config.get("model_type", "clip_text_model") != "clip_text_model":
        raise ValueError(
            f"model_type {config.get('model_type')!r} with text_config {'text_config' in config}: only a CLIP "
            "text tower's config ('clip_text_model') is supported here; `from_transformers` reads a full CLIP "
            "folder's text_config itself"
        )
    unknown = sorted(k for k in config if k not in DEFAULTS and k not in IGNORED and not k.startswith("_"))
    if unknown:
        raise ValueError(f"CLIPTextModel config options not supported: {unknown}")
    if config.get("pruned_heads"):
        raise ValueError(f"pruned_heads {config['pruned_heads']} not supported: every layer has all its heads")
    cfg = {**DEFAULTS, **{k: v for k, v in config.items() if k in DEFAULTS}}
    if cfg["hidden_act"] not in ACTIVATIONS:
        raise ValueError(f"hidden_act {cfg['hidden_act']!r} not supported: only {sorted(ACTIVATIONS)}")
    if type(cfg["eos_token_id"]) is not int:
        raise ValueError(f"eos_token_id {cfg['eos_token_id']!r} not supported: pooling needs one integer id")
    if cfg["hidden_size"] % cfg["num_attention_heads"]:
        raise ValueError(
            f"hidden_size {cfg['hidden_size']} is not divisible by num_attention_heads {cfg['num_attention_heads']}"
        )
    return cfg


def text_config(folder: Path) -> tuple[dict, bool]:
    """(the text tower's config, whether the folder is a full CLIPModel) from `folder`'s config.json: a
    full CLIP model's (`model_type` "clip") `text_config`, or the file itself."""
    config = json.loads((folder / "config.json").read_text())
    if config.get("model_type") == "clip" and isinstance(config.get("text_config"), dict):
        return config["text_config"], True
    return config, False


class LayerNorm(eqx.Module):
    """`torch.nn.LayerNorm` over the last axis with its affine, `[..., d] -> [..., d]`; float32 statistics."""

    weight: Float[Array, " d"]
    bias: Float[Array, " d"]
    eps: float = eqx.field(static=True)

    def __init__(self, dim: int, eps: float):
        self.weight, self.bias = jax.device_put(np.ones(dim, np.float32)), jax.device_put(np.zeros(dim, np.float32))
        self.eps = eps

    def __call__(self, x: Float[Array, "*batch d"]) -> Float[Array, "*batch d"]:
        return layer_norm(x, self.eps) * self.weight + self.bias


class CLIPAttention(eqx.Module):
    """Multi-head attention `[b, n, d] -> [b, n, d]`: out_proj(softmax(q kᵀ / sqrt(d_head) + mask) v),
    logits and softmax in float32 (XLA's `dot_product_attention`)."""

    q_proj: Dense
    k_proj: Dense
    v_proj: Dense
    out_proj: Dense
    num_heads: int = eqx.field(static=True)

    def __init__(self, dim: int, num_heads: int, *, key: PRNGKeyArray):
        kq, kk, kv, ko = jax.random.split(key, 4)
        self.q_proj, self.k_proj, self.v_proj = (Dense(dim, dim, key=k) for k in (kq, kk, kv))
        self.out_proj = Dense(dim, dim, key=ko)
        self.num_heads = num_heads

    def __call__(self, x: Float[Array, "b n d"], allowed: Bool[Array, "#b 1 n n"]) -> Float[Array, "b n d"]:
        b, n, d = x.shape
        heads = lambda t: t.reshape(b, n, self.num_heads, d // self.num_heads)  # noqa: E731
        q, k, v = heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x))
        y = jax.nn.dot_product_attention(q, k, v, mask=allowed)
        return self.out_proj(y.reshape(b, n, d))


class CLIPMLP(eqx.Module):
    """fc2(act(fc1(x))), `[..., d] -> [..., d]` through `intermediate_size`."""

    fc1: Dense
    fc2: Dense
    hidden_act: str = eqx.field(static=True)

    def __init__(self, dim: int, hidden: int, hidden_act: str, *, key: PRNGKeyArray):
        k1, k2 = jax.random.split(key)
        self.fc1, self.fc2 = Dense(dim, hidden, key=k1), Dense(hidden, dim, key=k2)
        self.hidden_act = hidden_act

    def __call__(self, x: Float[Array, "*batch d"]) -> Float[Array, "*batch d"]:
        return self.fc2(ACTIVATIONS[self.hidden_act](self.fc1(x)))


class CLIPEncoderLayer(eqx.Module):
    """One pre-LN block: x + attn(LN1(x)), then x + MLP(LN2(x)), `[b, n, d] -> [b, n, d]`."""

    self_attn: CLIPAttention
    layer_norm1: LayerNorm
    mlp: CLIPMLP
    layer_norm2: LayerNorm

    def __init__(self, cfg: dict, *, key: PRNGKeyArray):
        ka, km = jax.random.split(key)
        dim, eps = cfg["hidden_size"], cfg["layer_norm_eps"]
        self.self_attn = CLIPAttention(dim, cfg["num_attention_heads"], key=ka)
        self.layer_norm1, self.layer_norm2 = LayerNorm(dim, eps), LayerNorm(dim, eps)
        self.mlp = CLIPMLP(dim, cfg["intermediate_size"], cfg["hidden_act"], key=km)

    def __call__(self, x: Float[Array, "b n d"], allowed: Bool[Array, "#b 1 n n"]) -> Float[Array, "b n d"]:
        x = x + self.self_attn(self.layer_norm1(x), allowed)
        return x + self.mlp(self.layer_norm2(x))


class CLIPEncoder(eqx.Module):
    """The stack of blocks (a module of its own so that keys read `encoder.layers.<i>.…`)."""

    layers: list[CLIPEncoderLayer]


class CLIPTextEmbeddings(eqx.Module):
    """token_embedding[ids] + position_embedding[0..n-1], `[b, n] -> [b, n, d]`."""

    token_embedding: Embedding
    position_embedding: Embedding

    def __call__(self, input_ids: Int[Array, "b n"]) -> Float[Array, "b n d"]:
        n = input_ids.shape[1]
        return self.token_embedding.weight[input_ids] + self.position_embedding.weight[None, :n]


class CLIPTextModel(eqx.Module):
    """transformers' `CLIPTextModel`: token ids `[b, n]` (n <= max_position_embeddings) ->
    (last_hidden_state `[b, n, d]`, pooler_output `[b, d]`).

    Build with `from_transformers(folder)` (weights) or `from_config(config, key=...)` (random). A
    plain pytree of arrays: pass it to a jitted function as an argument (a frozen tower in the
    training step), or wrap calls in `eqx.filter_jit`.
    """

    embeddings: CLIPTextEmbeddings
    encoder: CLIPEncoder
    final_layer_norm: LayerNorm
    eos_token_id: int = eqx.field(static=True)
    causal: bool = eqx.field(static=True)

    def __init__(self, config: dict, *, key: PRNGKeyArray, causal: bool = True):
        cfg = parse_config(config)
        k_tok, k_pos, *k_layers = jax.random.split(key, 2 + cfg["num_hidden_layers"])
        dim = cfg["hidden_size"]
        self.embeddings = CLIPTextEmbeddings(
            Embedding(cfg["vocab_size"], dim, std=0.02, key=k_tok),  # transformers' init std
            Embedding(cfg["max_position_embeddings"], dim, std=0.02, key=k_pos),
        )
        self.encoder = CLIPEncoder([CLIPEncoderLayer(cfg, key=k) for k in k_layers])
        self.final_layer_norm = LayerNorm(dim, cfg["layer_norm_eps"])
        self.eos_token_id = cfg["eos_token_id"]
        self.causal = causal

    @classmethod
    def from_config(cls, config: dict, *, key: PRNGKeyArray, causal: bool = True) -> "CLIPTextModel":
        """Random weights (Dense: PyTorch's default init; embeddings N(0, 0.02²); LayerNorm 1/0) for a
        transformers CLIPTextConfig dict. `causal=False` lets every token attend to every other (not
        CLIP: for a tower trained from scratch, whose first words may need the later ones)."""
        return cls(config, key=key, causal=causal)

    @classmethod
    def from_transformers(
        cls, path: str | Path, *, variant: str | None = None, place: Place | None = None
    ) -> "CLIPTextModel":
        """A transformers CLIPTextModel folder (config.json + model.safetensors, or the shards of its
        `model.safetensors.index.json`; fp32, fp16 or bf16; keys with or without "text_model."; a
        stored `position_ids` buffer is ignored), as float32 parameters. `variant` (e.g. "fp16") loads
        `model.<variant>.safetensors` or its shards instead, as transformers' `variant=`. With `place`
        (e.g. `eqxdiff.sharding.placement(mesh, min_size)`), each weight is read straight into its
        sharding in `place(abstract)`; without, onto the first device."""
        config, full = text_config(Path(path))
        abstract = abstract_network(cls, config)

        def rename(key: str) -> str | None:  # a full CLIPModel's other towers: not read
            return None if full and key.startswith(OTHER_TOWERS) else key.removeprefix(PREFIX)

        weights = weight_files(path, WEIGHTS_FILE, variant)
        return load_safetensors(abstract, weights, rename=rename, ignore=BUFFERS, place=place)

    @property
    def num_layers(self) -> int:
        return len(self.encoder.layers)

    def __call__(
        self,
        input_ids: Int[Array | np.ndarray, "b n"],
        attention_mask: Int[Array | np.ndarray, "b n"] | Bool[Array | np.ndarray, "b n"] | None = None,
        *,
        hidden_layer: int | None = None,
    ) -> tuple[Float[Array, "b n d"], Float[Array, "b d"]]:
        """(hidden states `[b, n, d]`, pooled `[b, d]`) for token ids `[b, n]`.

        Attention is causal (unless built with `causal=False`); `attention_mask` (1 = token, 0 =
        padding) also hides padded keys, as in transformers. A row whose query sees no key (left
        padding) is not meaningful (transformers' own eager and sdpa paths disagree there). pooled =
        the final-LayerNorm state at the largest id when `eos_token_id == 2` (legacy configs), else
        at the first `eos_token_id` (position 0 if a row has none), as transformers' `pooler_output`.

        `hidden_layer=None` gives `last_hidden_state` (after final_layer_norm); an int gives
        transformers' `hidden_states[hidden_layer]` instead (0 = embeddings, -1 = the last block,
        -2 = the penultimate block as SDXL uses; no final LayerNorm; diffusers' `clip_skip` applies
        `final_layer_norm` to it). `pooled` always comes from the last layer.
        """
        input_ids = jnp.asarray(input_ids)
        b, n = input_ids.shape
        positions = self.embeddings.position_embedding.weight.shape[0]
        if n > positions:
            raise ValueError(f"CLIPTextModel: {n} tokens, more than max_position_embeddings {positions}")
        if hidden_layer is not None and not -(self.num_layers + 1) <= hidden_layer <= self.num_layers:
            raise ValueError(f"hidden_layer {hidden_layer} is not an index of {self.num_layers + 1} hidden states")
        allowed = jnp.asarray(np.tril(np.ones((n, n), bool)) | (not self.causal))[None, None]
        if attention_mask is not None:
            allowed = allowed & (jnp.asarray(attention_mask) != 0)[:, None, None, :]
        x = self.embeddings(input_ids)
        states = [x]
        for layer in self.encoder.layers:
            x = layer(x, allowed)
            states.append(x)
        last = self.final_layer_norm(x)
        if self.eos_token_id == LEGACY_EOS:
            index = jnp.argmax(input_ids, axis=-1)
        else:
            index = jnp.argmax((input_ids == self.eos_token_id).astype(jnp.int32), axis=-1)
        pooled = last[jnp.arange(b), index]
        return (last if hidden_layer is None else states[hidden_layer]), pooled
