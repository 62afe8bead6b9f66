"""Data-parallel batch sampler that resumes exactly from a consumed-sample count.

Samples are consumed in one global order ``consumed_samples, consumed_samples + 1, ...``
(the randomness lives in the dataset's shuffle index), in global batches of
``micro_batch_size * data_parallel_size``; rank *r* takes slice ``[r*mbs, (r+1)*mbs)`` of each.
So the global stream does not depend on the DP size, and restarting with the checkpoint's
``consumed_samples`` — with the same or a different DP size — continues it exactly.
"""

from __future__ import annotations

from typing import Iterator


class PretrainingSampler:
    """Yields this rank's micro-batch index lists; use as a DataLoader ``batch_sampler``.

    Args:
        total_samples: length of the dataset (global samples available).
        consumed_samples: samples already consumed by all ranks together (from the checkpoint).
        micro_batch_size: samples per rank per step.
        data_parallel_rank / data_parallel_size: this rank and the number of DP ranks.
        drop_last: drop a final incomplete global batch (default; keeps every rank in lockstep).
            With False the remainder is dealt out as far as it goes, Megatron style.
    """

    def __init__(
        self,
        total_samples: int,
        consumed_samples: int,
        micro_batch_size: int,
        data_parallel_rank: int,
        data_parallel_size: int,
        drop_last: bool = True,
    ) -> None:
        if total_samples <= 0:
            raise ValueError(f"total_samples: expected a positive count, got {total_samples}")
        if not 0 <= consumed_samples <= total_samples:
            raise ValueError(f"consumed_samples: expected 0..{total_samples} (total_samples), got {consumed_samples}")
        if micro_batch_size <= 0:
            raise ValueError(f"micro_batch_size: expected a positive integer, got {micro_batch_size}")
        if data_parallel_size <= 0:
            raise ValueError(f"data_parallel_size: expected a positive integer, got {data_parallel_size}")
        if not 0 <= data_parallel_rank < data_parallel_size:
            raise ValueError(f"data_parallel_rank: expected 0..{data_parallel_size - 1}, got {data_parallel_rank}")
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.data_parallel_rank = data_parallel_rank
        self.data_parallel_size = data_parallel_size
        self.drop_last = drop_last

    @property
    def global_batch(self) -> int:
        return self.micro_batch_size * self.data_parallel_size

    def __len__(self) -> int:
        """Micro-batches this rank will yield."""
        remaining = self.total_samples - self.consumed_samples
        full = remaining // self.global_batch
        if self.drop_last:
            return full
        rest = remaining - full * self.global_batch
        return full + int(rest > self.data_parallel_rank * self.micro_batch_size)

    def __iter__(self) -> Iterator[list[int]]:
        lo = self.data_parallel_rank * self.micro_batch_size
        start = self.consumed_samples
        while start + self.global_batch <= self.total_samples:
            yield list(range(start + lo, start + lo + self.micro_batch_size))
            start += self.global_batch
        if not self.drop_last and start + lo < self.total_samples:
            yield list(range(start + lo, min(start + lo + self.micro_batch_size, self.total_samples)))
