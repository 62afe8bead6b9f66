"""Megatron-LM's memory-mapped indexed dataset (``PREFIX.bin`` + ``PREFIX.idx``), byte for byte.

Layout of ``PREFIX.idx`` (all little endian)::

    magic            9 bytes   b"MMIDIDX\\x00\\x00"
    version          <Q        1
    dtype code       <B        1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64, 7 float32, 8 uint16
    sequence count   <Q        S
    document count   <Q        D  (= number of documents + 1)
    sequence_lengths int32[S]  tokens per sequence
    sequence_ptrs    int64[S]  byte offset of each sequence in PREFIX.bin
    document_indices int64[D]  0, then the end (exclusive sequence index) of every document
    [sequence_modes  int8[S]]  only in megatron's "multimodal" variant; accepted on read

``PREFIX.bin`` is the raw concatenation of all sequences in the dtype above.
We write one sequence per document (megatron's ``add_item`` + ``end_document``), so for our
files "sequence" and "document" coincide; the reader handles the general case.

Every inconsistency raises :class:`IndexedDatasetError` naming the file and the problem:
a memory-mapped read must never silently return bytes that belong to something else.
"""

from __future__ import annotations

import errno
import os
import struct
from array import array
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from megaflex.hashing import sha256_file

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER_SIZE = 9 + 8 + 1 + 8 + 8  # magic, version, dtype code, sequence count, document count
DTYPE_CODES: dict[int, type[np.number]] = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}
_CODE_OF = {np.dtype(t): c for c, t in DTYPE_CODES.items()}


class DataError(ValueError):
    """Data that cannot be trained or evaluated on (corrupt files, ids outside the vocabulary,
    a tokenizer other than the one the data or checkpoint was made with)."""


class IndexedDatasetError(DataError):
    """A ``.bin``/``.idx`` pair is missing, corrupt or inconsistent."""


def why_not_a_file(path: str | os.PathLike) -> str:
    """Why ``path`` is not a readable regular file: a directory, a symbolic-link loop, a broken
    link, something else (a socket, a device) or simply absent."""
    if os.path.islink(path):
        try:
            os.stat(path)
        except OSError as e:
            if e.errno == errno.ELOOP:
                return "is a symbolic link loop (the link points back to itself through other links)"
            return f"is a broken symbolic link to {os.readlink(path)!r}"
    if os.path.isdir(path):
        return "is a directory, not a file"
    if os.path.exists(path):
        return "is not a regular file"
    return "file not found"


def _directory_hint(prefix: str | os.PathLike) -> str:
    if not os.path.isdir(prefix):
        return ""
    pairs = sorted(n[:-4] for n in os.listdir(prefix) if n.endswith(".idx"))[:3]
    return (f"; {os.fspath(prefix)} is a directory: give the path of the data without its extension"
            + (f", e.g. {os.path.join(prefix, pairs[0])}" if pairs else ""))


def index_file_path(prefix: str | os.PathLike) -> str:
    return f"{os.fspath(prefix)}.idx"


def data_file_path(prefix: str | os.PathLike) -> str:
    return f"{os.fspath(prefix)}.bin"


def dtype_code(dtype: np.dtype | type) -> int:
    """Megatron's numeric code for a token dtype."""
    dt = np.dtype(dtype)
    if dt not in _CODE_OF:
        raise ValueError(f"dtype: expected one of {sorted(str(np.dtype(t)) for t in DTYPE_CODES.values())}, got {dt}")
    return _CODE_OF[dt]


def optimal_dtype(vocab_size: int) -> np.dtype:
    """uint16 when the vocabulary fits, else int32 (megatron-core's ``DType.optimal_dtype`` rule:
    cardinality < 65500 -> uint16), so our files are byte-identical to megatron's for the same tokens."""
    if vocab_size <= 0:
        raise ValueError(f"vocab_size: expected a positive integer, got {vocab_size}")
    return np.dtype(np.uint16) if vocab_size < 65500 else np.dtype(np.int32)


def check_vocab_fits(vocab_size: int, dtype: np.dtype | type) -> None:
    """Raise if token ids ``0..vocab_size-1`` cannot be represented in ``dtype``."""
    dt = np.dtype(dtype)
    if dt.kind not in "iu":
        raise ValueError(f"dtype: token files need an integer dtype, got {dt}")
    if vocab_size - 1 > np.iinfo(dt).max:
        raise ValueError(
            f"dtype: a vocabulary of {vocab_size} tokens does not fit {dt} (max id {np.iinfo(dt).max}); "
            f"use int32 or omit the dtype to choose automatically"
        )


class IndexedDataset:
    """Zero-copy reader: ``ds[i]`` / ``ds.get(i, offset, length)`` return read-only numpy views
    into the memory-mapped ``.bin`` (nothing is read until the view is used).

    Opening checks everything that is O(1) (header, counts vs. file sizes, total tokens vs. ``.bin``
    size, document indices bounds); :meth:`verify` adds the structural checks, one vectorised pass
    over the index (lengths non-negative, pointers monotone and equal to the running sum of the
    sizes, last pointer + size = ``.bin`` length, document indices monotone), and
    :meth:`check_token_sample` reads a bounded random sample of token ids. Training runs both
    (about a second for a 1B-token index, see ``benchmarks/data.py``);
    ``data_prep.inspect --verify`` adds a scan of every token id.
    """

    def __init__(self, prefix: str | os.PathLike, verify: bool = False) -> None:
        self.prefix = os.fspath(prefix)
        self._open()
        if verify:
            self.verify()

    # ------------------------------------------------------------------ opening
    def _open(self) -> None:
        idx_path, bin_path = index_file_path(self.prefix), data_file_path(self.prefix)
        for p in (idx_path, bin_path):
            if not os.path.isfile(p):
                raise IndexedDatasetError(f"{p}: {why_not_a_file(p)} (prefix {self.prefix!r}{_directory_hint(self.prefix)})")
        idx_size = os.path.getsize(idx_path)
        if idx_size < HEADER_SIZE:
            raise IndexedDatasetError(f"{idx_path}: {idx_size} bytes is shorter than the {HEADER_SIZE}-byte header")
        with open(idx_path, "rb") as f:
            header = f.read(HEADER_SIZE)
        magic = header[:9]
        if magic != MAGIC:
            raise IndexedDatasetError(f"{idx_path}: wrong magic {magic!r}, expected {MAGIC!r} (not a megatron .idx file)")
        (version,) = struct.unpack("<Q", header[9:17])
        if version != VERSION:
            raise IndexedDatasetError(f"{idx_path}: unknown version {version}, expected {VERSION}")
        code = header[17]
        if code not in DTYPE_CODES:
            raise IndexedDatasetError(f"{idx_path}: unknown dtype code {code}, expected one of {sorted(DTYPE_CODES)}")
        self.dtype = np.dtype(DTYPE_CODES[code])
        seq_count, doc_count = struct.unpack("<QQ", header[18:34])
        body = idx_size - HEADER_SIZE
        expected = 12 * seq_count + 8 * doc_count
        if body == expected:
            multimodal = False
        elif body == expected + seq_count:
            multimodal = True  # megatron's optional int8 sequence modes follow the document indices
        else:
            raise IndexedDatasetError(
                f"{idx_path}: header says {seq_count} sequences and {doc_count} document indices "
                f"({HEADER_SIZE + expected} bytes) but the file has {idx_size} bytes"
            )
        self._idx_mmap = np.memmap(idx_path, mode="r", dtype=np.uint8)
        off = HEADER_SIZE
        self.sequence_lengths = np.frombuffer(self._idx_mmap, np.int32, seq_count, off)
        off += 4 * seq_count
        self.sequence_pointers = np.frombuffer(self._idx_mmap, np.int64, seq_count, off)
        off += 8 * seq_count
        self.document_indices = np.frombuffer(self._idx_mmap, np.int64, doc_count, off)
        off += 8 * doc_count
        self.sequence_modes = np.frombuffer(self._idx_mmap, np.int8, seq_count, off) if multimodal else None

        if doc_count == 0 or self.document_indices[0] != 0 or self.document_indices[-1] != seq_count:
            first = self.document_indices[0] if doc_count else None
            last = self.document_indices[-1] if doc_count else None
            raise IndexedDatasetError(
                f"{idx_path}: document indices must start at 0 and end at the sequence count {seq_count}, "
                f"got first={first} last={last} ({doc_count} entries)"
            )
        self.num_tokens = int(self.sequence_lengths.sum(dtype=np.int64))
        bin_size = os.path.getsize(bin_path)
        expected_bin = self.num_tokens * self.dtype.itemsize
        if bin_size < expected_bin:
            raise IndexedDatasetError(
                f"{bin_path}: truncated: the index describes {self.num_tokens} tokens ({expected_bin} bytes) "
                f"but the file has {bin_size} bytes"
            )
        if bin_size > expected_bin:
            raise IndexedDatasetError(
                f"{bin_path}: {bin_size - expected_bin} bytes more than the {expected_bin} the index describes "
                f"(index and data files do not belong together?)"
            )
        if seq_count and int(self.sequence_pointers[-1]) + int(self.sequence_lengths[-1]) * self.dtype.itemsize > bin_size:
            raise IndexedDatasetError(f"{idx_path}: last sequence pointer points past the end of {bin_path} ({bin_size} bytes)")
        self._bin_size = bin_size
        # np.memmap cannot map an empty file; an empty view keeps the read path uniform.
        self._bin = np.memmap(bin_path, mode="r", dtype=np.uint8) if bin_size else np.zeros(0, np.uint8)

    def verify(self) -> None:
        """Structural check (one vectorised pass over the index); raises :class:`IndexedDatasetError`."""
        idx_path, bin_path = index_file_path(self.prefix), data_file_path(self.prefix)
        lengths = self.sequence_lengths.astype(np.int64)
        if len(lengths) and lengths.min() < 0:
            i = int(np.argmin(lengths))
            raise IndexedDatasetError(f"{idx_path}: sequence {i} has negative length {lengths[i]}")
        # Pointers equal to the running sum of the sizes are monotone and leave no gap or overlap.
        expected = np.zeros(len(lengths), np.int64)
        if len(lengths) > 1:
            np.cumsum(lengths[:-1] * self.dtype.itemsize, out=expected[1:])
        bad = np.flatnonzero(expected != self.sequence_pointers)
        if len(bad):
            i = int(bad[0])
            raise IndexedDatasetError(
                f"{idx_path}: {len(bad)} sequence pointers disagree with the sequence sizes; first is sequence {i}: "
                f"pointer {int(self.sequence_pointers[i])}, expected {int(expected[i])} "
                f"({bin_path} has {self._bin_size} bytes); the index is corrupt, re-run data_prep.preprocess"
            )
        if len(lengths):
            end = int(self.sequence_pointers[-1]) + int(lengths[-1]) * self.dtype.itemsize
            if end != self._bin_size:
                raise IndexedDatasetError(
                    f"{idx_path}: last sequence pointer + size = {end} bytes, but {bin_path} has {self._bin_size} bytes"
                )
        steps = np.diff(self.document_indices)
        if len(steps) and steps.min() < 0:
            i = int(np.flatnonzero(steps < 0)[0]) + 1
            raise IndexedDatasetError(f"{idx_path}: document indices decrease at entry {i}")

    def check_token_sample(self, vocab_size: int, num_sequences: int = 256, tokens_per_sequence: int = 256,
                           seed: int = 0) -> None:
        """Raise if any token id in a bounded, seeded sample is >= ``vocab_size``.

        Reads at most ``num_sequences`` random sequences (plus the first and the last), up to
        ``tokens_per_sequence`` tokens from a random offset in each: a corrupt ``.bin`` or data made
        with a larger vocabulary shows up at open time, for the cost of a few hundred small reads."""
        if vocab_size < 1:
            raise ValueError(f"vocab_size: expected a positive integer, got {vocab_size}")
        n = len(self)
        if n == 0:
            return
        rng = np.random.default_rng(seed)
        picks = np.unique(np.concatenate([[0, n - 1], rng.integers(0, n, min(num_sequences, n))]))
        for i in picks:
            size = int(self.sequence_lengths[i])
            take = min(size, tokens_per_sequence)
            offset = int(rng.integers(0, size - take + 1))
            ids = self.get(int(i), offset, take)
            if take and (int(ids.max()) >= vocab_size or int(ids.min()) < 0):
                bad = int(ids.max()) if int(ids.max()) >= vocab_size else int(ids.min())
                raise IndexedDatasetError(
                    f"{data_file_path(self.prefix)}: sequence {int(i)} holds token id {bad}, outside the "
                    f"vocabulary [0, {vocab_size}) (model.vocab_size); the data was tokenized with a larger "
                    f"vocabulary or the file is corrupt"
                )

    # ------------------------------------------------------------------ reading
    def __len__(self) -> int:
        return len(self.sequence_lengths)

    @property
    def num_documents(self) -> int:
        return len(self.document_indices) - 1

    def get(self, idx: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens ``[offset, offset + length)`` of sequence ``idx`` as a read-only view (no copy)."""
        n = len(self)
        if not -n <= idx < n:
            raise IndexError(f"idx: sequence {idx} out of range for {n} sequences in {self.prefix}")
        idx = int(idx) % n
        seq_len = int(self.sequence_lengths[idx])
        if length is None:
            length = seq_len - offset
        if offset < 0 or length < 0 or offset + length > seq_len:
            raise IndexError(f"offset/length: [{offset}, {offset + length}) outside sequence {idx} of length {seq_len}")
        start = int(self.sequence_pointers[idx]) + offset * self.dtype.itemsize
        stop = start + length * self.dtype.itemsize
        if start < 0 or stop > self._bin_size:
            raise IndexedDatasetError(
                f"{index_file_path(self.prefix)}: sequence {idx} points to bytes [{start}, {stop}) "
                f"past the end of {data_file_path(self.prefix)} ({self._bin_size} bytes)"
            )
        return self._bin[start:stop].view(self.dtype)

    def __getitem__(self, idx: int) -> np.ndarray:
        return self.get(idx)

    def document(self, doc: int) -> np.ndarray:
        """All tokens of document ``doc`` (its sequences concatenated; a view when it has one)."""
        lo, hi = int(self.document_indices[doc]), int(self.document_indices[doc + 1])
        if hi - lo == 1:
            return self.get(lo)
        return np.concatenate([self.get(i) for i in range(lo, hi)]) if hi > lo else np.zeros(0, self.dtype)

    def index_sha256(self) -> str:
        """sha256 of the ``.idx`` file (cached): identifies everything sample indices depend on."""
        if getattr(self, "_idx_sha256", None) is None:
            self._idx_sha256 = sha256_file(index_file_path(self.prefix))
        return self._idx_sha256

    def __getstate__(self) -> dict:
        # Re-map in the receiving process (DataLoader workers) instead of pickling the mapping.
        return {"prefix": self.prefix}

    def __setstate__(self, state: dict) -> None:
        self.prefix = state["prefix"]
        self._open()

    def __repr__(self) -> str:
        return (
            f"IndexedDataset({self.prefix!r}, sequences={len(self)}, documents={self.num_documents}, "
            f"tokens={self.num_tokens}, dtype={self.dtype})"
        )


class IndexedDatasetBuilder:
    """Streaming writer of ``PREFIX.bin``/``PREFIX.idx``.

    Tokens go straight to disk; only 12 bytes per sequence (+8 per document) stay in memory, so a
    corpus larger than RAM streams through. Files are written as ``*.tmp`` and renamed on
    :meth:`finalize`, so an interrupted run never leaves a valid-looking pair behind.
    """

    def __init__(self, prefix: str | os.PathLike, dtype: np.dtype | type = np.uint16, vocab_size: int | None = None) -> None:
        self.prefix = os.fspath(prefix)
        self.dtype = np.dtype(dtype)
        dtype_code(self.dtype)  # validates
        if vocab_size is not None:
            check_vocab_fits(vocab_size, self.dtype)
        self.vocab_size = vocab_size
        Path(self.prefix).parent.mkdir(parents=True, exist_ok=True)
        self._bin = open(data_file_path(self.prefix) + ".tmp", "wb")
        self._lengths = array("i")  # int32, as in the file
        self._doc_indices = array("q", [0])
        self._info = np.iinfo(self.dtype) if self.dtype.kind in "iu" else None

    def add_item(self, tokens: Sequence[int] | np.ndarray) -> None:
        """Append one sequence (call :meth:`end_document` to close the document)."""
        arr = np.asarray(tokens)
        if arr.ndim != 1:
            raise ValueError(f"tokens: expected a 1-D sequence, got shape {arr.shape}")
        if arr.size and self._info is not None:
            lo, hi = int(arr.min()), int(arr.max())
            limit = self._info.max if self.vocab_size is None else self.vocab_size - 1
            if lo < max(self._info.min, 0) or hi > limit:
                raise ValueError(f"tokens: ids must lie in [0, {limit}] for dtype {self.dtype}, got range [{lo}, {hi}]")
        if arr.size > np.iinfo(np.int32).max:
            raise ValueError(f"tokens: a sequence of {arr.size} tokens exceeds the int32 length field")
        self._bin.write(arr.astype(self.dtype, copy=False).tobytes())
        self._lengths.append(arr.size)

    def end_document(self) -> None:
        self._doc_indices.append(len(self._lengths))

    def add_document(self, tokens: Sequence[int] | np.ndarray) -> None:
        """Append one document stored as one sequence."""
        self.add_item(tokens)
        self.end_document()

    def add_index(self, prefix: str | os.PathLike) -> None:
        """Append a whole existing dataset (used by merge); its dtype must match."""
        other = IndexedDataset(prefix)
        if other.dtype != self.dtype:
            raise ValueError(f"prefix: {prefix} has dtype {other.dtype}, the output has {self.dtype}; cannot concatenate")
        base = len(self._lengths)
        self._lengths.frombytes(np.ascontiguousarray(other.sequence_lengths).tobytes())
        self._doc_indices.frombytes((other.document_indices[1:] + base).astype(np.int64).tobytes())
        with open(data_file_path(prefix), "rb") as f:
            while chunk := f.read(1 << 24):
                self._bin.write(chunk)

    @property
    def num_documents(self) -> int:
        return len(self._doc_indices) - 1

    def finalize(self) -> None:
        """Write the ``.idx`` and move both files into place."""
        if self._doc_indices[-1] != len(self._lengths):
            self.end_document()  # trailing add_item calls without end_document form one document
        self._bin.close()
        lengths = np.frombuffer(self._lengths, dtype=np.int32) if len(self._lengths) else np.zeros(0, np.int32)
        pointers = np.zeros(len(lengths), np.int64)
        if len(lengths) > 1:
            np.cumsum(lengths[:-1].astype(np.int64) * self.dtype.itemsize, out=pointers[1:])
        doc_idx = np.frombuffer(self._doc_indices, dtype=np.int64)
        idx_tmp = index_file_path(self.prefix) + ".tmp"
        with open(idx_tmp, "wb") as f:
            f.write(MAGIC)
            f.write(struct.pack("<Q", VERSION))
            f.write(struct.pack("<B", dtype_code(self.dtype)))
            f.write(struct.pack("<Q", len(lengths)))
            f.write(struct.pack("<Q", len(doc_idx)))
            f.write(lengths.tobytes())
            f.write(pointers.tobytes())
            f.write(doc_idx.tobytes())
        os.replace(data_file_path(self.prefix) + ".tmp", data_file_path(self.prefix))
        os.replace(idx_tmp, index_file_path(self.prefix))

    def __enter__(self) -> "IndexedDatasetBuilder":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.finalize()
        else:  # leave nothing half-written behind
            self._bin.close()
            for p in (data_file_path(self.prefix) + ".tmp", index_file_path(self.prefix) + ".tmp"):
                if os.path.exists(p):
                    os.remove(p)


def merge_datasets(prefixes: Iterable[str | os.PathLike], output_prefix: str | os.PathLike) -> IndexedDataset:
    """Concatenate several datasets (e.g. preprocessing shards) into ``output_prefix``."""
    prefixes = [os.fspath(p) for p in prefixes]
    if not prefixes:
        raise ValueError("prefixes: expected at least one dataset prefix to merge, got none")
    first = IndexedDataset(prefixes[0])
    with IndexedDatasetBuilder(output_prefix, dtype=first.dtype) as builder:
        for p in prefixes:
            builder.add_index(p)
    return IndexedDataset(output_prefix)
