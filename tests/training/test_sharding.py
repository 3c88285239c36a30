"""The FSDP rule, named sharding rules, the mesh, and where every leaf of a real TrainState ends up."""

import re

import equinox as eqx
import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from eqxdiff.nn import UNet
from eqxdiff.sharding import batch_sharding, fsdp_spec, leaf_names, make_mesh, sharding_summary
from eqxdiff.training import abstract_train_state, adamw_cosine, create_train_state


@pytest.mark.parametrize(
    "shape, fsdp, min_size, expected",
    [
        ((3, 3, 16, 32), 4, 100, P(None, None, None, "fsdp")),  # largest divisible axis
        ((3, 3, 32, 32), 4, 100, P(None, None, "fsdp")),  # tie: the earliest axis
        ((64, 64), 8, 100, P("fsdp")),
        ((30, 8), 4, 100, P(None, "fsdp")),  # the largest axis does not divide, the next does
        ((30, 7), 4, 100, P()),  # nothing divides: replicate
        ((8, 8), 4, 100, P()),  # below the threshold
        ((128,), 4, 128, P("fsdp")),  # exactly at the threshold
        ((64, 64), 1, 1, P()),  # fsdp=1 is plain data parallelism
        ((), 4, 0, P()),  # scalars
    ],
)
def test_fsdp_spec(shape, fsdp, min_size, expected):
    assert fsdp_spec(shape, fsdp, min_size) == expected


def test_make_mesh_shapes_and_errors():
    assert dict(make_mesh(-1, 4).shape) == {"data": 2, "fsdp": 4}
    assert dict(make_mesh(8, 1).shape) == {"data": 8, "fsdp": 1}
    assert dict(make_mesh(1, 2, jax.devices()[:2]).shape) == {"data": 1, "fsdp": 2}
    with pytest.raises(ValueError, match="3 x fsdp=2 = 6 devices, but 8 are present"):
        make_mesh(3, 2)
    with pytest.raises(ValueError, match="fsdp=3 must be >= 1 and divide the 8 devices"):
        make_mesh(-1, 3)


def tiny_unet(key):
    return UNet(1, (16, 32), 1, num_classes=10, norm_groups=4, key=key)


def test_fsdp_state_params_ema_and_adam_moments_share_one_layout():
    optimizer, _ = adamw_cosine(1e-3, 10, 1)
    state, _ = create_train_state(tiny_unet, optimizer, jax.random.key(0), make_mesh(-1, 4), min_size=1024)
    params = jax.tree.leaves(eqx.filter(state.model, eqx.is_inexact_array))
    ema = jax.tree.leaves(eqx.filter(state.ema, eqx.is_inexact_array))
    adam = state.opt_state[1][0]  # chain(clip, adamw) -> adamw's ScaleByAdamState
    mu, nu = jax.tree.leaves(adam.mu), jax.tree.leaves(adam.nu)
    assert len(params) == len(ema) == len(mu) == len(nu)
    sharded = 0
    for p, e, m, v in zip(params, ema, mu, nu):
        expected = fsdp_spec(p.shape, 4, 1024)
        for leaf in (p, e, m, v):
            assert leaf.sharding.spec == expected, (p.shape, leaf.sharding.spec)
        if p.size >= 1024:
            assert expected != P(), p.shape  # every large UNet weight has a divisible axis
            sharded += 1
            assert p.addressable_shards[0].data.size == p.size // 4  # really split, not replicated
    assert sharded > 10
    assert state.step.sharding.spec == P() and state.bad_steps.sharding.spec == P()


def test_fsdp1_shards_nothing_and_summary_counts_bytes():
    optimizer, _ = adamw_cosine(1e-3, 10, 1)
    state, shardings = create_train_state(tiny_unet, optimizer, jax.random.key(0), make_mesh(-1, 1), min_size=1024)
    for leaf in jax.tree.leaves(eqx.filter(state, eqx.is_array)):
        assert leaf.sharding.is_fully_replicated
    total = sum(x.nbytes for x in jax.tree.leaves(eqx.filter(state, eqx.is_array)))
    line = sharding_summary(state, shardings)
    assert "0 sharded over fsdp" in line and f"{total / 2**20:.1f} MiB per device" in line


def test_batch_is_split_over_both_axes():
    mesh = make_mesh(-1, 4)
    x = jax.device_put(np.zeros((16, 8, 8, 1), np.float32), batch_sharding(mesh))
    assert x.sharding.spec == P(("data", "fsdp"))
    assert {s.data.shape for s in x.addressable_shards} == {(2, 8, 8, 1)}


# Named rules. min_size 64 makes conv_out.weight (3, 3, 16, 1) = 144 elements FSDP-sharded by default.
RULE_MIN_SIZE = 64


def _specs_by_path(shardings) -> dict[str, P]:
    return {jax.tree_util.keystr(p): s.spec for p, s in jax.tree_util.tree_leaves_with_path(shardings)}


def _conv_out_copies(state):
    adam = state.opt_state[1][0]
    return [state.model.conv_out.weight, state.ema.conv_out.weight, adam.mu.conv_out.weight, adam.nu.conv_out.weight]


def test_leaf_names_give_copies_their_parameter_path():
    optimizer, _ = adamw_cosine(1e-3, 10, 1)
    abstract, _ = abstract_train_state(tiny_unet, optimizer, make_mesh(2, 4), RULE_MIN_SIZE)
    names = leaf_names(abstract)
    assert set(_conv_out_copies(names)) == {"conv_out.weight"}
    assert names.model.down_blocks[0][0].conv1.weight == "down_blocks.0.0.conv1.weight"
    assert names.opt_state[1][0].nu.down_blocks[0][0].conv1.weight == "down_blocks.0.0.conv1.weight"
    assert (names.step, names.bad_steps, names.opt_state[1][0].count) == ("step", "bad_steps", "opt_state.1.0.count")


@pytest.mark.parametrize("regex", ["conv_out", r"^conv_out\.weight$"])  # anchored: only the parameter path matches
def test_one_rule_replicates_a_leaf_its_ema_and_both_adam_moments_and_nothing_else(regex):
    optimizer, _ = adamw_cosine(1e-3, 10, 1)
    mesh = make_mesh(2, 4)
    _, default = abstract_train_state(tiny_unet, optimizer, mesh, RULE_MIN_SIZE)
    assert default.model.conv_out.weight.spec == P(None, None, "fsdp")  # the rule has something to undo
    state, ruled = create_train_state(
        tiny_unet, optimizer, jax.random.key(0), mesh, RULE_MIN_SIZE, rules=[(regex, P())]
    )
    before, after = _specs_by_path(default), _specs_by_path(ruled)
    assert before.keys() == after.keys()
    changed = {path for path in before if before[path] != after[path]}
    assert changed == {
        ".model.conv_out.weight",
        ".ema.conv_out.weight",
        ".opt_state[1][0].mu.conv_out.weight",
        ".opt_state[1][0].nu.conv_out.weight",
    }
    assert all(after[path] == P() for path in changed)
    for leaf in _conv_out_copies(state):  # the real arrays: whole on every device
        assert leaf.sharding.is_fully_replicated and leaf.addressable_shards[0].data.shape == (3, 3, 16, 1)
    arrays = jax.tree.leaves(eqx.filter(state, eqx.is_array))
    for leaf, sharding in zip(arrays, jax.tree.leaves(ruled), strict=True):
        assert leaf.sharding.is_equivalent_to(sharding, leaf.ndim)
        assert sharding.spec == P() or fsdp_spec(leaf.shape, 4, RULE_MIN_SIZE) == sharding.spec


def test_explicit_specs_and_spec_functions_first_match_wins():
    optimizer, _ = adamw_cosine(1e-3, 10, 1)
    rules = [
        (r"time_embed\.fc1\.weight", P(None, "fsdp")),  # default: P("fsdp"), the earliest of two equal axes
        ("time_embed", P()),  # fc1.weight matched the rule above first
        ("label_embed", P(None, ("data", "fsdp"))),  # (11, 128): 128 over all 8 devices
        (r"\.bias$", lambda shape, fsdp_size, min_size: fsdp_spec(shape, fsdp_size, 1)),  # shard even small biases
    ]
    state, shardings = create_train_state(
        tiny_unet, optimizer, jax.random.key(0), make_mesh(2, 4), RULE_MIN_SIZE, rules=rules
    )
    model, mu = state.model, state.opt_state[1][0].mu
    for tree in (model, state.ema, mu):
        assert tree.time_embed.fc1.weight.sharding.spec == P(None, "fsdp")
        assert tree.time_embed.fc2.weight.sharding.is_fully_replicated  # (128, 128): fsdp_spec would shard it
        assert tree.label_embed.weight.addressable_shards[0].data.shape == (11, 16)
        assert tree.conv_in.bias.addressable_shards[0].data.shape == (4,)  # (16,) < min_size, sharded by the rule
    assert shardings.model.conv_out.bias.spec == P()  # (1,): fsdp_spec(.., 1) finds no divisible axis
    assert model.conv_in.weight.sharding.spec == fsdp_spec((3, 3, 1, 16), 4, RULE_MIN_SIZE)  # no rule: default
    with pytest.raises(ValueError, match="either `rules` or `shardings`"):  # given shardings already hold their rules
        create_train_state(
            tiny_unet, optimizer, jax.random.key(0), make_mesh(2, 4), 64, rules=rules, shardings=shardings
        )


@pytest.mark.parametrize(
    "spec, message",
    [
        (P("fsdp"), r"conv_out\.weight of shape \(3, 3, 16, 1\).*splits dimension 0 \(size 3\) into 4 parts"),
        (P(None, None, None, "data"), r"conv_out\.weight.*\{'data': 2, 'fsdp': 4\}.*dimension 3 \(size 1\)"),
        (P(None, None, "model"), r"conv_out\.weight.*axes \['model'\] the mesh does not have"),
        (P(None, None, None, None, "fsdp"), r"conv_out\.weight.*names 5 dimensions, the leaf has 4"),
    ],
)
def test_a_spec_that_does_not_fit_its_leaf_is_an_error_naming_leaf_spec_and_mesh(spec, message):
    optimizer, _ = adamw_cosine(1e-3, 10, 1)
    with pytest.raises(ValueError, match=message):
        abstract_train_state(tiny_unet, optimizer, make_mesh(2, 4), RULE_MIN_SIZE, rules=[(r"conv_out\.weight", spec)])


def test_a_rule_that_matches_nothing_is_an_error_naming_it():
    optimizer, _ = adamw_cosine(1e-3, 10, 1)
    with pytest.raises(ValueError, match=r"rule 'conv_ot' matches no leaf .*conv_out\.weight"):
        abstract_train_state(tiny_unet, optimizer, make_mesh(2, 4), RULE_MIN_SIZE, rules=[("conv_ot", P())])
    with pytest.raises(ValueError, match="not a valid regex"):
        abstract_train_state(tiny_unet, optimizer, make_mesh(2, 4), RULE_MIN_SIZE, rules=[("conv_out[", P())])


def test_head_layout_rules_split_attention_outputs_along_their_output_axis():
    """HEAD_LAYOUT_RULES (train/main.py --init's): an SD UNet's to_out.0 weights, base or under a LoRA, split along
    their output axis, their LoRA A replicated; every other leaf as fsdp_spec. (On an SDXL-like UNet of 20 heads over
    8 devices fsdp_spec alone made GSPMD replicate the heads in the LoRA step's backward pass; BENCHMARKS.md.)"""
    import json
    from pathlib import Path

    from eqxdiff.sd import SDUNet
    from eqxdiff.nn.lora import add_lora
    from eqxdiff.sharding import HEAD_LAYOUT_RULES, output_axis_spec, state_shardings

    assert output_axis_spec((16, 24), 8, 1) == P(None, "fsdp") and output_axis_spec((16, 20), 8, 1) == P()
    assert output_axis_spec((16, 24), 8, 10**6) == P() and output_axis_spec((16, 24), 1, 1) == P()
    config = json.loads(
        (Path(__file__).parents[1] / "data" / "sd_pipeline" / "sdxl" / "unet" / "config.json").read_text()
    )
    assert fsdp_spec((16, 16), 8, 1) == P("fsdp")  # alone: a square weight split along its input (heads) axis

    def unet(lora: bool):
        model = SDUNet.from_config(config, key=jax.random.key(0))
        return add_lora(model, 2, key=jax.random.key(1)) if lora else model

    for lora in (False, True):
        model = eqx.filter_eval_shape(unet, lora)
        shardings = state_shardings(model, make_mesh(1, 8), 1, rules=HEAD_LAYOUT_RULES, strict=False)
        seen = set()
        for name, leaf, sharding in zip(
            jax.tree.leaves(leaf_names(model)), jax.tree.leaves(model), jax.tree.leaves(shardings), strict=True
        ):
            if re.search(r"to_out\.0\.(base_layer\.)?weight$", name):
                want, kind = P(None, "fsdp"), "weight"  # [heads · head_dim, out]: the output axis
            elif name.endswith("to_out.0.lora_A"):
                want, kind = P(), "lora_A"
            else:
                want, kind = fsdp_spec(leaf.shape, 8, 1), "other"
            assert sharding.spec == want, name
            seen.add(kind)
        assert seen == ({"weight", "lora_A", "other"} if lora else {"weight", "other"})
