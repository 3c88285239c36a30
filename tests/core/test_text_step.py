"""A frozen pretrained text tower in the training step: an argument (not a constant, not trained),
its encoded "" the null of caption dropout, laid out by the sharding rules."""

import functools
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import train_scripts  # noqa: F401 — puts train/ on sys.path: a test of the scripts
import main as train_main  # train/main.py
from eqxdiff.run.conditions import FrozenText
from eqxdiff.data import load_tokenizer
from eqxdiff.diffusion import EDMPreconditioning, EDMSchedule
from eqxdiff.nn import CLIPTextModel, TextCond
from jax.sharding import PartitionSpec as P

from eqxdiff.sharding import batch_sharding, fsdp_spec, make_mesh, state_shardings
from eqxdiff.text.conditioning import TextConditioning, encode_tokens
from eqxdiff.training import abstract_train_state, adamw_cosine, create_train_state, make_train_step

pytestmark = pytest.mark.quick  # the quick tier, the edit loop (tests/README.md)

DATA = Path(__file__).parents[1] / "data"
SCHEDULE, PARAM = EDMSchedule(), EDMPreconditioning()
BATCH, TOKENS = 8, 16


class PooledShift(eqx.Module):
    """A tiny text-conditional model: x·a + pooled·u + mean over unpadded tokens of context·v."""

    a: jax.Array
    u: jax.Array
    v: jax.Array

    def __init__(self, key):
        self.a = jnp.ones(())
        self.u, self.v = jax.random.normal(key, (2, 32, 1)) * 0.1

    def __call__(self, x, t, cond, *, key=None):
        mask = cond.mask[..., None].astype(x.dtype)
        context = (cond.context * mask).sum(1) / mask.sum(1)
        shift = cond.pooled @ self.u + context @ self.v
        return x * self.a + shift[:, None, None, :]


@functools.cache
def text_side() -> TextConditioning:
    """The sd_like CLIP fixture (vocab 99, 16 positions) with ids kept inside its vocabulary."""
    encoder = CLIPTextModel.from_transformers(DATA / "clip_text" / "sd_like")
    tokenizer = load_tokenizer(DATA / "clip_tokenizer" / "sd1")
    return TextConditioning(tokenizer, TOKENS, "empty", encoder=encoder)


def batch(seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(3, TOKENS, BATCH)
    mask = (np.arange(TOKENS)[None] < lengths[:, None]).astype(np.int32)
    ids = np.where(mask == 1, rng.integers(0, 98, (BATCH, TOKENS)), 1).astype(np.int32)  # 98 < vocab 99
    return {"image": rng.integers(0, 256, (BATCH, 8, 8, 1), dtype=np.uint8), "input_ids": ids, "attention_mask": mask}


@functools.cache
def build(min_size: int = 256):
    mesh = make_mesh(data=-1, fsdp=2)
    text = text_side()
    frozen = {"text_encoder": text.encoder, "null_cond": text.encoded_null()}
    frozen_shardings = state_shardings(frozen, mesh, min_size)
    frozen = jax.device_put(frozen, frozen_shardings)
    optimizer, lr = adamw_cosine(1e-3, 100, 2)
    abstract, shardings = abstract_train_state(PooledShift, optimizer, mesh, min_size)
    prepare = functools.partial(
        train_main.prepare, condition=FrozenText(text, text.encoded_null()), schedule=SCHEDULE, cond_dropout=0.0
    )
    step = make_train_step(
        prepare=prepare,
        loss_fn=functools.partial(train_main.loss_fn, schedule=SCHEDULE, parameterization=PARAM),
        optimizer=optimizer,
        lr_schedule=lr,
        ema_decay=0.9,
        state_shardings=shardings,
        batch_sharding=batch_sharding(mesh),
        seed=0,
        frozen_shardings=frozen_shardings,
    )
    return mesh, optimizer, shardings, frozen, frozen_shardings, step


def fresh_state():
    mesh, optimizer, shardings, *_ = build()
    return create_train_state(PooledShift, optimizer, jax.random.key(0), mesh, 256, shardings=shardings)[0]


def test_the_tower_is_an_argument_outside_the_state():
    mesh, _, _, frozen, frozen_shardings, step = build()
    state = fresh_state()
    params = sum(x.size for x in jax.tree.leaves(eqx.filter(state.model, eqx.is_inexact_array)))
    assert params == 1 + 2 * 32  # the model's own: no tower weight in the model, the EMA or Adam's moments
    for leaf, sharding in zip(jax.tree.leaves(frozen), jax.tree.leaves(frozen_shardings), strict=True):
        assert leaf.sharding.spec == sharding.spec == fsdp_spec(leaf.shape, 2, 256)  # the size rule, as the state
    assert frozen["text_encoder"].embeddings.token_embedding.weight.sharding.spec == P(None, "fsdp")

    data = jax.tree.map(lambda a: jax.device_put(a, batch_sharding(mesh)), batch())
    _, metrics = step(fresh_state(), data, frozen)
    # Another tower, same shapes: a different loss from the same compiled step. A tower closed
    # over as a constant could not change the loss; one in the state would be trained.
    other = eqx.tree_at(
        lambda f: f["text_encoder"].embeddings.token_embedding.weight,
        frozen,
        frozen["text_encoder"].embeddings.token_embedding.weight * 3.0,
    )
    _, other_metrics = step(fresh_state(), data, other)
    assert step.traces == 1
    assert float(metrics["loss"]) != float(other_metrics["loss"])
    weight = frozen["text_encoder"].embeddings.token_embedding.weight
    assert not weight.is_deleted()  # not donated: the next step reads it again


def test_caption_dropout_uses_the_encoded_empty_caption():
    text = text_side()
    data = batch(1)
    prepare = functools.partial(
        train_main.prepare, condition=FrozenText(text, text.encoded_null()), schedule=SCHEDULE, cond_dropout=0.5
    )
    frozen = {"text_encoder": text.encoder, "null_cond": text.encoded_null()}
    cond = jax.tree.map(np.asarray, jax.jit(prepare)(data, jax.random.key(0), frozen)["cond"])
    assert isinstance(cond, TextCond) and isinstance(text.encoded_null(), TextCond)
    captions = encode_tokens(text.encoder, data)  # encoded on the host, row by row the same tower
    empty = encode_tokens(text.encoder, text.tokens([""]))
    assert empty.mask[0].sum() == 2  # "" is bos, eos
    dropped = [not np.array_equal(cond.mask[i], data["attention_mask"][i]) for i in range(BATCH)]
    assert 0 < sum(dropped) < BATCH  # both kinds of rows at p = 0.5 with this key
    for i, drop in enumerate(dropped):
        want = jax.tree.map(lambda a: a[0], empty) if drop else jax.tree.map(lambda a: a[i], captions)
        for name in ("context", "pooled"):
            got = getattr(cond, name)[i]
            np.testing.assert_allclose(got, getattr(want, name), atol=2e-6, err_msg=f"{name} row {i}")
        np.testing.assert_array_equal(cond.mask[i], want.mask)


def test_zeros_null_text_and_a_mismatched_tokenizer():
    text = text_side()
    zeros = TextConditioning(text.tokenizer, TOKENS, "zeros", encoder=text.encoder).encoded_null()
    assert not zeros.context.any() and not zeros.pooled.any() and zeros.mask.sum() == 2
    from eqxdiff.text.conditioning import open_text_conditioning

    with pytest.raises(ValueError, match="not a pair"):  # 10,514 token ids, a table of 99 rows
        open_text_conditioning(str(DATA / "clip_text" / "sd_like"), str(DATA / "clip_tokenizer" / "sd1"))
