"""Where a script writes, checked before its long part: a dataset through Inception or an encoder, a
sampling run or a training run must not end in a traceback because a folder is missing or read-only.
Each check refuses in one line (a SystemExit with a message: status 2, train/startup.py)."""

import tempfile
from pathlib import Path


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
    that also holds for root and for read-only mounts, where permission bits do not tell."""
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
