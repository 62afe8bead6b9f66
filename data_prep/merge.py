"""Concatenate indexed datasets (e.g. ``preprocess --docs-per-shard`` shards) into one.

    python -m data_prep.merge --input data/wt_00000 data/wt_00001 --output-prefix data/wt
    python -m data_prep.merge --input data/wt_*.bin --output-prefix data/wt   # shell globs work too

Inputs are prefixes (a trailing ``.bin``/``.idx`` is stripped, duplicates dropped, order kept);
all must share one dtype. Data is copied in 16 MiB chunks, so memory stays bounded. When the
inputs have data cards, they must name the same tokenizer, and the output gets a card too.
"""

from __future__ import annotations

import argparse
import sys

from megaflex.data.card import check_same_tokenizer, data_tokenizer, write_data_card
from megaflex.data.indexed import merge_datasets


def normalise_prefixes(inputs: list[str]) -> list[str]:
    """Strip ``.bin``/``.idx`` and de-duplicate, keeping first-seen order."""
    out: list[str] = []
    for p in inputs:
        if p.endswith((".bin", ".idx")):
            p = p[:-4]
        if p not in out:
            out.append(p)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--input", nargs="+", required=True, help="dataset prefixes, in output order")
    ap.add_argument("--output-prefix", required=True)
    a = ap.parse_args(argv)
    prefixes = normalise_prefixes(a.input)
    if a.output_prefix in prefixes:
        print(f"error: output-prefix {a.output_prefix} is also an input", file=sys.stderr)
        return 2
    try:
        tokenizers = [data_tokenizer(p) for p in prefixes]
        for p, t in zip(prefixes[1:], tokenizers[1:]):
            check_same_tokenizer(tokenizers[0], t, f"the data {prefixes[0]}", f"the data {p}")
        ds = merge_datasets(prefixes, a.output_prefix)
        if all(tokenizers):
            write_data_card(a.output_prefix, tokenizers[0], inputs=prefixes, dtype=str(ds.dtype), documents=ds.num_documents)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"merged {len(prefixes)} datasets into {ds}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
