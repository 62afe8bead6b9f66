"""What the benchmarks share: the benchmarked GPT's shape flags and its config, and the glibc malloc
settings their CPU workers run under."""

from __future__ import annotations

import argparse
import os

from megaflex.cli_args import nonnegative_int, positive_int
from megaflex.model.config import ModelConfig


# The benchmarked GPT's shape: small defaults that run on a 2-core CPU.
MODEL_DEFAULTS = dict(vocab_size=8000, num_layers=4, hidden_size=256, num_heads=4, feature_dim=64)


def add_model_arguments(parser: argparse.ArgumentParser, *, threads: bool = True, **defaults: int) -> None:
    """--vocab-size, --num-layers, ... of the benchmarked GPT (``MODEL_DEFAULTS``, or ``defaults``,
    which may add shape fields such as ``chunk_size``); ``threads``: also --threads."""
    for name, default in {**MODEL_DEFAULTS, **defaults}.items():
        parser.add_argument("--" + name.replace("_", "-"), type=positive_int, default=default)
    if threads:
        parser.add_argument("--threads", type=nonnegative_int, default=0, help="torch threads (0: torch default)")


def model_config(args: argparse.Namespace, kind: str, max_seq_len: int) -> ModelConfig:
    """The GPT of ``add_model_arguments``'s flags with attention ``kind``; ``<kind>_window<W>`` adds
    a W-token softmax window under one normaliser (``model.softmax_window``); a ``_capped`` suffix
    sets ``model.normalization=capped_denominator``."""
    kind, capped, _ = kind.partition("_capped")
    attention, _, window = kind.partition("_window")
    return ModelConfig(
        vocab_size=args.vocab_size, num_layers=args.num_layers, hidden_size=args.hidden_size,
        num_heads=args.num_heads, attention=attention, feature_dim=args.feature_dim, max_seq_len=max_seq_len,
        softmax_window=int(window) if window else 0, normalization="capped_denominator" if capped else "rms",
    )


# glibc malloc: never mmap (then munmap) large blocks, never trim the heap. PyTorch's CPU
# allocator does not cache, so without this every step's large temporaries are fresh pages that
# fault in (and are zeroed by the kernel) again: at 16k tokens that doubled the linear layers'
# time, and at the kernel-study shape it costs every kind 20-25% of its tokens/s.
# ``launch/setup_env.sh`` sets the first two on CPU nodes.
# ``glibc.malloc.hugetlb=1`` (glibc >= 2.35) madvises the heap for transparent huge pages (THP is
# usually "madvise"-only): streaming passes over the [H, N, F] tensors then take ~1/3 fewer cycles
# (TLB misses), ~8% of the layer at 64k tokens. Applied to every kind alike; jemalloc/tcmalloc
# with THP achieve the same in production.
MALLOC_TUNING = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(1 << 40), "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}


def worker_env(malloc_tuning: bool) -> dict[str, str]:
    """The environment of a benchmark's worker subprocess: this one's, plus ``MALLOC_TUNING`` unless
    ``malloc_tuning`` is False (the caller's own GLIBC_TUNABLES are kept)."""
    env = dict(os.environ)
    if malloc_tuning:
        env.update(MALLOC_TUNING)
        if os.environ.get("GLIBC_TUNABLES"):
            env["GLIBC_TUNABLES"] = os.environ["GLIBC_TUNABLES"] + ":" + MALLOC_TUNING["GLIBC_TUNABLES"]
    return env
