"""File helpers shared by the packages: content hashes (remembered by file stat), atomic writes."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

PUBLIC_FILE_MODE = 0o644  # temporary files are created 0600; what we write is for everyone to read


def file_sha256(path: Path, chunk_bytes: int = 1 << 22) -> str:
    """Hex SHA-256 of a file, read in chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as stream:
        while chunk := stream.read(chunk_bytes):
            digest.update(chunk)
    return digest.hexdigest()


def remembered_digest(kind: str, paths: Sequence[Path], compute: Callable[[], str]) -> str:
    """`compute()`, a digest of the files `paths`, remembered across processes while none of them changes.

    Opening an engine directory checks every file's SHA-256 (1.4 GB for the embedded default: ~1.1 s on a
    2-core EPYC, at every `generate`). As git's index does, the result is kept beside the files' stat
    (resolved path, size, mtime and ctime in ns, inode) under `cache_dir()/digests/`; while the stat is
    unchanged the digest is returned unread, and any write to a file (which moves its ctime, whatever
    is done to its mtime) makes the next call hash it again. An unwritable cache only costs the hashing.

    Args:
        kind: what the digest is (part of the key: the same files hashed two ways keep two entries).
        paths: the files `compute` reads.
        compute: the digest, computed when no entry matches.
    """
    from blockpilot.assets.packages import cache_dir

    stats = []
    for path in paths:
        st = Path(path).stat()
        stats.append([str(Path(path).resolve()), st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino])
    key = json.dumps([kind, stats])
    entry = cache_dir() / "digests" / hashlib.sha256(key.encode()).hexdigest()[:32]
    try:
        stored = json.loads(entry.read_text())
        if stored.get("key") == key and isinstance(stored.get("digest"), str):
            return stored["digest"]
    except (OSError, ValueError):
        pass
    digest = compute()
    try:
        write_text_atomic(entry, json.dumps({"key": key, "digest": digest}))
        _prune_digests(entry.parent)
    except OSError:
        pass
    return digest


def remembered_file_sha256(path: Path) -> str:
    """`file_sha256(path)`, remembered while the file's stat is unchanged (`remembered_digest`)."""
    return remembered_digest("sha256", [path], lambda: file_sha256(path))


DIGESTS_KEPT = 1000
"""Above this many remembered digests, those of files that are gone or changed are removed."""


def _prune_digests(folder: Path) -> None:
    entries = list(folder.iterdir())
    if len(entries) <= DIGESTS_KEPT:
        return
    for entry in entries:
        try:
            for path, size, mtime_ns, ctime_ns, inode in json.loads(json.loads(entry.read_text())["key"])[1]:
                st = os.stat(path)
                if [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino] != [size, mtime_ns, ctime_ns, inode]:
                    raise ValueError(path)
        except (OSError, ValueError, KeyError, TypeError):
            entry.unlink(missing_ok=True)


def check_out_path(path: Path, flag: str) -> None:
    """Raise `UserError` when `path` (a command's output) could not be created where it is: the nearest folder
    on its way that exists is a file, or cannot be written."""
    from blockpilot.errors import UserError

    parent = nearest_existing(Path(path).parent)  # a relative path ends at "."
    if parent is None:
        return
    if not parent.is_dir():
        raise UserError(f"{flag} {path}: {parent} is a file, not a folder; choose another {flag}")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UserError(f"{flag} {path}: cannot write in {parent}; choose another {flag} or make it writable")


def nearest_existing(path: Path) -> Path | None:
    """`path` itself or the nearest of its parents that exists (None: none does)."""
    return next((p for p in (Path(path), *Path(path).parents) if p.exists()), None)


def write_text_atomic(path: Path, text: str) -> None:
    """Write `text` to `path` through a temporary file in the same directory and a rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as stream:
            stream.write(text)
        os.chmod(tmp, PUBLIC_FILE_MODE)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


@contextmanager
def staged_directory(out_dir: Path, replace: bool = False) -> Iterator[Path]:
    """Yield an empty sibling directory of `out_dir` to fill; on success it is renamed to `out_dir`
    (which `replace=True` removes first), on any error it is removed: `out_dir` appears complete or
    not at all."""
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        yield tmp
        if replace and out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
