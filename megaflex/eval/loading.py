"""Load a ``megaflex-train`` checkpoint for evaluation: any ZeRO stage, any TP size.

A checkpoint folder (``<checkpoint.dir>/step_XXXXXXXX``, or ``<checkpoint.dir>`` whose ``latest``
names it, or a run directory) as ``megaflex.checkpoint`` lays it out. The weights are
consolidated over ZeRO and resharded to the evaluation's TP size by
``megaflex.checkpoint.load_checkpoint_weights`` (shared with training's ``checkpoint.init_from``)
and loaded into a fresh ``GPT``. No DeepSpeed engine or optimizer is built.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from megaflex.checkpoint import CheckpointError, CheckpointMeta, load_checkpoint_weights, resolve_checkpoint
from megaflex.model.config import ModelConfig
from megaflex.model.gpt import GPT

if TYPE_CHECKING:
    from megaflex.parallel import ParallelState, TensorParallelRNGTracker

__all__ = ["USER_ERRORS", "LoadedCheckpoint", "load_for_eval", "refuse_bidirectional", "resolve_checkpoint"]  # resolve_checkpoint: re-exported

# What the evaluation commands report as one `error:` line with exit status 2: bad arguments,
# data (DataError, TokenizerMismatchError are ValueErrors), missing files, unusable checkpoints.
USER_ERRORS = (ValueError, FileNotFoundError, NotADirectoryError, IsADirectoryError, CheckpointError)


@dataclass
class LoadedCheckpoint:
    """A model ready for evaluation and what came with it."""

    model: GPT
    config: dict[str, Any]  # the resolved run config stored in the checkpoint
    meta: CheckpointMeta
    path: Path
    tokenizer: Any  # megaflex.data.tokenizer.Tokenizer or None

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    @property
    def eod_id(self) -> int | None:
        return getattr(self.tokenizer, "eod_id", None)


def refuse_bidirectional(checkpoint: str | os.PathLike, tag: str | None, use: str) -> None:
    """ValueError when the checkpoint holds a bidirectional model (``model.causal: false``), which
    ``use`` (perplexity, generation) cannot serve: checked from its metadata, before any weight is read."""
    path = resolve_checkpoint(checkpoint, tag)
    if CheckpointMeta.read(path).model_config.get("causal", True) is False:  # saved before the field: causal
        raise ValueError(f"checkpoint {path} holds a bidirectional model (model.causal: false), which sees every "
                         f"token it is asked to predict: {use} needs a causal language model (an encoder is trained "
                         "and tested by python -m megaflex.training.classify)")


def load_for_eval(
    checkpoint: str | os.PathLike,
    *,
    tag: str | None = None,
    tokenizer: str | None = None,
    device: str | torch.device = "cpu",
    parallel: "ParallelState | None" = None,
    rng_tracker: "TensorParallelRNGTracker | None" = None,
) -> LoadedCheckpoint:
    """Build the checkpoint's GPT, parallelised over ``parallel`` (default single device;
    ``rng_tracker``: its TP-region stream), and load its weights.

    ``parallel`` may have any TP size; the saved shards are resharded to it (exactly:
    ``megaflex.checkpoint.reshard``). ``tokenizer`` overrides the tokenizer path recorded in the
    run config (``data.tokenizer``). A bidirectional model loads too: callers that need a
    language model check ``refuse_bidirectional`` first.
    """
    from megaflex.checkpoint.reshard import load_state_dict_checked
    from megaflex.parallel import parallelize_gpt

    tp_size, tp_rank = (parallel.tp_size, parallel.tp_rank) if parallel is not None else (1, 0)
    weights, meta, path = load_checkpoint_weights(checkpoint, tp_size, tp_rank, tag)
    config = meta.config
    model = GPT(ModelConfig.from_dict(meta.model_config))
    if parallel is not None:
        model = parallelize_gpt(model, parallel, rng_tracker)
    load_state_dict_checked(model, weights)
    model.to(device).eval()
    tok_path = tokenizer or (config.get("data") or {}).get("tokenizer")
    tok = None
    if tok_path:
        from megaflex.data.tokenizer import Tokenizer

        tok = Tokenizer(tok_path)
    return LoadedCheckpoint(model, config, meta, path, tok)
