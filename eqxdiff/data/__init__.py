"""Data for eqxdiff: record sources, per-process grain pipelines, the host tokenizers they run and the
device prefetch thread."""

from eqxdiff.data.captioned_digits import (
    CaptionedDigitsSource,
    caption_digits,
    captioned_digits_prompts,
    captioned_digits_tokenizer,
)
from eqxdiff.data.pipeline import batch_stream, check_position, data_position
from eqxdiff.data.prefetch import Prefetch, global_batch
from eqxdiff.data.records import TEXT, Source, TextField, batch_spec, describe_fields, stack_records
from eqxdiff.data.folder import UnreadableImagesError
from eqxdiff.data.sources import ImageSource, describe_source, write_arrayrecord
from eqxdiff.data.specs import open_source
from eqxdiff.data.tokenized import TokenizedSource
from eqxdiff.data.tokenizer import TextTokenizer, TokenizeText, load_tokenizer, word_tokenizer

__all__ = [
    "TEXT",
    "CaptionedDigitsSource",
    "ImageSource",
    "Prefetch",
    "Source",
    "TextField",
    "TextTokenizer",
    "TokenizeText",
    "TokenizedSource",
    "UnreadableImagesError",
    "caption_digits",
    "batch_spec",
    "batch_stream",
    "captioned_digits_prompts",
    "captioned_digits_tokenizer",
    "check_position",
    "data_position",
    "describe_fields",
    "describe_source",
    "global_batch",
    "load_tokenizer",
    "open_source",
    "stack_records",
    "word_tokenizer",
    "write_arrayrecord",
]
