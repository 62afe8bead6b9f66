"""The four tensor-parallel region mappings (Megatron-LM ``mappings.py``) as autograd functions.

Each is a conjugate pair: what the forward does over the TP group, the backward undoes.

    copy_to_tp_region      fwd: identity          bwd: all-reduce      (enter a column-parallel region)
    reduce_from_tp_region  fwd: all-reduce        bwd: identity        (leave a row-parallel region)
    scatter_to_tp_region   fwd: split last dim    bwd: all-gather
    gather_from_tp_region  fwd: all-gather last   bwd: split last dim

With a TP size of 1 all four are identities and never touch ``torch.distributed``.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from megaflex.parallel.state import ParallelState


def _check_groups(state: ParallelState) -> None:
    if state.tp_group is None:
        raise RuntimeError(f"{state} has no process groups (built with single()/detached()); cannot communicate")


def _all_reduce(x: torch.Tensor, state: ParallelState) -> torch.Tensor:
    if state.tp_size == 1:
        return x
    _check_groups(state)
    x = x.contiguous().clone()  # never mutate a tensor autograd may have saved
    dist.all_reduce(x, group=state.tp_group)
    return x


def _split_last(x: torch.Tensor, state: ParallelState) -> torch.Tensor:
    if state.tp_size == 1:
        return x
    size = x.shape[-1]
    if size % state.tp_size != 0:
        raise ValueError(f"last dim: expected a multiple of tp_size={state.tp_size}, got {size}")
    return x.chunk(state.tp_size, dim=-1)[state.tp_rank].contiguous()


def _gather_last(x: torch.Tensor, state: ParallelState) -> torch.Tensor:
    if state.tp_size == 1:
        return x
    _check_groups(state)
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(state.tp_size)]
    dist.all_gather(parts, x, group=state.tp_group)
    return torch.cat(parts, dim=-1)


class _Conjugate(torch.autograd.Function):
    """``forward(x, state)`` over a group; the backward applies its conjugate ``backward`` to the gradient."""

    @staticmethod
    def forward(ctx, x, state, forward, backward):  # type: ignore[override]
        ctx.state, ctx.conjugate = state, backward
        return forward(x, state)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return ctx.conjugate(grad, ctx.state), None, None, None


def conjugate_pair(
    x: torch.Tensor,
    state: ParallelState,
    forward: Callable[[torch.Tensor, ParallelState], torch.Tensor],
    backward: Callable[[torch.Tensor, ParallelState], torch.Tensor],
) -> torch.Tensor:
    """``forward(x, state)``, differentiated by ``backward(grad, state)`` (e.g. split / all-gather)."""
    return _Conjugate.apply(x, state, forward, backward)


def _identity(x: torch.Tensor, state: ParallelState) -> torch.Tensor:
    return x


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, state: ParallelState) -> torch.Tensor:
        if state.tp_size > 1 and x.is_contiguous() and not x.is_leaf and x._base is None:
            # A fresh partial result (a matmul's output): reduced in place, no activation-sized
            # copy. Should anything have saved it for backward, autograd's version check raises.
            _check_groups(state)
            ctx.mark_dirty(x)
            dist.all_reduce(x, group=state.tp_group)
            return x
        return _all_reduce(x, state)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def copy_to_tp_region(x: torch.Tensor, state: ParallelState) -> torch.Tensor:
    """Identity forward; all-reduce the gradient (input replicated, consumers sharded)."""
    return conjugate_pair(x, state, _identity, _all_reduce)


def reduce_from_tp_region(x: torch.Tensor, state: ParallelState) -> torch.Tensor:
    """Sum partial results over the TP group; gradient passes through."""
    return _ReduceFromTP.apply(x, state)


def scatter_to_tp_region(x: torch.Tensor, state: ParallelState) -> torch.Tensor:
    """Keep this rank's chunk of the last dim [..., n] -> [..., n / tp]; backward all-gathers."""
    return conjugate_pair(x, state, _split_last, _gather_last)


def gather_from_tp_region(x: torch.Tensor, state: ParallelState) -> torch.Tensor:
    """All-gather the last dim [..., n / tp] -> [..., n] (rank order); backward splits."""
    return conjugate_pair(x, state, _gather_last, _split_last)
