"""Model weights out of any megaflex checkpoint (no DeepSpeed engine or optimizer is built).

    state = load_model_state("runs/teacher", tp_size=2, tp_rank=1)  # this rank's shard

A checkpoint is read per saved TP rank (``megaflex.checkpoint.shards``: any ZeRO stage, pipeline
stages gathered; a plain GPT state dict per TP rank), then resharded exactly to the caller's TP
size (``megaflex.checkpoint.reshard``). Training uses it for ``checkpoint.init_from`` (``megaflex.training.weights``) and distillation teachers;
evaluation (``megaflex.eval.loading``) for every checkpoint it reads.
"""

from __future__ import annotations

import os
from pathlib import Path

from megaflex.checkpoint.layout import META_FILE, complete_tags, run_checkpoint_dir, verify_checkpoint
from megaflex.checkpoint.manager import select_checkpoint
from megaflex.checkpoint.metadata import CheckpointMeta
from megaflex.checkpoint.reshard import gpt_layout, reshard
from megaflex.checkpoint.shards import StateDict, load_tp_state_dicts
from megaflex.model.config import ModelConfig


# ------------------------------------------------------------------------------- reading
def resolve_checkpoint(checkpoint: str | os.PathLike, tag: str | None = None) -> Path:
    """A complete checkpoint folder from a folder, its parent ``checkpoint.dir`` or a run dir
    (whose ``run_checkpoint_dir`` holds the tags); ``tag`` picks one tag instead of the newest
    (``select_checkpoint``'s ``auto``; the checksums are verified by the reader)."""
    root = Path(checkpoint)
    if (root / META_FILE).is_file() and tag is None:
        return root
    searched = [d for d in (root, run_checkpoint_dir(root)) if d.is_dir()]
    for ckpt_dir in searched:
        if tag is None:
            path, _ = select_checkpoint(ckpt_dir, "auto")
            if path is not None:
                return path
        elif (ckpt_dir / tag / META_FILE).is_file():
            return ckpt_dir / tag
    if tag is not None:
        have = {os.fspath(d): complete_tags(d) for d in searched}
        raise ValueError(f"tag: {tag!r} is not a complete checkpoint under {os.fspath(checkpoint)!r}; complete tags: {have}")
    raise ValueError(f"checkpoint: expected a checkpoint folder (with {META_FILE}) or a directory holding "
                     f"complete checkpoints, got {os.fspath(checkpoint)!r}")


def load_checkpoint_weights(
    checkpoint: str | os.PathLike, tp_size: int = 1, tp_rank: int = 0, tag: str | None = None
) -> tuple[StateDict, CheckpointMeta, Path]:
    """(TP rank ``tp_rank``'s state dict at TP size ``tp_size``, the checkpoint's metadata, its
    folder). Checksums are verified first, so a damaged file is named before torch reads it."""
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank: expected 0 <= tp_rank < tp_size={tp_size}, got {tp_rank}")
    path = resolve_checkpoint(checkpoint, tag)
    meta = CheckpointMeta.from_dict(verify_checkpoint(path))
    model_config = ModelConfig.from_dict(meta.model_config)
    shards = load_tp_state_dicts(path, int(meta.tensor_parallel_size), meta.pp_size, model_config.num_layers)
    if len(shards) != tp_size:
        shards = reshard(shards, gpt_layout(model_config), tp_size)
    return shards[tp_rank], meta, path


def load_model_state(checkpoint: str | os.PathLike, tp_size: int = 1, tp_rank: int = 0) -> StateDict:
    """The consolidated weights of any megaflex checkpoint (any ZeRO stage, any saved TP size),
    resharded to ``tp_size`` and cut for ``tp_rank``."""
    return load_checkpoint_weights(checkpoint, tp_size, tp_rank)[0]
