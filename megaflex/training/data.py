"""Training/validation data for the trainer: datasets and the data-parallel batch stream.

A dataset maps a sample index to ``seq_len + 1`` token ids (inputs = [:-1], labels = [1:]).
``indexed`` datasets come from ``megaflex.data`` (Megatron .bin/.idx, shuffled sample index);
``synthetic`` draws seeded random tokens per index (benchmarks, no files needed).

The stream is a pure function of ``consumed_samples``: optimizer step ``i`` reads the
``global_batch`` consecutive sample indices starting at ``consumed_samples`` and data-parallel
rank ``r`` takes micro-batches out of them (``PretrainingSampler``). Resuming from a checkpoint
with the same or a different data-parallel size therefore continues exactly where it stopped.
"""

from __future__ import annotations

from typing import Any, Iterator, Protocol

import numpy as np
import torch

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


def build_datasets(cfg: Config, train_samples: int, valid_samples: int) -> tuple[TokenDataset, TokenDataset | None]:
    """(train, valid or None) holding at least the requested number of samples."""
    d = cfg.data
    if d.source == "synthetic":
        train = SyntheticDataset(train_samples, d.seq_len, cfg.model.vocab_size, cfg.train.seed)
        valid = SyntheticDataset(valid_samples, d.seq_len, cfg.model.vocab_size, cfg.train.seed + 1)
        return train, valid
    from megaflex.data import gpt_dataset  # noqa: PLC0415 - only needed for indexed data

    train = gpt_dataset.build_dataset(
        d.train_path, weights=d.train_weights, seq_len=d.seq_len, num_samples=train_samples,
        seed=cfg.train.seed, cache_dir=d.cache_dir,
    )
    valid = None
    if d.valid_path:
        valid = gpt_dataset.build_dataset(
            d.valid_path, weights=None, seq_len=d.seq_len, num_samples=valid_samples,
            seed=cfg.train.seed, cache_dir=d.cache_dir,
        )
    return train, valid


def _tokens(sample: Any) -> torch.Tensor:
    if isinstance(sample, dict):  # Megatron-style {"text": ...} / {"tokens": ...}
        sample = sample.get("tokens", sample.get("text"))
    return torch.as_tensor(np.asarray(sample, dtype=np.int64))


def micro_batch_indices(consumed_samples: int, micro: int, dp_rank: int, dp_size: int) -> range:
    """Sample indices of this rank's next micro-batch when ``consumed_samples`` are done.

    One micro-step of all replicas reads ``micro * dp_size`` consecutive indices; rank ``r``
    takes its ``micro``-sized slice (Megatron's MegatronPretrainingSampler)."""
    start = consumed_samples + dp_rank * micro
    return range(start, start + micro)


def get_batch(dataset: TokenDataset, indices: range, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids [B, N], labels [B, N]) of the given samples."""
    tokens = torch.stack([_tokens(dataset[i % len(dataset)]) for i in indices])  # [B, N + 1]
    tokens = tokens.to(device)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def step_batches(
    dataset: TokenDataset, consumed_samples: int, micro: int, grad_accum: int, dp_rank: int, dp_size: int, device: str
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The ``grad_accum`` micro-batches of this rank for the optimizer step at ``consumed_samples``."""
    for m in range(grad_accum):
        base = consumed_samples + m * micro * dp_size
        yield get_batch(dataset, micro_batch_indices(base, micro, dp_rank, dp_size), device)
