"""`open_source(spec)`: the dataset a `--dataset` spec string names, as a record source
(eqxdiff/data/sources.py says what every image source holds). It sits above the modules of each kind,
which build on sources.py's records and digits, so that imports point down only.

- `digits`: scikit-learn's bundled 1,797 handwritten digits, 10 classes, kept at their native
  8×8×1 (the models handle 8×8; chosen for speed). Levels 0..16 are stretched to 0..255.
  No captions (captions=True needs allow_uncaptioned: all "").
- `npz:PATH`: arrays `images` (N, H, W, C) uint8 and optional `labels` (N,) int; stored size kept.
  Captions: an optional `captions` (N,) numpy str array (`np.array(list_of_str)`). PATH may be a bucket
  object (gs://...): downloaded whole into memory.
- `folder:PATH`: image files decoded with pillow. Class sub-folders (sorted names -> labels
  0..K-1), or images directly in PATH (unlabeled). Opening decodes every file in full (JPEG at
  its smallest DCT scale, which still reads all its data; in threads), so a non-image or truncated
  file fails at once: one `UnreadableImagesError` lists them all, or, with `skip_bad_images`, they
  are dropped and kept in `source.skipped` (eqxdiff/data/folder.py). The folder is L (1 channel)
  when every readable file is grayscale, else RGB. Images are center-cropped to a square and resized to `image_size`.
  Captions: a `.txt` beside each image or a `captions.jsonl` (`eqxdiff.data.captions`).
  PATH may be a bucket prefix (gs://...): read from its local copy in $EQXDIFF_CACHE (eqxdiff/local_copies.py).
- `arrayrecord:GLOB`: grain ArrayRecord files in the record format of eqxdiff/data/sources.py
  (`write_arrayrecord` writes it). Channels come from the first record (L stays 1 channel, anything
  else is RGB); crop/resize as for folders. Captions: the header's "caption". GLOB may be a bucket URL
  (gs://BUCKET/data/train-*.array_record): the files it matches are read from their local copies, since
  array_record's reader (grain's ArrayRecordDataSource) opens local files only.
- `latents:DIR`: latents pre-encoded by train/encode.py (`eqxdiff.data.latents.LatentSource`:
  fields `mean`, `logvar` float16, plus the encoded source's label; `image_shape` is the latent's).
  DIR may be a bucket prefix: read from its local copy, as arrayrecord's files are.
  `captions` does not apply: its fields are what the encode stored.
- `captioned_digits`: two digits side by side, 8×16×1, always captioned, no label
  (`eqxdiff.data.captioned_digits`).
"""

from collections.abc import Callable
from pathlib import Path

from eqxdiff.data.captioned_digits import CaptionedDigitsSource
from eqxdiff.data.captions import missing_caption
from eqxdiff.data.folder import FolderSource
from eqxdiff.data.latents import LatentSource
from eqxdiff.data.sources import ArrayRecordSource, ArraySource, ImageSource, load_digits_source, load_npz
from eqxdiff.local_copies import local_copy
from eqxdiff.paths import as_path


def _digits(captions: bool, allow_uncaptioned: bool) -> ImageSource:
    if captions and not allow_uncaptioned:
        raise missing_caption("any image of digits (use --dataset captioned_digits for captioned digits)")
    digits = load_digits_source()
    return ArraySource(digits.images, digits.labels, "digits", [""] * len(digits)) if captions else digits


# Datasets built in, by name: (captions, allow_uncaptioned) -> source. A new one is a row here.
BUILTIN_SOURCES: dict[str, Callable[[bool, bool], ImageSource]] = {
    "digits": _digits,
    "captioned_digits": lambda captions, allow_uncaptioned: CaptionedDigitsSource(),  # always captioned
}
# Datasets on disk, `KIND:ARG`: (ARG, spec, image_size, captions, allow_uncaptioned, skip_bad_images) -> source.
PATH_SOURCES: dict[str, Callable[[str, str, int, bool, bool, bool], ImageSource]] = {
    "npz": lambda arg, spec, size, captions, allow, skip: load_npz(as_path(arg), spec, captions, allow),
    "folder": lambda arg, spec, size, captions, allow, skip: FolderSource(
        _local_folder(arg, spec), size, spec, captions, allow, skip
    ),
    "arrayrecord": lambda arg, spec, size, captions, allow, skip: ArrayRecordSource(arg, size, spec, captions, allow),
    "latents": lambda arg, spec, size, captions, allow, skip: LatentSource(as_path(arg), spec),
}
SPEC_FORMS = "digits, npz:PATH, folder:PATH, arrayrecord:GLOB, latents:DIR, captioned_digits"


def _local_folder(arg: str, spec: str) -> Path:
    """The folder `arg` names; a bucket prefix (gs://...) as its local copy (local_copies.local_copy): the folder
    source lists it and reads each image at open and again per record, from files."""
    try:
        return local_copy(arg)
    except FileNotFoundError as e:
        raise FileNotFoundError(f"Dataset folder not found: {e} (from --dataset {spec}).") from None


def open_source(
    spec: str,
    image_size: int = 32,
    *,
    captions: bool = False,
    allow_uncaptioned: bool = False,
    skip_bad_images: bool = False,
) -> ImageSource:
    """Open the dataset named by `spec` (see the module docstring). `image_size` applies to
    `folder:` and `arrayrecord:` (resize); digits stay 8×8, captioned_digits 8×16 and npz keeps its
    stored size. `captions` adds the "caption" text field to image sources; a missing caption raises
    naming the image unless `allow_uncaptioned` (then ""). `skip_bad_images` applies to `folder:`
    only (other kinds ignore it): unreadable files are dropped (`source.skipped`) instead of raising
    `UnreadableImagesError`. Missing paths raise FileNotFoundError and bad specs ValueError, here,
    before any compile."""
    kind, _, arg = spec.partition(":")
    if image_size < 1:
        raise ValueError(f"image_size must be >= 1, got {image_size}.")
    if spec in BUILTIN_SOURCES:
        return BUILTIN_SOURCES[spec](captions, allow_uncaptioned)
    if kind in PATH_SOURCES and arg:
        return PATH_SOURCES[kind](arg, spec, image_size, captions, allow_uncaptioned, skip_bad_images)
    raise ValueError(f"Unknown dataset {spec!r}; the accepted forms are: {SPEC_FORMS}.")
