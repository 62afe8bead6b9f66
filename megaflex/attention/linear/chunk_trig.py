"""Trig feature map fused into the chunked form on CPU: no [B, H, N, F] tensor is ever saved.

``trig_linear_attention_chunked`` is ``chunked_linear_attention(phi(q), phi(k), kls(k), v)`` with
phi the random-Fourier map of ``feature_maps/trig.py``, the CPU twin of ``triton/trig.py``.
Long sequences (one head per call in ``chunk.py``'s plan) run one sweep per head over the
chunk groups: per group the features of its q and k rows are computed on the fly into
cache-sized buffers (``trig_rows``: mm + cos/sin + pair sums; the feature scale goes to the group
functions as q_scale, k_scale), then the group goes
through ``chunked.group_forward``. Forward keeps only the raw q, k, v, the map's parameters, the
fp32 numerators (for the normalisation's backward) and the state before each group.
Backward recomputes each group's features (keeping the projection's cos/sin), runs
``chunked.group_backward`` into group-sized feature gradients, and backpropagates through the map
right there:

    dproj = s (cos p gS - sin p gC) per half,   dx = dproj omega (+ 2 x dkls inv_t for keys)
    domega += dproj^T x,                        dinv_t += dkls . ||k||^2

So between forward and backward only [B, H, N, d]-sized tensors live, as for softmax attention.
Short sequences (several heads per batched call) gain nothing from this and take the plain path:
the fused feature map, then ``chunked_linear_attention``.
"""

from __future__ import annotations

import torch

from ..base import LinearAttentionState, accumulation_dtype
from ..decay import fold_keys, run_folded
from ..feature_maps.trig import feature_scale, trig_d_proj, trig_feature_map, trig_rows
from ..heads import for_each_head
from ..inputs import validate_linear_attention_inputs
from ..normalize import normalize_backward, normalize_output, reads_denominator
from .chunk import (
    GroupScratch, chunk_groups, chunk_stabiliser, chunked_linear_attention, group_backward, group_forward, plan_blocks,
    unpack_result,
)

# chunked_linear_attention's plan decides "long" (one head per block); False forces the plain path
FUSED_TRIG_ENABLED = True


def _key_log_scale(k: torch.Tensor, inv_t_rows: torch.Tensor, shift: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(||k||^2, kls = ||k||^2 inv_t (+ ``shift`` [BH, N]: the decay's fold)), both [BH, N], from k [BH, N, d],
    one head at a time (no [BH, N, d] temporary); the backward reads ||k||^2 back for d inv_t."""
    sq, out = k.new_empty(k.shape[:2]), k.new_empty(k.shape[:2])
    for i in range(k.shape[0]):
        torch.sum(k[i] * k[i], dim=-1, out=sq[i])  # as the plain map computes it, to the bit
        torch.mul(sq[i], inv_t_rows[i], out=out[i])
        if shift is not None:
            out[i] += shift[i]
    return sq, out


class _GroupBuffers:
    """One head's per-group scratch: features and the projection's cos/sin of q and k rows, the
    values with their ones column, and (backward) the feature gradients and dL/dproj."""

    def __init__(self, rows: int, p: int, feat: int, dv: int, like: torch.Tensor, backward: bool) -> None:
        def new(*shape: int) -> torch.Tensor:
            return like.new_empty(1, *shape)

        self.qf, self.kf = new(rows, feat), new(rows, feat)
        self.proj, self.q_cos, self.q_sin, self.k_cos, self.k_sin = (new(rows, p) for _ in range(5))
        self.v_aug = new(rows, dv + 1)
        self.v_aug[..., dv] = 1.0  # the ones column, set once: ``features`` only rewrites the values
        if backward:
            self.dqf, self.dkf, self.d_lam = new(rows, feat), new(rows, feat), like.new_empty(rows)

    def features(self, xq: torch.Tensor, xk: torch.Tensor, v: torch.Tensor, w_t: torch.Tensor, paired: bool) -> None:
        """Features of a group's rows xq, xk [1, r, d] *without* the feature scale (the group
        functions take it as q_scale, k_scale) and v [1, r, Dv] with its ones column."""
        r, dv = xq.shape[1], v.shape[-1]
        trig_rows(xq, w_t, paired, self.proj[:, :r], self.q_cos[:, :r], self.q_sin[:, :r], self.qf[:, :r], 1.0)
        trig_rows(xk, w_t, paired, self.proj[:, :r], self.k_cos[:, :r], self.k_sin[:, :r], self.kf[:, :r], 1.0)
        self.v_aug[:, :r, :dv] = v


class _ChunkedTrigAttention(torch.autograd.Function):
    """(q, k [BH, N, d], v [BH, N, Dv], omega [H, P, d], inv_t [H], log_decay [H] | None, s0 [BH, F, Dv+1],
    m0 [BH], heads, paired, chunk_size, normalization, eps, out_dtype, origin) -> (out [BH, N, Dv], final
    state, log_max), all inputs in the accumulation dtype. One head per block (long N); see the module
    docstring. ``log_decay``: the decay folded into the key log-scales about ``origin``, kls_s - (s - c) g
    (``decay.py``; the state's part is the caller's), so d g = -sum_s (s - c) dkls_s."""

    @staticmethod
    def forward(ctx, q, k, v, omega, inv_t, log_decay, s0, m0, heads, paired, chunk_size, normalization, eps, out_dtype, origin):  # type: ignore[override]
        bh, n, _ = q.shape
        dv, p = v.shape[-1], omega.shape[1]
        feat = p if paired else 2 * p
        c = min(chunk_size, n)
        groups = chunk_groups(n, c, feat)
        scale = feature_scale(p, paired)  # features are computed unscaled; the group functions apply it
        inv_rows = inv_t.repeat(bh // heads)  # [BH]: head h of every batch entry
        shift = None if log_decay is None else fold_keys(None, log_decay, (bh // heads, heads, n), -origin).reshape(bh, n)
        k_sq, lam = _key_log_scale(k, inv_rows, shift)
        m, bounds, decay, fast = chunk_stabiliser(lam, m0, c)
        states = q.new_empty(bh, len(groups) + 1, feat, dv + 1)
        states[:, 0] = s0
        most = max(g for _, g, _, _ in groups)
        nc = dv + 1 if reads_denominator(normalization) else dv
        numer = q.new_empty(bh, n, nc)
        out = torch.empty(bh, n, dv, dtype=out_dtype, device=q.device)

        def forward_head(b: int) -> None:
            w_t = omega[b % heads].t().unsqueeze(0)  # [1, d, P]
            dec_b = decay[b : b + 1].view(1, -1, 1, 1)
            scratch = GroupScratch(1, most, feat, dv + 1, q, backward=False)
            buf = _GroupBuffers(most * c, p, feat, dv, q, backward=False)
            for gi, (sl, g, cl, c0) in enumerate(groups):
                r = g * cl
                buf.features(q[b : b + 1, sl], k[b : b + 1, sl], v[b : b + 1, sl], w_t, paired)
                ng = numer[b, sl].view(g, cl, nc)
                group_forward(
                    buf.qf[0, :r].view(g, cl, feat), buf.kf[0, :r].view(g, cl, feat), buf.v_aug[0, :r].view(g, cl, dv + 1),
                    lam[b, sl].view(g, cl), m[b, sl].view(g, cl), bounds[b : b + 1, c0 : c0 + g + 1],
                    states[b : b + 1, gi], dec_b[:, c0 : c0 + g], all(fast[b][c0 : c0 + g]), scratch, ng, scale, scale,
                )  # fmt: skip
                states[b, gi + 1] = scratch.s[0, g]
                den = ng[..., dv] if nc > dv else None
                out[b, sl] = normalize_output(ng[..., :dv], den, normalization, eps).view(r, dv)

        for_each_head(forward_head, bh, q.device)
        ctx.save_for_backward(q, k, v, omega, inv_t, s0, numer, k_sq, lam, m, bounds, states)
        ctx.meta = (c, heads, groups, decay, fast, paired, normalization, eps, log_decay is not None, origin)
        log_max = bounds[:, -1].clone()
        ctx.mark_non_differentiable(log_max)
        return out, states[:, -1].clone(), log_max

    @staticmethod
    def backward(ctx, d_out, d_final, _d_log_max):  # type: ignore[override]
        q, k, v, omega, inv_t, s0, numer, k_sq, lam, m, bounds, states = ctx.saved_tensors
        c, heads, groups, decay, fast, paired, normalization, eps, decays, origin = ctx.meta
        bh, n, d = q.shape
        dv, p, feat, nc = v.shape[-1], omega.shape[1], states.shape[2], numer.shape[-1]
        most = max(g for _, g, _, _ in groups)
        scale = feature_scale(p, paired)
        inv_rows = inv_t.repeat(bh // heads)
        carry = d_final.clone()
        dq, dk, d_v = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        d_omega = q.new_zeros(bh, p, d)
        d_inv = q.new_zeros(bh)
        d_shift = q.new_zeros(bh) if decays else None  # sum_s (s - c) dkls_s per row
        tokens = torch.arange(-origin, n - origin, device=q.device, dtype=q.dtype) if decays else None

        def backward_head(b: int) -> None:
            w = omega[b % heads].unsqueeze(0)  # [1, P, d]
            w_t = w.transpose(1, 2)
            dec_b = decay[b : b + 1].view(1, -1, 1, 1)
            scratch = GroupScratch(1, most, feat, dv + 1, q, backward=True)
            buf = _GroupBuffers(most * c, p, feat, dv, q, backward=True)
            for gi, (sl, g, cl, c0) in reversed(list(enumerate(groups))):
                r = g * cl
                xq, xk = q[b : b + 1, sl], k[b : b + 1, sl]
                buf.features(xq, xk, v[b : b + 1, sl], w_t, paired)
                dng = normalize_backward(numer[b, sl].view(g, cl, nc), d_out[b, sl].reshape(g, cl, dv), normalization, eps)
                dqf, dkf, d_lam = buf.dqf[:, :r], buf.dkf[:, :r], buf.d_lam[:r]
                group_backward(
                    buf.qf[0, :r].view(g, cl, feat), buf.kf[0, :r].view(g, cl, feat), buf.v_aug[0, :r].view(g, cl, dv + 1),
                    lam[b, sl].view(g, cl), m[b, sl].view(g, cl), bounds[b : b + 1, c0 : c0 + g + 1],
                    states[b : b + 1, gi], dec_b[:, c0 : c0 + g], all(fast[b][c0 : c0 + g]), dng, carry[b : b + 1],
                    scratch, dqf.view(g, cl, feat), dkf.view(g, cl, feat), d_v[b, sl].view(g, cl, dv), d_lam.view(g, cl), scale, scale,
                )  # fmt: skip
                # back through the map: queries (their log-scale is unused), then keys
                d_proj = buf.proj[:, :r]
                trig_d_proj(buf.q_cos[:, :r], buf.q_sin[:, :r], dqf, paired, d_proj, 1.0)
                torch.bmm(d_proj, w, out=dq[b : b + 1, sl])
                d_omega[b : b + 1].baddbmm_(d_proj.transpose(1, 2), xq)
                trig_d_proj(buf.k_cos[:, :r], buf.k_sin[:, :r], dkf, paired, d_proj, 1.0)
                torch.bmm(d_proj, w, out=dk[b : b + 1, sl])
                d_omega[b : b + 1].baddbmm_(d_proj.transpose(1, 2), xk)
                dk[b, sl].addcmul_(xk[0], (d_lam * (2 * inv_rows[b])).unsqueeze(-1))
                d_inv[b] += torch.dot(d_lam, k_sq[b, sl])
                if decays:
                    d_shift[b] += torch.dot(d_lam, tokens[sl])

        for_each_head(backward_head, bh, q.device)
        d_s0 = carry if ctx.needs_input_grad[6] else None
        d_omega = d_omega.view(-1, heads, p, d).sum(dim=0)
        d_inv = d_inv.view(-1, heads).sum(dim=0)
        d_decay = None if d_shift is None else -d_shift.view(-1, heads).sum(dim=0)
        return dq, dk, d_v, d_omega, d_inv, d_decay, d_s0, *([None] * 8)


def trig_linear_attention_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    omega: torch.Tensor,
    inv_temperature: torch.Tensor,
    *,
    paired: bool,
    normalization: str = "rms",
    chunk_size: int = 64,
    initial_state: LinearAttentionState | None = None,
    eps: float = 1e-6,
    log_decay: torch.Tensor | None = None,
) -> tuple[torch.Tensor, LinearAttentionState]:
    """Causal linear attention of the trig map ``trig_feature_map(x, omega, inv_temperature,
    paired=paired)`` applied to q and k, chunked form on CPU (the contract of
    ``triton.trig_linear_attention``): q, k [B, H, N, d], v [B, H, N, Dv], omega [H, P, d],
    inv_temperature [H] -> (out [B, H, N, Dv] in v.dtype, state in fp32, fp64 for fp64 inputs).
    ``log_decay`` [H] | None: the per-head decay of old keys (``decay.py``), folded in.

    Differentiable w.r.t. q, k, v, omega, inv_temperature, log_decay and the initial state's kv and k_sum.
    """
    if q.dim() != 4 or k.shape != q.shape or v.dim() != 4 or v.shape[:3] != q.shape[:3]:
        raise ValueError(f"q, k, v: expected [B, H, N, *] with k matching q {tuple(q.shape)}, got {tuple(k.shape)}, {tuple(v.shape)}")
    batch, heads, n, d = q.shape
    dv = v.shape[-1]
    if omega.dim() != 3 or omega.shape[0] != heads or omega.shape[2] != d or (paired and omega.shape[1] % 2):
        raise ValueError(f"omega: expected shape [{heads}, P, {d}] (P even when paired), got {tuple(omega.shape)}")
    if inv_temperature.shape != (heads,):
        raise ValueError(f"inv_temperature: expected shape ({heads},), got {tuple(inv_temperature.shape)}")
    p = omega.shape[1]
    feat = p if paired else 2 * p
    # the plain path's checks (dtypes, N >= 1, options, state shapes) on feature-shaped stand-ins
    stand_in = q.new_zeros(()).expand(batch, heads, n, feat)
    validate_linear_attention_inputs(
        stand_in, stand_in, None, v, form="chunked", normalization=normalization, chunk_size=chunk_size,
        initial_state=initial_state, eps=eps, log_decay=log_decay,
    )  # fmt: skip
    bh = batch * heads
    blocks, _, _ = plan_blocks(bh, n, min(chunk_size, n), feat, q.device)
    if not FUSED_TRIG_ENABLED or len(blocks) != bh:
        qf, _ = trig_feature_map(q, omega, inv_temperature, paired=paired)
        kf, kls = trig_feature_map(k, omega, inv_temperature, paired=paired)
        return chunked_linear_attention(
            qf, kf, kls, v, normalization=normalization, chunk_size=chunk_size, initial_state=initial_state, eps=eps,
            log_decay=log_decay,
        )
    def fused(lo: int, hi: int, origin: int, state: LinearAttentionState | None) -> tuple[torch.Tensor, LinearAttentionState]:
        """Tokens lo .. hi - 1 through the Function, from ``state`` (with a decay: folded about ``origin``)."""
        acc, n_part = accumulation_dtype(v.dtype), hi - lo
        with torch.autocast(device_type=q.device.type, enabled=False):
            if state is None:
                state = LinearAttentionState.empty(batch, heads, feat, dv, device=q.device, dtype=acc)
            s0 = state.augmented().to(acc)
            out, final, log_max = _ChunkedTrigAttention.apply(
                q[:, :, lo:hi].to(acc).reshape(bh, n_part, d).contiguous(),
                k[:, :, lo:hi].to(acc).reshape(bh, n_part, d).contiguous(),
                v[:, :, lo:hi].to(acc).reshape(bh, n_part, dv).contiguous(),
                omega.to(acc).contiguous(),
                inv_temperature.to(acc),
                None if log_decay is None else log_decay.to(acc),
                s0.reshape(bh, feat, dv + 1),
                state.log_max.detach().to(acc).reshape(bh),
                heads,
                paired,
                chunk_size,
                normalization,
                eps,
                v.dtype,
                origin,
            )
        return unpack_result(out, final, log_max, batch, heads, state.offset + n_part)

    if log_decay is None:
        return fused(0, n, 0, initial_state)
    return run_folded(fused, n, log_decay, initial_state)
