"""LoRA adapters (eqxdiff/nn/lora.py) on the tiny SD 1.x-like UNet fixture: zero B is the base exactly, the
update is (alpha/r)·x Aᵀ Bᵀ against numpy, the default targets are the attention projections, merging keeps
the output, and the trainable part (gradient, optimizer step) holds the adapters only."""

import os
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec
from safetensors.numpy import save_file

from eqxdiff.nn import Dense, TextCond
from eqxdiff.sd import SDUNet
from eqxdiff.nn.lora import (
    LoRALinear,
    add_lora,
    layer_names,
    lora_filter,
    lora_frozen,
    lora_layers,
    merge_lora,
    partition_lora,
)
from eqxdiff.sd.lora_files import load_lora, save_lora
from eqxdiff.sharding import make_mesh, state_shardings

DATA = Path(__file__).parents[1] / "data" / "sd_unet" / "sd1_like"
LORA_DATA = Path(__file__).parents[1] / "data" / "lora"
# Max error relative to the output's max: SDUNet's own parity with diffusers is 4e-6 (tests/sd/test_sd_unet.py).
TOL = 1e-5
forward = eqx.filter_jit(lambda unet, x, t, cond: unet(x, t, cond))


@pytest.fixture(scope="module")
def unet_and_inputs():
    ref = {k: jnp.asarray(v) for k, v in np.load(DATA / "reference.npz").items()}
    return SDUNet.from_diffusers(DATA), (ref["x"], ref["t"], TextCond(ref["context"], ref["mask"]))


def moved_off_zero(model, seed: int = 0):
    """Every adapter's B drawn from N(0, 0.1²), an update that changes the output (numpy's draws: jax.random's, op by
    op, compile a program for each shape)."""
    rng = np.random.default_rng(seed)
    layers = lora_layers(model).values()
    new_b = [jnp.asarray(0.1 * rng.standard_normal(layer.lora_B.shape), layer.lora_B.dtype) for layer in layers]
    return eqx.tree_at(lambda m: [layer.lora_B for layer in lora_layers(m).values()], model, new_b)


def rel_err(a, b) -> float:
    return float(np.abs(np.asarray(a) - np.asarray(b)).max() / np.abs(np.asarray(b)).max())


def test_lora_linear_is_base_plus_scaled_low_rank_update():
    base = Dense(6, 5, key=jax.random.key(0))
    rng = np.random.default_rng(1)  # numpy's draws, the layer in one program: op by op, each op compiles
    a, b, x = (rng.standard_normal(shape).astype(np.float32) for shape in ((3, 6), (5, 3), (4, 6)))
    out = eqx.filter_jit(lambda layer, x: layer(x))(LoRALinear(base, jnp.asarray(a), jnp.asarray(b), alpha=7.0), x)
    x = np.asarray(x, np.float64)
    w, bias, a, b = (np.asarray(v, np.float64) for v in (base.weight, base.bias, a, b))
    want = x @ w + bias + (7.0 / 3) * x @ a.T @ b.T
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)


def test_default_targets_are_the_attention_projections(unet_and_inputs):
    unet, _ = unet_and_inputs
    wrapped = lora_layers(add_lora(unet, 4, key=jax.random.key(0)))
    want = [n for n in layer_names(unet) if n.endswith((".to_q", ".to_k", ".to_v", ".to_out.0"))]
    assert sorted(wrapped) == sorted(want) and len(want) == 4 * 2 * 4  # 4 transformers × attn1, attn2 × 4 projections
    assert "mid_block.attentions.0.transformer_blocks.0.attn2.to_k" in wrapped
    assert all(layer.lora_A.shape[0] == 4 and layer.alpha == 4.0 for layer in wrapped.values())


def test_targets_regex_and_no_match_refused(unet_and_inputs):
    unet, _ = unet_and_inputs
    only_k = lora_layers(add_lora(unet, 2, targets=r"attn2\.to_k$", key=jax.random.key(0)))
    assert len(only_k) == 4 and all(name.endswith("attn2.to_k") for name in only_k)
    with pytest.raises(ValueError, match="match no linear or conv layer"):
        add_lora(unet, 2, targets=r"to_qq$", key=jax.random.key(0))


def test_the_frozen_rest_without_drawing_is_the_partitions(unet_and_inputs):
    unet, _ = unet_and_inputs
    targets = r"to_q|to_v|conv1|downsamplers\.0\.conv"  # Dense and Conv2d wrappers both
    want = partition_lora(add_lora(unet, 4, alpha=8, targets=targets, key=jax.random.key(0)))[1]
    frozen = lora_frozen(unet, 4, alpha=8, targets=targets)
    assert jax.tree.structure(frozen) == jax.tree.structure(want)
    # the UNet's own arrays, as the partition's are: none copied, none drawn
    assert all(x is y for x, y in zip(jax.tree.leaves(frozen), jax.tree.leaves(want), strict=True))
    with pytest.raises(ValueError, match="match no linear or conv layer"):
        lora_frozen(unet, 2, targets=r"to_qq$")


def test_a_is_peft_kaiming_uniform_and_b_zero(unet_and_inputs):
    unet, _ = unet_and_inputs
    layers = lora_layers(add_lora(unet, 4, key=jax.random.key(0)))
    layer = layers["mid_block.attentions.0.transformer_blocks.0.attn2.to_k"]
    a, bound = np.asarray(layer.lora_A), 1 / np.sqrt(layer.lora_A.shape[1])  # kaiming_uniform(a=√5): U(±1/√in)
    assert np.abs(a).max() <= bound and np.abs(a).max() > 0.8 * bound and not np.any(np.asarray(layer.lora_B))


def test_zero_b_is_the_base_exactly(unet_and_inputs):
    """The default adapters (r 4, alpha 4): the structure of the alpha_eq_r file's below, one forward program for
    both (zero B makes the update zero at any alpha)."""
    unet, (x, t, cond) = unet_and_inputs
    lora = add_lora(unet, 4, key=jax.random.key(0))
    np.testing.assert_array_equal(forward(lora, x, t, cond), forward(unet, x, t, cond))


def test_merge_equals_unmerged(unet_and_inputs):
    """The convs file's adapters (PEFT's, off zero: linear to_q, 3x3, 1x1 and the stride-2 downsampler's convs)
    merged: the base UNet's structure and diffusers' output with the LoRA on (its forward programs: the base's and
    test_diffusers_lora_file_loads_with_diffusers_output[convs]'s, none of its own)."""
    unet, (x, t, cond) = unet_and_inputs
    lora = load_lora(unet, LORA_DATA / "convs")
    kinds = {type(layer).__name__ for layer in lora_layers(lora).values()}
    assert kinds == {"LoRALinear", "LoRAConv2d"} and "down_blocks.0.downsamplers.0.conv" in lora_layers(lora)
    out, base = forward(lora, x, t, cond), forward(unet, x, t, cond)
    assert rel_err(out, base) > 1e-2  # the adapters change the output
    merged = eqx.filter_jit(merge_lora)(lora)  # one program: op by op, each layer's shapes compiled on their own
    assert not lora_layers(merged) and jax.tree.structure(merged) == jax.tree.structure(unet)
    merged_out = forward(merged, x, t, cond)
    assert rel_err(merged_out, out) < 1e-5
    assert rel_err(merged_out, np.load(LORA_DATA / "convs" / "reference.npz")["out"]) < TOL


@pytest.fixture(scope="module")
def adapter_gradient(unet_and_inputs):
    """(lora: the default adapters moved off zero, its trainable part, its frozen part, the gradient of the mean
    squared output with respect to the trainable part, on one device): one UNet backward pass compiled, for the
    tests of the trainable part and of its sharded step."""
    unet, (x, t, cond) = unet_and_inputs
    lora = moved_off_zero(add_lora(unet, 4, key=jax.random.key(0)))
    trainable, frozen = partition_lora(lora)

    def loss(train, rest):
        return jnp.mean(jnp.square(eqx.combine(train, rest)(x, t, cond)))

    return lora, trainable, frozen, eqx.filter_jit(jax.grad(loss))(trainable, frozen)


def test_trainable_part_is_the_adapters_only(adapter_gradient):
    lora, trainable, frozen, grads = adapter_gradient
    names = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(trainable)[0]]
    assert len(names) == 2 * len(lora_layers(lora)) and all(n.endswith((".lora_A", ".lora_B")) for n in names)
    assert jax.tree.leaves(eqx.filter(lora, lora_filter(lora))) == jax.tree.leaves(trainable)
    assert jax.tree.structure(grads) == jax.tree.structure(trainable)  # no base leaf in the gradient
    assert all(np.abs(np.asarray(g)).max() > 0 for g in jax.tree.leaves(grads))
    optimizer = optax.adam(1e-2)

    @eqx.filter_jit  # one program, not each leaf's update op by op
    def adam_step(trainable, grads):
        updates, _ = optimizer.update(grads, optimizer.init(trainable), trainable)
        return eqx.apply_updates(trainable, updates)

    stepped = eqx.combine(adam_step(trainable, grads), frozen)
    before, after = eqx.partition(lora, lora_filter(lora))[1], eqx.partition(stepped, lora_filter(stepped))[1]
    for old, new in zip(jax.tree.leaves(before), jax.tree.leaves(after), strict=True):
        np.testing.assert_array_equal(old, new)  # the base is bitwise unchanged
    assert all(
        not np.array_equal(o, n)
        for o, n in zip(jax.tree.leaves(trainable), jax.tree.leaves(partition_lora(stepped)[0]), strict=True)
    )


@pytest.mark.parametrize("case", ["alpha8_meta", "alpha_eq_r", "convs", "unet_adapter"])
def test_diffusers_lora_file_loads_with_diffusers_output(unet_and_inputs, case):
    """tools/make_lora_fixtures.py: PEFT adapters saved by diffusers' save_lora_weights; alpha 8 ≠ r 4 from the
    file's LoraConfig metadata (and 1x1-conv proj_in/proj_out adapters), alpha = r for a file without it, and
    PEFT's conv adapters (3x3, 1x1 and the stride-2 downsampler's) with alpha 2, and the UNet's own
    save_lora_adapter file (no `unet.` prefix) with alpha 3 ≠ r 2."""
    unet, (x, t, cond) = unet_and_inputs
    lora = load_lora(unet, LORA_DATA / case)
    want = np.load(LORA_DATA / case / "reference.npz")["out"]
    alphas = {layer.alpha for layer in lora_layers(lora).values()}
    assert alphas == {"alpha8_meta": {8.0}, "alpha_eq_r": {4.0}, "convs": {2.0}, "unet_adapter": {3.0}}[case]
    assert case != "convs" or {"down_blocks.0.downsamplers.0.conv", "up_blocks.0.resnets.0.conv_shortcut"} <= set(
        lora_layers(lora)
    )
    assert rel_err(forward(lora, x, t, cond), want) < TOL


def test_save_then_load_is_the_same_model(unet_and_inputs, tmp_path):
    unet, _ = unet_and_inputs
    lora = moved_off_zero(add_lora(unet, 3, alpha=5, targets=r"(to_q|to_v|proj_in|conv1)$", key=jax.random.key(2)))
    file = save_lora(lora, tmp_path)
    assert file.name == "pytorch_lora_weights.safetensors"
    again = load_lora(unet, tmp_path)
    assert sorted(lora_layers(again)) == sorted(lora_layers(lora))
    for old, new in zip(jax.tree.leaves(lora), jax.tree.leaves(again), strict=True):
        np.testing.assert_array_equal(old, new)
    assert {layer.alpha for layer in lora_layers(again).values()} == {5.0}
    with pytest.raises(FileExistsError, match="overwrite=True"):
        save_lora(lora, tmp_path)
    before = os.umask(0o027)  # the file's permissions: the umask's, as a file written in place (not 0o600)
    try:
        assert save_lora(lora, tmp_path, overwrite=True) == file
    finally:
        os.umask(before)
    assert file.stat().st_mode & 0o777 == 0o640


def test_saved_file_has_the_names_and_shapes_diffusers_writes(unet_and_inputs, tmp_path):
    """The same adapters as tools/make_lora_fixtures.py's alpha8_meta (r 4 on the attention projections and on
    SD 1.x's proj_in/proj_out, which diffusers holds as 1x1 convolutions: use_linear_projection false), saved
    here: the file diffusers' save_lora_weights wrote for that UNet has the same keys and shapes, the 1x1 convs'
    lora_A [r, in, 1, 1] and lora_B [out, r, 1, 1] (PEFT's Conv2d adapter), the linears' 2-D."""
    from safetensors import safe_open

    def shapes(file) -> dict[str, tuple]:
        with safe_open(str(file), framework="numpy") as f:
            return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}

    unet, _ = unet_and_inputs
    lora = add_lora(unet, 4, alpha=8, targets=r"(to_k|to_q|to_v|to_out\.0|proj_in|proj_out)$", key=jax.random.key(4))
    ours = shapes(save_lora(lora, tmp_path))
    diffusers = shapes(LORA_DATA / "alpha8_meta" / "pytorch_lora_weights.safetensors")
    assert ours == diffusers
    proj = {k: v for k, v in ours.items() if ".proj_in." in k or ".proj_out." in k}
    assert len(proj) == 16 and all(len(v) == 4 and v[2:] == (1, 1) for v in proj.values())


def test_other_formats_refused_by_name(unet_and_inputs, tmp_path):
    unet, _ = unet_and_inputs
    a, b = np.zeros((4, 8), np.float32), np.zeros((8, 4), np.float32)
    kohya = {
        "lora_unet_down_blocks_0_attentions_0_proj_in.lora_down.weight": a,
        "lora_unet_down_blocks_0_attentions_0_proj_in.lora_up.weight": b,
    }
    text = {
        "unet.mid_block.attentions.0.proj_in.lora_A.weight": a,
        "unet.mid_block.attentions.0.proj_in.lora_B.weight": b,
        "text_encoder.text_model.encoder.layers.0.self_attn.q_proj.lora_A.weight": a,
    }
    other_model = {"unet.blocks.0.attn.qkv.lora_A.weight": a, "unet.blocks.0.attn.qkv.lora_B.weight": b}
    for tensors, match in ((kohya, "kohya"), (text, "text_encoder"), (other_model, "not linear or conv layers")):
        save_file(tensors, str(tmp_path / "pytorch_lora_weights.safetensors"))
        with pytest.raises(ValueError, match=match):
            load_lora(unet, tmp_path)


def test_adapters_and_frozen_base_shard_by_the_same_rules(unet_and_inputs, adapter_gradient):
    """The training layout: adapters (the trained state) and the frozen base (an argument of the step), each laid
    out by `state_shardings` over an 8-way FSDP mesh; one sharded step moves the adapters only, as unsharded."""
    _, (x, t, cond) = unet_and_inputs
    _, trainable, frozen, grads = adapter_gradient
    mesh = make_mesh(1, 8)
    rules = [(r"\.lora_B$", PartitionSpec())]  # one rule by name, as train/main.py's SHARDING_RULES
    train_sh, frozen_sh = (state_shardings(tree, mesh, 16, rules=rules, strict=False) for tree in (trainable, frozen))
    a_specs = {s.spec for s in jax.tree.leaves(train_sh) if s is not None}
    assert PartitionSpec() in a_specs and any("fsdp" in str(s) for s in a_specs)  # lora_A split, lora_B replicated
    name = "mid_block.attentions.0.transformer_blocks.0.attn1.to_q"
    assert "fsdp" in str(lora_layers(eqx.combine(train_sh, frozen_sh))[name].base_layer.weight.spec)  # the base: FSDP

    def step(train, rest):
        grads = jax.grad(lambda tr: jnp.mean(jnp.square(eqx.combine(tr, rest)(x, t, cond))))(train)
        return jax.tree.map(lambda p, g: p - 0.1 * g, train, grads)

    # the step unsharded: the one-device gradient's, in numpy (op by op on the device, each leaf's shape compiled)
    want = jax.tree.map(lambda p, g: np.asarray(p) - np.float32(0.1) * np.asarray(g), trainable, grads)
    # laid out from the host: a device array's shards are cut by a program compiled for each shape (~30 here)
    host = lambda tree: jax.tree.map(lambda a: np.asarray(a) if eqx.is_array(a) else a, tree)  # noqa: E731
    got = eqx.filter_jit(step)(jax.device_put(host(trainable), train_sh), jax.device_put(host(frozen), frozen_sh))
    for w, g in zip(jax.tree.leaves(want), jax.tree.leaves(got), strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-6)
