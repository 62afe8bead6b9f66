"""Cross-entropy over vocabulary-sharded logits, without ever gathering the full vocabulary.

Each TP rank holds logits for a contiguous slice [start, start + V_local) of the padded
vocabulary. With z the fp32 logits, M = max_c z_c, s_c = z_c - M and C the true vocab size:

    loss = log sum_c exp(s_c) - (1 - eps) * s_y - eps * (sum_c s_c) / C

which is exactly ``F.cross_entropy(z, y, label_smoothing=eps)`` (the smoothed target puts
eps / C on every class). Per-token cost: one MAX all-reduce and one SUM all-reduce of
[..., 3] (sum-exp, target logit, logit sum fused into one message). Columns >= C are padding
and are excluded everywhere, so TP=1 and TP=k agree even though their padding differs.

The gradient is written by hand: d loss / d z_c = softmax_c - (1 - eps) [c = y] - eps / C.
Labels equal to ``ignore_index`` give loss 0 and zero gradient (as F.cross_entropy).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megaflex.parallel.state import ParallelState


def _all_reduce_(x: torch.Tensor, state: ParallelState, op: dist.ReduceOp.RedOpType) -> None:
    if state.tp_size > 1:
        if state.tp_group is None:
            raise RuntimeError(f"{state} has no process groups; cannot communicate")
        dist.all_reduce(x, op=op, group=state.tp_group)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, labels, vocab_size, label_smoothing, ignore_index, state):
        v_local = logits.shape[-1]
        start = state.tp_rank * v_local
        z = logits.float()
        cols = torch.arange(start, start + v_local, device=logits.device)
        valid = cols < vocab_size  # [V_local]; False on padding columns
        z = z.masked_fill(~valid, float("-inf"))

        # Global max (a rank whose slice is all padding contributes -inf).
        zmax = z.amax(dim=-1)
        _all_reduce_(zmax, state, dist.ReduceOp.MAX)
        shifted = z - zmax.unsqueeze(-1)  # [..., V_local], <= 0, -inf on padding
        exp = shifted.exp()

        # This rank's contribution of the target logit (0 unless the label is in our slice).
        ignored = labels == ignore_index
        local_label = labels - start
        in_slice = (local_label >= 0) & (local_label < v_local) & ~ignored
        gather_idx = local_label.clamp(0, v_local - 1).unsqueeze(-1)
        target = shifted.gather(-1, gather_idx).squeeze(-1).masked_fill(~in_slice, 0.0)

        stats = torch.stack(
            [exp.sum(-1), target, shifted.masked_fill(~valid, 0.0).sum(-1)], dim=-1
        )  # [..., 3]
        _all_reduce_(stats, state, dist.ReduceOp.SUM)
        sum_exp, target, sum_shifted = stats.unbind(-1)

        loss = sum_exp.log() - (1.0 - label_smoothing) * target
        if label_smoothing > 0:
            loss = loss - label_smoothing * sum_shifted / vocab_size
        loss = loss.masked_fill(ignored, 0.0)

        softmax = exp.div_(sum_exp.unsqueeze(-1))  # in place: exp is not needed any more
        ctx.save_for_backward(softmax, gather_idx, in_slice, ignored, valid)
        ctx.label_smoothing = label_smoothing
        ctx.vocab_size = vocab_size
        ctx.logits_dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, gather_idx, in_slice, ignored, valid = ctx.saved_tensors
        eps = ctx.label_smoothing
        grad = softmax  # reuse the saved buffer, as Megatron does; backward runs once
        grad.scatter_add_(-1, gather_idx, -(1.0 - eps) * in_slice.to(grad.dtype).unsqueeze(-1))
        if eps > 0:
            grad.sub_(valid.to(grad.dtype) * (eps / ctx.vocab_size))
        grad.mul_(grad_loss.masked_fill(ignored, 0.0).unsqueeze(-1))
        return grad.to(ctx.logits_dtype), None, None, None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    vocab_size: int,
    state: ParallelState,
    *,
    label_smoothing: float = 0.0,
    ignore_index: int = -100,
) -> torch.Tensor:
    """Per-token fp32 loss [...] from this rank's logits shard [..., V_padded / tp].

    Rank r's shard covers padded-vocabulary ids [r * V_local, (r + 1) * V_local); ids >= ``vocab_size``
    are padding. Labels must lie in [0, vocab_size) or equal ``ignore_index`` (not checked on
    device, to avoid a host sync; an out-of-range label shows up as an inf/garbage loss).
    """
    if logits.dim() < 1 or not logits.is_floating_point():
        raise ValueError(f"logits: expected a floating tensor [..., V_local], got {logits.dtype} {tuple(logits.shape)}")
    if tuple(labels.shape) != tuple(logits.shape[:-1]):
        raise ValueError(f"labels: expected shape {tuple(logits.shape[:-1])} (logits without the vocab dim), got {tuple(labels.shape)}")
    if labels.is_floating_point():
        raise ValueError(f"labels: expected an integer tensor, got {labels.dtype}")
    if not 0 < vocab_size <= logits.shape[-1] * state.tp_size:
        raise ValueError(
            f"vocab_size: expected 0 < vocab_size <= {logits.shape[-1] * state.tp_size} (logits width x tp), got {vocab_size}"
        )
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing: expected 0 <= label_smoothing < 1, got {label_smoothing}")
    return _VocabParallelCrossEntropy.apply(logits, labels.long(), vocab_size, float(label_smoothing), ignore_index, state)
