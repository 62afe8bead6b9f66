"""Concatenate indexed datasets (e.g. ``preprocess --docs-per-shard`` shards) into one.

    python -m data_prep.merge --input data/wt_00000 data/wt_00001 --output-prefix data/wt
    python -m data_prep.merge --input data/wt_*.bin --output-prefix data/wt   # shell globs work too

Inputs are prefixes (a trailing ``.bin``/``.idx`` is stripped, duplicates dropped, order kept);
all must share one dtype. Data is copied in 16 MiB chunks, so memory stays bounded.
"""

from __future__ import annotations

import argparse
import sys

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
        ds = merge_datasets(prefixes, a.output_prefix)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"merged {len(prefixes)} datasets into {ds}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
