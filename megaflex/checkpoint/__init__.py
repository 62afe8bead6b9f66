"""Everything megaflex knows about checkpoints, in one package.

* ``layout``: file and folder names (tags, ``latest``, metadata, RNG files, universal copies, a
  run's ``checkpoints/`` and ``merged/``), checksums, atomic file writes;
* ``metadata``: ``CheckpointMeta``, the typed ``megaflex.json``;
* ``manager``: atomic saves and loads of a DeepSpeed engine, checksum verification, and
  ``select_checkpoint``, the one resume decision; ``save_weights_only`` for weights-only saves;
* ``background``: saves off the training step (``checkpoint.background``): host copies of
  DeepSpeed's state dicts, written and hashed by a thread, committed by the manager;
* ``compat``: what a run checks in a checkpoint's metadata before resuming from it;
* ``shards``: the saved shards as plain GPT state dicts, one per saved TP rank (any ZeRO stage, PP gathered);
* ``weights``: model weights out of any checkpoint, resharded to any TP size;
* ``reshard``: exact conversion between TP sizes, safetensors export (``python -m
  megaflex.checkpoint.reshard``).

Layering: it uses ``megaflex.model`` and ``megaflex.parallel``; training, evaluation and the
export commands use it, nothing below them does.
"""

from megaflex.checkpoint import layout
from megaflex.checkpoint.compat import (
    check_compatible, check_optimizer_groups, check_resume_layout, needs_repartition, parameter_shapes,
)
from megaflex.checkpoint.layout import (
    CheckpointError, CorruptCheckpointError, complete_tags, merged_checkpoint_dir, run_checkpoint_dir,
)
from megaflex.checkpoint.manager import CheckpointManager, preflight, save_weights_only, select_checkpoint
from megaflex.checkpoint.metadata import CheckpointMeta
from megaflex.checkpoint.weights import load_checkpoint_weights, load_model_state, resolve_checkpoint

__all__ = [
    "CheckpointError", "CheckpointManager", "CheckpointMeta", "CorruptCheckpointError", "check_compatible",
    "check_optimizer_groups", "check_resume_layout", "complete_tags", "layout", "load_checkpoint_weights",
    "load_model_state", "merged_checkpoint_dir", "needs_repartition", "parameter_shapes", "preflight",
    "resolve_checkpoint", "run_checkpoint_dir", "save_weights_only", "select_checkpoint",
]
