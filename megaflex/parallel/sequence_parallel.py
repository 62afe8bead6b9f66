"""Megatron-style sequence parallelism: the residual stream split along the sequence over the TP group.

Under plain tensor parallelism every TP rank holds the whole [B, N, h] residual stream between
the parallel linears, so the norms, the residual adds and the dropouts run (and keep their
activations) tp times over. With sequence parallelism (Korthikanti et al. 2022, Megatron-LM's
``sequence_parallel``) TP rank r holds tokens [r N / tp, (r + 1) N / tp) of it instead:

    embedding      all-reduce over vocab slices  ->  reduce-scatter along the sequence
    column linear  x [B, N / tp, h]: all-gather along the sequence first (backward: reduce-scatter)
    row linear     all-reduce of partial sums    ->  reduce-scatter along the sequence (bwd: all-gather)
    logits         the final hidden shard is all-gathered before the vocab-sharded head

so the communicated volume is unchanged (an all-reduce is a reduce-scatter plus an all-gather)
and the norm/dropout/residual activations shrink by tp. The column-parallel linear keeps only its
input *shard* for backward and gathers it again there (Megatron does the same), so the gathered
input is never stored either.

Parameters that are replicated over TP but used on a sequence shard (norm weights and biases,
the row-parallel bias) get only this shard's gradient on each rank; ``summed_over_sequence``
wraps their use so that the backward all-reduces that gradient over the TP group. Doing it at
the use site (not in a hook after backward) keeps it correct whatever accumulates the gradient:
micro-batch accumulation, ZeRO 1/2 buckets or ZeRO-3 partitions only ever see the full gradient.

The sequence is dim -2 of every tensor here ([..., N, h]).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megaflex.parallel.mappings import conjugate_pair, copy_to_tp_region
from megaflex.parallel.state import ParallelState

SEQUENCE_DIM = -2
# Newer torch names the tensor collectives *_single and deprecates the old names; torch 2.11 (the
# lowest supported) has only all_gather_into_tensor / reduce_scatter_tensor. Same semantics.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _check(state: ParallelState, length: int) -> None:
    if state.tp_group is None:
        raise RuntimeError(f"{state} has no process groups (built with single()/detached()); cannot communicate")
    if length % state.tp_size != 0:
        raise ValueError(
            f"sequence length: expected a multiple of tensor_parallel_size {state.tp_size} under sequence "
            f"parallelism, got {length}"
        )


def split_sequence(x: torch.Tensor, state: ParallelState) -> torch.Tensor:
    """This TP rank's contiguous shard of the sequence dim (no communication)."""
    n = x.shape[SEQUENCE_DIM]
    if n % state.tp_size != 0:
        _check(state, n)
    return x.narrow(SEQUENCE_DIM, state.tp_rank * (n // state.tp_size), n // state.tp_size).contiguous()


def gather_sequence(x: torch.Tensor, state: ParallelState) -> torch.Tensor:
    """[..., N / tp, h] on every TP rank -> [..., N, h] in TP-rank order."""
    _check(state, 0)
    front = x.movedim(SEQUENCE_DIM, 0).contiguous()
    out = front.new_empty(state.tp_size * front.shape[0], *front.shape[1:])
    _all_gather_single(out, front, group=state.tp_group)
    return out.movedim(0, SEQUENCE_DIM)


def reduce_scatter_sequence(x: torch.Tensor, state: ParallelState) -> torch.Tensor:
    """[..., N, h] partial sums on every TP rank -> this rank's shard [..., N / tp, h] of their sum."""
    _check(state, x.shape[SEQUENCE_DIM])
    front = x.movedim(SEQUENCE_DIM, 0).contiguous()
    out = front.new_empty(front.shape[0] // state.tp_size, *front.shape[1:])
    _reduce_scatter_single(out, front, group=state.tp_group)
    return out.movedim(0, SEQUENCE_DIM)


def scatter_to_sequence(x: torch.Tensor, state: ParallelState) -> torch.Tensor:
    """Replicated -> this rank's shard. Backward: all-gather (each rank differentiated its own shard)."""
    return conjugate_pair(x, state, split_sequence, gather_sequence)


def gather_from_sequence(x: torch.Tensor, state: ParallelState) -> torch.Tensor:
    """Shard -> the replicated whole sequence. Backward: reduce-scatter (the consumers' gradients are
    partial sums over TP: each rank's column shard saw the whole sequence)."""
    return conjugate_pair(x, state, gather_sequence, reduce_scatter_sequence)


def reduce_scatter_to_sequence(x: torch.Tensor, state: ParallelState) -> torch.Tensor:
    """Partial sums over TP -> this rank's shard of their sum. Backward: all-gather."""
    return conjugate_pair(x, state, reduce_scatter_sequence, gather_sequence)


class _GatheredLinear(torch.autograd.Function):
    """y = all_gather(x) W^T + b, keeping only the shard x for backward (gathered again there)."""

    @staticmethod
    def forward(ctx, x, weight, bias, state):  # type: ignore[override]
        ctx.state, ctx.has_bias = state, bias is not None
        ctx.save_for_backward(x, weight)
        return F.linear(gather_sequence(x, state), weight, bias)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        x, weight = ctx.saved_tensors
        needs_input, needs_weight, needs_bias = ctx.needs_input_grad[:3]  # the same graph on every TP rank
        grad_input = reduce_scatter_sequence(grad.matmul(weight), ctx.state) if needs_input else None
        grad_2d = grad.reshape(-1, grad.shape[-1])
        grad_weight = grad_bias = None
        if needs_weight:
            total = gather_sequence(x, ctx.state)  # [..., N, in]
            grad_weight = grad_2d.t().matmul(total.reshape(-1, total.shape[-1]))
        if needs_bias and ctx.has_bias:
            grad_bias = grad_2d.sum(0)
        return grad_input, grad_weight, grad_bias, None


def gathered_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, state: ParallelState) -> torch.Tensor:
    """Column-parallel linear on a sequence shard: x [..., N / tp, in] -> y [..., N, out / tp]."""
    return _GatheredLinear.apply(x, weight, bias, state)


def summed_over_sequence(param: torch.Tensor | None, state: ParallelState) -> torch.Tensor | None:
    """``param`` (replicated over TP) as used on this rank's sequence shard: identity forward, and the
    backward all-reduces its gradient over the TP group so every rank gets the whole sequence's."""
    return None if param is None else copy_to_tp_region(param, state)


class SequenceParallelLayerNorm(nn.LayerNorm):
    """``nn.LayerNorm`` on a sequence shard (same parameters and state-dict keys)."""

    def __init__(self, hidden: int, eps: float, state: ParallelState) -> None:
        super().__init__(hidden, eps=eps)
        self.state = state

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, bias = summed_over_sequence(self.weight, self.state), summed_over_sequence(self.bias, self.state)
        return F.layer_norm(x, self.normalized_shape, weight, bias, self.eps)


class SequenceParallelRMSNorm(nn.RMSNorm):
    """``nn.RMSNorm`` on a sequence shard (same parameters and state-dict keys)."""

    def __init__(self, hidden: int, eps: float, state: ParallelState) -> None:
        super().__init__(hidden, eps=eps)
        self.state = state

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.normalized_shape, summed_over_sequence(self.weight, self.state), self.eps)
