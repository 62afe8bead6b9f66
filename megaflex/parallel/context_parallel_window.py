"""Context parallelism for the one-normaliser window hybrid (``megaflex.attention.window``).

CP rank r holds a slice of n tokens. Its first W - 1 queries see, in their exact window, the last
W - 1 keys of rank r - 1 (the halo); every older key is far field. So, next to the state exchange
of ``context_parallel.py``, each rank j contributes

* S^far_j: the linear state of its keys except its last W - 1 (those stay exact for rank j + 1),
* S^tail_j: the linear state of its last W - 1 keys (far field for ranks j + 2 and later),
* its last W - 1 keys themselves: k, kf, kls, v (rank j + 1's window cache).

One all-gather carries all three (B H (2 (F (Dv + 1) + 1) + (W - 1)(d + F + 1 + Dv)) floats per
rank, independent of n). Rank r's far state is S^far_j for j < r and S^tail_j for j < r - 1,
rescaled to their common max; its window cache is rank r - 1's tail (none on rank 0). The slice
then runs the hybrid's chunked form from that state and cache, as a single rank would continue
from them. Backward: one all-gather of (dL/dS_in, dL/dcache); rank j collects dL/dS^far_j,
dL/dS^tail_j and its tail's gradient (from rank j + 1). The stabilisers are constants for autograd.
With a decay (``attention/decay.py``) both states hold their keys decayed to the slice's last token and
reach rank r decayed by r - 1 - j more slices, as in ``context_parallel.py``; the halo keeps raw log-scales.

Needs n >= W - 1 (the halo comes from one rank), no q/k/v convolution and no document resets.
"""

from __future__ import annotations

import torch

from megaflex.attention import LinearAttentionState
from megaflex.attention.base import accumulation_dtype
from megaflex.attention.documents import DocumentLayout, has_restarts
from megaflex.attention.window import WindowCache, windowed_linear_attention
from megaflex.attention.decay import fold_keys
from megaflex.parallel.context_parallel import check_whole_sequences, cp_all_gather, local_state, slice_decay_grad, slice_lags
from megaflex.parallel.state import ParallelState


def _weights(maxes: torch.Tensor, cp: int, slice_decay: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """maxes [2 CP, B, H] (far states, then tails) -> (M_in [CP, B, H], W [CP(r), 2 CP, B, H]): rank r
    takes far_j for j < r and tail_j for j < r - 1, weighted exp(M_j - M_in(r)); ``slice_decay`` [H] (n g):
    both decayed by the r - 1 - j slices between them, M_j + (r - 1 - j) n g."""
    j = torch.arange(cp, device=maxes.device)
    r = j.unsqueeze(1)
    include = torch.cat([j < r, j < r - 1], dim=1).view(cp, 2 * cp, 1, 1)  # [CP(r), 2 CP, 1, 1]
    seen = maxes.unsqueeze(0)
    if slice_decay is not None:
        seen = seen + torch.cat([slice_lags(cp, maxes.device)] * 2, dim=1) * slice_decay.detach()
    m_in = seen.masked_fill(~include, float("-inf")).amax(dim=1)  # [CP, B, H]
    w = torch.exp(seen - m_in.unsqueeze(1)).masked_fill(~include, 0.0)
    return m_in, w.nan_to_num(0.0)  # nan only where nothing is included (-inf - -inf)


class _WindowExchange(torch.autograd.Function):
    """(S_far, M_far, S_tail, M_tail [B, H, L] / [B, H], tail [B, H, T, X]) -> (S_in, M_in, halo
    [B, H, T, X]: rank r - 1's tail, zeros on rank 0). One all-gather each way."""

    @staticmethod
    def forward(ctx, s_far, m_far, s_tail, m_tail, tail, state, slice_decay):  # type: ignore[override]
        size = s_far.shape[-1]
        flat_tail = tail.flatten(2)  # [B, H, T X]
        packed = torch.cat([s_far, m_far.unsqueeze(-1), s_tail, m_tail.unsqueeze(-1), flat_tail], dim=-1)
        gathered = cp_all_gather(packed, state)  # [CP, B, H, 2 L + 2 + T X]
        states = torch.cat([gathered[..., :size], gathered[..., size + 1 : 2 * size + 1]])  # [2 CP, B, H, L]
        maxes = torch.cat([gathered[..., size], gathered[..., 2 * size + 1]])  # [2 CP, B, H]
        m_in, w = _weights(maxes, state.cp_size, slice_decay)
        r = state.cp_rank
        s_in = torch.einsum("jbh,jbhl->bhl", w[r], states)
        halo = gathered[r - 1, ..., 2 * size + 2 :].view_as(tail) if r > 0 else torch.zeros_like(tail)
        ctx.state, ctx.w, ctx.tail_shape = state, w, tail.shape
        if slice_decay is not None:
            ctx.save_for_backward(s_far, s_tail)
        ctx.mark_non_differentiable(m_in)
        return s_in, m_in[r].clone(), halo

    @staticmethod
    def backward(ctx, d_s_in, _d_m_in, d_halo):  # type: ignore[override]
        state, cp, j = ctx.state, ctx.state.cp_size, ctx.state.cp_rank
        if d_halo is None:
            d_halo = d_s_in.new_zeros(ctx.tail_shape)
        grads = cp_all_gather(torch.cat([d_s_in, d_halo.flatten(2)], dim=-1), state)  # [CP(r), B, H, L + T X]
        size = d_s_in.shape[-1]
        d_states = grads[..., :size]
        d_far = torch.einsum("rbh,rbhl->bhl", ctx.w[:, j], d_states)
        d_tail_state = torch.einsum("rbh,rbhl->bhl", ctx.w[:, cp + j], d_states)
        d_tail = grads[j + 1, ..., size:].view(ctx.tail_shape) if j + 1 < cp else grads.new_zeros(ctx.tail_shape)
        d_decay = None
        if ctx.needs_input_grad[6]:
            s_far, s_tail = ctx.saved_tensors
            d_decay = (slice_decay_grad(ctx.w[:, j], d_states, s_far, j)
                       + slice_decay_grad(ctx.w[:, cp + j], d_states, s_tail, j))  # fmt: skip
        return d_far, None, d_tail_state, None, d_tail, None, d_decay


def _state_of(kf: torch.Tensor, kls: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``local_state`` that also takes no keys or no features (sliding-window softmax): a zero state
    with log_max -inf."""
    if kf.shape[2] == 0 or kf.shape[-1] == 0:
        batch, heads, feat = kf.shape[0], kf.shape[1], kf.shape[-1]
        acc = accumulation_dtype(v.dtype)
        return (kf.new_zeros(batch, heads, feat, v.shape[-1] + 1, dtype=acc),
                kf.new_full((batch, heads), float("-inf"), dtype=acc))  # fmt: skip
    return local_state(kf, kls, v)


class ContextParallelWindowAttention:
    """Stands in for a one-normaliser ``LocalMixingCore`` when sequences are split over CP ranks
    (whole sequences only, like ``ContextParallelAttention``)."""

    def __init__(self, core: "torch.nn.Module", state: ParallelState) -> None:
        if core.mixing != "shared_normaliser" or core.conv_size:
            raise ValueError(
                f"context_parallel_size: expected 1 with model.window_mixing={core.mixing!r} or model.qkv_conv_size="
                f"{core.conv_size} (only the one-normaliser window without convolution exchanges a halo), got {state.cp_size}"
            )
        self.core, self.state = core, state

    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, state: object = None, return_state: bool = False,
        document_starts: DocumentLayout | torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, None]:
        check_whole_sequences(state, return_state)
        if has_restarts(document_starts, continues_state=True):  # any start, position 0 included
            raise ValueError("document_starts: document resets are not supported by the window hybrid under context "
                             "parallelism; use context_parallel_size=1")
        window, n = self.core.window, q.shape[2]
        keep = max(window - 1, 0)
        if n < keep:
            raise ValueError(f"sequence slice: expected at least softmax_window - 1 = {keep} tokens per CP rank, got {n}")
        inner = self.core.core
        offset = self.state.cp_rank * n  # global position of this slice's first token
        qf, qls, kf, kls = self.core.window_features(q, k, offset)
        acc = accumulation_dtype(v.dtype)
        kls_acc = kf.new_zeros(kf.shape[:3], dtype=acc) if kls is None else kls.to(acc)
        log_decay = inner.log_decay()
        # the states hold their keys decayed to the slice's last token (the halo keeps the raw kls)
        kls_aged = kls_acc if log_decay is None else fold_keys(kls_acc, log_decay, tuple(kls_acc.shape), first=1 - n)
        slice_decay = None if log_decay is None else n * log_decay
        cut = n - keep
        with torch.autocast(device_type=q.device.type, enabled=False):
            s_far, m_far = _state_of(kf[:, :, :cut], kls_aged[:, :, :cut], v[:, :, :cut])
            s_tail, m_tail = _state_of(kf[:, :, cut:], kls_aged[:, :, cut:], v[:, :, cut:])
            tail = torch.cat([k[:, :, cut:].to(acc), kf[:, :, cut:].to(acc), kls_acc[:, :, cut:].unsqueeze(-1),
                              v[:, :, cut:].to(acc)], dim=-1)  # fmt: skip
            s_in, m_in, halo = _WindowExchange.apply(s_far.flatten(2), m_far, s_tail.flatten(2), m_tail, tail, self.state,
                                                     slice_decay)  # fmt: skip
        s_in = s_in.view_as(s_far)
        far = LinearAttentionState(kv=s_in[..., :-1], k_sum=s_in[..., -1], log_max=m_in, offset=offset)
        cache = None
        if self.state.cp_rank > 0 and keep:
            d, feat = k.shape[-1], kf.shape[-1]
            cache = WindowCache(halo[..., :d], halo[..., d : d + feat], halo[..., d + feat], halo[..., d + feat + 1 :])
        out, _, _ = windowed_linear_attention(
            q, qf, qls, k, kf, kls, v, window=window, form=inner.form, normalization=inner.normalization,
            chunk_size=inner.chunk_size, far_state=far, cache=cache, eps=inner.eps, return_state=False,
            backend=inner.backend, log_decay=log_decay,
        )  # fmt: skip
        return out, None
