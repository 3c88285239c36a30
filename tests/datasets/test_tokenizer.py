"""eqxdiff.data's tokenizer against transformers' CLIPTokenizer ids, committed by
tools/make_tokenizer_fixtures.py (tests/data/clip_tokenizer/: CLIP's first 10,000 real BPE merges, SD 1.x's
vocab.json + merges.txt folder padding with <|endoftext|>, SD 2's tokenizer.json folder padding with "!")."""

import functools
import json
import pickle
import shutil
from pathlib import Path

import grain
import numpy as np
import pytest
import tokenizers

from eqxdiff.data import TokenizeText, load_tokenizer

DATA = Path(__file__).parents[1] / "data" / "clip_tokenizer"
REFERENCE = json.loads((DATA / "reference.json").read_text(encoding="utf-8"))
PROMPTS = REFERENCE["prompts"] + REFERENCE["slow_divergent_prompts"]
CONFIGS = ["tokenizer_config.json", "special_tokens_map.json"]


@functools.cache
def tokenizer(form: str):
    return load_tokenizer(DATA / form)


def reference(form: str, max_length: int) -> tuple[np.ndarray, np.ndarray]:
    rows = REFERENCE[form][str(max_length)]
    return np.array(rows["input_ids"]), np.array(rows["attention_mask"])


def assert_rows_equal(got: np.ndarray, want: np.ndarray) -> None:
    wrong = [PROMPTS[i] for i in np.flatnonzero((got != want).any(axis=1))]
    assert not wrong, f"rows differ from transformers for {wrong}"


@pytest.mark.parametrize("form", ["sd1", "sd2"])
@pytest.mark.parametrize("max_length", [77, 8])
def test_ids_and_mask_equal_transformers(form, max_length):
    """Unicode, punctuation, contractions, numbers, whitespace runs, upper case, special tokens in the text,
    a prompt of exactly 77 tokens and longer ones (truncated to bos ... eos), the empty prompt."""
    ids, mask = tokenizer(form)(PROMPTS, max_length=max_length)
    want_ids, want_mask = reference(form, max_length)
    assert ids.dtype == mask.dtype == np.int32 and ids.shape == mask.shape == (len(PROMPTS), max_length)
    assert_rows_equal(ids, want_ids)
    assert_rows_equal(mask, want_mask)


def test_pad_token_and_default_length_follow_the_folder():
    """SD 1.x pads with <|endoftext|>, SD 2 with "!" (id 0) because special_tokens_map.json overrides
    tokenizer_config.json; no max_length means the config's model_max_length."""
    for form, pad_id in [("sd1", 10513), ("sd2", 0)]:
        ids, mask = tokenizer(form)(["a photo of a cat", ""])
        assert ids.shape == (2, 77)
        np.testing.assert_array_equal(ids[0, :8], [10512, 320, 1125, 539, 320, 2368, 10513, pad_id])
        np.testing.assert_array_equal(mask.sum(axis=1), [7, 2])


def test_vocab_and_merges_with_sd2_configs(tmp_path):
    """SD 2's configs over the vocab.json + merges.txt form give SD 2's ids (the generator checked transformers
    agrees on both forms): the pad token "!" becomes a special token and splits "wow!"."""
    for name in ["vocab.json", "merges.txt"]:
        shutil.copy(DATA / "sd1" / name, tmp_path / name)
    for name in CONFIGS:
        shutil.copy(DATA / "sd2" / name, tmp_path / name)
    ids, mask = load_tokenizer(tmp_path)(PROMPTS, max_length=77)
    want_ids, want_mask = reference("sd2", 77)
    assert_rows_equal(ids, want_ids)
    assert_rows_equal(mask, want_mask)


def test_padding_and_truncation_saved_in_tokenizer_json_are_ignored(tmp_path):
    """transformers saves a call's padding and truncation into tokenizer.json; the folder's configs still rule."""
    saved = tokenizers.Tokenizer.from_file(str(DATA / "sd2" / "tokenizer.json"))
    saved.enable_padding(length=5, pad_id=10513, pad_token="<|endoftext|>")
    saved.enable_truncation(max_length=5)
    saved.save(str(tmp_path / "tokenizer.json"))
    for name in CONFIGS:
        shutil.copy(DATA / "sd2" / name, tmp_path / name)
    ids, _ = load_tokenizer(tmp_path)(PROMPTS, max_length=77)
    assert_rows_equal(ids, reference("sd2", 77)[0])


def test_errors_name_what_is_missing(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"tokenizer\.json, or vocab\.json \+ merges\.txt"):
        load_tokenizer(tmp_path)
    with pytest.raises(ValueError, match=r"max_length 78 exceeds the model's maximum length 77"):
        tokenizer("sd1")(["a cat"], max_length=78)
    with pytest.raises(TypeError, match="list of texts"):
        tokenizer("sd1")("a cat")
    # tokenizer.json alone: no model_max_length to default to, and CLIPTokenizer's default pad <|endoftext|>.
    shutil.copy(DATA / "sd2" / "tokenizer.json", tmp_path / "tokenizer.json")
    bare = load_tokenizer(tmp_path)
    with pytest.raises(ValueError, match="pass max_length"):
        bare(["a cat"])
    np.testing.assert_array_equal(bare(["a cat"], max_length=5)[0], [[10512, 320, 2368, 10513, 10513]])


def test_tokenizes_in_a_grain_pipeline_after_pickling():
    """Picklable (grain ships transforms to worker processes), and a grain map + batch gives the reference rows."""
    tokenize = pickle.loads(pickle.dumps(TokenizeText(tokenizer("sd2"), field="caption", max_length=77)))
    examples = [{"caption": prompt, "label": np.int32(i)} for i, prompt in enumerate(PROMPTS[:6])]
    dataset = grain.MapDataset.source(examples).map(tokenize).batch(3)
    batches = list(dataset.to_iter_dataset(grain.ReadOptions(num_threads=2)))
    assert [sorted(b) for b in batches] == [["attention_mask", "input_ids", "label"]] * 2
    want_ids, want_mask = reference("sd2", 77)
    np.testing.assert_array_equal(np.concatenate([b["input_ids"] for b in batches]), want_ids[:6])
    np.testing.assert_array_equal(np.concatenate([b["attention_mask"] for b in batches]), want_mask[:6])
    np.testing.assert_array_equal(np.concatenate([b["label"] for b in batches]), np.arange(6))
