"""Megatron indexed-dataset format: round trip, byte compatibility with megatron-core, bad files."""

from __future__ import annotations

import struct
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

from megaflex.data.indexed import (
    HEADER_SIZE,
    IndexedDataset,
    IndexedDatasetBuilder,
    IndexedDatasetError,
    check_vocab_fits,
    merge_datasets,
    optimal_dtype,
)

REPO = Path(__file__).resolve().parents[2]


def random_docs(n: int, vocab: int, seed: int, max_len: int = 50) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, rng.integers(0, max_len)) for _ in range(n)]


def write(prefix: Path, docs: list[np.ndarray], dtype=np.uint16) -> IndexedDataset:
    with IndexedDatasetBuilder(prefix, dtype=dtype) as b:
        for d in docs:
            b.add_document(d)
    return IndexedDataset(prefix)


def megatron_indexed():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.datasets import indexed_dataset
    return indexed_dataset


@pytest.mark.parametrize("dtype", [np.uint16, np.int32, np.int64, np.uint8])
def test_round_trip(tmp_path: Path, dtype) -> None:
    docs = random_docs(200, 250, seed=0)
    ds = write(tmp_path / "d", docs, dtype)
    assert len(ds) == ds.num_documents == 200
    assert ds.dtype == np.dtype(dtype)
    assert ds.num_tokens == sum(len(d) for d in docs)
    for i, d in enumerate(docs):
        np.testing.assert_array_equal(ds[i], d)
        if len(d) > 3:  # partial reads are views at the right offset
            np.testing.assert_array_equal(ds.get(i, 2, len(d) - 3), d[2:-1])
    ds.verify()
    assert np.shares_memory(ds.get(5), ds._bin)  # zero copy


def test_optimal_dtype_follows_megatron() -> None:
    mi = megatron_indexed()
    for v in (100, 32000, 65499, 65500, 65536, 100_000):
        assert optimal_dtype(v) == np.dtype(mi.DType.optimal_dtype(v))


def test_files_byte_identical_to_megatron_builder(tmp_path: Path) -> None:
    import torch

    mi = megatron_indexed()
    docs = random_docs(300, 60000, seed=1)
    write(tmp_path / "ours", docs, np.uint16)
    builder = mi.IndexedDatasetBuilder(str(tmp_path / "theirs.bin"), dtype=np.uint16)
    for d in docs:
        builder.add_item(torch.from_numpy(d.astype(np.int64)))
        builder.end_document()
    builder.finalize(str(tmp_path / "theirs.idx"))
    for ext in ("bin", "idx"):
        assert (tmp_path / f"ours.{ext}").read_bytes() == (tmp_path / f"theirs.{ext}").read_bytes()


def test_megatron_reads_ours(tmp_path: Path) -> None:
    mi = megatron_indexed()
    docs = random_docs(120, 100_000, seed=2)
    write(tmp_path / "ours", docs, np.int32)
    theirs = mi.IndexedDataset(str(tmp_path / "ours"))
    assert len(theirs) == len(docs)
    np.testing.assert_array_equal(theirs.document_indices, np.arange(len(docs) + 1))
    for i, d in enumerate(docs):
        np.testing.assert_array_equal(theirs[i], d)
        if len(d) > 4:
            np.testing.assert_array_equal(theirs.get(i, offset=1, length=3), d[1:4])


def test_we_read_megatron_multi_sequence_documents(tmp_path: Path) -> None:
    import torch

    mi = megatron_indexed()
    rng = np.random.default_rng(3)
    builder = mi.IndexedDatasetBuilder(str(tmp_path / "m.bin"), dtype=np.int32)
    docs = []
    for _ in range(40):  # documents of 1-3 sequences ("sentences")
        seqs = [rng.integers(0, 70000, rng.integers(1, 20)) for _ in range(rng.integers(1, 4))]
        for s in seqs:
            builder.add_item(torch.from_numpy(s))
        builder.end_document()
        docs.append(seqs)
    builder.finalize(str(tmp_path / "m.idx"))
    ds = IndexedDataset(tmp_path / "m", verify=True)
    assert ds.dtype == np.int32 and ds.num_documents == 40
    assert len(ds) == sum(len(s) for s in docs)
    flat = [s for seqs in docs for s in seqs]
    for i, s in enumerate(flat):
        np.testing.assert_array_equal(ds[i], s)
    for j, seqs in enumerate(docs):
        np.testing.assert_array_equal(ds.document(j), np.concatenate(seqs))


def test_merge_concatenates(tmp_path: Path) -> None:
    a, b = random_docs(30, 500, seed=4), random_docs(20, 500, seed=5)
    write(tmp_path / "a", a)
    write(tmp_path / "b", b)
    merged = merge_datasets([tmp_path / "a", tmp_path / "b"], tmp_path / "ab")
    merged.verify()
    assert len(merged) == 50
    for i, d in enumerate(a + b):
        np.testing.assert_array_equal(merged[i], d)
    write(tmp_path / "c", a, np.int32)
    with pytest.raises(ValueError, match="dtype"):
        merge_datasets([tmp_path / "a", tmp_path / "c"], tmp_path / "ac")


def test_merge_cli_and_inspect_cli(tmp_path: Path) -> None:
    write(tmp_path / "s_00000", random_docs(10, 300, seed=6))
    write(tmp_path / "s_00001", random_docs(15, 300, seed=7))
    run = lambda *args: subprocess.run([sys.executable, "-m", *args], cwd=REPO, capture_output=True, text=True)
    r = run("data_prep.merge", "--input", str(tmp_path / "s_00000.bin"), str(tmp_path / "s_00000.idx"),
            str(tmp_path / "s_00001"), "--output-prefix", str(tmp_path / "s"))
    assert r.returncode == 0, r.stderr
    assert len(IndexedDataset(tmp_path / "s")) == 25
    r = run("data_prep.inspect", str(tmp_path / "s"), "--verify")
    assert r.returncode == 0, r.stderr
    assert "25 sequences" in r.stdout and "verify: OK" in r.stdout
    with open(tmp_path / "s.bin", "r+b") as f:  # truncate -> non-zero exit naming the file
        f.truncate(10)
    r = run("data_prep.inspect", str(tmp_path / "s"), "--verify")
    assert r.returncode != 0 and "s.bin" in r.stderr and "truncated" in r.stderr


# ---------------------------------------------------------------------------- bad files
@pytest.fixture
def good(tmp_path: Path) -> Path:
    write(tmp_path / "g", random_docs(20, 300, seed=8, max_len=30) + [np.arange(5)])
    return tmp_path / "g"


def patch(path: Path, offset: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def test_truncated_bin(good: Path) -> None:
    size = good.with_suffix(".bin").stat().st_size
    with open(good.with_suffix(".bin"), "r+b") as f:
        f.truncate(size - 2)
    with pytest.raises(IndexedDatasetError, match=r"g\.bin: truncated"):
        IndexedDataset(good)


def test_extra_bytes_in_bin(good: Path) -> None:
    with open(good.with_suffix(".bin"), "ab") as f:
        f.write(b"\0\0")
    with pytest.raises(IndexedDatasetError, match=r"g\.bin: 2 bytes more"):
        IndexedDataset(good)


def test_wrong_magic(good: Path) -> None:
    patch(good.with_suffix(".idx"), 0, b"XXIDIDX\0\0")
    with pytest.raises(IndexedDatasetError, match=r"g\.idx: wrong magic"):
        IndexedDataset(good)


def test_unknown_version(good: Path) -> None:
    patch(good.with_suffix(".idx"), 9, struct.pack("<Q", 2))
    with pytest.raises(IndexedDatasetError, match=r"g\.idx: unknown version 2"):
        IndexedDataset(good)


def test_unknown_dtype_code(good: Path) -> None:
    patch(good.with_suffix(".idx"), 17, bytes([9]))
    with pytest.raises(IndexedDatasetError, match=r"g\.idx: unknown dtype code 9"):
        IndexedDataset(good)


def test_counts_disagree_with_file_size(good: Path) -> None:
    patch(good.with_suffix(".idx"), 18, struct.pack("<Q", 22))
    with pytest.raises(IndexedDatasetError, match=r"g\.idx: header says 22 sequences.*but the file has"):
        IndexedDataset(good)


def test_idx_shorter_than_header(good: Path) -> None:
    with open(good.with_suffix(".idx"), "r+b") as f:
        f.truncate(HEADER_SIZE - 1)
    with pytest.raises(IndexedDatasetError, match="shorter than the 34-byte header"):
        IndexedDataset(good)


def test_pointer_past_end_of_bin(good: Path) -> None:
    ds = IndexedDataset(good)
    n = len(ds)
    ptr_off = HEADER_SIZE + 4 * n
    del ds
    patch(good.with_suffix(".idx"), ptr_off + 8 * 3, struct.pack("<q", 10**9))  # a middle pointer
    ds = IndexedDataset(good)  # cheap checks pass; the read and verify() must not
    with pytest.raises(IndexedDatasetError, match=r"sequence 3 points to bytes .* past the end of .*g\.bin"):
        ds.get(3)
    with pytest.raises(IndexedDatasetError, match=r"g\.idx: 1 sequence pointers disagree.*first is sequence 3"):
        ds.verify()
    patch(good.with_suffix(".idx"), ptr_off + 8 * (n - 1), struct.pack("<q", 10**9))  # the last one
    with pytest.raises(IndexedDatasetError, match="last sequence pointer points past the end"):
        IndexedDataset(good)


def test_document_indices_inconsistent(good: Path) -> None:
    n = len(IndexedDataset(good))
    patch(good.with_suffix(".idx"), HEADER_SIZE + 12 * n + 8 * n, struct.pack("<q", n + 5))
    with pytest.raises(IndexedDatasetError, match="document indices must start at 0 and end at the sequence count"):
        IndexedDataset(good)


def test_missing_files(tmp_path: Path, good: Path) -> None:
    with pytest.raises(IndexedDatasetError, match=r"nope\.idx: file not found"):
        IndexedDataset(tmp_path / "nope")
    good.with_suffix(".bin").unlink()
    with pytest.raises(IndexedDatasetError, match=r"g\.bin: file not found"):
        IndexedDataset(good)


def test_vocab_must_fit_dtype(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="70000 tokens does not fit uint16"):
        check_vocab_fits(70000, np.uint16)
    with pytest.raises(ValueError, match="does not fit uint16"):
        IndexedDatasetBuilder(tmp_path / "x", dtype=np.uint16, vocab_size=70000)
    with IndexedDatasetBuilder(tmp_path / "y", dtype=np.uint16, vocab_size=1000) as b:
        with pytest.raises(ValueError, match=r"ids must lie in \[0, 999\]"):
            b.add_document(np.array([1, 1000]))
        b.add_document(np.array([1, 999]))
    assert len(IndexedDataset(tmp_path / "y")) == 1


def test_interrupted_write_leaves_nothing(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError):
        with IndexedDatasetBuilder(tmp_path / "z") as b:
            b.add_document(np.arange(4))
            raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) == []


def test_pickle_reopens(good: Path) -> None:
    import pickle

    ds = IndexedDataset(good)
    ds2 = pickle.loads(pickle.dumps(ds))
    np.testing.assert_array_equal(ds2[4], ds[4])
