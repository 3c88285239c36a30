"""Text -> padded token ids on the host, in the data pipeline (a grain map), never inside a jitted step.

`load_tokenizer(folder)` reads the files a CLIP tokenizer ships as: `tokenizer.json`, or SD's tokenizer/
folder (`vocab.json` + `merges.txt`), for which it builds the pipeline transformers' `CLIPTokenizer` builds
(`CLIPConverter`): NFC, whitespace runs -> " ", lowercase; CLIP's split regex; byte-level symbols; BPE
with a `</w>` end-of-word suffix; bos ... eos around each text. Hugging Face `tokenizers` runs it.

Special tokens and lengths follow the folder's configs as transformers reads them: special_tokens_map.json
over tokenizer_config.json over CLIPTokenizer's defaults, so SD 1.x pads with <|endoftext|> and SD 2 with
"!" (its map says "!", its config <|endoftext|>). Every special token is matched in the text as a whole
token, "!" included under SD 2's config, as transformers does.

`word_tokenizer(vocab, max_length)` builds a word-level tokenizer for a closed vocabulary (a text tower
trained from scratch, e.g. on captioned_digits) with the same library and the same `TextTokenizer` interface.
"""

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path

import grain
import numpy as np
import tokenizers
from jaxtyping import Int32
from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers, processors
from tokenizers.models import BPE, WordLevel

SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token")  # added in this order: the last flags win
CLIP_DEFAULTS = {
    "bos_token": "<|startoftext|>",
    "eos_token": "<|endoftext|>",
    "unk_token": "<|endoftext|>",
    "pad_token": "<|endoftext|>",
}
CLIP_SPLIT = r"""'s|'t|'re|'ve|'m|'ll|'d|[\p{L}]+|[\p{N}]|[^\s\p{L}\p{N}]+"""  # CLIP's word regex
NO_LIMIT = 10**12  # transformers writes model_max_length = 1e30 for "no known limit"
WORD_SPECIALS = (
    "<pad>",
    "<unk>",
    "<bos>",
    "<eos>",
)  # ids 0..3: eos is not 2, which CLIP configs read as legacy pooling


@dataclasses.dataclass(frozen=True)
class TextTokenizer:
    """`tok(texts, max_length)` -> (ids, mask), both int32[b, max_length]: bos, the text's tokens, eos, then
    `pad_id`; a text too long keeps bos, its first max_length - 2 tokens and eos. `mask` is 1 on bos..eos and 0
    on padding (transformers' attention_mask). Picklable, so grain can ship it to worker processes."""

    tokenizer: tokenizers.Tokenizer  # padding and truncation off: each call sets its own length
    pad_token: str
    pad_id: int
    model_max_length: int | None  # the text model's positions (77 for CLIP); None if the folder does not say

    def __call__(
        self, texts: Sequence[str], max_length: int | None = None
    ) -> tuple[Int32[np.ndarray, "b n"], Int32[np.ndarray, "b n"]]:
        if isinstance(texts, str):
            raise TypeError("Pass a list of texts, e.g. tok([text]); a str would be read as one text per character.")
        max_length = self.check_length(max_length)
        num_special = 0 if self.tokenizer.post_processor is None else self.tokenizer.num_special_tokens_to_add(False)
        ids = np.full((len(texts), max_length), self.pad_id, np.int32)
        mask = np.zeros((len(texts), max_length), np.int32)
        for row, encoding in enumerate(self.tokenizer.encode_batch(list(texts), add_special_tokens=False)):
            encoding.truncate(max_length - num_special)  # the text only, so bos and eos always fit
            encoding = self.tokenizer.post_process(encoding)  # bos ... eos
            ids[row, : len(encoding.ids)] = encoding.ids
            mask[row, : len(encoding.ids)] = 1
        return ids, mask

    def check_length(self, max_length: int | None) -> int:
        if max_length is None:
            if self.model_max_length is None:
                raise ValueError("This tokenizer's folder gives no model_max_length: pass max_length (77 for CLIP).")
            return self.model_max_length
        if self.model_max_length is not None and max_length > self.model_max_length:
            raise ValueError(
                f"max_length {max_length} exceeds the model's maximum length {self.model_max_length}"
                " (model_max_length in tokenizer_config.json): the text model has no positions beyond it."
            )
        if max_length < 2:
            raise ValueError(f"max_length {max_length} leaves no room for the bos and eos tokens.")
        return max_length


@dataclasses.dataclass(frozen=True)
class TokenizeText(grain.transforms.Map):
    """A grain map: replaces the text in `example[field]` by "input_ids" and "attention_mask", int32[max_length]."""

    tokenizer: TextTokenizer
    field: str = "caption"
    max_length: int | None = None

    def map(self, example: dict) -> dict:
        ids, mask = self.tokenizer([example[self.field]], self.max_length)
        rest = {key: value for key, value in example.items() if key != self.field}
        return {**rest, "input_ids": ids[0], "attention_mask": mask[0]}


def load_tokenizer(path: str | Path) -> TextTokenizer:
    """The tokenizer in folder `path`: tokenizer.json, else vocab.json + merges.txt (SD's tokenizer/ folder),
    with its special tokens and model_max_length from tokenizer_config.json / special_tokens_map.json."""
    folder = Path(path)
    config = read_json(folder / "tokenizer_config.json")
    specials = {
        key: read_json(folder / "special_tokens_map.json").get(key, config.get(key, CLIP_DEFAULTS[key]))
        for key in SPECIAL_TOKENS
    }
    content = {key: value["content"] if isinstance(value, dict) else value for key, value in specials.items()}
    from_json = (folder / "tokenizer.json").is_file()
    if from_json:
        tokenizer = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
    elif (folder / "vocab.json").is_file() and (folder / "merges.txt").is_file():
        tokenizer = clip_bpe(folder / "vocab.json", folder / "merges.txt", content["unk_token"])
    else:
        raise FileNotFoundError(
            f"No tokenizer in {folder}: looked for tokenizer.json, or vocab.json + merges.txt (the files of a Stable"
            " Diffusion tokenizer/ folder)."
        )
    tokenizer.no_padding()
    tokenizer.no_truncation()
    tokenizer.add_special_tokens([added_token(value) for value in specials.values()])
    if not from_json:  # bos ... eos, as transformers' CLIPConverter (tokenizer.json carries its own)
        bos, eos = content["bos_token"], content["eos_token"]
        tokenizer.post_processor = processors.RobertaProcessing(
            (eos, tokenizer.token_to_id(eos)),
            (bos, tokenizer.token_to_id(bos)),
            trim_offsets=False,
            add_prefix_space=False,
        )
    pad_id = tokenizer.token_to_id(content["pad_token"])
    model_max_length = config.get("model_max_length")
    return TextTokenizer(
        tokenizer=tokenizer,
        pad_token=content["pad_token"],
        pad_id=pad_id,
        model_max_length=None if model_max_length is None or model_max_length >= NO_LIMIT else int(model_max_length),
    )


def word_tokenizer(vocab: Sequence[str], max_length: int) -> TextTokenizer:
    """A word-level tokenizer over a closed vocabulary: lowercase, split at whitespace (a run of punctuation is
    a word of its own), one id per word, "<bos> ... <eos>" added by a post-processor (as CLIP's tokenizer does),
    padded with "<pad>". Ids: <pad> 0, <unk> 1, <bos> 2, <eos> 3, then `vocab[k]` -> 4 + k; a word outside
    `vocab` maps to <unk>. `max_length` is the text model's number of positions (model_max_length): calls
    default to it and may not exceed it."""
    pre_tokenizer = pre_tokenizers.Whitespace()
    for word in vocab:
        if word != word.lower() or [piece for piece, _ in pre_tokenizer.pre_tokenize_str(word)] != [word]:
            raise ValueError(
                f"Vocabulary word {word!r} can never be produced: words are lowercase and whole"
                r" pre-tokens (a run of \w, or of punctuation, with no whitespace)."
            )
    ids = {token: i for i, token in enumerate((*WORD_SPECIALS, *vocab))}
    if len(ids) != len(WORD_SPECIALS) + len(vocab):
        raise ValueError(f"The vocabulary repeats a word or a special token {WORD_SPECIALS}: {list(vocab)}.")
    pad, unk, bos, eos = WORD_SPECIALS
    tokenizer = tokenizers.Tokenizer(WordLevel(ids, unk_token=unk))
    tokenizer.normalizer = normalizers.Lowercase()
    tokenizer.pre_tokenizer = pre_tokenizer
    tokenizer.add_special_tokens([AddedToken(token, special=True) for token in WORD_SPECIALS])
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A {eos}", special_tokens=[(bos, ids[bos]), (eos, ids[eos])]
    )
    if max_length < 2:
        raise ValueError(f"max_length {max_length} leaves no room for the bos and eos tokens.")
    return TextTokenizer(tokenizer=tokenizer, pad_token=pad, pad_id=ids[pad], model_max_length=max_length)


def clip_bpe(vocab_file: Path, merges_file: Path, unk_token: str) -> tokenizers.Tokenizer:
    """CLIP's tokenization pipeline, as transformers' `convert_slow_tokenizer.CLIPConverter` builds it."""
    vocab, merges = BPE.read_file(str(vocab_file), str(merges_file))
    tokenizer = tokenizers.Tokenizer(
        BPE(
            vocab,
            merges,
            dropout=None,
            continuing_subword_prefix="",
            end_of_word_suffix="</w>",
            fuse_unk=False,
            unk_token=unk_token,
        )
    )
    tokenizer.normalizer = normalizers.Sequence(
        [normalizers.NFC(), normalizers.Replace(Regex(r"\s+"), " "), normalizers.Lowercase()]
    )
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(CLIP_SPLIT), behavior="removed", invert=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def added_token(value: str | dict) -> AddedToken:
    """A special token from a config entry: a plain string, or an AddedToken dict with its matching flags."""
    if isinstance(value, str):
        return AddedToken(value, special=True)
    flags = {key: value[key] for key in ("single_word", "lstrip", "rstrip", "normalized") if key in value}
    return AddedToken(value["content"], special=True, **flags)


def read_json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
