"""GPT training samples over an :class:`IndexedDataset`, with Megatron's three indices.

For one split (a contiguous range of documents) and ``num_samples`` samples of ``seq_len + 1``
tokens (sample *i* covers stream positions ``[i*seq_len, (i+1)*seq_len]``, so consecutive
samples overlap by one token — the next-token target of the last input):

* ``doc_idx``     int32/int64[E * D]: the split's document ids, independently shuffled in each of
  the E epochs needed (an epoch is a permutation, so every document appears once per epoch);
* ``sample_idx``  int64[num_samples, 2]: (position in doc_idx, token offset) where each sample
  starts in the concatenated document stream;
* ``shuffle_idx`` int64[num_samples]: the order samples are served in.

One ``numpy.random.RandomState(seed)`` drives both shuffles. As in Megatron, when the last epoch
is needed for < 80% of its samples it is shuffled separately (documents and samples), so the
partial epoch is a uniform subset rather than the head of a joint shuffle.

Everything is vectorised numpy (searchsorted over cumulative lengths — no compiled helper).
Indices are cached as ``.npy`` under ``cache_dir/<sha256 of everything that determines them>``:
the builder rank writes them (atomically, description last), the caller's ``barrier`` runs, and
every rank memory-maps them.
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from megaflex.data.indexed import DataError, IndexedDataset

SPLIT_NAMES = ("train", "valid", "test")
INDEX_VERSION = 1  # bump when the index algorithm changes, invalidating every cache
_FINAL_EPOCH_THRESHOLD = 0.8


def parse_split(split: str | Sequence[float]) -> list[float]:
    """``"949,50,1"`` (or ``"0.9, 0.1"`` or a sequence) -> normalised [train, valid, test] weights."""
    if isinstance(split, str):
        try:
            parts = [float(s) for s in split.replace("/", ",").split(",") if s.strip()]
        except ValueError:
            raise ValueError(f"split: expected comma-separated numbers like '949,50,1', got {split!r}") from None
    else:
        parts = [float(s) for s in split]
    if not 1 <= len(parts) <= 3 or any(p < 0 for p in parts) or sum(parts) <= 0:
        raise ValueError(f"split: expected 1-3 non-negative weights with a positive sum, got {split!r}")
    parts += [0.0] * (3 - len(parts))
    total = sum(parts)
    return [p / total for p in parts]


def split_ranges(num_docs: int, split: str | Sequence[float]) -> dict[str, tuple[int, int]]:
    """Document ranges per split, rounded as Megatron does (the rounding error goes to the last)."""
    weights = parse_split(split)
    bounds = [0]
    for w in weights:
        bounds.append(bounds[-1] + int(round(w * num_docs)))
    diff = bounds[-1] - num_docs
    bounds = [bounds[0]] + [b - diff for b in bounds[1:]]
    return {name: (bounds[i], bounds[i + 1]) for i, name in enumerate(SPLIT_NAMES)}


@dataclass(frozen=True)
class GPTIndices:
    doc_idx: np.ndarray
    sample_idx: np.ndarray
    shuffle_idx: np.ndarray


def _int_dtype(max_value: int) -> type:
    return np.int32 if max_value < np.iinfo(np.int32).max else np.int64


def build_indices(
    doc_ids: np.ndarray, doc_lengths: np.ndarray, seq_len: int, num_samples: int | None, seed: int
) -> GPTIndices:
    """Build (doc_idx, sample_idx, shuffle_idx); ``doc_lengths[k]`` is the length of ``doc_ids[k]``.

    ``num_samples=None`` means exactly one epoch (every available sample once, no repeats).
    """
    doc_ids = np.asarray(doc_ids)
    if len(doc_ids) != len(doc_lengths):
        raise ValueError(f"doc_lengths: expected {len(doc_ids)} lengths (one per document), got {len(doc_lengths)}")
    doc_lengths = np.asarray(doc_lengths, dtype=np.int64)
    if seq_len < 1:
        raise ValueError(f"seq_len: expected a positive integer, got {seq_len}")
    tokens_per_epoch = int(doc_lengths.sum())
    per_epoch = (tokens_per_epoch - 1) // seq_len  # each sample needs seq_len + 1 tokens
    if per_epoch < 1:
        raise ValueError(
            f"seq_len: {seq_len} (+1 target token) is longer than the whole split ({tokens_per_epoch} tokens "
            f"in {len(doc_ids)} documents)"
        )
    if num_samples is None:
        num_samples = per_epoch
    if num_samples < 1:
        raise ValueError(f"num_samples: expected a positive integer or None, got {num_samples}")
    num_epochs = 1
    while (num_epochs * tokens_per_epoch - 1) // seq_len < num_samples:
        num_epochs += 1
    samples_sans_final = ((num_epochs - 1) * tokens_per_epoch - 1) // seq_len if num_epochs > 1 else 0
    separate_final = num_epochs > 1 and (num_samples - samples_sans_final) < _FINAL_EPOCH_THRESHOLD * per_epoch

    rng = np.random.RandomState(seed)
    # Document index: one independent permutation of the split per epoch (as positions 0..D-1).
    n_docs = len(doc_ids)
    local = np.empty(num_epochs * n_docs, dtype=_int_dtype(n_docs))
    for e in range(num_epochs):
        local[e * n_docs : (e + 1) * n_docs] = rng.permutation(n_docs)
    doc_idx = doc_ids[local]

    # Sample index: sample i starts at stream position i*seq_len; find its document by binary search.
    lengths = doc_lengths[local]  # length of each doc_idx entry
    del local
    ends = np.cumsum(lengths)  # exclusive end position of each doc_idx entry in the stream
    starts = np.arange(num_samples, dtype=np.int64) * seq_len
    sample_doc = np.searchsorted(ends, starts, side="right")
    sample_off = starts - (ends[sample_doc] - lengths[sample_doc])
    del ends, lengths, starts
    sample_idx = np.stack([sample_doc, sample_off], axis=1).astype(np.int64)

    # Shuffle index: the partial final epoch (if separate) is shuffled among itself.
    if separate_final:
        shuffle_idx = np.concatenate(
            [rng.permutation(samples_sans_final), samples_sans_final + rng.permutation(num_samples - samples_sans_final)]
        )
    else:
        shuffle_idx = rng.permutation(num_samples)
    return GPTIndices(doc_idx, sample_idx, shuffle_idx.astype(np.int64))


class GPTDataset:
    """``ds[i]`` -> int64 array of ``seq_len + 1`` tokens (inputs ``[:-1]``, targets ``[1:]``).

    Args:
        dataset: a prefix or an open :class:`IndexedDataset`.
        split_name: "train" | "valid" | "test" — which document range of ``split`` to use.
        seq_len: tokens per training input.
        num_samples: samples to serve (more than one epoch repeats documents); None = one epoch.
        seed: seeds the document and sample shuffles.
        split: document-range weights, Megatron style ("949,50,1").
        cache_dir: where indices are cached; None builds them in memory (no caching). A cache entry
            that is truncated or unreadable is rebuilt by the builder (with a warning).
        is_builder: whether this process builds missing cached indices (e.g. global rank 0).
        barrier: called after building, before loading (e.g. ``torch.distributed.barrier``).
    """

    def __init__(
        self,
        dataset: str | os.PathLike | IndexedDataset,
        split_name: str,
        seq_len: int,
        num_samples: int | None = None,
        seed: int = 1234,
        split: str | Sequence[float] = "949,50,1",
        cache_dir: str | os.PathLike | None = None,
        is_builder: bool = True,
        barrier: Callable[[], None] | None = None,
    ) -> None:
        self.indexed = dataset if isinstance(dataset, IndexedDataset) else IndexedDataset(dataset)
        if split_name not in SPLIT_NAMES:
            raise ValueError(f"split_name: expected one of {SPLIT_NAMES}, got {split_name!r}")
        self.split_name, self.seq_len, self.seed = split_name, seq_len, seed
        self.split = parse_split(split)
        lo, hi = split_ranges(len(self.indexed), self.split)[split_name]
        if hi <= lo:
            raise DataError(
                f"split: the {split_name!r} split of {self.indexed.prefix} has zero documents "
                f"(split {split!r} over {len(self.indexed)} documents); raise its weight in data.split"
                + (" or give data.valid_path" if split_name == "valid" else "")
            )
        self.doc_range = (lo, hi)
        self.description = {
            "class": "GPTDataset", "version": INDEX_VERSION,
            "prefix": os.path.realpath(self.indexed.prefix),
            "idx_sha256": self.indexed.index_sha256(),
            "split": self.split, "split_name": split_name, "doc_range": [lo, hi],
            "seq_len": seq_len, "num_samples": num_samples, "seed": seed,
        }
        self.cache_hash = hashlib.sha256(json.dumps(self.description, sort_keys=True).encode()).hexdigest()[:32]
        self.built_indices = False  # True when this process built (not loaded) the indices
        self._cache_dir = cache_dir
        self.indices = self._load_or_build(num_samples, cache_dir, is_builder, barrier)
        self.num_samples = len(self.indices.shuffle_idx)

    # ------------------------------------------------------------------ indices
    def _build(self, num_samples: int | None) -> GPTIndices:
        lo, hi = self.doc_range
        ids = np.arange(lo, hi, dtype=_int_dtype(hi))
        lengths = self.indexed.sequence_lengths[lo:hi]
        self.built_indices = True
        try:
            return build_indices(ids, lengths, self.seq_len, num_samples, self.seed)
        except ValueError as e:
            raise ValueError(f"{self.indexed.prefix} [{self.split_name}]: {e}") from None

    def cache_paths(self, cache_dir: str | os.PathLike) -> dict[str, Path]:
        base = Path(cache_dir) / f"{self.cache_hash}-gpt-{self.split_name}"
        return {k: Path(f"{base}-{k}.npy") for k in ("doc_idx", "sample_idx", "shuffle_idx")} | {
            "description": Path(f"{base}-description.json")
        }

    def _load_or_build(
        self, num_samples: int | None, cache_dir, is_builder: bool, barrier: Callable[[], None] | None
    ) -> GPTIndices:
        if cache_dir is None:
            if barrier is not None:
                barrier()
            return self._build(num_samples)
        paths = self.cache_paths(cache_dir)
        if is_builder and paths["description"].is_file() and self._load_cached(paths) is None:
            warnings.warn(
                f"cache_dir: cached sample indices {paths['description'].parent}/{paths['description'].stem}* "
                f"for {self.indexed.prefix} [{self.split_name}] are unreadable or truncated; rebuilding them",
                stacklevel=2,
            )
            paths["description"].unlink()
        if is_builder and not paths["description"].is_file():
            indices = self._build(num_samples)
            Path(cache_dir).mkdir(parents=True, exist_ok=True)
            for key in ("doc_idx", "sample_idx", "shuffle_idx"):
                tmp = paths[key].with_suffix(f".tmp{os.getpid()}.npy")
                np.save(tmp, getattr(indices, key))
                os.replace(tmp, paths[key])
            # the description is written last: its presence marks a complete cache entry
            tmp = paths["description"].with_suffix(f".tmp{os.getpid()}")
            tmp.write_text(json.dumps(self.description, indent=2, sort_keys=True))
            os.replace(tmp, paths["description"])
        if barrier is not None:
            barrier()
        if not paths["description"].is_file():
            raise FileNotFoundError(
                f"cache_dir: no cached indices {paths['description']} for {self.indexed.prefix} [{self.split_name}]; "
                f"the is_builder process must build them before the barrier"
            )
        indices = self._load_cached(paths)
        if indices is None:
            raise ValueError(
                f"cache_dir: cached sample indices next to {paths['description']} are unreadable or truncated; "
                f"delete them (the builder rank rebuilds them)"
            )
        return indices

    @staticmethod
    def _load_cached(paths: dict[str, Path]) -> GPTIndices | None:
        """Memory-map a cache entry; None when a file is missing, truncated or inconsistent."""
        try:
            indices = GPTIndices(*(np.load(paths[k], mmap_mode="r") for k in ("doc_idx", "sample_idx", "shuffle_idx")))
        except (OSError, ValueError, EOFError):  # e.g. "mmap length is greater than file size"
            return None
        consistent = indices.sample_idx.ndim == 2 and len(indices.sample_idx) == len(indices.shuffle_idx)
        return indices if consistent else None

    def __getstate__(self) -> dict:
        # DataLoader workers started with spawn: re-map cached indices instead of pickling copies.
        state = self.__dict__.copy()
        if self._cache_dir is not None:
            state["indices"] = None
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        if self.indices is None:
            paths = self.cache_paths(self._cache_dir)
            self.indices = GPTIndices(*(np.load(paths[k], mmap_mode="r") for k in ("doc_idx", "sample_idx", "shuffle_idx")))

    # ------------------------------------------------------------------ samples
    def __len__(self) -> int:
        return self.num_samples

    def unshuffled(self, i: int) -> np.ndarray:
        """Sample ``i`` of the stream before the shuffle (stream positions [i*seq_len, (i+1)*seq_len])."""
        doc_pos, offset = (int(x) for x in self.indices.sample_idx[i])
        need = self.seq_len + 1
        parts = []
        lengths = self.indexed.sequence_lengths
        while need > 0:
            if doc_pos >= len(self.indices.doc_idx):
                raise IndexError(f"sample {i} runs past the document index of {self.indexed.prefix}")
            doc = int(self.indices.doc_idx[doc_pos])
            take = min(need, int(lengths[doc]) - offset)
            if take > 0:
                parts.append(self.indexed.get(doc, offset, take))
                need -= take
            doc_pos, offset = doc_pos + 1, 0
        return np.concatenate(parts).astype(np.int64) if len(parts) > 1 else parts[0].astype(np.int64)

    def __getitem__(self, idx: int) -> np.ndarray:
        if not -self.num_samples <= idx < self.num_samples:
            raise IndexError(f"idx: sample {idx} out of range for {self.num_samples} samples")
        return self.unshuffled(int(self.indices.shuffle_idx[idx]))

    def __repr__(self) -> str:
        return (
            f"GPTDataset({self.indexed.prefix!r}, {self.split_name}, docs {self.doc_range}, seq_len={self.seq_len}, "
            f"num_samples={self.num_samples}, seed={self.seed})"
        )
