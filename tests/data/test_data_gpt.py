"""GPT samples, index cache, blending and the data-parallel sampler."""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path

import numpy as np
import pytest
from data_files import make_dataset

from megaflex.data import (
    BlendedDataset,
    GPTDataset,
    IndexedDataset,
    IndexedDatasetBuilder,
    PretrainingSampler,
    blend_indices,
    build_datasets,
    split_ranges,
)


@pytest.fixture
def data(tmp_path: Path) -> IndexedDataset:
    return make_dataset(tmp_path / "d", 300, seed=0)


def stream_of(ds: GPTDataset) -> np.ndarray:
    return np.concatenate([ds.indexed[int(d)] for d in ds.indices.doc_idx]).astype(np.int64)


def test_samples_tile_the_document_stream(data: IndexedDataset) -> None:
    seq_len = 16
    ds = GPTDataset(data, "train", seq_len, None, seed=3, split="80,20,0")
    lo, hi = ds.doc_range
    assert sorted(ds.indices.doc_idx.tolist()) == list(range(lo, hi))  # one epoch: each document once
    stream = stream_of(ds)
    assert len(ds) == (len(stream) - 1) // seq_len
    for i in range(len(ds)):  # sample i = stream[i*L : (i+1)*L + 1], overlapping the next by one token
        np.testing.assert_array_equal(ds.unshuffled(i), stream[i * seq_len : (i + 1) * seq_len + 1])
    assert sorted(ds.indices.shuffle_idx.tolist()) == list(range(len(ds)))
    assert not np.array_equal(ds.indices.shuffle_idx, np.arange(len(ds)))  # actually shuffled
    x = ds[0]
    assert x.dtype == np.int64 and x.shape == (seq_len + 1,)


def test_multiple_epochs_and_separate_final_epoch(data: IndexedDataset) -> None:
    seq_len = 16
    one = GPTDataset(data, "train", seq_len, None, seed=3, split="80,20,0")
    per_epoch, n_docs = len(one), one.doc_range[1] - one.doc_range[0]
    ds = GPTDataset(data, "train", seq_len, per_epoch + 10, seed=3, split="80,20,0")  # a sliver of epoch 2
    assert len(ds.indices.doc_idx) == 2 * n_docs
    for e in range(2):  # each epoch is a permutation of the split
        assert sorted(ds.indices.doc_idx[e * n_docs : (e + 1) * n_docs].tolist()) == list(range(*ds.doc_range))
    stream = stream_of(ds)
    for i in range(len(ds)):
        np.testing.assert_array_equal(ds.unshuffled(i), stream[i * seq_len : (i + 1) * seq_len + 1])
    sans = (one.indexed.sequence_lengths[slice(*ds.doc_range)].sum() - 1) // seq_len
    # the partial final epoch is shuffled on its own: the first `sans` served samples are epoch 1's
    assert sorted(ds.indices.shuffle_idx[:sans].tolist()) == list(range(sans))
    big = GPTDataset(data, "train", seq_len, 3 * per_epoch, seed=3, split="80,20,0")
    assert len(big) == 3 * per_epoch and len(big.indices.doc_idx) == 3 * n_docs


def test_splits_are_disjoint_document_ranges(data: IndexedDataset) -> None:
    r = split_ranges(len(data), "949,50,1")
    assert r["train"][0] == 0 and r["train"][1] == r["valid"][0] and r["valid"][1] == r["test"][0]
    assert r["test"][1] == len(data) == 300
    assert (r["train"][1], r["valid"][1] - r["valid"][0]) == (285, 15)  # round(0.949*300), round(0.05*300)
    sets = build_datasets(data.prefix, split="60,30,10", seq_len=8)
    docs = {k: set(v.indices.doc_idx.tolist()) for k, v in sets.items()}
    assert not docs["train"] & docs["valid"] and not docs["valid"] & docs["test"] and not docs["train"] & docs["test"]
    assert set().union(*docs.values()) == set(range(300))


def test_determinism_and_seed(data: IndexedDataset) -> None:
    a = GPTDataset(data, "train", 8, 500, seed=1)
    b = GPTDataset(data, "train", 8, 500, seed=1)
    c = GPTDataset(data, "train", 8, 500, seed=2)
    np.testing.assert_array_equal(np.stack([a[i] for i in range(50)]), np.stack([b[i] for i in range(50)]))
    assert not np.array_equal(np.stack([a[i] for i in range(50)]), np.stack([c[i] for i in range(50)]))


# ---------------------------------------------------------------------------- sampler
def global_stream(total: int, consumed: int, mbs: int, dp: int) -> list[int]:
    """Samples in consumption order: step by step, rank 0's micro-batch, then rank 1's, ..."""
    per_rank = [list(PretrainingSampler(total, consumed, mbs, r, dp)) for r in range(dp)]
    assert len({len(p) for p in per_rank}) == 1  # ranks stay in lockstep
    return [i for step in zip(*per_rank) for batch in step for i in batch]


@pytest.mark.parametrize("dp", [1, 2, 3, 4])
def test_one_epoch_visits_every_sample_once(data: IndexedDataset, dp: int) -> None:
    ds = GPTDataset(data, "train", 8, None, seed=5)
    mbs = 3
    seen = global_stream(len(ds), 0, mbs, dp)
    assert len(seen) == len(set(seen))
    assert len(ds) - len(seen) < mbs * dp  # only the incomplete last global batch is dropped
    assert set(seen) == set(range(len(seen)))
    # and at token level: distinct stream windows, i.e. each sample of the epoch exactly once
    windows = {int(ds[i][0]) for i in seen}
    assert len(windows) == len(seen)


def test_resume_continues_identical_stream_even_when_dp_changes() -> None:
    total, mbs = 500, 2
    reference = global_stream(total, 0, 1, 1)  # the order every DP layout must follow
    assert reference[:16] == global_stream(total, 0, mbs, 4)[:16]
    for consumed in range(0, total, 8):  # checkpoints taken with global batch 8
        for dp in (1, 2, 4, 8):
            resumed = global_stream(total, consumed, mbs, dp)
            n = len(resumed)
            assert resumed == reference[consumed : consumed + n]
            assert total - consumed - n < mbs * dp
    with pytest.raises(ValueError, match="consumed_samples"):
        PretrainingSampler(100, 101, 2, 0, 1)
    with pytest.raises(ValueError, match="data_parallel_rank"):
        PretrainingSampler(100, 0, 2, 2, 2)


def test_sampler_without_drop_last() -> None:
    per_rank = [list(PretrainingSampler(10, 0, 2, r, 2, drop_last=False)) for r in range(2)]
    assert per_rank == [[[0, 1], [4, 5], [8, 9]], [[2, 3], [6, 7]]]
    assert [len(PretrainingSampler(10, 0, 2, r, 2, drop_last=False)) for r in range(2)] == [3, 2]


def test_dataloader_batches(data: IndexedDataset) -> None:
    import torch

    ds = GPTDataset(data, "train", 8, 100, seed=1)
    loader = torch.utils.data.DataLoader(ds, batch_sampler=PretrainingSampler(len(ds), 10, 4, 1, 2))
    batch = next(iter(loader))
    assert batch.dtype == torch.int64 and batch.shape == (4, 9)
    np.testing.assert_array_equal(batch.numpy(), np.stack([ds[i] for i in range(14, 18)]))


# ---------------------------------------------------------------------------- blending
def test_blend_proportions_for_every_prefix() -> None:
    w = np.array([0.5, 0.3, 0.15, 0.05])
    index, sample = blend_indices(w, 20000)
    onehot = np.eye(4)[index]
    counts = np.cumsum(onehot, axis=0)  # counts[n-1, d] = samples of d among the first n
    n = np.arange(1, 20001)[:, None]
    assert np.abs(counts - n * w).max() <= 1 + 4 / 2  # each sample goes to the most-behind dataset
    assert np.abs(counts[-1] / 20000 - w).max() < 0.01
    for d in range(4):  # each dataset's samples are used in order 0, 1, 2, ...
        np.testing.assert_array_equal(sample[index == d], np.arange((index == d).sum()))
    assert np.bincount(blend_indices([1.0, 0.0], 50)[0], minlength=2).tolist() == [50, 0]


def test_blended_datasets_from_prefixes(tmp_path: Path) -> None:
    a = make_dataset(tmp_path / "a", 200, seed=1, base=0)
    b = make_dataset(tmp_path / "b", 50, seed=2, base=10**6)  # token values tell the source apart
    sets = build_datasets([a.prefix, b.prefix], [0.75, 0.25], "90,10,0", seq_len=8,
                          num_samples_per_split=(4000, 400, None), seed=9, cache_dir=tmp_path / "cache")
    train = sets["train"]
    assert isinstance(train, BlendedDataset) and len(train) == 4000 and sets["test"] is None
    from_b = np.array([train[i][0] >= 10**6 for i in range(len(train))])
    assert abs(from_b.mean() - 0.25) < 0.01
    assert len(train.datasets[1]) > 1.5 * (len(b.sequence_lengths) * 20 // 8)  # b repeats epochs to fill its share
    with pytest.raises(ValueError, match="weights: expected 2 weights"):
        build_datasets([a.prefix, b.prefix], [1.0], seq_len=8, num_samples_per_split=(10, 10, 10))
    with pytest.raises(ValueError, match="needs an explicit train sample count"):
        build_datasets([a.prefix, b.prefix], [1, 1], seq_len=8)


# ---------------------------------------------------------------------------- cache
def test_index_cache_reuse_and_invalidation(tmp_path: Path) -> None:
    data = make_dataset(tmp_path / "d", 100, seed=0)
    cache = tmp_path / "cache"
    kw = dict(split_name="train", seq_len=8, num_samples=300, seed=1, split="90,10,0", cache_dir=cache)
    first = GPTDataset(data, **kw)
    assert first.built_indices
    again = GPTDataset(data.prefix, **kw)
    assert not again.built_indices and isinstance(again.indices.shuffle_idx, np.memmap)
    np.testing.assert_array_equal(np.stack([first[i] for i in range(300)]), np.stack([again[i] for i in range(300)]))
    n_files = len(list(cache.iterdir()))
    for change in (dict(seed=2), dict(seq_len=9), dict(num_samples=301), dict(split="80,20,0"), dict(split_name="valid")):
        changed = GPTDataset(data, **(kw | change))
        assert changed.built_indices, change
        assert len(list(cache.iterdir())) == n_files + 4, change  # a new entry: 3 arrays + description
        n_files += 4
    import pickle

    clone = pickle.loads(pickle.dumps(again))  # e.g. a spawned DataLoader worker: re-maps the cache
    assert isinstance(clone.indices.doc_idx, np.memmap)
    np.testing.assert_array_equal(clone[7], again[7])
    make_dataset(tmp_path / "d", 100, seed=1)  # same prefix, different document lengths
    assert GPTDataset(data.prefix, **kw).built_indices


def _rank_main(rank: int, prefix: str, cache: str, barrier, queue) -> None:
    ds = GPTDataset(prefix, "train", 8, 777, seed=4, cache_dir=cache, is_builder=rank == 0, barrier=barrier.wait)
    queue.put((rank, ds.built_indices, np.stack([ds[i] for i in range(len(ds))]).tobytes()))


@pytest.mark.slow
def test_one_builder_others_mmap_after_barrier(tmp_path: Path) -> None:
    data = make_dataset(tmp_path / "d", 200, seed=0)
    ctx = mp.get_context("spawn")
    barrier, queue = ctx.Barrier(3), ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(r, data.prefix, str(tmp_path / "c"), barrier, queue)) for r in range(3)]
    for p in procs:
        p.start()
    results = sorted(queue.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert [built for _, built, _ in results] == [True, False, False]
    assert results[0][2] == results[1][2] == results[2][2]


def test_non_builder_without_cache_errors(data: IndexedDataset, tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="the is_builder process must build them before the barrier"):
        GPTDataset(data, "train", 8, 10, cache_dir=tmp_path / "empty", is_builder=False)


# ---------------------------------------------------------------------------- bad input
def test_bad_dataset_arguments(tmp_path: Path) -> None:
    small = make_dataset(tmp_path / "s", 10, seed=0, max_len=5)
    with pytest.raises(ValueError, match="the 'valid' split of .* has zero documents"):
        GPTDataset(small, "valid", 4, 10, split="949,50,1")
    total = small.num_tokens
    with pytest.raises(ValueError, match=rf"seq_len: {total} \(\+1 target token\) is longer than the whole split"):
        GPTDataset(small, "train", total, 10, split="1,0,0")
    with pytest.raises(ValueError, match="split: expected comma-separated numbers"):
        GPTDataset(small, "train", 4, 10, split="a,b")
    with pytest.raises(ValueError, match="split_name"):
        GPTDataset(small, "dev", 4, 10)
    with pytest.raises(ValueError, match="num_samples: expected a positive integer"):
        GPTDataset(small, "train", 2, 0, split="1,0,0")
