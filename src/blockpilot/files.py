"""File helpers shared by the packages: content hashes."""

from __future__ import annotations

import hashlib
from pathlib import Path


def file_sha256(path: Path, chunk_bytes: int = 1 << 22) -> str:
    """Hex SHA-256 of a file, read in chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as stream:
        while chunk := stream.read(chunk_bytes):
            digest.update(chunk)
    return digest.hexdigest()
