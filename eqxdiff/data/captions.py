"""Captions beside the images of a `folder:` dataset, and the rule for an image without one.

Two layouts (paths relative to the dataset folder; either works with class sub-folders):

- `captions.jsonl` in the folder: one JSON object per line, `{"file": "cats/a.png", "caption": "..."}`.
  When present it is the only place captions are read from (`.txt` files are then ignored).
- otherwise a `.txt` file beside each image with the same stem (`cats/a.png` -> `cats/a.txt`), UTF-8.

Captions are stripped of surrounding whitespace. Opening checks that every image has a caption (one
directory listing per folder, no file reads); the `.txt` files are read when a record is read. A missing
caption is an error naming the image, unless `allow_uncaptioned` maps it to the empty caption "".
"""

import json
from collections.abc import Sequence
from pathlib import Path, PurePosixPath

JSONL = "captions.jsonl"


def missing_caption(name: str) -> ValueError:
    """The error for an image without a caption; `name` says which image (and where its caption was looked for)."""
    return ValueError(
        f"No caption for {name}. Add it, or pass allow_uncaptioned=True (--allow_uncaptioned) to use the empty"
        " caption for images without one."
    )


class FolderCaptions:
    """`captions[i]` is the caption (str) of `images[i]`, an image file under `root`."""

    def __init__(self, root: Path, images: Sequence[Path], allow_uncaptioned: bool = False):
        jsonl = root / JSONL
        if jsonl.is_file():
            known = read_jsonl(jsonl, root, images)
            self.entries: list[str | Path | None] = [known.get(f) for f in images]
            where = f" (no line of {jsonl} names it)"
        else:
            self.entries = list(txt_files(images))
            where = ""
        missing = [f for f, entry in zip(images, self.entries) if entry is None]
        if missing and not allow_uncaptioned:
            where = where or f" (expected {missing[0].with_suffix('.txt')}, or a {JSONL} in {root})"
            raise missing_caption(f"image {missing[0]}{where}; {len(missing)} of {len(images)} images have none")

    def __len__(self) -> int:
        return len(self.entries)

    def __getitem__(self, i: int) -> str:
        entry = self.entries[i]
        if entry is None:  # allowed to be uncaptioned
            return ""
        if isinstance(entry, str):
            return entry
        try:
            return entry.read_text(encoding="utf-8-sig").strip()  # -sig: a byte-order mark is not text
        except UnicodeDecodeError as e:
            raise ValueError(f"Caption file {entry} is not UTF-8 text: {e}") from e


def txt_files(images: Sequence[Path]) -> list[Path | None]:
    """Each image's `.txt` twin, or None where there is none (one listing per folder, not a stat per image)."""
    listings: dict[Path, set[str]] = {}
    twins = []
    for image in images:
        if image.parent not in listings:
            listings[image.parent] = {p.name for p in image.parent.iterdir() if p.is_file()}
        twin = image.with_suffix(".txt")
        twins.append(twin if twin.name in listings[image.parent] else None)
    return twins


def read_jsonl(path: Path, root: Path, images: Sequence[Path]) -> dict[Path, str]:
    """{image: caption} from a captions.jsonl; a bad line, an unknown file or a repeated one raises, naming the line."""
    by_name = {image.relative_to(root).as_posix(): image for image in images}
    captions: dict[Path, str] = {}
    form = '{"file": "relative/path.png", "caption": "..."}'
    for n, line in enumerate(path.read_text(encoding="utf-8-sig").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} line {n} is not JSON ({e}); each line is {form}.") from e
        if not (isinstance(entry, dict) and all(isinstance(entry.get(k), str) for k in ("file", "caption"))):
            raise ValueError(f"{path} line {n} is {line.strip()[:200]}; each line is {form}.")
        image = by_name.get(PurePosixPath(entry["file"]).as_posix())  # "./a.png" names a.png
        if image is None:
            raise ValueError(f"{path} line {n} names {entry['file']!r}, which is not an image file in {root}.")
        if image in captions:
            raise ValueError(f"{path} line {n} names {entry['file']!r} again; give each image one caption.")
        captions[image] = entry["caption"].strip()
    return captions
