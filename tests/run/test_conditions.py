"""eqxdiff/run/conditions.py: one null per condition, for dropout and guidance alike, and configs that rebuild
the condition (eqxdiff/run/open_condition.py). (The step with a frozen tower: tests/core/test_text_step.py.)"""

from pathlib import Path

import equinox as eqx
import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec

from eqxdiff.run.conditions import EncodedText, Labels, NoCondition, ScratchText
from eqxdiff.data import open_source
from eqxdiff.diffusion import drop_condition
from eqxdiff.nn import CLIPTextModel, TextCond, UNet
from eqxdiff.sharding import make_mesh
from eqxdiff.run.open_condition import condition_from_config, open_text, stored_condition
from runs import train_here


def scratch(**tower) -> ScratchText:
    text = open_text(
        "scratch",
        "captioned_digits",
        "empty",
        scratch_config=dict(
            hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, hidden_act="gelu", **tower
        ),
        mesh=make_mesh(data=-1, fsdp=1),
        min_size=2**62,
    )
    return ScratchText(text, causal=False, pooled=True)


def test_labels_drop_to_label_n_and_guide_against_it():
    labels = Labels(10)
    batch = {"label": np.arange(8, dtype=np.int32)}
    dropped = np.asarray(drop_condition(jax.random.key(0), labels.cond(batch, None), 1.0, labels.null(None)))
    np.testing.assert_array_equal(dropped, np.full(8, 10))  # p = 1: every label is the null one
    cond, null = labels.for_sampling([3, 7], 2)
    np.testing.assert_array_equal(cond, [3, 3, 7, 7])
    np.testing.assert_array_equal(null, [10])
    assert labels.model_kwargs() == {"num_classes": 10} and NoCondition().for_sampling([0], 3) == (None, None)


def test_encoded_text_is_a_typed_condition_and_its_null_one_row_of_it():
    """The step reads the stored float16 records as TextCond(context, mask, pooled) in float32; dropout
    puts the one-row null in whole; a dict null (the format of files, not of the step) is refused by the
    constructor's annotation (checked in tests)."""
    null = TextCond(
        np.full((1, 4, 3), -1, np.float32), np.asarray([[1, 1, 0, 0]], np.int32), np.full((1, 3), -2, np.float32)
    )
    condition = EncodedText(None, null)
    rng = np.random.default_rng(0)
    half = lambda *shape: rng.normal(size=shape).astype(np.float16)  # noqa: E731 — as records store them
    batch = {
        "context": half(2, 4, 3),
        "pooled": half(2, 3),
        "attention_mask": np.asarray([[1, 1, 1, 0], [1, 1, 1, 1]], np.int32),
    }
    frozen = condition.frozen()
    cond = condition.cond(batch, frozen)
    assert isinstance(cond, TextCond) and condition.null(frozen) is null and condition.null(None) is null
    assert cond.context.dtype == cond.pooled.dtype == np.float32
    np.testing.assert_array_equal(cond.context, batch["context"].astype(np.float32))
    np.testing.assert_array_equal(cond.pooled, batch["pooled"].astype(np.float32))
    np.testing.assert_array_equal(cond.mask, batch["attention_mask"])
    kept, dropped = (drop_condition(jax.random.key(0), cond, p, null) for p in (0.0, 1.0))
    for name in ("context", "mask", "pooled"):
        np.testing.assert_array_equal(getattr(kept, name), getattr(cond, name))
        want = np.broadcast_to(getattr(null, name), getattr(cond, name).shape)
        np.testing.assert_array_equal(getattr(dropped, name), want)
    with pytest.raises(TypeError, match="parameter 'null'"):
        EncodedText(None, null.as_dict())


def test_a_scratch_tower_guides_against_the_tokens_it_trains_with_and_its_widths_are_stored():
    condition = scratch()
    model = condition.build(lambda key, **sizes: sizes, jax.random.key(0))  # the sizes the network is asked for
    assert model.net == {"context_dim": 16, "pooled_dim": 16}
    _, null = condition.for_sampling(["a 3 left of a 7"], 1)
    trained = model.null_cond(1)  # what caption dropout puts in, inside the model
    for name in ("input_ids", "attention_mask"):
        np.testing.assert_array_equal(null[name], trained[name])
        np.testing.assert_array_equal(condition.null(None)[name], trained[name])
    config = condition.to_config()
    assert config["tower"]["hidden_size"] == 16 and config["causal"] is False and config["pooled"] is True
    rebuilt = condition_from_config(config, mesh=make_mesh(data=-1, fsdp=1))
    assert rebuilt.to_config() == config and rebuilt.text.scratch_config == condition.text.scratch_config


def test_captioned_digits_is_asked_for_its_tower_and_prompts():
    source = open_source("captioned_digits")
    assert source.text_defaults == {"text_encoder": "scratch", "tokenizer": "captioned_digits"}
    records = scratch().records(source)
    assert set(records.fields) == {"image", "input_ids", "attention_mask"}  # captions tokenized on the host
    assert len(source.sample_prompts(10)) == 10


def test_old_checkpoints_name_their_condition_by_text_and_num_classes():
    assert stored_condition({"num_classes": 10}) == {"kind": "labels", "num_classes": 10}
    assert stored_condition({"num_classes": 0}) == {"kind": "none"}
    old = stored_condition(
        {
            "num_classes": 0,
            "text": {"text_encoder": "scratch", "tokenizer": "captioned_digits", "null_text": "empty", "max_length": 8},
        }
    )
    assert old["kind"] == "scratch_text" and old["causal"] is True and old["pooled"] is True


def test_a_dataset_whose_flips_change_its_captions_refuses_hflip(tmp_path):
    """main.py asks the source (`hflip_keeps_meaning`), before any model is built."""
    with pytest.raises(SystemExit, match="--hflip would swap what captioned_digits's captions place left and right"):
        train_here("--run_dir", tmp_path / "run", "--dataset", "captioned_digits", "--hflip", "--wandb", "disabled")


def readme_condition_example() -> str:
    """The code block of edit (f), a new kind of condition, on docs/edits.md (the README's edits table points there)."""
    edits = (Path(__file__).parents[2] / "docs" / "edits.md").read_text()
    section = edits[edits.index("**(f) A new kind of condition**") :]
    block = section[section.index("```python\n") + len("```python\n") :]
    return block[: block.index("\n```")]


def test_the_readme_condition_kind_trains_samples_and_is_rebuilt(monkeypatch):
    """Edit (f) as written (docs/edits.md): its class conditions a UNet (its condition, its null dropped in,
    guidance rows), and train/sample.py's rebuild finds it through the row it adds to CONDITION_KINDS; a kind with
    no row is refused naming the table."""
    import jax.numpy as jnp
    from eqxdiff.run import open_condition

    kinds = dict(open_condition.CONDITION_KINDS)
    monkeypatch.setattr(open_condition, "CONDITION_KINDS", kinds)
    with pytest.raises(
        KeyError, match="'image_embedding', which CONDITION_KINDS in eqxdiff/run/open_condition.py does not"
    ):
        condition_from_config({"kind": "image_embedding", "dim": 6}, mesh=None)
    scope = {"NoCondition": NoCondition, "TextCond": TextCond, "jnp": jnp, "np": np, "CONDITION_KINDS": kinds}
    exec(readme_condition_example(), scope)
    condition = condition_from_config(scope["ImageEmbedding"](6).to_config(), mesh=None)
    assert type(condition) is scope["ImageEmbedding"] and condition.dim == 6
    labels = condition_from_config(Labels(7).to_config(), mesh=None)
    assert type(labels) is Labels and labels.num_classes == 7

    net = UNet(1, (8,), 1, (0,), key=jax.random.key(0), **condition.model_kwargs())
    embedding = np.random.default_rng(0).standard_normal((4, 6)).astype(np.float16)
    cond = drop_condition(jax.random.key(1), condition.cond({"embedding": embedding}, None), 0.5, condition.null(None))
    x, t = jnp.zeros((4, 8, 8, 1)), jnp.ones((4,))
    # traced, not compiled: the network's checks of its condition run at trace time
    assert eqx.filter_eval_shape(net, x, t, cond).shape == (4, 8, 8, 1)
    rows, null = condition.for_sampling(embedding[:2], 3)
    assert rows.context.shape == (6, 1, 6) and np.array_equal(rows.pooled[3:], np.repeat(embedding[1:2], 3, 0))
    assert eqx.filter_eval_shape(net, x[:1], t[:1], jax.tree.map(jnp.asarray, null)).shape == (1, 8, 8, 1)


def test_a_rule_for_a_tower_that_encodes_only_sample_prompts_is_no_typo():
    """An encoded-text run's step takes no tower, yet its tower is loaded by SHARDING_RULES (it encodes the
    sample prompts): `pretrained()` names it, so main's check finds a rule for it; a scratch tower is the model's."""
    import dataclasses

    from eqxdiff.sharding import RuleError, check_rules_match

    tower = scratch()  # a tower to stand in for a pretrained one: the names are the same
    null = TextCond(np.zeros((1, 4, 3), np.float32), np.ones((1, 4), np.int32), np.zeros((1, 3), np.float32))
    model = CLIPTextModel.from_config(tower.text.scratch_config, key=jax.random.key(0), causal=True)
    frozen_tower = dataclasses.replace(tower.text, encoder=model)
    encoded = EncodedText(frozen_tower, null)
    rules = [(r"^text_encoder\.", PartitionSpec())]
    with pytest.raises(RuleError, match="matches no leaf"):
        check_rules_match(rules, [encoded.frozen()])  # the step's argument alone: the null
    check_rules_match(rules, [encoded.frozen(), encoded.pretrained()])
    assert tower.pretrained() == {} and Labels(3).pretrained() == {} and NoCondition().pretrained() == {}
