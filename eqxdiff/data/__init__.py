"""Data for eqxdiff: record sources, per-process grain pipelines and the device prefetch thread."""

from eqxdiff.data.pipeline import batch_stream, check_position, data_position
from eqxdiff.data.prefetch import Prefetch
from eqxdiff.data.records import Source, batch_spec, describe_fields, stack_records
from eqxdiff.data.sources import ImageSource, open_source, write_arrayrecord

__all__ = [
    "ImageSource",
    "Prefetch",
    "Source",
    "batch_spec",
    "batch_stream",
    "check_position",
    "data_position",
    "describe_fields",
    "open_source",
    "stack_records",
    "write_arrayrecord",
]
