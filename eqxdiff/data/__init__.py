"""Data for eqxdiff: per-process host pipelines and the device prefetch thread."""

from eqxdiff.data.arrays import load_digits, shuffled_batches
from eqxdiff.data.prefetch import Prefetch

__all__ = ["Prefetch", "load_digits", "shuffled_batches"]
