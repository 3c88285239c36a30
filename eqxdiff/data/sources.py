"""Image datasets as grain random-access sources: digits, npz, arrayrecord, and what they share.

Every image source is a record source (`eqxdiff.data.records.Source`) with the fields
`{"image": uint8[H, W, C]}`, plus `"label": int32[]` when labeled, plus `"caption": TEXT` (a str)
when opened with `captions=True`, and carries `image_shape` (H, W, C), `num_classes` (0:
unlabeled, no label field) and `spec` (its string). `class_names` holds the label names (index =
label) where the data names its classes (`folder:` sub-folders; [] when unlabeled), else None
(digits, npz, arrayrecord: bare label ids); latents keep their source's (meta.json); captioned sources
have no such attribute.
`describe_source` prints any of them in one line. Images stay uint8 on the way to the device;
`eqxdiff.images.from_uint8` maps them to [-1, 1] there. A caption is tokenized when its record is
read (`eqxdiff.data.TokenizedSource`). The `--dataset` specs that name them, and what each holds:
eqxdiff/data/specs.py (`open_source`).

A missing caption (captions=True) is an error naming the image, unless `allow_uncaptioned` makes
it "". Without captions=True every source is as it was: no caption field, `.txt` files ignored.

ArrayRecord record format (no pickle, safe for untrusted files): a little-endian uint32 header
length n, then n bytes of UTF-8 JSON `{"label": int, "num_classes": int}` (+ `"caption": str` when
captioned), then the encoded image (PNG, JPEG, or anything pillow reads). `num_classes` is read
from the first record.
"""

import glob
import io
import importlib.util
import json
import os
import struct
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol, runtime_checkable

import grain
import jax
import numpy as np
from jaxtyping import Int, UInt8
from PIL import Image

from eqxdiff.data.captions import missing_caption
from eqxdiff.data.latents import LatentSource
from eqxdiff.data.records import TEXT, Source
from eqxdiff.local_copies import local_copies_matching
from eqxdiff.paths import is_url

GRAYSCALE_MODES = {"1", "L", "LA"}
MAX_NAMED_CLASSES = 10  # class names shown by describe_source; the rest are counted
_HEADER_LEN = struct.Struct("<I")


@runtime_checkable
class ImageSource(Source, Protocol):
    """A record source of `{"image": uint8 (H, W, C)}` (+ `"label": int32 ()` when labeled)."""

    image_shape: tuple[int, int, int]
    num_classes: int


def image_fields(image_shape: tuple[int, int, int], num_classes: int, captions: bool = False) -> dict:
    """The fields of an image source: the image, its label when there are classes, its caption (TEXT) if asked."""
    fields = {"image": jax.ShapeDtypeStruct(tuple(image_shape), np.uint8)}
    if num_classes:
        fields["label"] = jax.ShapeDtypeStruct((), np.int32)
    if captions:
        fields["caption"] = TEXT
    return fields


def image_record(image: np.ndarray, label: int | np.integer, num_classes: int, caption: str | None = None) -> dict:
    """One example of an image source: `{"image"}`, plus `"label"` (int32) when labeled, plus `"caption"` if given."""
    record = {"image": image, "label": np.int32(label)} if num_classes else {"image": image}
    return record if caption is None else {**record, "caption": caption}


class ArraySource:
    """Images held in memory: (N, H, W, C) uint8, (N,) labels and, when captioned, N captions."""

    def __init__(
        self,
        images: UInt8[np.ndarray, "n h w c"],
        labels: Int[np.ndarray, " n"] | None,
        spec: str,
        captions: Sequence[str] | None = None,
    ):
        if len(images) == 0:
            raise ValueError(f"Dataset {spec} has no images.")
        if captions is not None and len(captions) != len(images):
            raise ValueError(f"Dataset {spec} has {len(images)} images but {len(captions)} captions.")
        self.images = images
        self.labels = np.zeros(len(images), np.int32) if labels is None else labels.astype(np.int32)
        self.captions = captions
        self.num_classes = 0 if labels is None else int(labels.max()) + 1
        self.class_names = None  # bare label ids
        self.image_shape = tuple(int(d) for d in images.shape[1:])
        self.fields = image_fields(self.image_shape, self.num_classes, captions is not None)
        self.spec = spec

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int) -> dict:
        caption = None if self.captions is None else str(self.captions[i])
        return image_record(self.images[i], self.labels[i], self.num_classes, caption)


def decode_image(data: bytes, channels: int, size: int, name: str) -> UInt8[np.ndarray, "s s c"]:
    """Encoded bytes -> (size, size, channels) uint8: convert, center-crop to a square, resize."""
    try:
        with Image.open(io.BytesIO(data)) as image:
            image = image.convert("L" if channels == 1 else "RGB")  # decodes; corrupt data raises here
    except Exception as e:  # noqa: BLE001 — pillow raises many types; re-raised with the name
        raise ValueError(f"Could not decode image {name}: {e}") from e
    w, h = image.size
    if (w, h) != (size, size):
        side = min(w, h)
        left, top = (w - side) // 2, (h - side) // 2
        image = image.crop((left, top, left + side, top + side)).resize((size, size), Image.Resampling.BICUBIC)
    return np.asarray(image, np.uint8).reshape(size, size, channels)


def encode_record(image: UInt8[np.ndarray, "h w c"], label: int, num_classes: int, caption: str | None = None) -> bytes:
    """One ArrayRecord record: header length, JSON header (with the caption if given), PNG bytes (lossless)."""
    if image.shape[-1] not in (1, 3):
        raise ValueError(f"Images must have 1 or 3 channels, got shape {image.shape}.")
    png = io.BytesIO()
    Image.fromarray(image[..., 0] if image.shape[-1] == 1 else image).save(png, format="PNG")
    header = {"label": int(label), "num_classes": int(num_classes)}
    if caption is not None:
        header["caption"] = caption
    data = json.dumps(header, ensure_ascii=False).encode()
    return _HEADER_LEN.pack(len(data)) + data + png.getvalue()


def decode_record(record: bytes, name: str) -> tuple[dict, bytes]:
    """An ArrayRecord record -> (JSON header, encoded image bytes)."""
    try:
        (n,) = _HEADER_LEN.unpack_from(record)
        header = json.loads(record[_HEADER_LEN.size : _HEADER_LEN.size + n])
        return header, record[_HEADER_LEN.size + n :]
    except (struct.error, ValueError) as e:
        raise ValueError(f"{name} is not an eqxdiff image record ({e}); see write_arrayrecord.") from e


def write_arrayrecord(
    path: str | Path,
    images: UInt8[np.ndarray, "n h w c"],
    labels: Int[np.ndarray, " n"] | None = None,
    num_classes: int | None = None,
    captions: Sequence[str] | None = None,
) -> None:
    """Write images (PNG-encoded), labels and, if given, one caption per image as one ArrayRecord
    file readable by `arrayrecord:`. Unlabeled data (labels None) is stored with label 0 and
    num_classes 0; `num_classes` defaults to max(labels) + 1."""
    from array_record.python.array_record_module import ArrayRecordWriter

    if captions is not None and (len(captions) != len(images) or not all(isinstance(c, str) for c in captions)):
        raise ValueError(f"captions must be one str per image ({len(images)}); got {len(captions)} items.")
    if labels is None:
        labels, num_classes = np.zeros(len(images), np.int64), 0
    elif num_classes is None:
        num_classes = int(labels.max()) + 1
    if num_classes and (labels.min() < 0 or labels.max() >= num_classes):
        raise ValueError(f"Labels must lie in [0, {num_classes}), got [{labels.min()}, {labels.max()}].")
    writer = ArrayRecordWriter(str(path), "group_size:1")  # group size 1: fast random access (grain)
    try:
        for i, (image, label) in enumerate(zip(images, labels)):
            writer.write(encode_record(image, int(label), num_classes, None if captions is None else captions[i]))
    finally:
        writer.close()


class ArrayRecordSource:
    """Encoded image records in ArrayRecord files, decoded (and resized) when an element is read.

    With captions, the first record's caption is checked at open (reading every header would read
    the whole dataset); any other record without one raises, naming it, when it is read."""

    def __init__(
        self, pattern: str, image_size: int, spec: str, captions: bool = False, allow_uncaptioned: bool = False
    ):
        # A bucket's files are read from their local copies: array_record's reader opens local files only.
        if is_url(pattern):
            paths = local_copies_matching(pattern)
        else:
            paths = sorted(glob.glob(str(Path(pattern).expanduser())))
        if not paths:
            raise FileNotFoundError(f"No ArrayRecord files match {pattern} (from --dataset {spec}).")
        try:
            self.records = grain.sources.ArrayRecordDataSource(paths)
        except RuntimeError as e:  # array_record's message does not name the file
            raise ValueError(f"Could not open the ArrayRecord files matching {pattern}: {e}") from e
        if len(self.records) == 0:
            raise ValueError(f"The ArrayRecord files matching {pattern} hold no records.")
        self.spec = spec
        header, data = decode_record(self.records[0], f"record 0 of {pattern}")
        with Image.open(io.BytesIO(data)) as first:
            channels = 1 if first.mode in GRAYSCALE_MODES else 3
        self.num_classes = int(header["num_classes"])
        self.class_names = None  # bare label ids
        self.image_shape = (image_size, image_size, channels)
        self.fields = image_fields(self.image_shape, self.num_classes, captions)
        self.captions, self.allow_uncaptioned = captions, allow_uncaptioned
        if captions:
            self.caption(header, 0)

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, i: int) -> dict:
        name = f"record {i} of {self.spec}"
        header, data = decode_record(self.records[i], name)
        size, _, channels = self.image_shape
        caption = self.caption(header, i) if self.captions else None
        return image_record(decode_image(data, channels, size, name), header["label"], self.num_classes, caption)

    def caption(self, header: dict, i: int) -> str:
        caption = header.get("caption")
        if caption is None and not self.allow_uncaptioned:
            raise missing_caption(f"record {i} of {self.spec} (its header has no 'caption'; see write_arrayrecord)")
        if caption is not None and not isinstance(caption, str):
            raise ValueError(f"Record {i} of {self.spec} has a caption that is not a string: {caption!r}.")
        return caption or ""


def load_npz(path: os.PathLike, spec: str, captions: bool = False, allow_uncaptioned: bool = False) -> ArraySource:
    """`images` (N, H, W, C) uint8, optional `labels` (N,) and, with captions, `captions` (N,) str from an
    .npz file (no pickle), on disk or in a bucket (an epath.Path: eqxdiff/paths.py)."""
    if not path.is_file():
        raise FileNotFoundError(f"Dataset file not found: {path} (from --dataset {spec}).")
    with np.load(io.BytesIO(path.read_bytes()) if is_url(path) else path) as arrays:  # a bucket's: read whole
        if "images" not in arrays:
            raise ValueError(f"{path} has no 'images' array (found: {', '.join(arrays.files)}).")
        images = arrays["images"]
        labels = arrays["labels"] if "labels" in arrays else None
        texts = npz_captions(arrays, path, len(images), allow_uncaptioned) if captions else None
    if images.dtype != np.uint8 or images.ndim != 4:
        raise ValueError(f"{path}: 'images' must be (N, H, W, C) uint8, got {images.shape} {images.dtype}.")
    if labels is not None and (labels.shape != images.shape[:1] or labels.dtype.kind not in "iu" or (labels < 0).any()):
        raise ValueError(f"{path}: 'labels' must be ({len(images)},) integers >= 0, got {labels.shape} {labels.dtype}.")
    return ArraySource(images, labels, spec, texts)


def npz_captions(arrays: np.lib.npyio.NpzFile, path: os.PathLike, n: int, allow_uncaptioned: bool) -> list[str]:
    """The `captions` array of an npz as n str ("" each when it has none and that is allowed)."""
    if "captions" not in arrays:
        if allow_uncaptioned:
            return [""] * n
        raise missing_caption(f"any image of {path}: the npz has no captions (add a 'captions' array of {n} str)")
    try:
        texts = arrays["captions"]
    except ValueError as e:  # an object array needs pickle, which is off
        raise ValueError(f"{path}: 'captions' must be a numpy str array, np.array(list_of_str) ({e}).") from e
    if texts.dtype.kind != "U" or texts.shape != (n,):
        got = f"{texts.shape} {texts.dtype}"
        raise ValueError(f"{path}: 'captions' must be ({n},) str (np.array(list_of_str)), got {got}.")
    return [str(t).strip() for t in texts]


def load_digits_source() -> ArraySource:
    """scikit-learn's digits as an 8×8×1 uint8 source (levels 0..16 -> 0..255, rounded).

    Read straight from the CSV that ships inside scikit-learn (the file `load_digits` reads):
    importing sklearn itself would add its whole import time to every run's start-up."""
    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("--dataset digits needs scikit-learn: pip install scikit-learn")
    path = Path(spec.submodule_search_locations[0]) / "datasets" / "data" / "digits.csv.gz"
    table = np.loadtxt(path, delimiter=",", dtype=np.int64)  # 1797 rows: 64 pixels (0..16), label
    images = np.round(table[:, :64].reshape(-1, 8, 8) * (255 / 16)).astype(np.uint8)[..., None]
    return ArraySource(images, table[:, 64], "digits")


def describe_source(source: ImageSource) -> str:
    """One line for start-up printing: spec, count, classes, the shape the model sees and, for a
    folder, the unreadable files skipped. E.g. "folder:pets: 1,234 images, classes 0=cats, 1=dogs,
    model input 32×32×3 after resizing, 2 unreadable files skipped"."""
    noun = ("latent" if isinstance(source, LatentSource) else "image") + ("s" if len(source) != 1 else "")
    h, w, c = source.image_shape
    resized = " after resizing" if source.spec.partition(":")[0] in ("folder", "arrayrecord") else ""
    parts = [
        f"{len(source):,} {noun}",
        describe_classes(source.num_classes, getattr(source, "class_names", None)),
        *(["captioned"] if "caption" in source.fields else []),
        *([latent_text(source)] if isinstance(source, LatentSource) and latent_text(source) else []),
        f"model input {h}×{w}×{c}{resized}",
    ]
    skipped = len(getattr(source, "skipped", ()))  # folder: files dropped by skip_bad_images
    if skipped:
        parts.append(f"{skipped} unreadable file{'s' if skipped > 1 else ''} skipped")
    return f"{source.spec}: {', '.join(parts)}"


def latent_text(source: LatentSource) -> str:
    """What latents hold of captions, for `describe_source`: "" (none), "text-conditioned (caption
    tokens)", "text-conditioned (captions encoded ahead of time)", or "raw captions"."""
    text = source.meta.get("text")
    if text is not None:  # train/encode.py --text_encoder: training conditions on these
        return f"text-conditioned ({'captions encoded ahead of time' if text['encoded'] else 'caption tokens'})"
    return "raw captions" if "caption" in source.meta["fields"] else ""


def describe_classes(num_classes: int, names: Sequence[str] | None) -> str:
    """ "unlabeled", "labels 0..K-1" (no names) or "classes 0=cats, 1=dogs" (the first few, then the count)."""
    if not num_classes:
        return "unlabeled"
    if not names:
        return f"labels 0..{num_classes - 1}"
    shown = ", ".join(f"{k}={name}" for k, name in enumerate(names[:MAX_NAMED_CLASSES]))
    more = f", ... ({num_classes} classes)" if num_classes > MAX_NAMED_CLASSES else ""
    return f"classes {shown}{more}"
