"""Data for eqxdiff: image sources, per-process grain pipelines and the device prefetch thread."""

from eqxdiff.data.pipeline import batch_spec, batch_stream, check_position, data_position
from eqxdiff.data.prefetch import Prefetch
from eqxdiff.data.sources import ImageSource, open_source, write_arrayrecord

__all__ = [
    "ImageSource",
    "Prefetch",
    "batch_spec",
    "batch_stream",
    "check_position",
    "data_position",
    "open_source",
    "write_arrayrecord",
]
