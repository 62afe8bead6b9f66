"""Small indexed datasets written by tests of the data, training and failure-mode packages."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from megaflex.data import IndexedDataset, IndexedDatasetBuilder
from megaflex.data.indexed import HEADER_SIZE


def write_docs(prefix: Path, n_docs: int, vocab: int, seed: int = 0) -> IndexedDataset:
    rng = np.random.default_rng(seed)
    with IndexedDatasetBuilder(prefix, dtype=np.uint16) as b:
        for _ in range(n_docs):
            b.add_document(rng.integers(0, vocab, int(rng.integers(5, 60))))
    return IndexedDataset(prefix)


def shift_pointers(prefix: Path, shift: int, which: slice) -> None:
    """Add ``shift`` bytes to the sequence pointers ``which`` of ``prefix.idx`` in place."""
    n = len(IndexedDataset(prefix))
    with open(f"{prefix}.idx", "r+b") as f:
        f.seek(HEADER_SIZE + 4 * n)
        pointers = np.frombuffer(f.read(8 * n), np.int64).copy()
        pointers[which] += shift
        f.seek(HEADER_SIZE + 4 * n)
        f.write(pointers.tobytes())


def make_dataset(prefix: Path, n_docs: int, seed: int, base: int = 0, max_len: int = 40) -> IndexedDataset:
    """Documents of random length whose tokens are unique stream positions (base, base+1, ...),
    so every sample identifies exactly which tokens it holds."""
    rng = np.random.default_rng(seed)
    pos = base
    with IndexedDatasetBuilder(prefix, dtype=np.int32) as b:
        for _ in range(n_docs):
            n = int(rng.integers(1, max_len))
            b.add_document(np.arange(pos, pos + n))
            pos += n
    return IndexedDataset(prefix)
