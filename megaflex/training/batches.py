"""The trainer's batch stream: named micro-batches, built once, on the device.

    layout = BatchLayout.of(cfg, state)                        # this rank's cut of every global batch
    with batch_stream(dataset, layout, device, count, consumed) as batches:
        batch = next(batches)                                   # Batch(input_ids, labels, documents)
        engine(batch.input_ids, batch.labels, documents=batch.documents)

Step ``i`` reads the ``global_batch`` consecutive sample indices starting at ``consumed_samples``;
data-parallel rank ``r`` takes its micro-batches out of them (``megaflex.data.PretrainingSampler``).
Under context parallelism every CP rank of a replica reads the same samples and keeps its
contiguous slice of the sequence. With document boundaries (``data.document_boundaries: reset``)
each token's position in its document is counted on the whole sequence before the cut, so a CP
slice starting mid-document knows it; ``Batch.documents`` carries it to the model. The samples are
read, stacked and pinned one ahead on a background thread (``Prefetcher``).
"""

from __future__ import annotations

import queue
import threading
import warnings
from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np
import torch

from megaflex.attention.documents import document_positions
from megaflex.data.sampler import PretrainingSampler
from megaflex.model.gpt import Documents
from megaflex.parallel.context_parallel import sequence_slice
from megaflex.training.config import Config
from megaflex.training.data import TokenDataset, document_eod_id


@dataclass
class Batch:
    """One micro-batch as the model takes it: ``input_ids``/``labels`` [B, N] and the document
    boundaries (None without ``data.document_boundaries: reset``)."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    documents: Documents | None = None


@dataclass(frozen=True)
class BatchLayout:
    """How this rank cuts the sample stream into micro-batches (data/context-parallel place, documents)."""

    micro_batch_size: int
    dp_rank: int = 0
    dp_size: int = 1
    cp_rank: int = 0
    cp_size: int = 1
    eod_id: int | None = None  # cut documents after this id (None: no document boundaries)
    reset_positions: bool = False  # positions restart in each document (data.reset_positions)

    @classmethod
    def of(cls, cfg: Config, state: Any) -> "BatchLayout":
        """The layout of a run's rank (``state``: its ``megaflex.parallel.ParallelState``)."""
        return cls(cfg.train.micro_batch_size, state.dp_rank, state.dp_size, state.cp_rank, state.cp_size,
                   document_eod_id(cfg), cfg.data.reset_positions)


def _tokens(sample: Any) -> torch.Tensor:
    return torch.as_tensor(np.asarray(sample, dtype=np.int64))


def get_batch(dataset: TokenDataset, indices: list[int], device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids [B, N], labels [B, N]) of the given samples."""
    tokens = torch.stack([_tokens(dataset[i]) for i in indices]).to(device)  # [B, N + 1]
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


class BatchStream:
    """``Batch``es on the device, read and pinned one ahead on a background thread (``Prefetcher``).
    A caller that stops before the last batch closes it (or uses ``with``) so no reader outlives it."""

    def __init__(self, host_tensors: Iterator[tuple[torch.Tensor, ...]], device: str, reset_positions: bool) -> None:
        self._prefetcher = Prefetcher(host_tensors, device)
        self._reset_positions = reset_positions

    def __iter__(self) -> "BatchStream":
        return self

    def __next__(self) -> Batch:
        input_ids, labels, *positions = next(self._prefetcher)
        if not positions:
            return Batch(input_ids, labels)
        documents = Documents(starts=positions[0] == 0, position_ids=positions[0] if self._reset_positions else None)
        return Batch(input_ids, labels, documents)

    def close(self) -> None:
        self._prefetcher.close()

    def __enter__(self) -> "BatchStream":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def batch_stream(dataset: TokenDataset, layout: BatchLayout, device: str, count: int, consumed_samples: int = 0) -> BatchStream:
    """This rank's next ``count`` micro-batches after ``consumed_samples`` (all ranks together)."""

    def host_tensors() -> Iterator[tuple[torch.Tensor, ...]]:
        sampler = PretrainingSampler(len(dataset), consumed_samples, layout.micro_batch_size, layout.dp_rank, layout.dp_size)
        for _, indices in zip(range(count), sampler):
            tensors: tuple[torch.Tensor, ...] = get_batch(dataset, indices, "cpu")
            if layout.eod_id is not None:
                tensors = (*tensors, document_positions(tensors[0], layout.eod_id))
            if layout.cp_size > 1:
                tensors = tuple(sequence_slice(t, layout.cp_rank, layout.cp_size).contiguous() for t in tensors)
            yield tensors

    return BatchStream(host_tensors(), device, layout.reset_positions)


class Prefetcher:
    """Iterate CPU tensor tuples from ``source``, ``depth`` ahead on a daemon thread, delivered on
    ``device``: pinned memory and non-blocking copies when ``device`` is CUDA (pinning off on the
    CPU). An exception in ``source`` (e.g. a ``DataError``) is raised by ``next`` in order."""

    _END = object()

    def __init__(self, source: Iterator[tuple[torch.Tensor, ...]], device: str, depth: int = 2) -> None:
        self.device = torch.device(device)
        self._pin = self.device.type == "cuda"
        self._queue: Any = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._fill, args=(source,), daemon=True, name="batch-prefetch")
        self._thread.start()

    def _fill(self, source: Iterator[tuple[torch.Tensor, ...]]) -> None:
        try:
            for item in source:
                if self._pin:
                    item = tuple(t.pin_memory() for t in item)
                if not self._put(item):
                    return
        except BaseException as e:  # handed to the consumer, raised there
            self._put(e)
            return
        self._put(self._END)

    def _put(self, item: Any) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def __iter__(self) -> "Prefetcher":
        return self

    def __next__(self) -> tuple[torch.Tensor, ...]:
        item = self._queue.get()
        if item is self._END:
            self._queue.put(self._END)  # stay exhausted
            raise StopIteration
        if isinstance(item, BaseException):
            raise item
        return tuple(t.to(self.device, non_blocking=self._pin) for t in item)

    def close(self, timeout_s: float = 60.0) -> None:
        """Stop the reader thread and wait for it (it also stops on its own after the last batch).

        Waiting matters at exit: a daemon thread still inside an ATen op (GIL released) when the
        interpreter finalises is unwound through C++ ``noexcept`` frames, which aborts the process
        (``terminate called without an active exception``, exit -6 instead of the run's code)."""
        self._stop.set()
        if self._thread is threading.current_thread() or not self._thread.is_alive():
            return
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            warnings.warn(f"the batch-prefetch thread did not stop within {timeout_s:.0f} s (a blocked read?)",
                          RuntimeWarning, stacklevel=2)

    def __enter__(self) -> "Prefetcher":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        self._stop.set()
