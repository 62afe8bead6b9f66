"""Model weights out of any megaflex checkpoint, and warm starts from them.

    state = load_model_state("runs/teacher/checkpoints", tp_size=2, tp_rank=1)  # this rank's shard
    copied, path = init_from_checkpoint(model, "runs/teacher", "all")         # warm start

A checkpoint is read per saved TP rank (file names: ``megaflex.checkpoint_layout``):

* ZeRO 0: ``mp_rank_XX_model_states.pt["module"]``;
* ZeRO 1-3: the fp32 master weights consolidated over data-parallel ranks with DeepSpeed's
  ``zero_to_fp32`` (run on each TP rank's files separately),

then resharded exactly to the caller's TP size (``megaflex.parallel.reshard``). No DeepSpeed
engine or optimizer is built. Training uses it for ``checkpoint.init_from``; evaluation
(``evaluation.loading``) for every checkpoint it reads.

``init_from_checkpoint`` copies a selection of the parameters into a freshly built model:
``all``, ``kernel`` (the learnable kernel: what the feature maps declare) or ``non_kernel``. A
parameter the checkpoint lacks may only be one a softmax model has not got (kernel parameters
and linear attention's per-head output gain, e.g. a softmax checkpoint into a Flexformer
student): it keeps its fresh init.
"""

from __future__ import annotations

import contextlib
import io
import os
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import nn

from megaflex.checkpoint_layout import (
    META_FILE, complete_tags, find_resume_path, model_states_file, tp_rank_files, verify_checkpoint, zero_optim_files,
)
from megaflex.model.config import ModelConfig
from megaflex.training.config_loader import ConfigError

INIT_PARAMETERS = ("all", "kernel", "non_kernel")
StateDict = dict[str, torch.Tensor]


# ------------------------------------------------------------------------------- reading
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


def load_tp_state_dicts(path: Path, tp_size: int) -> list[StateDict]:
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


def _zero_consolidated(path: Path, tp_rank: int) -> StateDict:
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


def load_checkpoint_weights(
    checkpoint: str | os.PathLike, tp_size: int = 1, tp_rank: int = 0, tag: str | None = None
) -> tuple[StateDict, dict[str, Any], Path]:
    """(TP rank ``tp_rank``'s state dict at TP size ``tp_size``, the checkpoint's metadata, its
    folder). Checksums are verified first, so a damaged file is named before torch reads it."""
    from megaflex.parallel.reshard import gpt_layout, reshard

    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank: expected 0 <= tp_rank < tp_size={tp_size}, got {tp_rank}")
    path = resolve_checkpoint(checkpoint, tag)
    meta = verify_checkpoint(path)
    shards = load_tp_state_dicts(path, int(meta.get("tensor_parallel_size", 1)))
    if len(shards) != tp_size:
        shards = reshard(shards, gpt_layout(ModelConfig.from_dict(meta["config"]["model"])), tp_size)
    return shards[tp_rank], meta, path


def load_model_state(checkpoint: str | os.PathLike, tp_size: int = 1, tp_rank: int = 0) -> StateDict:
    """The consolidated weights of any megaflex checkpoint (any ZeRO stage, any saved TP size),
    resharded to ``tp_size`` and cut for ``tp_rank``."""
    return load_checkpoint_weights(checkpoint, tp_size, tp_rank)[0]


# ------------------------------------------------------------------------------- warm start
def kernel_parameter_names(model: nn.Module) -> set[str]:
    """Names (as in ``model.named_parameters()``) of every parameter the feature maps (and
    attention wrappers) declare: ``megaflex.attention.named_kernel_parameters``."""
    from megaflex.attention import named_kernel_parameters

    return {name for name, _ in named_kernel_parameters(model)}


def linear_attention_parameter_names(model: nn.Module) -> set[str]:
    """The parameters a softmax model does not have: the kernel parameters plus linear
    attention's per-head output gain (the learnable scale of its rms normalisation)."""
    gains = {name for name, _ in model.named_parameters() if name.endswith("attn.out_gain")}
    return kernel_parameter_names(model) | gains


def select_parameters(model: nn.Module, selection: str) -> list[str]:
    """Names of ``model``'s parameters in ``selection`` (one of ``INIT_PARAMETERS``)."""
    if selection not in INIT_PARAMETERS:
        raise ValueError(f"selection: expected one of {INIT_PARAMETERS}, got {selection!r}")
    kernel = kernel_parameter_names(model)
    names = [name for name, _ in model.named_parameters()]
    if selection == "kernel":
        return [n for n in names if n in kernel]
    if selection == "non_kernel":
        return [n for n in names if n not in kernel]
    return names


@torch.no_grad()
def copy_parameters(model: nn.Module, state: StateDict, selection: str, source: str = "checkpoint") -> list[str]:
    """Copy the ``selection`` parameters of ``model`` from ``state``; returns the copied names.

    Selected linear-attention parameters (kernel, output gain) missing from ``state`` keep their
    init, unless ``selection`` is ``kernel``; any other missing one, and any shape mismatch, is a
    ``ConfigError`` naming the parameter and both shapes."""
    optional = linear_attention_parameter_names(model) if selection != "kernel" else set()
    params = dict(model.named_parameters())
    copied = []
    for name in select_parameters(model, selection):
        param = params[name]
        if name not in state:
            if name in optional:
                continue  # e.g. a softmax source: the student's kernel starts fresh
            raise ConfigError(
                f"checkpoint.init_from: {source} has no parameter {name!r} (the model's is {list(param.shape)}); "
                + ("init_parameters=kernel needs a source with this kernel" if selection == "kernel"
                   else "only kernel parameters and linear attention's out_gain may be missing")
            )
        value = state[name]
        if tuple(value.shape) != tuple(param.shape):
            raise ConfigError(
                f"checkpoint.init_from: parameter {name!r}: expected shape {list(param.shape)} (this model), "
                f"got {list(value.shape)} in {source}"
            )
        param.copy_(value.to(param.dtype))
        copied.append(name)
    return copied


def init_from_checkpoint(
    model: nn.Module, checkpoint: str | os.PathLike, selection: str = "all"
) -> tuple[list[str], Path]:
    """Warm start: copy ``selection`` of ``model``'s parameters from ``checkpoint`` (resharded to
    the model's TP layout). Returns (copied names, the checkpoint folder read); bad input is a
    ``ConfigError``."""
    factory = getattr(model, "layer_factory", None)
    tp_size, tp_rank = (factory.tp_size, factory.tp_rank) if factory is not None else (1, 0)
    try:
        state, _, path = load_checkpoint_weights(checkpoint, tp_size, tp_rank)
    except ValueError as e:
        raise ConfigError(f"checkpoint.init_from: {e}") from None
    return copy_parameters(model, state, selection, source=f"checkpoint {path}"), path
