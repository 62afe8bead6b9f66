"""Training/validation data for the trainer: the datasets (the batch stream over them is
``megaflex.training.batches``).

A dataset maps a sample index to ``seq_len + 1`` token ids (inputs = [:-1], labels = [1:]).
``indexed`` datasets come from ``megaflex.data`` (Megatron .bin/.idx, shuffled sample index);
``synthetic`` draws seeded random tokens per index (benchmarks, no files needed).

The batch stream is a pure function of ``consumed_samples`` (``megaflex.training.batches``):
resuming from a checkpoint with the same or a different data-parallel size therefore continues
exactly where it stopped.

Start-up checks (``check_data_tokenizer`` before the model is built, ``build_datasets`` after):
``data.tokenizer`` exists and fits ``model.vocab_size``; every prefix's data card names the same
tokenizer; every index passes the structural checks and a sample of its ids is below the
vocabulary; every sample served is checked again, so an id >= ``model.vocab_size`` is a
:class:`DataError` naming the sample, never an ``IndexError`` in the embedding.
"""

from __future__ import annotations

import os
import tempfile
import time
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, NamedTuple, Protocol

import numpy as np

from megaflex.data.card import check_same_tokenizer, data_tokenizer, read_data_card
from megaflex.data.indexed import DataError
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


class VocabCheckedDataset:
    """Serves ``dataset``'s samples, raising :class:`DataError` on an id outside ``[0, vocab_size)``."""

    def __init__(self, dataset: TokenDataset, vocab_size: int, name: str) -> None:
        self.dataset, self.vocab_size, self.name = dataset, vocab_size, name

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, idx: int) -> np.ndarray:
        sample = np.asarray(self.dataset[idx])
        if sample.size and (int(sample.max()) >= self.vocab_size or int(sample.min()) < 0):
            bad = int(sample.max()) if int(sample.max()) >= self.vocab_size else int(sample.min())
            raise DataError(
                f"{self.name} sample {idx} holds token id {bad}, outside model.vocab_size {self.vocab_size}; "
                f"the data was tokenized with a larger vocabulary or is corrupt (check it with data_prep.inspect --verify)"
            )
        return sample


def check_data_tokenizer(cfg: Config) -> dict | None:
    """Check ``data.tokenizer`` and the data cards against each other and ``model.vocab_size``.

    Returns the tokenizer record to store with checkpoints (from ``data.tokenizer``, else from
    the data cards; None when neither exists, e.g. synthetic data). Raises :class:`DataError`."""
    d, vocab = cfg.data, cfg.model.vocab_size
    record, record_from = None, None
    if d.tokenizer:
        if not os.path.isfile(d.tokenizer):
            raise DataError(f"data.tokenizer (from {cfg.where('data.tokenizer')}): tokenizer model {d.tokenizer} not found")
        from megaflex.data.tokenizer import Tokenizer, check_lossless

        setting = f"data.tokenizer (from {cfg.where('data.tokenizer')})"
        try:
            tokenizer = Tokenizer(d.tokenizer)
        except ValueError as e:  # not a sentencepiece model / tokenizers file, no EOD token
            raise DataError(f"{setting}: {str(e).removeprefix('model_path: ')}") from None
        check_lossless(tokenizer, setting)
        record, record_from = tokenizer.record, f"data.tokenizer ({d.tokenizer})"
    if d.source == "indexed":
        for prefix in [*d.train_path, *d.valid_path]:
            card = data_tokenizer(prefix)
            check_same_tokenizer(card, record, f"the data {prefix}", record_from or "")
            if card and record is None:
                record, record_from = card, f"the data {prefix}"
    if record is not None and record["vocab_size"] > vocab:
        raise DataError(
            f"model.vocab_size (from {cfg.where('model.vocab_size')}): {vocab} is smaller than the vocabulary of "
            f"{record_from} ({record['vocab_size']} tokens); set model.vocab_size >= {record['vocab_size']}"
        )
    return record


def check_document_boundaries(cfg: Config) -> list[str]:
    """``data.document_boundaries: reset`` against the data cards of indexed data. A DataError when
    ``data.eod_token_id`` is outside a prefix's tokenizer vocabulary (no token has it: the resets
    would never happen); a warning line per prefix whose documents carry no EOD to reset at (card:
    ``append_eod: false``), or whose appended EOD is not ``data.eod_token_id``."""
    d = cfg.data
    if d.document_boundaries != "reset" or d.source != "indexed":
        return []
    eod, out = d.eod_token_id, []  # None: data.tokenizer's EOD, the one the data cards record
    for prefix in dict.fromkeys([*d.train_path, *d.valid_path]):
        card = read_data_card(prefix) or {}
        vocab = (card.get("tokenizer") or {}).get("vocab_size")
        if eod is not None and isinstance(vocab, int) and eod >= vocab:
            raise DataError(
                f"data.eod_token_id (from {cfg.where('data.eod_token_id')}): {eod} is outside the vocabulary of the "
                f"data {prefix} ({vocab} tokens, its data card): no token has that id, so document_boundaries=reset "
                f"would never cut; its EOD id is {card.get('eod_id')} (unset data.eod_token_id to use data.tokenizer's)"
            )
        if card.get("append_eod") is False and (eod is None or eod == card.get("eod_id")):
            out.append(f"WARNING: data.document_boundaries=reset: the data {prefix} was tokenized without an EOD after "
                       "each document (data card: append_eod false), so its samples have no boundary to reset at; "
                       "re-tokenize it without --no-append-eod, or set data.document_boundaries=none")
        elif eod is not None and card.get("append_eod") and card.get("eod_id") not in (None, eod):
            out.append(f"WARNING: data.eod_token_id={eod} (from {cfg.where('data.eod_token_id')}) is not the EOD id "
                       f"{card['eod_id']} that ends each document of the data {prefix} (data card): resets cut after "
                       f"token {eod}, not at the documents' ends")
    return out


def index_cache_dir(cfg: Config) -> str:
    """``data.cache_dir``, else ``index_cache/`` next to the first training prefix, else (that
    folder not writable, e.g. read-only shared data) ``<logging.run_dir>/index_cache``."""
    if cfg.data.cache_dir:
        return cfg.data.cache_dir
    beside = Path(os.path.abspath(cfg.data.train_path[0])).parent / "index_cache"
    if _writable_dir(beside):
        return str(beside)
    fallback = Path(cfg.logging.run_dir) / "index_cache"
    warnings.warn(f"data.cache_dir: {beside} is not writable; caching sample indices in {fallback}", stacklevel=2)
    return str(fallback)


def _writable_dir(path: Path) -> bool:
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path):
            return True
    except OSError:
        return False


# Rank 0 builds missing sample indices while the others wait, for minutes on a large corpus: longer
# than parallel.timeout_minutes, whose NCCL watchdog would end the job on the default group. They
# wait on a gloo group of their own with this bound instead (a rank that dies still ends the wait:
# its peers' connections close), and rank 1 reports every INDEX_WAIT_REPORT_S that it is waiting.
INDEX_BUILD_TIMEOUT = timedelta(hours=6)
INDEX_WAIT_REPORT_S = 60.0


def index_build_barrier() -> Callable[[], None]:
    """The barrier the sample-index builder and its waiting peers meet at (``INDEX_BUILD_TIMEOUT``, on
    a new gloo group: collective, every rank calls this once and then the barrier alike)."""
    import torch.distributed as dist

    group = dist.new_group(backend="gloo", timeout=INDEX_BUILD_TIMEOUT)
    rank = dist.get_rank()

    def wait() -> None:
        work = dist.barrier(group=group, async_op=True)
        start, reported = time.monotonic(), 0
        while not work.is_completed():
            time.sleep(0.1)
            due = int((time.monotonic() - start) / INDEX_WAIT_REPORT_S)
            if rank == 1 and due > reported:
                reported = due
                print(f"rank 1: waiting for rank 0 to build the sample indices ({time.monotonic() - start:.0f} s so far; "
                      f"at most {INDEX_BUILD_TIMEOUT.total_seconds() / 3600:.0f} h)", flush=True)  # fmt: skip
        work.wait()  # raises what failed it (a peer gone)

    return wait


class Datasets(NamedTuple):
    train: TokenDataset
    valid: TokenDataset | None  # None without validation (train.eval_iters 0)


def build_datasets(cfg: Config, train_samples: int, valid_samples: int, rank: int = 0) -> Datasets:
    """(train, valid or None) holding at least the requested number of samples.

    Indexed data: with ``data.valid_path`` the two sets come from their own files, otherwise
    ``data.split`` cuts train/valid out of ``data.train_path`` (Megatron's document split).
    Rank 0 builds the cached sample indices (in ``index_cache_dir``), the others wait at
    ``index_build_barrier`` (not the collective timeout) and load them. Indexed data is checked on
    open and per sample (module docstring)."""
    d = cfg.data
    if d.source == "synthetic":
        train = SyntheticDataset(train_samples, d.seq_len, cfg.model.vocab_size, cfg.train.seed)
        # train.eval_iters=0 (no validation): no validation set, as for indexed data below
        valid = SyntheticDataset(valid_samples, d.seq_len, cfg.model.vocab_size, cfg.train.seed + 1) if valid_samples else None
        return Datasets(train, valid)
    import torch.distributed as dist

    from megaflex.data import build_datasets as build_indexed  # noqa: PLC0415 - only for indexed data

    vocab = cfg.model.vocab_size
    common = dict(
        seq_len=d.seq_len, seed=cfg.train.seed, cache_dir=index_cache_dir(cfg),
        is_builder=(rank == 0), barrier=index_build_barrier() if dist.is_initialized() else None, vocab_size=vocab,
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
    train = VocabCheckedDataset(train, vocab, f"training data {', '.join(d.train_path)}")
    if valid is not None:
        valid = VocabCheckedDataset(valid, vocab, f"validation data {', '.join(d.valid_path or d.train_path)}")
    return Datasets(train, valid)


def document_eod_id(cfg: Config) -> int | None:
    """The EOD id packed samples are cut after (``data.document_boundaries: reset``), else None."""
    d = cfg.data
    if d.document_boundaries != "reset":
        return None
    if d.eod_token_id is not None:
        return d.eod_token_id
    from megaflex.data.tokenizer import Tokenizer

    return Tokenizer(d.tokenizer).eod_id
