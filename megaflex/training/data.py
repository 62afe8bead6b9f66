"""Training/validation data for the trainer: datasets and the data-parallel batch stream.

A dataset maps a sample index to ``seq_len + 1`` token ids (inputs = [:-1], labels = [1:]).
``indexed`` datasets come from ``megaflex.data`` (Megatron .bin/.idx, shuffled sample index);
``synthetic`` draws seeded random tokens per index (benchmarks, no files needed).

The stream is a pure function of ``consumed_samples``: optimizer step ``i`` reads the
``global_batch`` consecutive sample indices starting at ``consumed_samples`` and data-parallel
rank ``r`` takes its micro-batches out of them (``megaflex.data.PretrainingSampler``). Resuming from a checkpoint
with the same or a different data-parallel size therefore continues exactly where it stopped.
Under context parallelism every CP rank of a replica reads the same samples and keeps its
contiguous slice of the sequence (so the CP size can change on resume too).
"""

from __future__ import annotations

from typing import Any, Iterator, Protocol

import numpy as np
import torch

from megaflex.data.sampler import PretrainingSampler
from megaflex.parallel.context_parallel import sequence_slice
from megaflex.training.config import Config


class TokenDataset(Protocol):
    def __len__(self) -> int: ...

    def __getitem__(self, idx: int) -> Any: ...


class SyntheticDataset:
    """Seeded uniform random tokens; sample ``i`` is the same in every process and run."""

    def __init__(self, num_samples: int, seq_len: int, vocab_size: int, seed: int) -> None:
        self.num_samples, self.seq_len, self.vocab_size, self.seed = num_samples, seq_len, vocab_size, seed

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, idx: int) -> np.ndarray:
        rng = np.random.default_rng((self.seed, idx))
        return rng.integers(0, self.vocab_size, size=self.seq_len + 1, dtype=np.int64)


def build_datasets(cfg: Config, train_samples: int, valid_samples: int, rank: int = 0) -> tuple[TokenDataset, TokenDataset | None]:
    """(train, valid or None) holding at least the requested number of samples.

    Indexed data: with ``data.valid_path`` the two sets come from their own files, otherwise
    ``data.split`` cuts train/valid out of ``data.train_path`` (Megatron's document split).
    Rank 0 builds the cached sample indices, the others wait at a barrier and load them."""
    d = cfg.data
    if d.source == "synthetic":
        train = SyntheticDataset(train_samples, d.seq_len, cfg.model.vocab_size, cfg.train.seed)
        valid = SyntheticDataset(valid_samples, d.seq_len, cfg.model.vocab_size, cfg.train.seed + 1)
        return train, valid
    import torch.distributed as dist

    from megaflex.data import build_datasets as build_indexed  # noqa: PLC0415 - only for indexed data

    common = dict(
        seq_len=d.seq_len, seed=cfg.train.seed, cache_dir=d.cache_dir, is_builder=(rank == 0),
        barrier=dist.barrier if dist.is_initialized() else None,
    )
    if d.valid_path:
        train = build_indexed(d.train_path, d.train_weights, split="1,0,0",
                              num_samples_per_split=(train_samples, 0, 0), **common)["train"]
        valid = build_indexed(d.valid_path, None, split="0,1,0",
                              num_samples_per_split=(0, valid_samples, 0), **common)["valid"]
    else:
        sets = build_indexed(d.train_path, d.train_weights, split=d.split,
                             num_samples_per_split=(train_samples, valid_samples, 0), **common)
        train, valid = sets["train"], sets["valid"]
    return train, valid


def _tokens(sample: Any) -> torch.Tensor:
    return torch.as_tensor(np.asarray(sample, dtype=np.int64))


def get_batch(dataset: TokenDataset, indices: list[int], device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids [B, N], labels [B, N]) of the given samples."""
    tokens = torch.stack([_tokens(dataset[i]) for i in indices]).to(device)  # [B, N + 1]
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def micro_batches(
    dataset: TokenDataset, consumed_samples: int, micro: int, count: int, dp_rank: int, dp_size: int, device: str,
    cp_rank: int = 0, cp_size: int = 1,
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's next ``count`` micro-batches after ``consumed_samples`` (all ranks together),
    cut to CP rank ``cp_rank``'s slice of the sequence."""
    sampler = PretrainingSampler(len(dataset), consumed_samples, micro, dp_rank, dp_size)
    for _, indices in zip(range(count), sampler):
        ids, labels = get_batch(dataset, indices, device)
        if cp_size > 1:
            ids, labels = sequence_slice(ids, cp_rank, cp_size), sequence_slice(labels, cp_rank, cp_size)
        yield ids, labels
