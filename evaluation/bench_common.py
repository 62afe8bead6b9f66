"""What the model-level benchmarks share: the benchmarked GPT's shape flags and its config."""

from __future__ import annotations

import argparse

from megaflex.model.config import ModelConfig


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags for the benchmarked GPT's shape (small defaults that run on a 2-core CPU)."""
    parser.add_argument("--vocab-size", type=int, default=8000)
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--num-heads", type=int, default=4)
    parser.add_argument("--feature-dim", type=int, default=64)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch default)")


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
