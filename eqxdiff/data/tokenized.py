"""A record source whose text field arrives tokenized: the tokenizer runs when a record is read, in the
grain pipeline's reader threads, never inside a jitted step."""

import jax
import numpy as np

from eqxdiff.data.records import Source, TextField, describe_fields
from eqxdiff.data.tokenizer import TextTokenizer, TokenizeText


class TokenizedSource:
    """`source` with its text field `field` replaced by "input_ids" and "attention_mask", int32[max_length] each
    (`eqxdiff.data.TokenizeText` applied to every record read; `max_length` None: the tokenizer's
    model_max_length). Length, `spec` and every other attribute (`image_shape`, `num_classes`, ...) are the
    wrapped source's.

        source = TokenizedSource(open_source("folder:/data/pets", captions=True), load_tokenizer(clip_dir))
        batch_stream(source, 256, seed)   # {"image": uint8[b, 32, 32, 3], "input_ids", "attention_mask": int32[b, 77]}
    """

    def __init__(self, source: Source, tokenizer: TextTokenizer, max_length: int | None = None, field: str = "caption"):
        if not isinstance(source.fields.get(field), TextField):
            raise ValueError(
                f"{source.spec} has no text field {field!r} to tokenize (its fields: {describe_fields(source.fields)});"
                " open it with captions=True (--captions), or name its text field with field=."
            )
        clash = {"input_ids", "attention_mask"} & (source.fields.keys() - {field})
        if clash:
            raise ValueError(f"{source.spec} already has a field {sorted(clash)[0]!r}; tokenizing would replace it.")
        max_length = tokenizer.check_length(max_length)
        tokens = jax.ShapeDtypeStruct((max_length,), np.int32)
        self.source = source
        self.tokenize = TokenizeText(tokenizer, field, max_length)
        rest = {k: f for k, f in source.fields.items() if k != field}
        self.fields = {**rest, "input_ids": tokens, "attention_mask": tokens}
        self.spec = source.spec

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, i: int) -> dict:
        return self.tokenize.map(self.source[i])

    def __getattr__(self, name: str):
        """image_shape, num_classes, class_names, ...: the wrapped source's (called only for names not set here)."""
        if name == "source":  # not set yet (e.g. while unpickling): no recursion through self.source
            raise AttributeError(name)
        return getattr(self.source, name)
