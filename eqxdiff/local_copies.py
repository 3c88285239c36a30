"""Files in a bucket for readers that need a local file (ArrayRecord's random access, an image folder's listing, a
weights folder's loaders), and local files written by such writers that belong in a bucket.

`local_copy(url)` mirrors an object, or every object under a prefix, into the cache folder
`$EQXDIFF_CACHE` (default `~/.cache/eqxdiff`) at `SCHEME/BUCKET/KEY`, so the same URL always lands in the same
place; a file is fetched again only when its object changed (a hash of the object's metadata as the listing
gives it — checksum, generation, size — is kept in a manifest beside the copy); `local_copies_matching(pattern)`
copies the objects a glob URL matches.
`upload(local, path)` puts a local file at `path`, as one object when it is a URL.
"""

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from eqxdiff.paths import as_path, is_url, write_whole

MANIFEST_SUFFIX = ".fetched.json"  # beside a copy: {relative file name: the object's ukey when fetched}


def cache_root() -> Path:
    """Where bucket objects are copied: $EQXDIFF_CACHE, or ~/.cache/eqxdiff."""
    return Path(os.environ.get("EQXDIFF_CACHE") or "~/.cache/eqxdiff").expanduser()


def local_copy(path: str | os.PathLike) -> Path:
    """`path` itself when local; for a URL naming an object or a prefix (a folder), its local copy under
    `cache_root()`, brought up to date: a missing or changed file is fetched, a file gone from the bucket removed.
    A URL that names nothing raises FileNotFoundError naming it."""
    if not is_url(path):
        return Path(path).expanduser()
    import fsspec

    fs, key = fsspec.core.url_to_fs(str(path))
    key = key.rstrip("/")
    scheme = str(path).partition("://")[0]
    copy = cache_root() / scheme / key
    if fs.isdir(key):  # one listing gives every object's metadata: no request per file
        remote = {os.path.relpath(f, key): (f, info) for f, info in fs.find(key, detail=True).items()}
    elif fs.isfile(key):
        remote = {"": (key, fs.info(key))}
    else:
        raise FileNotFoundError(f"{path}: no such object or prefix in the bucket")
    manifest_path = copy.with_name(copy.name + MANIFEST_SUFFIX)
    manifest = json.loads(manifest_path.read_text()) if manifest_path.is_file() else {}
    for name in set(manifest) - set(remote):  # deleted in the bucket since the last copy
        (copy / name).unlink(missing_ok=True)
        manifest.pop(name)
    try:
        for name, (remote_key, info) in sorted(remote.items()):
            local = copy / name if name else copy
            ukey = hashlib.sha256(json.dumps(info, sort_keys=True, default=str).encode()).hexdigest()
            if manifest.get(name) == ukey and local.is_file():
                continue
            local.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=local.parent, prefix=f".{local.name}.", suffix=".part")
            os.close(fd)
            try:
                fs.get_file(remote_key, tmp)
                os.replace(tmp, local)  # a reader on this host never sees half a file
            except BaseException:
                os.unlink(tmp)
                raise
            manifest[name] = ukey
    finally:  # once, not per file (a folder of n images: n rewrites of an n-line manifest); kept if interrupted
        manifest_path.parent.mkdir(parents=True, exist_ok=True)
        write_whole(manifest_path, json.dumps(manifest, indent=1))  # processes of one host may copy at once
    return copy


def local_copies_matching(pattern: str) -> list[Path]:
    """The local copies (`local_copy`) of the objects a glob URL (`gs://BUCKET/data/train-*.array_record`) matches,
    in name order; [] when none does (also when the bucket does not exist)."""
    import fsspec

    fs, key = fsspec.core.url_to_fs(pattern)
    scheme = pattern.partition("://")[0]
    try:
        matches = fs.glob(key, detail=True)
    except FileNotFoundError:  # gcsfs's for a missing bucket names only its API path ("b/NAME/o")
        return []
    return [local_copy(f"{scheme}://{name}") for name, info in sorted(matches.items()) if info["type"] == "file"]


def canonical(path: str | os.PathLike) -> str:
    """What names `path` wherever it is read from: a URL as given, a local path absolute."""
    return str(path) if is_url(path) else str(Path(path).expanduser().resolve())


def upload(local: Path, path: str | os.PathLike) -> None:
    """Put the local file `local` at `path`: one upload for a URL (the object appears whole or not at all), a copy
    and a rename on disk."""
    path = as_path(path)
    if is_url(path):
        import fsspec

        fs, key = fsspec.core.url_to_fs(str(path))
        fs.put_file(str(local), key)
        return
    tmp = path.with_name(f".{path.name}.part")
    shutil.copyfile(local, tmp)
    os.replace(tmp, path)
