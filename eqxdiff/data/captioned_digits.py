"""`captioned_digits`: two handwritten digits side by side, captioned so that only word order says which is where.

Example i is an 8×16×1 uint8 image: a real digit of class L on the left (columns 0..7) and one of
class R on the right (columns 8..15), both from scikit-learn's 1,797 digits as `--dataset digits` reads
them, and one caption from this grammar:

    a L left of a R  |  a R right of a L  |  L then R  |  L before R  |  R after L

Each digit is written as a numeral ("3") or a number word ("three"), chosen per digit; "a" is "an"
before 8 and "eight". So "a 3 left of a 7", "a 7 right of a 3", "three then seven" and "seven after 3"
all show 3 on the left and 7 on the right, and "a 7 left of a 3" holds the same words as the first in
another order: a bag of words (a pooled text vector) cannot tell the two apart, attention over the
tokens in order can. L and R always differ: a pair of equal digits has no order to learn, and the
scoring prompts (`captioned_digits_prompts`) are the same 90 ordered pairs.

The dataset is virtual and random-access: the classes, digit images, template and word forms of all
NUM_EXAMPLES examples are drawn once from a fixed-seed generator, so `source[i]` is the same in every
process and every run. Fields: "image" and "caption" (TEXT; no label). Tokenize with
`TokenizedSource(source, captioned_digits_tokenizer())`.
"""

import jax
import numpy as np
from jaxtyping import Int32

from eqxdiff.data.records import TEXT
from eqxdiff.data.sources import load_digits_source
from eqxdiff.data.tokenizer import TextTokenizer, word_tokenizer

NUM_EXAMPLES = 20_000
SEED = 0
NUMBER_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
# {L}/{R}: the left/right digit, {aL}/{aR}: its article. Templates 0..4.
TEMPLATES = (
    "{aL} {L} left of {aR} {R}",
    "{aR} {R} right of {aL} {L}",
    "{L} then {R}",
    "{L} before {R}",
    "{R} after {L}",
)
VOCAB = ("a", "an", "left", "right", "of", "then", "before", "after", *map(str, range(10)), *NUMBER_WORDS)
MAX_LENGTH = 8  # the longest caption, "an eight right of a three", is 6 words + bos + eos


def digits_caption(left: int, right: int, template: int, left_as_word: bool, right_as_word: bool) -> str:
    """The caption of TEMPLATES[template] for digit `left` on the left and `right` on the right."""
    words = [NUMBER_WORDS[d] if as_word else str(d) for d, as_word in ((left, left_as_word), (right, right_as_word))]
    a = ["an" if w in ("8", "eight") else "a" for w in words]
    return TEMPLATES[template].format(L=words[0], R=words[1], aL=a[0], aR=a[1])


class CaptionedDigitsSource:
    """The `captioned_digits` record source (module docstring): `{"image": uint8[8, 16, 1], "caption": str}`.

    `digits[i]` is example i's (left, right) classes, int32[2]."""

    def __init__(self, num_examples: int = NUM_EXAMPLES, seed: int = SEED):
        single = load_digits_source()
        self.images, labels = single.images, single.labels
        rng = np.random.default_rng(seed)
        left = rng.integers(0, 10, num_examples)
        right = (left + rng.integers(1, 10, num_examples)) % 10  # uniform over the 9 other classes
        self.digits = np.stack([left, right], axis=1).astype(np.int32)
        # A uniformly drawn image of each digit's class: position u·count within the class's block of a sort.
        by_class = np.argsort(labels, kind="stable")
        counts = np.bincount(labels, minlength=10)
        starts = np.cumsum(counts) - counts
        u = rng.random((num_examples, 2))
        self.image_index = by_class[starts[self.digits] + (u * counts[self.digits]).astype(np.int64)]
        self.template = rng.integers(0, len(TEMPLATES), num_examples)
        self.as_word = rng.integers(0, 2, (num_examples, 2)).astype(bool)
        self.image_shape = (8, 16, 1)
        self.num_classes = 0
        self.fields = {"image": jax.ShapeDtypeStruct(self.image_shape, np.uint8), "caption": TEXT}
        self.spec = "captioned_digits"

    # What a run on these captions uses unless its flags say otherwise (eqxdiff/run/open_condition.py asks): a
    # tower trained from scratch, reading the grammar's word-level tokenizer (`captioned_digits_tokenizer`,
    # named so in checkpoints). A flip would swap the digits the captions place left and right.
    text_defaults = {"text_encoder": "scratch", "tokenizer": "captioned_digits"}
    hflip_keeps_meaning = False

    @staticmethod
    def scoring_prompts(num: int, seed: int = 0) -> tuple[list[str], Int32[np.ndarray, "n 2"]]:
        """`num` prompts to score samples by and the (left, right) digits each asks for (`captioned_digits_prompts`)."""
        return captioned_digits_prompts(num, seed)

    @staticmethod
    def prompt_digits(prompts: list[str]) -> Int32[np.ndarray, "n 2"]:
        """The (left, right) digits each prompt asks for (`caption_digits`); a prompt outside the grammar
        raises ValueError naming it."""
        return np.array([caption_digits(p) for p in prompts], np.int32).reshape(len(prompts), 2)

    def sample_prompts(self, num: int) -> list[str]:
        """`num` captions of the grammar for sample grids (`captioned_digits_prompts`, seed 0)."""
        return captioned_digits_prompts(num, seed=0)[0]

    def __len__(self) -> int:
        return len(self.digits)

    def caption(self, i: int) -> str:
        (left, right), (left_word, right_word) = self.digits[i], self.as_word[i]
        return digits_caption(int(left), int(right), int(self.template[i]), bool(left_word), bool(right_word))

    def __getitem__(self, i: int) -> dict:
        left, right = self.image_index[i]
        return {"image": np.concatenate([self.images[left], self.images[right]], axis=1), "caption": self.caption(i)}


def captioned_digits_prompts(num: int, seed: int = 0) -> tuple[list[str], Int32[np.ndarray, "n 2"]]:
    """`num` captions of the dataset's grammar and the (left, right) digits each one asks for: the 90 ordered
    pairs of different digits in a seeded random order, repeated (so each pair occurs num // 90 or one more
    times), with templates and word forms drawn from `seed`. Deterministic in (num, seed)."""
    rng = np.random.default_rng(seed)
    pairs = np.array([(left, right) for left in range(10) for right in range(10) if left != right], np.int32)
    order = np.concatenate([rng.permutation(len(pairs)) for _ in range(-(-num // len(pairs)))])[:num]
    digits = pairs[order]
    templates = rng.integers(0, len(TEMPLATES), num)
    as_word = rng.integers(0, 2, (num, 2)).astype(bool)
    prompts = [
        digits_caption(int(l), int(r), int(t), bool(wl), bool(wr))
        for (l, r), t, (wl, wr) in zip(digits, templates, as_word)
    ]
    return prompts, digits


def caption_digits(caption: str) -> tuple[int, int]:
    """The (left, right) digits a caption of the grammar asks for: its two digits in the order written,
    swapped by "right" or "after" ("a 7 right of a 3", "7 after 3": 3 on the left). A caption without
    exactly two digits, or with words outside VOCAB, raises naming it."""
    words = caption.lower().split()
    unknown = [w for w in words if w not in VOCAB]
    digits = [int(w) if w.isdigit() else NUMBER_WORDS.index(w) for w in words if w.isdigit() or w in NUMBER_WORDS]
    if unknown or len(digits) != 2:
        raise ValueError(f"{caption!r} is not a captioned_digits caption (two digits in its grammar: {TEMPLATES}).")
    first, second = digits
    return (second, first) if "right" in words or "after" in words else (first, second)


def captioned_digits_tokenizer() -> TextTokenizer:
    """The word-level tokenizer of the grammar's VOCAB, MAX_LENGTH (8) positions (`word_tokenizer`)."""
    return word_tokenizer(VOCAB, MAX_LENGTH)
