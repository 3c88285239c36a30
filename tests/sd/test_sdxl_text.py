"""The text side of SDXL against diffusers and transformers (tests/data/sdxl_text, written by
tools/make_sdxl_text_fixture.py): tower 2's projected `text_embeds` and hidden states, SDXL's penultimate
layer (no final LayerNorm) and its clip_skip, SD 1.x's clip_skip (final LayerNorm applied), the two towers
concatenated with tower 2's pooled vector, the two tokenizers' paddings, and the unconditional half
(`force_zeros_for_empty_prompt`) exactly as `StableDiffusionXLPipeline.encode_prompt` makes them; the
result is the `text` of an `SDXLCond` that `SDUNet` takes (tests/sd/test_sd_pipeline.py feeds it to one)."""

import dataclasses
import json
import shutil
from pathlib import Path

import equinox as eqx
import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec
from safetensors import safe_open
from safetensors.numpy import save_file

from eqxdiff.sd import SDXLTextEncoders, sd_prompt_embeds
from eqxdiff.sharding import make_mesh, placement, state_shardings
from eqxdiff.sd.sdxl_prompts import SDXLPrompts

DATA = Path(__file__).parents[1] / "data"
FOLDER = DATA / "sdxl_text"
# tools/make_sdxl_text_fixture.py's PROMPTS and CASES (the arguments of diffusers' encode_prompt)
LONG = (
    "a highly detailed oil painting of a lighthouse on a rocky cliff at sunset, waves crashing below, seagulls "
    "circling overhead, dramatic clouds lit in orange and purple, a small fishing boat returning to the harbor, "
    "warm light in the keeper's window, masterpiece, best quality, intricate brushwork, 8k, trending"
)
PROMPTS = ["a photo of a cat", "wow! a dog!!", LONG]
NEGATIVE = ["", "blurry, ugly", "lowres"]
CASES = {
    "zeros": dict(force_zeros=True),
    "empty": dict(force_zeros=False),
    "explicit_empty": dict(force_zeros=True, negative_prompt=["", "", ""]),
    "negative": dict(force_zeros=True, negative_prompt=NEGATIVE),
    "prompt_2": dict(
        force_zeros=True,
        prompt_2=["an oil painting", "", "a cat"],
        negative_prompt=["bad", "worse", "worst"],
        negative_prompt_2=["grey", "", "flat"],
    ),
    "clip_skip_1": dict(force_zeros=True, clip_skip=1, negative_prompt=NEGATIVE),
    "clip_skip_2": dict(force_zeros=True, clip_skip=2),
    "unguided": dict(force_zeros=True, guided=False),
    "refiner": dict(force_zeros=False, refiner=True),
}
WIDTHS = (8, 16, 12)  # tower 1, tower 2, projection_dim


def relative(ours, theirs) -> float:
    """max |ours - theirs| / max |theirs|."""
    theirs = np.asarray(theirs)
    return float(np.abs(np.asarray(ours) - theirs).max() / np.abs(theirs).max())


@pytest.fixture(scope="module")
def ref() -> dict[str, np.ndarray]:
    with np.load(FOLDER / "reference.npz") as f:
        return dict(f)


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory) -> Path:
    """The fixture as a whole pipeline folder: its towers and model_index.json, and the committed CLIP tokenizer
    folders as tokenizer/ (SD 1.x's: padding <|endoftext|>) and tokenizer_2/ (SD 2's: padding "!")."""
    folder = tmp_path_factory.mktemp("sdxl") / "pipeline"
    shutil.copytree(FOLDER, folder, ignore=shutil.ignore_patterns("reference.npz"))
    shutil.copytree(DATA / "clip_tokenizer" / "sd1", folder / "tokenizer")
    shutil.copytree(DATA / "clip_tokenizer" / "sd2", folder / "tokenizer_2")
    return folder


@pytest.fixture(scope="module")
def prompts(pipeline) -> SDXLPrompts:
    return SDXLPrompts.from_diffusers(pipeline)


@pytest.fixture(scope="module")
def encoders() -> SDXLTextEncoders:
    return SDXLTextEncoders.from_diffusers(FOLDER)


@eqx.filter_jit
def hidden_states(encoders: SDXLTextEncoders, ids, ids_2) -> dict:
    """Every hidden state of both towers (transformers' hidden_states), tower 2's outputs, and SD 1.x's clip_skip."""
    tower_1, tower_2 = encoders.text_encoder, encoders.text_encoder_2
    out = {f"hidden_states_{k}": tower_1(ids, hidden_layer=k)[0] for k in range(4)}
    out |= {f"hidden_states_2_{k}": tower_2(ids_2, hidden_layer=k)[0] for k in range(4)}
    out["last_hidden_state_2"], out["text_embeds"] = tower_2(ids_2)
    out["pooler_output_2"] = tower_2.text_model(ids_2)[1]
    out |= {f"sd1_clip_skip_{k or 'none'}": sd_prompt_embeds(tower_1, ids, clip_skip=k) for k in (None, 1, 2)}
    return out


def test_the_fixture_is_an_sdxl_pipelines_text_side(pipeline, ref, encoders):
    """(An SDXL UNet of the towers' widths taking their condition as SDXLCond, against diffusers' latents:
    tests/sd/test_sd_pipeline.py::test_sdxl_latents_equal_diffusers, whose pipeline has these towers.)"""
    assert (encoders.context_dim, encoders.pooled_dim) == (WIDTHS[0] + WIDTHS[1], WIDTHS[2])
    index = json.loads((pipeline / "model_index.json").read_text())
    assert index["_class_name"] == "StableDiffusionXLPipeline" and index["force_zeros_for_empty_prompt"] is True
    configs = [json.loads((FOLDER / name / "config.json").read_text()) for name in ("text_encoder", "text_encoder_2")]
    assert [c["architectures"] for c in configs] == [["CLIPTextModel"], ["CLIPTextModelWithProjection"]]
    assert [c["eos_token_id"] for c in configs] == [2, 2] and [c["dtype"] for c in configs] == ["float16"] * 2
    assert [c["hidden_size"] for c in configs] + [configs[1]["projection_dim"]] == list(WIDTHS)
    # SDXL's two paddings: eos (the largest id) for tokenizer/, "!" (id 0) for tokenizer_2/, around the same text
    ids, ids_2 = ref["input_ids"], ref["input_ids_2"]
    assert (ids[0, -1], ids_2[0, -1]) == (10513, 0)
    for row in (ids, ids_2):  # the largest id, where both towers pool, is each row's first eos
        np.testing.assert_array_equal(np.argmax(row, -1), np.argmax(row == 10513, -1))
    # "!" is a special token of tokenizer_2 (matched as a whole word) but not of tokenizer/: "wow!" splits otherwise
    assert list(np.argmax(ids == 10513, -1)) == [6, 6, 76] and list(np.argmax(ids_2 == 10513, -1)) == [6, 7, 76]
    assert (ids[2, -1], ids_2[2, -1]) == (10513, 10513)  # the long prompt: truncated to bos, 75 tokens, eos


def test_our_tokenizers_give_transformers_ids(prompts, ref):
    for tokenizer, ids in ((prompts.tokenizer, ref["input_ids"]), (prompts.tokenizer_2, ref["input_ids_2"])):
        np.testing.assert_array_equal(tokenizer(PROMPTS)[0], ids)
    assert (prompts.tokenizer.pad_token, prompts.tokenizer_2.pad_token) == ("<|endoftext|>", "!")


def test_towers_match_transformers(encoders, ref):
    """Each hidden state of both towers, tower 2's last_hidden_state, pooler_output and projected text_embeds,
    and SD 1.x's prompt_embeds for clip_skip None, 1, 2 (diffusers' StableDiffusionPipeline.encode_prompt)."""
    ours = hidden_states(encoders, ref["input_ids"], ref["input_ids_2"])
    theirs = {f"hidden_states_{k}": ref["hidden_states"][k] for k in range(4)}
    theirs |= {f"hidden_states_2_{k}": ref["hidden_states_2"][k] for k in range(4)}
    theirs |= {k: ref[k] for k in ("last_hidden_state_2", "text_embeds", "pooler_output_2")}
    theirs |= {f"sd1_clip_skip_{k}": ref[f"sd1_clip_skip_{k}"] for k in ("none", 1, 2)}
    errors = {k: relative(ours[k], v) for k, v in theirs.items()}
    print(errors)
    assert max(errors.values()) < 1e-5, errors
    assert ours["text_embeds"].shape == (3, WIDTHS[2])
    # the three SD 1.x clip_skips and the four states are different arrays (the fixture tells them apart)
    sd1 = ["sd1_clip_skip_none", "sd1_clip_skip_1", "sd1_clip_skip_2"]
    for group in (sd1, [f"hidden_states_2_{k}" for k in range(4)]):
        for a, b in zip(group, group[1:]):
            assert relative(theirs[a], theirs[b]) > 0.1, (a, b)


def test_sd1_negative_is_the_empty_prompt_without_clip_skip(prompts, ref):
    """StableDiffusionPipeline encodes its default negative "" as last_hidden_state, whatever clip_skip says."""
    ids = prompts.tokenizer([""] * 3)[0]
    embeds = eqx.filter_jit(sd_prompt_embeds)(prompts.encoders.text_encoder, ids)  # one program, not op by op
    assert relative(embeds, ref["sd1_negative"]) < 1e-5


def with_case(prompts: SDXLPrompts, pipeline: Path, case: dict) -> SDXLPrompts:
    """The prompts for a case: the refiner's from a folder without text_encoder/ and tokenizer/ whose
    model_index.json says force_zeros_for_empty_prompt false; the others with that field set as the case says."""
    if case.get("refiner"):
        folder = pipeline.parent / "refiner"
        if not folder.is_dir():
            shutil.copytree(pipeline, folder, ignore=shutil.ignore_patterns("text_encoder", "tokenizer"))
            index = json.loads((folder / "model_index.json").read_text())
            index |= {"text_encoder": [None, None], "tokenizer": [None, None], "force_zeros_for_empty_prompt": False}
            (folder / "model_index.json").write_text(json.dumps(index))
        refiner = SDXLPrompts.from_diffusers(folder)
        assert refiner.tokenizer is None and refiner.encoders.text_encoder is None
        assert refiner.force_zeros_for_empty_prompt is False
        return refiner
    return dataclasses.replace(prompts, force_zeros_for_empty_prompt=case["force_zeros"])


@pytest.mark.parametrize("name", list(CASES))
def test_prompts_match_diffusers_encode_prompt(prompts, pipeline, ref, name):
    """prompt_embeds, pooled_prompt_embeds and (guided) the negative ones, as diffusers' encode_prompt."""
    case = CASES[name]
    ours = with_case(prompts, pipeline, case)
    cond = ours.encode(PROMPTS, case.get("prompt_2"), clip_skip=case.get("clip_skip"))
    width = WIDTHS[1] + (0 if case.get("refiner") else WIDTHS[0])
    assert cond.context.shape == (3, 77, width) and cond.pooled.shape == (3, WIDTHS[2])
    assert cond.mask.shape == (3, 77) and (cond.mask == 1).all()  # diffusers' UNet attends to every position
    errors = {
        "prompt_embeds": relative(cond.context, ref[f"{name}_prompt_embeds"]),
        "pooled": relative(cond.pooled, ref[f"{name}_pooled"]),
    }
    if case.get("guided", True):
        negative = ours.negative(3, case.get("negative_prompt"), case.get("negative_prompt_2"))
        zeros = case["force_zeros"] and "negative_prompt" not in case
        assert zeros == (not ref[f"{name}_negative_embeds"].any())  # the reference: zeros exactly when forced
        if zeros:
            np.testing.assert_array_equal(negative.context, ref[f"{name}_negative_embeds"])
            np.testing.assert_array_equal(negative.pooled, ref[f"{name}_negative_pooled"])
        else:
            errors["negative_embeds"] = relative(negative.context, ref[f"{name}_negative_embeds"])
            errors["negative_pooled"] = relative(negative.pooled, ref[f"{name}_negative_pooled"])
        assert negative.mask.shape == (3, 77) and (negative.mask == 1).all()
    print(name, errors)
    assert max(errors.values()) < 1e-5, errors


def test_the_cases_are_told_apart(ref):
    """clip_skip picks other layers; prompt_2 changes only tower 2's half and the pooled vector."""
    base, skip_1, skip_2 = (ref[f"{n}_prompt_embeds"] for n in ("zeros", "clip_skip_1", "clip_skip_2"))
    assert relative(skip_1, base) > 0.1 and relative(skip_2, skip_1) > 0.1
    np.testing.assert_array_equal(ref["zeros_pooled"], ref["clip_skip_1_pooled"])  # pooled: always the last layer
    own_2 = ref["prompt_2_prompt_embeds"]
    np.testing.assert_array_equal(own_2[..., : WIDTHS[0]], base[..., : WIDTHS[0]])
    assert relative(own_2[..., WIDTHS[0] :], base[..., WIDTHS[0] :]) > 0.1
    assert relative(ref["prompt_2_pooled"], ref["zeros_pooled"]) > 0.1


def test_bad_input_is_named(prompts, encoders, tmp_path, ref):
    # the checks, traced: no op compiled or run
    traced = lambda *args, **kwargs: eqx.filter_eval_shape(encoders, *args, **kwargs)  # noqa: E731
    with pytest.raises(ValueError, match=r"clip_skip 3: this 3-layer tower takes 0\.\.2"):
        traced(ref["input_ids"], ref["input_ids_2"], clip_skip=3)
    with pytest.raises(ValueError, match=r"clip_skip -1: this 3-layer tower takes 0\.\.3"):
        sd_prompt_embeds(encoders.text_encoder, ref["input_ids"], clip_skip=-1)
    with pytest.raises(ValueError, match="text_encoder takes input_ids"):
        traced(None, ref["input_ids_2"])
    with pytest.raises(ValueError, match="3 prompts but 2 prompts_2"):
        prompts.encode(PROMPTS, PROMPTS[:2])
    with pytest.raises(ValueError, match="1 negative prompts for a batch of 3"):
        prompts.negative(3, ["bad"])
    with pytest.raises(FileNotFoundError, match=r"no text_encoder_2/ \(it holds \['unet'\]\)"):
        (tmp_path / "unet").mkdir()
        SDXLTextEncoders.from_diffusers(tmp_path)


def test_a_tokenizer_larger_than_its_tower_is_refused(pipeline, tmp_path):
    """A tower embedding fewer ids than its tokenizer makes: ids past its table would be clamped in jit."""
    folder = tmp_path / "pipeline"
    shutil.copytree(pipeline, folder)
    tower = folder / "text_encoder_2"
    with safe_open(str(tower / "model.safetensors"), framework="numpy") as f:
        state = {k: f.get_tensor(k) for k in f.keys()}
    key = "text_model.embeddings.token_embedding.weight"
    save_file(state | {key: state[key][:100]}, str(tower / "model.safetensors"))
    config = json.loads((tower / "config.json").read_text())
    (tower / "config.json").write_text(json.dumps(config | {"vocab_size": 100}))
    with pytest.raises(ValueError, match=r"tokenizer_2/ has 10514 ids but text_encoder_2/ embeds 100"):
        SDXLPrompts.from_diffusers(folder)


def test_variant_files_and_mesh_placement(tmp_path, encoders):
    """SDXL's fp16 variant names (model.fp16.safetensors) load with variant="fp16"; `place` lays out the whole
    module by one rule list (its paths name the tower), each weight read into that sharding."""
    folder = tmp_path / "pipeline"
    shutil.copytree(FOLDER, folder, ignore=shutil.ignore_patterns("reference.npz"))
    for name in ("text_encoder", "text_encoder_2"):
        (folder / name / "model.safetensors").rename(folder / name / "model.fp16.safetensors")
    mesh, min_size = make_mesh(-1, 4), 256
    rules = [(r"^text_encoder_2\.text_model\.embeddings\.token_embedding\.weight$", PartitionSpec())]
    place = placement(mesh, min_size, rules=rules)
    placed = SDXLTextEncoders.from_diffusers(folder, variant="fp16", place=place)
    abstract = eqx.filter_eval_shape(lambda: encoders)
    expected = jax.tree.leaves(state_shardings(abstract, mesh, min_size, rules=rules))
    assert [x.sharding for x in jax.tree.leaves(placed)] == expected
    assert placed.text_encoder.embeddings.token_embedding.weight.sharding.spec != PartitionSpec()  # sharded
    assert placed.text_encoder_2.text_model.embeddings.token_embedding.weight.sharding.spec == PartitionSpec()
    for a, b in zip(jax.tree.leaves(placed), jax.tree.leaves(encoders), strict=True):
        np.testing.assert_array_equal(a, b)
