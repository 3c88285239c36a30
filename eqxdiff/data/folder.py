"""`folder:PATH` datasets: image files on disk, one sub-folder per class or none (see
eqxdiff/data/specs.py's module docstring), every file decoded once when the folder opens."""

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from PIL import Image

from eqxdiff.data.captions import FolderCaptions
from eqxdiff.data.sources import GRAYSCALE_MODES, decode_image, image_fields, image_record

IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff"}
MAX_LISTED = 20  # unreadable files named one per line in an error; the rest are counted


class UnreadableImagesError(ValueError):
    """Image files pillow cannot decode; `bad` holds (path, pillow's reason) for every one of them."""

    def __init__(self, root: Path, bad: list[tuple[Path, str]], total: int):
        self.bad = bad
        lines = [f"  {path}: {reason}" for path, reason in bad[:MAX_LISTED]]
        if len(bad) > MAX_LISTED:
            lines.append(f"  ... and {len(bad) - MAX_LISTED} more")
        if len(bad) < total:
            fix = (
                "Remove or fix them, or open the folder with skip_bad_images=True (train/main.py: "
                "--skip_bad_images) to go without them."
            )
        else:
            fix = "Remove or fix them: none of the images is readable, so skipping them would leave nothing."
        listing = "\n".join(lines)
        super().__init__(f"{len(bad)} of {total} image files in {root} cannot be read:\n{listing}\n{fix}")


class FolderSource:
    """Image files on disk, decoded (and resized) when an element is read; captions beside them if asked.

    Opening decodes every file once (see the module docstring); with `skip_bad` the unreadable ones
    are dropped and `skipped` lists them as (path, pillow's reason)."""

    def __init__(
        self,
        root: Path,
        image_size: int,
        spec: str,
        captions: bool = False,
        allow_uncaptioned: bool = False,
        skip_bad: bool = False,
    ):
        if not root.is_dir():
            raise FileNotFoundError(f"Dataset folder not found: {root} (from --dataset {spec}).")
        class_dirs = sorted(d for d in root.iterdir() if d.is_dir() and not d.name.startswith("."))
        loose = _image_files(root)
        if class_dirs and loose:
            raise ValueError(f"{root} has both class sub-folders and loose images ({loose[0]}); use one layout.")
        if class_dirs:
            files = [(f, k) for k, d in enumerate(class_dirs) for f in _image_files(d)]
        else:
            files = [(f, 0) for f in loose]
        if not files:
            raise ValueError(f"No images ({', '.join(sorted(IMAGE_SUFFIXES))}) found in {root}.")
        with ThreadPoolExecutor() as pool:  # pillow releases the GIL while it decodes
            checked = list(pool.map(_check_image, [f for f, _ in files]))
        self.skipped = [(f, reason) for (f, _), (_, reason) in zip(files, checked) if reason is not None]
        if self.skipped and (not skip_bad or len(self.skipped) == len(files)):
            raise UnreadableImagesError(root, self.skipped, len(files))
        self.files = [file for file, (_, reason) in zip(files, checked) if reason is None]
        modes = [mode for mode, reason in checked if reason is None]
        self.num_classes = len(class_dirs)
        channels = 1 if all(mode in GRAYSCALE_MODES for mode in modes) else 3
        self.image_shape = (image_size, image_size, channels)
        self.fields = image_fields(self.image_shape, self.num_classes, captions)
        self.class_names = [d.name for d in class_dirs]
        self.captions = FolderCaptions(root, [f for f, _ in self.files], allow_uncaptioned) if captions else None
        self.spec = spec

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> dict:
        path, label = self.files[i]
        size, _, channels = self.image_shape
        image = decode_image(path.read_bytes(), channels, size, str(path))
        return image_record(image, label, self.num_classes, None if self.captions is None else self.captions[i])


def _image_files(folder: Path) -> list[Path]:
    return sorted(f for f in folder.iterdir() if f.is_file() and f.suffix.lower() in IMAGE_SUFFIXES)


def _check_image(path: Path) -> tuple[str | None, str | None]:
    """(pillow mode, None) when the whole file decodes, else (None, pillow's reason)."""
    try:
        with Image.open(path) as image:
            mode = image.mode
            if image.format == "JPEG":
                image.draft(mode, (1, 1))  # 1/8 scale: less work, yet the whole entropy-coded stream is read
            image.load()  # a truncated file raises here
        return mode, None
    except Exception as e:  # noqa: BLE001 — pillow raises many types; each becomes a listed reason
        return None, str(e) or type(e).__name__
