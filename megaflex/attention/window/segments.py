"""Long training sequences through the one-normaliser window in segments, recomputed in the backward.

``run_segments(step, ...)``: ``step(offset, has_far, has_cache, q, k, v, *carried)`` -> (out, far kv,
k_sum, log_max, cache k, kf, kls, v) computes one segment after the carried (far state, window cache)
of the previous one. The forward runs the segments under ``no_grad`` and keeps q, k, v and the small
carried tensors entering each segment; the backward recomputes one segment at a time (last first),
takes its gradients with ``torch.autograd.grad`` and hands the carried tensors' gradients to the
segment before. Unlike ``torch.utils.checkpoint`` around each segment, the output and the q, k, v
gradients are written into one full-size tensor each: no per-segment pieces concatenated at the
end (which held every gradient twice), and no ~900-module import on first use.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

Step = Callable[..., Sequence[torch.Tensor]]


class _Segments(torch.autograd.Function):
    @staticmethod
    def forward(ctx, step, offset, bounds, has_far, has_cache, n_params, q, k, v, *rest):  # type: ignore[override]
        carried, params = list(rest[: len(rest) - n_params]), rest[len(rest) - n_params :]
        out = v.new_empty(*v.shape)
        entering, slots, first = [], None, 0
        carried = [t.detach() for t in carried]
        for i, (lo, hi) in enumerate(bounds):
            entering.append((has_far, has_cache, carried))
            o, *new = step(offset + lo, has_far, has_cache, q[:, :, lo:hi], k[:, :, lo:hi], v[:, :, lo:hi], *carried)
            out[:, :, lo:hi] = o
            # the states entering the segments live in slots allocated once (re-allocated while a window
            # longer than a segment still grows the cache): small tensors allocated per segment among its
            # temporaries would pin the heap, which then grows by a segment's temporaries each time
            if slots is None or any(s.shape[1:] != t.shape for s, t in zip(slots, new)):
                slots, first = [t.new_empty(len(bounds) - i, *t.shape) for t in new], i
            carried = [s[i - first].copy_(t) for s, t in zip(slots, new)]
            del o, new
            has_far = has_cache = True
        ctx.step, ctx.offset, ctx.bounds, ctx.entering, ctx.params = step, offset, bounds, entering, params
        ctx.save_for_backward(q, k, v)
        final = [t.clone() for t in carried]
        ctx.mark_non_differentiable(final[2])  # log_max: the stabiliser
        return (out, *final)

    @staticmethod
    def backward(ctx, d_out, *d_final):  # type: ignore[override]
        q, k, v = ctx.saved_tensors
        grads = [torch.zeros_like(t) for t in (q, k, v)]
        params = [p for p in ctx.params if p.requires_grad]
        d_params = [None] * len(params)
        d_carried: list = list(d_final)
        for (lo, hi), (has_far, has_cache, carried) in zip(reversed(ctx.bounds), reversed(ctx.entering)):
            with torch.enable_grad():
                pieces = [t[:, :, lo:hi].detach().requires_grad_() for t in (q, k, v)]
                carried_in = [t.detach().requires_grad_(t.is_floating_point()) for t in carried]
                outs = ctx.step(ctx.offset + lo, has_far, has_cache, *pieces, *carried_in)
            pairs = [(o, g) for o, g in zip(outs, [d_out[:, :, lo:hi], *d_carried]) if g is not None and o.requires_grad]
            inputs = [*pieces, *carried_in, *params]
            got = torch.autograd.grad([o for o, _ in pairs], inputs, [g for _, g in pairs], allow_unused=True)
            for grad, piece in zip(grads, got[:3]):
                if piece is not None:
                    grad[:, :, lo:hi] = piece
            d_carried = list(got[3 : 3 + len(carried_in)])
            for i, g in enumerate(got[3 + len(carried_in) :]):
                if g is not None:
                    d_params[i] = g if d_params[i] is None else d_params[i] + g
            del outs, pieces, carried_in, pairs, got  # before the next segment's recompute
        it = iter(d_params)
        d_all = [next(it) if p.requires_grad else None for p in ctx.params]
        return (None, None, None, None, None, None, *grads, *d_carried, *d_all)


def run_segments(
    step: Step, offset: int, segment: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    carried: list[torch.Tensor], has_far: bool, has_cache: bool, params: Sequence[torch.nn.Parameter],
) -> list[torch.Tensor]:  # fmt: skip
    """(out [B, H, N, Dv], far kv, k_sum, log_max, cache k, kf, kls, v) after all segments of
    ``segment`` tokens; ``carried``: the initial far state's (kv, k_sum, log_max) if ``has_far``,
    then the cache's (k, kf, kls, v) if ``has_cache``; ``params``: what ``step`` reads that may need
    gradients (the feature map's parameters)."""
    n = q.shape[2]
    bounds = [(lo, min(lo + segment, n)) for lo in range(0, n, segment)]
    return list(_Segments.apply(step, offset, bounds, has_far, has_cache, len(params), q, k, v, *carried, *params))
