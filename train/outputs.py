"""Where a script writes, checked before its long part: a dataset through Inception or an encoder, a
sampling run or a training run must not end in a traceback because a folder is missing or read-only.
Each check refuses in one line (a SystemExit with a message: status 2, train/startup.py)."""

import secrets
import tempfile
from pathlib import Path

from eqxdiff.paths import as_path, is_url, url_error


def nearest_existing(path: Path) -> Path:
    """`path` or the closest of its parents that exists."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def check_writable(path: str | Path, flag: str, *, folder: bool = False, create: bool = True) -> Path:
    """The expanded `path` (a file, or with `folder` a directory), once a file can be written where it
    goes. `create`: make the folders it lies in now (what the script would make at the end anyway);
    else (a run directory, made only once the run starts) only the nearest existing one is tried,
    so a refused command leaves nothing behind. A temporary file is written and removed: the test
    that also holds for root and for read-only mounts, where permission bits do not tell. A URL
    (gs://BUCKET/KEY) is checked the same way in its bucket (`check_bucket_writable`)."""
    if is_url(path):
        return check_bucket_writable(path, flag, folder=folder)
    path = Path(path).expanduser()
    target = path if folder else path.parent
    if path.is_dir() and not folder:
        raise SystemExit(f"{flag} {path} is a folder: name a file inside it.")
    existing = nearest_existing(target)

    def refuse(where: Path, why) -> SystemExit:
        return SystemExit(f"{flag} {path}: cannot write into {where}: {why}; pass another {flag} (or make that "
                          "folder writable).")  # fmt: skip

    if not existing.is_dir():
        raise refuse(existing, "it is a file, not a folder")
    probe = target if create else existing
    try:
        if create:
            target.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=probe):
            pass
    except OSError as e:
        raise refuse(probe, e.strerror or e) from e
    return path


def check_bucket_writable(url: str, flag: str, *, folder: bool = False):
    """The epath.Path of `url` (a file, or with `folder` a prefix), once an object can be written where it goes:
    one empty object written and deleted, so that a missing bucket, a bad name or missing credentials is one line
    before anything loads, and nothing is written on the local disk instead."""
    if error := url_error(url):
        raise SystemExit(f"{flag} {error}; pass another {flag}.")
    path = as_path(url)
    scheme, _, rest = str(url).partition("://")
    bucket = rest.partition("/")[0]
    probe = (path if folder else path.parent) / f".write-probe-{secrets.token_hex(4)}"
    try:
        probe.write_text("")
        probe.unlink()
    except FileNotFoundError as e:  # gcsfs's answer to a missing bucket names only the request
        raise SystemExit(f"{flag} {url}: no bucket {scheme}://{bucket} (or no access to it); create it or pass "
                         f"another {flag}.") from e  # fmt: skip
    except Exception as e:  # the client libraries raise many kinds (HTTP, credentials, network)
        raise SystemExit(f"{flag} {url}: cannot write into {scheme}://{bucket}: {type(e).__name__}: {e}; check the "
                         f"bucket and the credentials, or pass another {flag}.") from e  # fmt: skip
    return path
