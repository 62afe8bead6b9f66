"""Warm starts: copy a selection of a checkpoint's parameters into a freshly built model.

    copied, path = init_from_checkpoint(model, "runs/teacher", "all")

The weights are read (any ZeRO stage, any saved TP size, resharded to the model's) by
``megaflex.checkpoint.load_checkpoint_weights``. The selection is ``all``, ``kernel`` (the
learnable kernel: what the feature maps declare) or ``non_kernel``. A parameter the checkpoint
lacks may only be one a softmax model has not got (kernel parameters and linear attention's
per-head output gain, e.g. a softmax checkpoint into a Flexformer student): it keeps its fresh
init.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from megaflex.checkpoint.weights import StateDict, load_checkpoint_weights
from megaflex.parallel.deferred_init import gathered
from megaflex.training.config import Config
from megaflex.training.config_loader import ConfigError

INIT_PARAMETERS = ("all", "kernel", "non_kernel")


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
        with gathered(param, modified=True):  # a deferred-init (ZeRO-3) model: one whole parameter at a time
            if _copy_one(name, param, state, selection, optional, source):
                copied.append(name)
    return copied


def _copy_one(name: str, param: nn.Parameter, state: StateDict, selection: str, optional: set[str], source: str) -> bool:
    """Copy ``state[name]`` into ``param``; False when it is an optional parameter ``state`` lacks."""
    if name not in state:
        if name in optional:
            return False  # e.g. a softmax source: the student's kernel starts fresh
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
    return True


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


def warm_start_from(cfg: Config, model: nn.Module, resuming: bool) -> dict[str, Any] | None:
    """``checkpoint.init_from`` at a fresh start (not when this run resumes its own checkpoint):
    copy the selected parameters into ``model``. Returns the record kept in checkpoint metadata."""
    c = cfg.checkpoint
    if c.init_from is None or resuming:
        return None
    copied, source = init_from_checkpoint(model, c.init_from, c.init_parameters)
    return {"path": str(source), "parameters": c.init_parameters, "copied": len(copied)}
