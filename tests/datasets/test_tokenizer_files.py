"""`save_tokenizer`: a tokenizer built in code (captioned_digits' word tokenizer) written as a folder reads back
with `load_tokenizer` to the same ids and masks (transformers reading it: tools/check_sd_scratch.py)."""

import json

import numpy as np
import pytest

from eqxdiff.data.captioned_digits import captioned_digits_tokenizer
from eqxdiff.data.tokenizer import WORD_SPECIALS, load_tokenizer
from eqxdiff.data.tokenizer_files import save_tokenizer


def test_word_tokenizer_reads_back_to_the_same_ids(tmp_path):
    tokenizer = captioned_digits_tokenizer()
    pad, unk, bos, eos = WORD_SPECIALS
    save_tokenizer(tokenizer, tmp_path, bos_token=bos, eos_token=eos, unk_token=unk)
    again = load_tokenizer(tmp_path)
    texts = ["a 3 left of a 7", "Seven then THREE", "", "an eight right of a three", "a zebra!"]
    for ours, theirs in zip(again(texts), tokenizer(texts), strict=True):
        np.testing.assert_array_equal(ours, theirs)
    assert (again.pad_id, again.model_max_length) == (tokenizer.pad_id, tokenizer.model_max_length)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert (config["tokenizer_class"], config["bos_token"], config["pad_token"]) == (
        "PreTrainedTokenizerFast",
        bos,
        pad,
    )
    with pytest.raises(ValueError, match="not tokens of this tokenizer"):
        save_tokenizer(tokenizer, tmp_path / "x", bos_token="<|startoftext|>", eos_token=eos, unk_token=unk)
