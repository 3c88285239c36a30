"""The dataset train/encode.py and train/fid_stats.py read once through the devices (eqxdiff/data/offline.py
runs it), opened as the user named it."""

from eqxdiff.data import open_source


def open_dataset(spec: str, image_size: int, **options):
    """`open_source(spec, image_size, **options)`; a missing or unreadable dataset stops the script in one line."""
    try:
        return open_source(spec, image_size, **options)
    except (ValueError, FileNotFoundError, ModuleNotFoundError) as e:
        raise SystemExit(str(e)) from e
