"""One path type for a local file and an object in a bucket (`gs://BUCKET/KEY`, `s3://BUCKET/KEY`).

A local path stays a `pathlib.Path` (with `~` expanded); a URL becomes an `etils.epath.Path`, the
type orbax itself writes checkpoints through (its gs:// backend is gcsfs, which reads
`STORAGE_EMULATOR_HOST`). Both answer `/`, `exists`, `is_dir`, `iterdir`, `glob`, `read_text`,
`write_text`, `read_bytes`, `write_bytes`, `open`, `mkdir`, so code written against one serves both.
What an object store lacks: appending to an object, renaming atomically, folders (a prefix is one).
"""

import importlib.util
import json
import os
import re
import tempfile
from pathlib import Path

URL_SCHEMES = ("gs://", "s3://")
CLIENTS = {"gs": "gcsfs", "s3": "s3fs"}  # epath's (fsspec's) file system for each scheme


def is_url(path: str | os.PathLike) -> bool:
    """Whether `path` names an object in a bucket rather than a local file."""
    return str(path).startswith(URL_SCHEMES)


def url_error(url: str | os.PathLike) -> str | None:
    """What is wrong with a bucket URL before any request is made, or None: its form, SCHEME://BUCKET/KEY with
    BUCKET of 3+ lower-case letters, digits, '.', '_' and '-' (GCS's and S3's rule, loosely), or a missing client."""
    scheme, _, rest = str(url).partition("://")
    bucket = rest.partition("/")[0]
    if not re.fullmatch(r"[a-z0-9][a-z0-9._-]{1,220}[a-z0-9]", bucket):
        return (
            f"{url}: {bucket!r} is not a bucket name ({scheme}://BUCKET/PREFIX, BUCKET of lower-case letters, "
            f"digits, '.', '_' and '-')"
        )
    if importlib.util.find_spec(CLIENTS[scheme]) is None:
        return f"{url}: {scheme}:// needs the {CLIENTS[scheme]} package: pip install {CLIENTS[scheme]}"
    return None


def as_path(path: str | os.PathLike) -> os.PathLike:
    """`path` as a Path object: an epath.Path for a URL, else a pathlib.Path with `~` expanded.
    Not `pathlib.Path(url)`: that folds `gs://b/k` into the local `gs:/b/k`."""
    if not is_url(path):
        return Path(path).expanduser()
    from etils import epath  # imported when a URL comes: a tenth of a second that local runs need not pay

    return epath.Path(str(path))


def absolute(path: str | os.PathLike) -> os.PathLike:
    """`as_path(path)`, made absolute when local (epath's own `absolute()` folds a URL into the working folder)."""
    path = as_path(path)
    return path if is_url(path) else path.absolute()


def new_file_mode() -> int:
    """The permissions `open(path, "w")` gives a new file: 0o666 less the process's umask. For files made another
    way (`tempfile.mkstemp`, safetensors: 0o600) and renamed into place, so that they read as any other file would.
    The umask from /proc (reading it with os.umask sets it for a moment, for every thread)."""
    try:
        with open("/proc/self/status") as status:
            umask = next(int(line.split()[1], 8) for line in status if line.startswith("Umask:"))
    except (OSError, StopIteration):
        umask = os.umask(0o022)
        os.umask(umask)
    return 0o666 & ~umask


def write_whole(path: os.PathLike, text: str) -> None:
    """Replace the file at `path` by `text` so that a reader never sees half of it: a temporary
    file renamed over it on disk; one upload in a bucket (an object appears whole, or not at all)."""
    if is_url(path):
        path.write_text(text)
        return
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, new_file_mode())  # mkstemp's 0o600: the umask's, as a file written in place
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def append_text(path: os.PathLike, text: str) -> None:
    """Add `text` to the end of the file at `path` (made when missing). In a bucket, where an object
    cannot be appended to, the object is read and written again whole: fine at a logging cadence."""
    if is_url(path):
        write_whole(path, (path.read_text() if path.exists() else "") + text)
        return
    with open(path, "a") as f:
        f.write(text)


def what_path_is(path: str | Path) -> str:
    """What a path a flag was given holds, for its refusal to say ("… X is a file"): nothing, a file, a diffusers
    pipeline folder, a model folder (its config's class), or a folder and its first entries."""
    path = Path(path).expanduser()
    if not path.exists():
        return "does not exist"
    if path.is_file():
        return "is a file"
    if (path / "model_index.json").is_file():
        return "is a diffusers pipeline folder (model_index.json)"
    if (path / "config.json").is_file():
        try:
            kind = json.loads((path / "config.json").read_text()).get("_class_name") or "no _class_name"
        except (ValueError, AttributeError):
            kind = "unreadable"
        return f"is a model folder (config.json: {kind})"
    names = sorted(p.name for p in path.iterdir())
    return f"is a folder holding {names[:4] + ['…'] * (len(names) > 4)}" if names else "is an empty folder"
