"""Summarise and check a megatron-format dataset.

    python -m data_prep.inspect PREFIX [--verify] [--tokenizer P.model] [--json]

Prints sequence/document/token counts, a log2 histogram of document lengths, and (with
``--tokenizer``) a decoded sample. ``--verify`` runs the full consistency check: header, counts
vs. file sizes, contiguous pointers, monotonic document indices and, with a tokenizer, every token
id below the vocabulary size. The exit status is non-zero on any inconsistency.
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

from megaflex.data.card import read_data_card
from megaflex.data.indexed import DataError, IndexedDataset, IndexedDatasetError, data_file_path


def length_histogram(lengths: np.ndarray) -> list[tuple[int, int, int]]:
    """(lo, hi, count) per power-of-two bin [lo, hi) of the sequence lengths."""
    if len(lengths) == 0:
        return []
    bins = np.floor(np.log2(np.maximum(lengths, 1))).astype(np.int64)
    counts = np.bincount(bins)
    return [(1 << b if b else 0, 1 << (b + 1), int(c)) for b, c in enumerate(counts) if c]


def max_token_id(ds: IndexedDataset, chunk: int = 1 << 24) -> int:
    """Largest token id in the ``.bin``, scanned in chunks (bounded memory)."""
    flat = np.memmap(data_file_path(ds.prefix), mode="r", dtype=ds.dtype) if ds.num_tokens else np.zeros(0, ds.dtype)
    return max((int(flat[i : i + chunk].max()) for i in range(0, len(flat), chunk)), default=-1)


def inspect(prefix: str, verify: bool = False, tokenizer: str | None = None, sample_tokens: int = 64) -> dict:
    """Summary dict; raises IndexedDatasetError (a DataError) on an inconsistency, DataError for a
    data card that describes another .idx (``verify``)."""
    ds = IndexedDataset(prefix, verify=verify)
    if verify:
        read_data_card(prefix)  # checks that the card describes this .idx
    lengths = ds.sequence_lengths
    info: dict = {
        "prefix": prefix, "dtype": str(ds.dtype), "sequences": len(ds), "documents": ds.num_documents,
        "tokens": ds.num_tokens,
        "length_min": int(lengths.min()) if len(ds) else 0, "length_max": int(lengths.max()) if len(ds) else 0,
        "length_mean": float(lengths.mean()) if len(ds) else 0.0,
        "histogram": length_histogram(lengths),
    }
    if tokenizer:
        from megaflex.data.tokenizer import Tokenizer

        tok = Tokenizer(tokenizer)
        if verify:
            top = max_token_id(ds)
            if top >= tok.vocab_size:
                raise IndexedDatasetError(f"{data_file_path(prefix)}: token id {top} >= vocab size {tok.vocab_size} of {tokenizer}")
        if len(ds):
            info["sample"] = tok.decode(ds.get(0, 0, min(sample_tokens, int(lengths[0]))))
    elif len(ds):
        info["sample_ids"] = ds.get(0, 0, min(sample_tokens, int(lengths[0]))).tolist()
    return info


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("prefix")
    ap.add_argument("--verify", action="store_true", help="full consistency check; non-zero exit on failure")
    ap.add_argument("--tokenizer", help="P.model or P.json, to decode a sample and check token ids")
    ap.add_argument("--sample-tokens", type=int, default=64)
    ap.add_argument("--json", action="store_true", help="print the summary as JSON")
    a = ap.parse_args(argv)
    try:
        info = inspect(a.prefix, a.verify, a.tokenizer, a.sample_tokens)
    except (DataError, FileNotFoundError) as e:  # IndexedDatasetError included
        print(f"INCONSISTENT: {e}", file=sys.stderr)
        return 1
    if a.json:
        print(json.dumps(info, indent=2))
        return 0
    print(f"{info['prefix']}: {info['sequences']} sequences, {info['documents']} documents, "
          f"{info['tokens']} tokens, dtype {info['dtype']}")
    print(f"lengths: min {info['length_min']}, mean {info['length_mean']:.1f}, max {info['length_max']}")
    width = max((c for _, _, c in info["histogram"]), default=1)
    for lo, hi, c in info["histogram"]:
        print(f"  [{lo:>8}, {hi:>8}) {c:>9} {'#' * max(1, round(40 * c / width))}")
    if "sample" in info:
        print(f"sample (document 0, first {a.sample_tokens} tokens): {info['sample']!r}")
    elif "sample_ids" in info:
        print(f"sample ids (document 0): {info['sample_ids']}")
    if a.verify:
        print("verify: OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
