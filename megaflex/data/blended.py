"""Blend several datasets by weight, and build train/valid/test datasets from prefixes.

Blending assigns sample *n* of the blend to the dataset that is furthest below its share,
measured in units of its own share: dataset *d*'s *k*-th sample is due at blend position
``(k + 1/2) / w_d``, and the blend serves samples in order of due position (ties to the lower
dataset index). This is the continuous form of Megatron's greedy "largest error" rule and is
computed with one vectorised sort instead of a compiled loop. For every prefix of *n* samples,
``|count_d - n * w_d| <= 1 + D / 2`` (D datasets), so proportions are exact up to a constant
number of samples — within 1% of the weights once ``n >= 100 (1 + D / 2) / min(w)``.
"""

from __future__ import annotations

import os
from typing import Callable, Sequence

import numpy as np

from megaflex.data.gpt_dataset import SPLIT_NAMES, GPTDataset, parse_split
from megaflex.data.indexed import IndexedDataset


def normalise_weights(weights: Sequence[float], n: int) -> np.ndarray:
    w = np.asarray(weights, dtype=np.float64)
    if w.shape != (n,):
        raise ValueError(f"weights: expected {n} weights (one per dataset), got {len(w)}")
    if np.any(w < 0) or not np.all(np.isfinite(w)) or w.sum() <= 0:
        raise ValueError(f"weights: expected non-negative finite weights with a positive sum, got {list(weights)}")
    return w / w.sum()


def blend_indices(weights: Sequence[float], num_samples: int) -> tuple[np.ndarray, np.ndarray]:
    """-> (dataset_index int16[num_samples], dataset_sample_index int64[num_samples])."""
    w = normalise_weights(weights, len(weights))
    if num_samples < 0:
        raise ValueError(f"num_samples: expected >= 0, got {num_samples}")
    due, owner = [], []
    for d, wd in enumerate(w):
        if wd == 0:
            continue
        k = np.arange(int(np.ceil(num_samples * wd)) + 2, dtype=np.float64)
        due.append((k + 0.5) / wd)
        owner.append(np.full(len(k), d, dtype=np.int16))
    due_all, owner_all = np.concatenate(due), np.concatenate(owner)
    # lexsort: primary key due position, secondary dataset index (deterministic ties)
    order = np.lexsort((owner_all, due_all))[:num_samples]
    dataset_index = owner_all[order]
    # k-th occurrence of each dataset = its sample index (due keys are increasing within a dataset)
    dataset_sample_index = np.zeros(num_samples, np.int64)
    for d in range(len(w)):
        mask = dataset_index == d
        dataset_sample_index[mask] = np.arange(int(mask.sum()))
    return dataset_index, dataset_sample_index


class BlendedDataset:
    """Serves ``datasets[dataset_index[i]][dataset_sample_index[i]]``."""

    def __init__(self, datasets: Sequence, weights: Sequence[float], num_samples: int) -> None:
        if not datasets:
            raise ValueError("datasets: expected at least one dataset to blend, got none")
        self.datasets = list(datasets)
        self.weights = normalise_weights(weights, len(self.datasets))
        self.num_samples = num_samples
        self.dataset_index, self.dataset_sample_index = blend_indices(self.weights, num_samples)
        counts = np.bincount(self.dataset_index, minlength=len(self.datasets))
        for d, (ds, c) in enumerate(zip(self.datasets, counts)):
            if len(ds) < c:
                raise ValueError(f"datasets: dataset {d} ({ds!r}) has {len(ds)} samples, the blend needs {c}")

    @staticmethod
    def samples_needed(weights: Sequence[float], num_samples: int) -> list[int]:
        """How many samples each dataset must provide for a blend of ``num_samples``."""
        index, _ = blend_indices(weights, num_samples)
        return np.bincount(index, minlength=len(weights)).tolist()

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, idx: int) -> np.ndarray:
        if not -self.num_samples <= idx < self.num_samples:
            raise IndexError(f"idx: sample {idx} out of range for {self.num_samples} samples")
        return self.datasets[int(self.dataset_index[idx])][int(self.dataset_sample_index[idx])]

    def __repr__(self) -> str:
        return f"BlendedDataset({len(self.datasets)} datasets, weights={self.weights.round(4).tolist()}, num_samples={self.num_samples})"


def build_datasets(
    prefixes: Sequence[str | os.PathLike] | str,
    weights: Sequence[float] | None = None,
    split: str | Sequence[float] = "949,50,1",
    seq_len: int = 2048,
    num_samples_per_split: Sequence[int | None] = (None, None, None),
    seed: int = 1234,
    cache_dir: str | os.PathLike | None = None,
    is_builder: bool = True,
    barrier: Callable[[], None] | None = None,
    vocab_size: int | None = None,
) -> dict[str, GPTDataset | BlendedDataset | None]:
    """``{"train": ..., "valid": ..., "test": ...}`` for one prefix or a weighted blend.

    A split is None when its weight in ``split`` is 0 or its requested sample count is 0.
    ``num_samples_per_split`` entries of None mean one epoch (single prefix only: a blend needs
    explicit counts so every dataset's share is defined).

    Every prefix is opened with the structural checks (:meth:`IndexedDataset.verify`) and, given
    ``vocab_size``, a bounded sample of its token ids is checked against it: a corrupt index or
    data from a larger vocabulary fails here, naming the file, instead of training on garbage.
    """
    prefixes = [prefixes] if isinstance(prefixes, (str, os.PathLike)) else list(prefixes)
    if not prefixes:
        raise ValueError("prefixes: expected at least one dataset prefix, got none")
    weights = [1.0] * len(prefixes) if weights is None else list(weights)
    w = normalise_weights(weights, len(prefixes))
    if len(num_samples_per_split) != 3:
        raise ValueError(f"num_samples_per_split: expected 3 entries (train, valid, test), got {len(num_samples_per_split)}")
    split_w = parse_split(split)
    indexed = [IndexedDataset(p, verify=True) for p in prefixes]
    if vocab_size is not None:
        for ds in indexed:
            ds.check_token_sample(vocab_size)
    out: dict[str, GPTDataset | BlendedDataset | None] = {}
    for s, name in enumerate(SPLIT_NAMES):
        n = num_samples_per_split[s]
        if split_w[s] == 0 or n == 0:
            out[name] = None
            continue

        def make(ds: IndexedDataset, count: int | None) -> GPTDataset:
            return GPTDataset(ds, name, seq_len, count, seed, split_w, cache_dir, is_builder, barrier)

        if len(prefixes) == 1:
            out[name] = make(indexed[0], n)
            continue
        if n is None:
            raise ValueError(f"num_samples_per_split: a blend of {len(prefixes)} datasets needs an explicit {name} sample count")
        counts = BlendedDataset.samples_needed(w, n)
        parts = [make(ds, c) if c > 0 else _Empty() for ds, c in zip(indexed, counts)]
        out[name] = BlendedDataset(parts, w, n)
    return out


class _Empty:
    """Placeholder for a zero-weight member of a blend (never indexed)."""

    def __len__(self) -> int:
        return 0
