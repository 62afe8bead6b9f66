"""Per-token cross-entropy of bf16 (or fp32) logits in fp32, a block of rows at a time.

``F.cross_entropy(logits.float(), ...)`` makes an fp32 copy of every logit and keeps fp32
log-probabilities for backward: 8 bytes per logit beside the bf16 logits (about 3 GB at micro-batch
8 x 1024 tokens x 50k vocabulary). Here each block of rows is upcast, its loss and log-sum-exp
computed, and only the logits (their own dtype) and one fp32 log-sum-exp per row are kept; the
backward recomputes the softmax block by block. Per row the forward is ``F.cross_entropy`` on fp32
logits, so the losses are those of the full-copy form.

With z the fp32 logits, p = softmax(z), eps the label smoothing over V classes and y the label:
    d loss / d z = p - (1 - eps) [c = y] - eps / V

``chunked_linear_cross_entropy`` goes one step further (``train.loss_chunk_tokens``): it takes the
final hidden states and the output matrix instead of the logits and runs the projection and the loss
``chunk_tokens`` tokens at a time, recomputing each chunk's logits in backward, so neither the
[tokens x V] logits nor their gradient ever exist whole (torchtitan's chunked loss, Liger/fla's fused
linear cross-entropy). Its per-chunk loss is any differentiable per-token loss of the logits chunk: the
blockwise one above, or the vocab-parallel one under tensor parallelism (which then all-reduces once
more per chunk in backward, for the recompute).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

BLOCK_ELEMENTS = 1 << 24  # fp32 logits upcast at once (64 MiB), whatever the vocabulary


class _BlockwiseCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor, label_smoothing: float, block_rows: int):  # type: ignore[override]
        rows = logits.shape[0]
        loss = torch.empty(rows, dtype=torch.float32, device=logits.device)
        lse = torch.empty(rows, dtype=torch.float32, device=logits.device)
        for start in range(0, rows, block_rows):
            block = slice(start, start + block_rows)
            z = logits[block].float()
            loss[block] = F.cross_entropy(z, labels[block], reduction="none", label_smoothing=label_smoothing)
            lse[block] = torch.logsumexp(z, dim=-1)
        ctx.save_for_backward(logits, labels, lse)
        ctx.label_smoothing, ctx.block_rows = label_smoothing, block_rows
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):  # type: ignore[override]
        logits, labels, lse = ctx.saved_tensors
        eps, block_rows = ctx.label_smoothing, ctx.block_rows
        vocab = logits.shape[-1]
        grad = torch.empty_like(logits)
        for start in range(0, logits.shape[0], block_rows):
            block = slice(start, start + block_rows)
            g = (logits[block].float() - lse[block, None]).exp_()  # softmax
            if eps:
                g.sub_(eps / vocab)
            g.scatter_add_(1, labels[block, None], g.new_full((g.shape[0], 1), -(1.0 - eps)))
            grad[block] = g.mul_(grad_loss[block, None].float())
        return grad, None, None, None


def blockwise_cross_entropy(
    logits: torch.Tensor, labels: torch.Tensor, label_smoothing: float = 0.0, block_rows: int | None = None
) -> torch.Tensor:
    """Per-token loss [...] (fp32) of ``logits`` [..., V] and ``labels`` [...] (all valid ids),
    equal to ``F.cross_entropy(logits.float(), labels, reduction="none", label_smoothing=...)``."""
    vocab = logits.shape[-1]
    flat = logits.reshape(-1, vocab)
    rows = block_rows or max(1, BLOCK_ELEMENTS // vocab)
    return _BlockwiseCrossEntropy.apply(flat, labels.reshape(-1), float(label_smoothing), rows).view(labels.shape)


# ``train.loss_chunk_tokens``'s default: off. The recompute costs CPU time (docs/results/bench_chunked_ce.json:
# 5-15% of a step at the kernel study's shape), and on CPU memory is rarely what stops a run.
DEFAULT_LOSS_CHUNK_TOKENS = 0

# (logits chunk [T_c, V_local], labels chunk [T_c]) -> per-token fp32 loss [T_c]; differentiable
ChunkLoss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Per-token loss of ``hidden @ weight.T``, ``chunk`` rows at a time: no chunk's logits outlive
    it. Backward recomputes each chunk's logits and differentiates ``loss_fn`` on them (its own
    backward: the local or the vocab-parallel one), then the projection by hand:
    grad_hidden = grad_logits @ W, grad_W = sum over chunks of grad_logits.T @ hidden (summed in
    fp32 when the weight is bf16/fp16, rounded to its dtype once)."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, loss_fn, chunk):  # type: ignore[override]
        loss = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        for start in range(0, hidden.shape[0], chunk):
            rows = slice(start, start + chunk)
            loss[rows] = loss_fn(F.linear(hidden[rows], weight), labels[rows])
        ctx.save_for_backward(hidden, weight, labels)
        ctx.loss_fn, ctx.chunk = loss_fn, chunk
        return loss

    @staticmethod
    def backward(ctx, grad_loss):  # type: ignore[override]
        hidden, weight, labels = ctx.saved_tensors
        want_hidden, want_weight = ctx.needs_input_grad[:2]
        grad_hidden = torch.empty_like(hidden) if want_hidden else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_weight else None
        for start in range(0, hidden.shape[0], ctx.chunk):
            rows = slice(start, start + ctx.chunk)
            with torch.enable_grad():
                logits = F.linear(hidden[rows], weight).requires_grad_(True)
                (grad_logits,) = torch.autograd.grad(ctx.loss_fn(logits, labels[rows]), logits, grad_loss[rows])
            if want_hidden:
                torch.mm(grad_logits, weight, out=grad_hidden[rows])
            if want_weight:
                if grad_weight.dtype == grad_logits.dtype:
                    grad_weight.addmm_(grad_logits.t(), hidden[rows])
                else:
                    grad_weight += (grad_logits.t() @ hidden[rows]).float()
        if want_weight:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None


def chunked_linear_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, loss_fn: ChunkLoss, chunk_tokens: int
) -> torch.Tensor:
    """Per-token fp32 loss [...] of the logits ``hidden`` [..., h] @ ``weight`` [V_local, h].T scored by
    ``loss_fn`` (e.g. a factory's ``cross_entropy``, vocab-parallel under TP), ``chunk_tokens`` tokens
    at a time: the whole [..., V_local] logits and their gradient never exist, only one chunk's.
    Equal to ``loss_fn(F.linear(hidden, weight), labels)`` per token (the same row computation);
    the weight's gradient sums the chunks' in another order (rounding)."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens: expected a positive integer, got {chunk_tokens}")
    if tuple(labels.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(f"labels: expected shape {tuple(hidden.shape[:-1])} (hidden without its last dim), "
                         f"got {tuple(labels.shape)}")
    flat = hidden.reshape(-1, hidden.shape[-1])
    loss = _ChunkedLinearCrossEntropy.apply(flat, weight, labels.reshape(-1), loss_fn, int(chunk_tokens))
    return loss.view(labels.shape)
