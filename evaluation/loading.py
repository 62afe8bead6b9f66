"""Load a ``megaflex-train`` checkpoint for evaluation: any ZeRO stage, any TP size.

A checkpoint folder (``<checkpoint.dir>/step_XXXXXXXX``, or ``<checkpoint.dir>`` whose ``latest``
names it) holds DeepSpeed engine files plus ``megaflex.json`` (resolved config, TP size,
parameter shapes, per-file checksums); see ``megaflex.checkpoint_layout``. Weights are recovered per saved TP rank

* ZeRO 0: ``mp_rank_XX_model_states.pt["module"]``;
* ZeRO 1-3: the fp32 master weights consolidated over data-parallel ranks with DeepSpeed's
  ``zero_to_fp32`` (run on each TP rank's files separately),

then resharded to the evaluation's TP size with ``megaflex.parallel.reshard`` when it differs,
and loaded into a fresh ``GPT``. No DeepSpeed engine or optimizer is built.
"""

from __future__ import annotations

import contextlib
import io
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from megaflex.checkpoint_layout import (
    META_FILE, complete_tags, find_resume_path, model_states_file, tp_rank_files, verify_checkpoint, zero_optim_files,
)
from megaflex.model.config import ModelConfig
from megaflex.model.gpt import GPT


@dataclass
class LoadedCheckpoint:
    """A model ready for evaluation and what came with it."""

    model: GPT
    config: dict[str, Any]  # the resolved run config stored in the checkpoint
    meta: dict[str, Any]
    path: Path
    tokenizer: Any  # megaflex.data.tokenizer.Tokenizer or None

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    @property
    def eod_id(self) -> int | None:
        return getattr(self.tokenizer, "eod_id", None)


def resolve_checkpoint(checkpoint: str | os.PathLike, tag: str | None = None) -> Path:
    """A complete checkpoint folder from a folder, its parent ``checkpoint.dir`` or a run dir
    (whose ``checkpoints/`` holds the tags); ``tag`` picks one tag instead of the newest."""
    root = Path(checkpoint)
    if (root / META_FILE).is_file() and tag is None:
        return root
    searched = [d for d in (root, root / "checkpoints") if d.is_dir()]
    for ckpt_dir in searched:
        if tag is None:
            path = find_resume_path(ckpt_dir, "auto")
            if path is not None:
                return path
        elif (ckpt_dir / tag / META_FILE).is_file():
            return ckpt_dir / tag
    if tag is not None:
        have = {os.fspath(d): complete_tags(d) for d in searched}
        raise ValueError(f"tag: {tag!r} is not a complete checkpoint under {os.fspath(checkpoint)!r}; complete tags: {have}")
    raise ValueError(f"checkpoint: expected a checkpoint folder (with {META_FILE}) or a directory holding "
                     f"complete checkpoints, got {os.fspath(checkpoint)!r}")


def load_tp_state_dicts(path: Path, tp_size: int) -> list[dict[str, torch.Tensor]]:
    """One fp32 state dict per saved TP rank (each that rank's shards, consolidated over ZeRO)."""
    out = []
    for tp_rank in range(tp_size):
        if zero_optim_files(path, tp_rank):
            state = _zero_consolidated(path, tp_rank)
        else:
            model_file = model_states_file(path, tp_rank)
            if not model_file.is_file():
                raise ValueError(f"checkpoint: {model_file} not found (expected DeepSpeed files for TP rank {tp_rank})")
            state = torch.load(model_file, map_location="cpu", weights_only=False)["module"]
        out.append({k: (v.float() if v.is_floating_point() else v) for k, v in state.items()})
    return out


def _zero_consolidated(path: Path, tp_rank: int) -> dict[str, torch.Tensor]:
    """``zero_to_fp32`` over the files of one TP rank (it globs a folder, so give it a view
    holding only that rank's model- and optimizer-state files)."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        view = Path(tmp) / "view"
        view.mkdir()
        for f in tp_rank_files(path, tp_rank):
            os.symlink(f.resolve(), view / f.name)
        with contextlib.redirect_stdout(io.StringIO()):  # zero_to_fp32 prints progress
            return dict(get_fp32_state_dict_from_zero_checkpoint(tmp, tag="view"))


def load_for_eval(
    checkpoint: str | os.PathLike,
    *,
    tag: str | None = None,
    tokenizer: str | None = None,
    device: str | torch.device = "cpu",
    layers: Any = None,
) -> LoadedCheckpoint:
    """Build the checkpoint's GPT with ``layers`` (default single device) and load its weights.

    ``layers`` may be a ``TensorParallelLayers`` of any TP size; the saved shards are resharded
    to it (exactly: ``megaflex.parallel.reshard``). ``tokenizer`` overrides the tokenizer path
    recorded in the run config (``data.tokenizer``).
    """
    from megaflex.parallel.reshard import gpt_layout, load_state_dict_checked, reshard

    path = resolve_checkpoint(checkpoint, tag)
    meta = verify_checkpoint(path)  # a truncated/damaged file is named before torch reads it
    config = meta["config"]
    model_config = ModelConfig.from_dict(config["model"])
    model = GPT(model_config, layers)
    target_tp, target_rank = model.layer_factory.tp_size, model.layer_factory.tp_rank
    shards = load_tp_state_dicts(path, int(meta.get("tensor_parallel_size", 1)))
    if len(shards) != target_tp:
        shards = reshard(shards, gpt_layout(model_config), target_tp)
    load_state_dict_checked(model, shards[target_rank])
    model.to(device).eval()
    tok_path = tokenizer or (config.get("data") or {}).get("tokenizer")
    tok = None
    if tok_path:
        from megaflex.data.tokenizer import Tokenizer

        tok = Tokenizer(tok_path)
    return LoadedCheckpoint(model, config, meta, path, tok)
