"""Model weights out of any megaflex checkpoint (no DeepSpeed engine or optimizer is built).

    state = load_model_state("runs/teacher", tp_size=2, tp_rank=1)  # this rank's shard

A checkpoint is read per saved TP rank (file names: ``megaflex.checkpoint.layout``):

* ZeRO 0: ``mp_rank_XX_model_states.pt["module"]``;
* ZeRO 1-3: the fp32 master weights consolidated over data-parallel ranks with DeepSpeed's
  ``zero_to_fp32`` (run on each TP rank's files separately); frozen parameters, which ZeRO 1
  keeps only in the module state, are taken from there,

A pipeline-parallel checkpoint (``pipeline_parallel_size`` > 1 in its metadata) is read per stage
and TP rank the same way (ZeRO 1: ``zero_to_fp32`` over model-parallel rank stage x tp + tp_rank;
ZeRO 0: the pipeline engine's per-layer files) and its parameter names mapped back to the GPT's
(``megaflex.parallel.pipeline.gpt_parameter_name``), so every reader gets a plain GPT state dict,

then resharded exactly to the caller's TP size (``megaflex.checkpoint.reshard``). Training uses
it for ``checkpoint.init_from`` (``megaflex.training.weights``) and distillation teachers;
evaluation (``megaflex.eval.loading``) for every checkpoint it reads.
"""

from __future__ import annotations

import contextlib
import io
import os
import tempfile
from pathlib import Path

import torch

from megaflex.checkpoint.layout import (
    META_FILE, complete_tags, model_states_file, pipeline_layer_files, run_checkpoint_dir, tp_rank_files,
    verify_checkpoint, zero_optim_files,
)
from megaflex.checkpoint.manager import select_checkpoint
from megaflex.checkpoint.metadata import CheckpointMeta
from megaflex.model.config import ModelConfig

StateDict = dict[str, torch.Tensor]


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


def load_tp_state_dicts(path: Path, tp_size: int, pp_size: int = 1, num_layers: int = 0) -> list[StateDict]:
    """One fp32 state dict per saved TP rank (each that rank's shards, consolidated over ZeRO and,
    with ``pp_size`` > 1, over the pipeline stages of a ``num_layers``-block GPT)."""
    if pp_size > 1:
        return [_pipeline_state_dict(path, tp_size, pp_size, num_layers, tp_rank) for tp_rank in range(tp_size)]
    return [_model_parallel_state_dict(path, tp_rank) for tp_rank in range(tp_size)]


def _model_parallel_state_dict(path: Path, mp_rank: int) -> StateDict:
    """The fp32 weights DeepSpeed saved for model-parallel rank ``mp_rank`` (the TP rank without PP)."""
    model_file = model_states_file(path, mp_rank)  # ZeRO 0-2 (ZeRO 3 writes per-rank model states)
    module = torch.load(model_file, map_location="cpu", weights_only=False)["module"] if model_file.is_file() else None
    if zero_optim_files(path, mp_rank):
        state = _zero_consolidated(path, mp_rank)
        # Frozen parameters (not in the optimizer) are kept by ZeRO 1 only in the module's
        # state dict (ZeRO 2/3 save them as fragments that zero_to_fp32 already merged).
        state.update({k: v for k, v in (module or {}).items() if k not in state and v.numel() > 0})
    elif module is not None:
        state = module
    else:
        raise ValueError(f"checkpoint: {model_file} not found (expected DeepSpeed files for model-parallel rank {mp_rank})")
    return {k: (v.float() if v.is_floating_point() else v) for k, v in state.items()}


def _pipeline_state_dict(path: Path, tp_size: int, pp_size: int, num_layers: int, tp_rank: int) -> StateDict:
    """TP rank ``tp_rank``'s GPT state dict gathered over the stages of a pipeline checkpoint (the
    tied embedding, held by the first and the last stage, is one weight: the first stage's)."""
    from megaflex.parallel.pipeline import gpt_parameter_name

    if zero_optim_files(path, tp_rank):  # ZeRO 1: the fp32 masters, per model-parallel rank stage x tp + tp_rank
        named = {}
        for stage in range(pp_size):
            named = _model_parallel_state_dict(path, stage * tp_size + tp_rank) | named
    else:  # ZeRO 0: the engine's own per-layer files, named "<layer index>.<name in the layer>"
        named = {}
        for index, file in pipeline_layer_files(path, tp_rank).items():
            layer = torch.load(file, map_location="cpu", weights_only=False)
            named.update({f"{index}.{k}": v for k, v in layer.items() if f"{index}.{k}" not in named})
        if not named:
            raise ValueError(f"checkpoint: no pipeline layer files for TP rank {tp_rank} in {path}")
    out: StateDict = {}
    for name, value in named.items():
        out.setdefault(gpt_parameter_name(name, num_layers), value.float() if value.is_floating_point() else value)
    return out


def _zero_consolidated(path: Path, tp_rank: int) -> StateDict:  # tp_rank: the model-parallel rank
    """``zero_to_fp32`` over the files of one TP rank (it globs a folder, so give it a view
    holding only that rank's model- and optimizer-state files)."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        view = Path(tmp) / "view"
        view.mkdir()
        for f in tp_rank_files(path, tp_rank):
            if f == model_states_file(path, tp_rank):
                states = torch.load(f, map_location="cpu", weights_only=False)
                if states.get("module") is None:  # the pipeline engine keeps the weights in per-layer files
                    torch.save({**states, "module": {}}, view / f.name)  # zero_to_fp32 reads its buffers
                    continue
            os.symlink(f.resolve(), view / f.name)
        with contextlib.redirect_stdout(io.StringIO()):  # zero_to_fp32 prints progress
            return dict(get_fp32_state_dict_from_zero_checkpoint(tmp, tag="view"))


def load_checkpoint_weights(
    checkpoint: str | os.PathLike, tp_size: int = 1, tp_rank: int = 0, tag: str | None = None
) -> tuple[StateDict, CheckpointMeta, Path]:
    """(TP rank ``tp_rank``'s state dict at TP size ``tp_size``, the checkpoint's metadata, its
    folder). Checksums are verified first, so a damaged file is named before torch reads it."""
    from megaflex.checkpoint.reshard import gpt_layout, reshard

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
