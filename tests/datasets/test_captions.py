"""Captioned data: text fields in records, captions of folder/jsonl/ArrayRecord/npz sources, the word-level
tokenizer, TokenizedSource through the pipeline, the captioned_digits task and its two-digit scorer."""

import pickle
from itertools import islice
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from eqxdiff.data import (
    TEXT,
    CaptionedDigitsSource,
    ImageSource,
    TokenizedSource,
    batch_spec,
    batch_stream,
    captioned_digits_prompts,
    captioned_digits_tokenizer,
    describe_fields,
    open_source,
    stack_records,
    word_tokenizer,
    write_arrayrecord,
)
from eqxdiff.eval.digits import digits_split, two_digit_accuracy

NUMBER_WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
DIGIT_WORDS = {**{w: d for d, w in enumerate(NUMBER_WORDS)}, **{str(d): d for d in range(10)}}


def write_png(path: Path, value: int, size: int = 4) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("L", (size, size), value).save(path)


# ---------------------------------------------------------------- sources with captions


def test_folder_txt_captions_and_captions_false_unchanged(tmp_path: Path):
    write_png(tmp_path / "cats" / "a.png", 10)
    write_png(tmp_path / "dogs" / "b.png", 20)
    (tmp_path / "cats" / "a.txt").write_text("  a cat,\nsitting \n", encoding="utf-8")
    (tmp_path / "dogs" / "b.txt").write_text("ein Hund – ü", encoding="utf-8")
    source = open_source(f"folder:{tmp_path}", image_size=4, captions=True)
    assert describe_fields(source.fields) == {"image": "uint8[4, 4, 1]", "label": "int32[]", "caption": "text"}
    assert [source[i]["caption"] for i in range(2)] == ["a cat,\nsitting", "ein Hund – ü"]
    assert [int(source[i]["label"]) for i in range(2)] == [0, 1]
    np.testing.assert_array_equal(source[1]["image"], np.full((4, 4, 1), 20, np.uint8))
    plain = open_source(f"folder:{tmp_path}", image_size=4)  # captions=False: as before, .txt files ignored
    assert len(plain) == 2 and plain[0].keys() == {"image", "label"}
    assert describe_fields(plain.fields) == {"image": "uint8[4, 4, 1]", "label": "int32[]"}


def test_folder_jsonl_captions_win_and_bad_lines_are_named(tmp_path: Path):
    write_png(tmp_path / "cats" / "a.png", 10)
    write_png(tmp_path / "dogs" / "b.png", 20)
    (tmp_path / "cats" / "a.txt").write_text("ignored: the jsonl wins")
    lines = ['{"file": "dogs/b.png", "caption": " a dog "}', "", '{"file": "./cats/a.png", "caption": "a cat"}']
    (tmp_path / "captions.jsonl").write_text("\n".join(lines), encoding="utf-8")
    source = open_source(f"folder:{tmp_path}", image_size=4, captions=True)
    assert [source[i]["caption"] for i in range(2)] == ["a cat", "a dog"]
    (tmp_path / "captions.jsonl").write_text("\n".join([*lines, '{"file": "cats/zz.png", "caption": "x"}']))
    with pytest.raises(ValueError, match=r"captions\.jsonl line 4 names 'cats/zz\.png', which is not an image"):
        open_source(f"folder:{tmp_path}", captions=True)
    (tmp_path / "captions.jsonl").write_text(lines[0] + '\n{"file": "cats/a.png"}')
    with pytest.raises(ValueError, match=r"line 2 is .*each line is \{\"file\""):
        open_source(f"folder:{tmp_path}", captions=True)


def test_missing_caption_names_the_image_unless_allowed(tmp_path: Path):
    write_png(tmp_path / "a.png", 10)
    write_png(tmp_path / "b.png", 20)
    (tmp_path / "a.txt").write_text("first")
    with pytest.raises(ValueError, match=r"No caption for image .*b\.png \(expected .*b\.txt.*--allow_uncaptioned"):
        open_source(f"folder:{tmp_path}", captions=True)
    source = open_source(f"folder:{tmp_path}", captions=True, allow_uncaptioned=True)
    assert [source[i]["caption"] for i in range(2)] == ["first", ""]
    (tmp_path / "captions.jsonl").write_text('{"file": "a.png", "caption": "from jsonl"}')
    with pytest.raises(ValueError, match=r"No caption for image .*b\.png \(no line of .*captions\.jsonl"):
        open_source(f"folder:{tmp_path}", captions=True)
    with pytest.raises(ValueError, match=r"No caption for any image of digits.*captioned_digits"):
        open_source("digits", captions=True)


def test_arrayrecord_and_npz_captions_round_trip(tmp_path: Path):
    images = np.random.default_rng(0).integers(0, 256, (3, 4, 4, 1), dtype=np.uint8)
    captions = ["a 3 left of a 7", "", "ünïcode “quotes”"]
    write_arrayrecord(tmp_path / "c.array_record", images, np.array([1, 0, 1]), captions=captions)
    source = open_source(f"arrayrecord:{tmp_path}/c.array_record", image_size=4, captions=True)
    assert [source[i]["caption"] for i in range(3)] == captions
    assert [int(source[i]["label"]) for i in range(3)] == [1, 0, 1]
    np.testing.assert_array_equal(source[2]["image"], images[2])
    assert open_source(source.spec, image_size=4)[0].keys() == {"image", "label"}  # captions=False ignores them

    write_arrayrecord(tmp_path / "plain.array_record", images)
    with pytest.raises(ValueError, match=r"No caption for record 0 of arrayrecord:.*plain"):
        open_source(f"arrayrecord:{tmp_path}/plain.array_record", captions=True)
    allowed = open_source(f"arrayrecord:{tmp_path}/plain.array_record", captions=True, allow_uncaptioned=True)
    assert allowed[1]["caption"] == ""

    np.savez(tmp_path / "c.npz", images=images, captions=np.array(captions))
    np.savez(tmp_path / "plain.npz", images=images)
    assert [open_source(f"npz:{tmp_path}/c.npz", captions=True)[i]["caption"] for i in range(3)] == captions
    with pytest.raises(ValueError, match="the npz has no captions"):
        open_source(f"npz:{tmp_path}/plain.npz", captions=True)


def test_sample_grid_prompts_are_spread_over_the_data(tmp_path: Path):
    """A captioned dataset in class order (a sorted folder): the grid's ten prompts come from every part of
    it, not ten captions of its first class."""
    from eqxdiff.run.open_condition import sample_prompts

    kinds = ["apple", "boat", "cat", "dog", "eel"]
    captions = [f"a {kind}, photo {i}" for kind in kinds for i in range(10)]
    images = np.zeros((len(captions), 4, 4, 1), np.uint8)
    np.savez(tmp_path / "c.npz", images=images, captions=np.array(captions))
    source = open_source(f"npz:{tmp_path}/c.npz", captions=True)
    prompts = sample_prompts("", source)
    assert len(set(prompts)) == 10 and set(prompts) <= set(captions)
    assert [sum(p.startswith(f"a {kind},") for p in prompts) for kind in kinds] == [2] * 5
    assert sample_prompts("a red boat|a cat", source) == ["a red boat", "a cat"]
    np.savez(tmp_path / "three.npz", images=images[:3], captions=np.array(captions[:3]))
    assert sample_prompts("", open_source(f"npz:{tmp_path}/three.npz", captions=True)) == captions[:3]


def test_text_fields_cannot_be_batched_untokenized(tmp_path: Path):
    np.savez(tmp_path / "c.npz", images=np.zeros((4, 2, 2, 1), np.uint8), captions=np.array(["x"] * 4))
    source = open_source(f"npz:{tmp_path}/c.npz", captions=True)
    assert source.fields["caption"] is TEXT
    message = r"Field 'caption' is text.*TokenizedSource\(source, tokenizer"
    with pytest.raises(ValueError, match=message):
        batch_spec(source, 4)
    with pytest.raises(ValueError, match=message):
        stack_records([source[0]], source.fields)
    with pytest.raises(ValueError, match=message):  # raised in grain's batching, surfaces at the first batch
        next(batch_stream(source, 2, 0, num_threads=0))


# ---------------------------------------------------------------- word-level tokenizer


def test_word_tokenizer_ids():
    tok = word_tokenizer(["a", "3", "left", "of", "7"], max_length=10)  # ids: pad 0, unk 1, bos 2, eos 3, words 4..
    ids, mask = tok(["a 3 left of a 7", "A  3\tLEFT of a cat", ""])
    np.testing.assert_array_equal(
        ids, [[2, 4, 5, 6, 7, 4, 8, 3, 0, 0], [2, 4, 5, 6, 7, 4, 1, 3, 0, 0], [2, 3] + [0] * 8]
    )
    np.testing.assert_array_equal(mask, [[1] * 8 + [0] * 2, [1] * 8 + [0] * 2, [1, 1] + [0] * 8])
    assert ids.dtype == mask.dtype == np.int32
    np.testing.assert_array_equal(tok(["a 3 left of a 7"], max_length=4)[0], [[2, 4, 5, 3]])  # truncated: bos ... eos
    np.testing.assert_array_equal(pickle.loads(pickle.dumps(tok))(["7 of"])[0][0, :4], [2, 8, 7, 3])
    with pytest.raises(ValueError, match="exceeds the model's maximum length 10"):
        tok(["a"], max_length=11)
    for bad in (["Left"], ["a b"], ["a", "a"], ["<pad>"]):
        with pytest.raises(ValueError, match="can never be produced|repeats"):
            word_tokenizer(bad, 8)


# ---------------------------------------------------------------- TokenizedSource


def test_tokenized_source_through_the_pipeline(tmp_path: Path):
    n = 6
    images = np.arange(n, dtype=np.uint8).reshape(n, 1, 1, 1)  # the image says the index
    captions = ["a 3 left of a 7", "7 of", "a", "", "3 3 3 3 3 3 3 3 3", "cat"]
    np.savez(tmp_path / "c.npz", images=images, labels=np.arange(n) % 2, captions=np.array(captions))
    tok = word_tokenizer(["a", "3", "left", "of", "7"], max_length=6)
    source = TokenizedSource(open_source(f"npz:{tmp_path}/c.npz", captions=True), tok)
    assert isinstance(source, ImageSource) and (source.image_shape, source.num_classes, len(source)) == (
        (1, 1, 1),
        2,
        n,
    )
    assert describe_fields(source.fields) == {
        "image": "uint8[1, 1, 1]",
        "label": "int32[]",
        "input_ids": "int32[6]",
        "attention_mask": "int32[6]",
    }
    spec = batch_spec(source, 4)
    for threads in (0, 2):
        for batch in islice(batch_stream(source, 4, 0, num_threads=threads), 3):
            for key, want in spec.items():
                assert (batch[key].shape, batch[key].dtype) == (want.shape, want.dtype), key
            index = batch["image"][:, 0, 0, 0]
            ids, mask = tok([captions[i] for i in index])
            np.testing.assert_array_equal(batch["input_ids"], ids)
            np.testing.assert_array_equal(batch["attention_mask"], mask)
    with pytest.raises(ValueError, match="has no text field 'caption'.*captions=True"):
        TokenizedSource(open_source(f"npz:{tmp_path}/c.npz"), tok)


# ---------------------------------------------------------------- captioned_digits


def stated_digits(caption: str) -> tuple[int, int]:
    """(left, right) as the caption says, read by an independent little parser of the grammar."""
    words = caption.split()
    first, second = [DIGIT_WORDS[w] for w in words if w in DIGIT_WORDS]
    if {"left", "then", "before"} & set(words):
        return first, second
    assert {"right", "after"} & set(words), caption
    return second, first


@pytest.fixture(scope="module")
def raw_digits() -> dict[int, set[bytes]]:
    """sklearn's own digit images (0..16 levels -> round(v·255/16)), as bytes per class."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    pixels = np.round(digits.images * (255 / 16)).astype(np.uint8)
    return {c: {p.tobytes() for p in pixels[digits.target == c]} for c in range(10)}


def test_captioned_digits_pixels_agree_with_the_words(raw_digits):
    source = open_source("captioned_digits")
    assert isinstance(source, CaptionedDigitsSource) and len(source) == 20_000
    assert (source.image_shape, source.num_classes) == ((8, 16, 1), 0)
    assert describe_fields(source.fields) == {"image": "uint8[8, 16, 1]", "caption": "text"}
    again = CaptionedDigitsSource()
    for i in [19_999, 7, 0, 12_345]:  # random access, any order, same in a second instance
        record = source[i]
        np.testing.assert_array_equal(record["image"], again[i]["image"])
        assert record["caption"] == again[i]["caption"]
    for i in range(0, 20_000, 97):
        record = source[i]
        left, right = stated_digits(record["caption"])
        assert left != right
        assert record["image"][:, :8, 0].tobytes() in raw_digits[left], record["caption"]
        assert record["image"][:, 8:, 0].tobytes() in raw_digits[right], record["caption"]


def test_captioned_digits_word_order_carries_the_meaning(raw_digits):
    source = open_source("captioned_digits")
    captions = [source.caption(i) for i in range(len(source))]
    one, other = captions.index("a 3 left of a 7"), captions.index("a 7 left of a 3")  # same words, swapped order
    for i, (left, right) in [(one, (3, 7)), (other, (7, 3))]:
        image = source[i]["image"]
        assert image[:, :8, 0].tobytes() in raw_digits[left] and image[:, 8:, 0].tobytes() in raw_digits[right]
    assert {"three then seven", "seven after three", "a 7 right of a 3"} <= set(captions)
    tok = captioned_digits_tokenizer()
    ids, mask = tok(captions[:2000])
    assert (ids != 1).all(), "a caption word is outside the vocabulary"  # 1: <unk>
    np.testing.assert_array_equal(mask.sum(1), [len(c.split()) + 2 for c in captions[:2000]])  # none truncated
    assert mask[:, -1].any()  # the longest captions fill every position


def test_captioned_digits_prompts_are_deterministic_and_balanced():
    prompts, digits = captioned_digits_prompts(180, seed=1)
    assert digits.dtype == np.int32 and digits.shape == (180, 2)
    assert [stated_digits(p) for p in prompts] == [tuple(d) for d in digits.tolist()]
    pairs, counts = np.unique(digits, axis=0, return_counts=True)
    assert len(pairs) == 90 and (counts == 2).all() and (pairs[:, 0] != pairs[:, 1]).all()
    again, _ = captioned_digits_prompts(180, seed=1)
    assert again == prompts and captioned_digits_prompts(180, seed=2)[0] != prompts


def test_two_digit_accuracy_on_real_and_swapped_pairs():
    train_x, train_y, _, _ = digits_split()
    left, right = train_x[:300], train_x[300:600]
    differ = train_y[:300] != train_y[300:600]
    pairs = np.concatenate([left, right], axis=2)[differ]  # float in [-1, 1]
    digits = np.stack([train_y[:300], train_y[300:600]], axis=1)[differ]
    real = two_digit_accuracy(pairs, digits)
    assert min(real.values()) >= 0.9, real
    swapped = two_digit_accuracy(pairs, digits[:, ::-1])
    assert max(swapped.values()) <= 0.1, swapped
    source = CaptionedDigitsSource()  # its uint8 images with the digits their captions state
    rows = range(0, 20_000, 50)
    score = two_digit_accuracy(np.stack([source[i]["image"] for i in rows]), source.digits[list(rows)])
    assert score["both"] >= 0.9, score
    with pytest.raises(ValueError, match=r"\(n, 8, 16, 1\)"):
        two_digit_accuracy(pairs[:, :, :8], digits)


def test_caption_digits_reads_every_template_and_word_form():
    from eqxdiff.data import caption_digits
    from eqxdiff.data.captioned_digits import TEMPLATES, digits_caption

    for template in range(len(TEMPLATES)):
        for words in ((False, False), (True, False), (False, True), (True, True)):
            for left, right in ((3, 7), (8, 0), (1, 9)):
                assert caption_digits(digits_caption(left, right, template, *words)) == (left, right)
    source = CaptionedDigitsSource(200)  # the dataset's own captions name its digits
    assert all(caption_digits(source.caption(i)) == tuple(source.digits[i]) for i in range(200))
    for bad in ("a 3 left of a", "a 3 left of a dog", "3 then 7 then 1"):
        with pytest.raises(ValueError, match="not a captioned_digits caption"):
            caption_digits(bad)
