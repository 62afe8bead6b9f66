"""SHA-256 of a file, the one hasher behind checkpoint manifests, tokenizer identities, data
indices and input fingerprints (bottom layer: imports nothing from megaflex)."""

from __future__ import annotations

import hashlib
import os

_CHUNK = 8 << 20  # bytes read per update: large enough that hashing runs at disk/memory speed


def sha256_file(path: str | os.PathLike) -> str:
    """Hex SHA-256 of the file's bytes, read in chunks (hashlib releases the GIL while hashing)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()
