"""A dataset is a source of records: each example a dict of named numpy arrays whose shapes and
dtypes the source declares up front, so batches can be described (and the step compiled)
before any data is read.

    class Latents:                      # e.g. pre-encoded latents with a caption's tokens
        spec = "latents:/data/x"
        fields = {"mean": jax.ShapeDtypeStruct((32, 32, 4), np.float16),
                  "tokens": jax.ShapeDtypeStruct((77,), np.int32)}
        def __len__(self): ...
        def __getitem__(self, i): return {"mean": ..., "tokens": ...}

The pipeline batches whatever fields a source declares; `prepare` in train/main.py turns a
batch of records into the model's input and condition.

A field may also be declared `TEXT` (e.g. `{"image": ..., "caption": TEXT}`): each record then holds a
Python str there. Text has no array shape, so it cannot be batched: wrap the source in
`eqxdiff.data.TokenizedSource`, which replaces it by "input_ids" and "attention_mask" when a record is read.
"""

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Protocol, runtime_checkable

import jax
import numpy as np


@dataclasses.dataclass(frozen=True)
class TextField:
    """The declaration of a text field: each record holds a `str` there (use the instance `TEXT`)."""

    def __repr__(self) -> str:
        return "TEXT"


TEXT = TextField()
Fields = Mapping[str, jax.ShapeDtypeStruct | TextField]


@runtime_checkable
class Source(Protocol):
    """A grain random-access source of records: `source[i]` is a dict with exactly the keys of
    `fields`, each value a numpy array of the declared per-example shape and dtype."""

    fields: Fields
    spec: str  # how the user named it (e.g. the --dataset value), for messages and checkpoints

    def __len__(self) -> int: ...

    def __getitem__(self, i: int) -> dict: ...


def describe_field(field: jax.ShapeDtypeStruct | TextField) -> str:
    """ "uint8[8, 8, 1]", or "text" for a text field."""
    return "text" if isinstance(field, TextField) else f"{np.dtype(field.dtype).name}{list(field.shape)}"


def describe_fields(fields: Fields) -> dict[str, str]:
    """{"image": "uint8[8, 8, 1]", "caption": "text", ...}: a json-able description (messages, checkpoints)."""
    return {k: describe_field(f) for k, f in fields.items()}


def check_batchable(fields: Fields) -> None:
    """Raise if a field is text: text has no array shape, so it must be tokenized before batching."""
    text = [k for k, f in fields.items() if isinstance(f, TextField)]
    if text:
        raise ValueError(
            f"Field {text[0]!r} is text, which cannot be batched: tokenize it first with"
            f" eqxdiff.data.TokenizedSource(source, tokenizer, field={text[0]!r}), which replaces it by"
            " int32 'input_ids' and 'attention_mask'."
        )


def stack_records(records: Sequence[dict], fields: Fields) -> dict[str, np.ndarray]:
    """A batch: each declared field stacked along a new first axis. A record whose keys, shapes
    or dtypes differ from the declaration raises, naming the field; so does a text field."""
    check_batchable(fields)
    for record in records:
        if record.keys() != fields.keys():
            raise ValueError(f"A record has fields {sorted(record)}, but its source declares {sorted(fields)}.")
        for name, want in fields.items():
            value = record[name]
            if np.shape(value) != tuple(want.shape) or np.asarray(value).dtype != want.dtype:
                got = f"{np.asarray(value).dtype.name}{list(np.shape(value))}"
                raise ValueError(
                    f"Field {name!r} of a record is {got}, but its source declares {describe_fields({name: want})[name]}."
                )
    return {name: np.stack([r[name] for r in records]) for name in fields}


def batch_spec(source: Source, global_batch_size: int) -> dict[str, jax.ShapeDtypeStruct]:
    """The global batch (all processes' rows) a pipeline over `source` feeds the step, as
    ShapeDtypeStructs: the train step can compile before the first batch exists. A text field raises."""
    check_batchable(source.fields)
    return {k: jax.ShapeDtypeStruct((global_batch_size, *f.shape), f.dtype) for k, f in source.fields.items()}
