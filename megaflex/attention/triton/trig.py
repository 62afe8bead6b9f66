"""Trig feature map + Triton attention in one autograd function (no saved [B, H, N, F] features).

Forward computes the random-Fourier features of q and k (``trig_feature_map_reference``, plain
vectorised torch: no loop over heads), runs the attention kernels and saves only q, k, v, the
map's parameters and the incoming state. Backward recomputes the features with autograd on,
runs the attention backward kernels, and backpropagates their feature gradients through the
map: dq, dk, domega, dinv_temperature. So between a layer's forward and backward only the raw
[B, H, N, d] inputs are alive, as for softmax attention; the features exist transiently.
"""

from __future__ import annotations

import torch

from ..base import LinearAttentionState
from ..feature_maps._trig import trig_feature_map_reference
from .function import ChunkPlan, attention_backward, attention_forward, check_options, check_triton_dtype, flat_inputs


def _features(q, k, omega, inv_temperature, paired):
    """(qf, kf, kls) [B, H, N, *] of the trig map (the query's log-scale is never used)."""
    qf, _ = trig_feature_map_reference(q, omega, inv_temperature, paired=paired)
    kf, kls = trig_feature_map_reference(k, omega, inv_temperature, paired=paired)
    return qf, kf, kls


class _TrigLinearAttention(torch.autograd.Function):
    """(q, k, v, omega, inv_temperature, kv0, k_sum0, log_max0 | None, paired, normalization,
    chunk_size, eps) -> (out [B, H, N, Dv], kv [BH, F, Dv], k_sum [BH, F], log_max [BH])."""

    @staticmethod
    def forward(ctx, q, k, v, omega, inv_temperature, kv0, z0, log_max0, paired, normalization, chunk_size, eps):  # type: ignore[override]
        batch, heads, n, _ = q.shape
        with torch.no_grad():
            qf, kf, kls = _features(q, k, omega, inv_temperature, paired)
        state = None if log_max0 is None else LinearAttentionState(kv0, z0, log_max0)
        (qq, kk, ls, vv), kv0_flat, z0_flat, plan = flat_inputs(qf, kf, kls, v, state, chunk_size)
        out, kv, k_sum = attention_forward(qq, kk, ls, vv, kv0_flat, z0_flat, plan, normalization, eps, v.dtype)
        ctx.save_for_backward(q, k, v, omega, inv_temperature, kv0_flat, z0_flat)
        ctx.plan, ctx.meta = plan, (paired, normalization, eps, kv0 is not None)
        ctx.set_materialize_grads(False)
        log_max = plan.chunk_max[:, -1]
        ctx.mark_non_differentiable(log_max)  # a stabiliser: a constant for autograd
        return out.view(batch, heads, n, plan.dv), kv, k_sum, log_max

    @staticmethod
    def backward(ctx, d_out, d_kv, d_k_sum, _d_log_max):  # type: ignore[override]
        q, k, v, omega, inv_temperature, kv0, z0 = ctx.saved_tensors
        paired, normalization, eps, has_state = ctx.meta
        plan: ChunkPlan = ctx.plan
        bh, n = plan.bh, plan.n
        needs = ctx.needs_input_grad
        leaves = [t.detach().requires_grad_(needs[i]) for t, i in zip((q, k, omega, inv_temperature), (0, 1, 3, 4))]
        with torch.enable_grad():
            qf, kf, kls = _features(*leaves, paired)
        dqf, dkf, dls, dv, d_kv0, d_z0 = attention_backward(
            qf.detach().reshape(bh, n, plan.feat).contiguous(),
            kf.detach().reshape(bh, n, plan.feat).contiguous(),
            kls.detach().reshape(bh, n).float().contiguous(),
            v.reshape(bh, n, plan.dv).contiguous(),
            kv0, z0, plan, normalization, eps,
            None if d_out is None else d_out.reshape(bh, n, plan.dv), d_kv, d_k_sum,
        )  # fmt: skip
        grads: list[torch.Tensor | None] = [None] * 4
        wanted = [i for i, leaf in enumerate(leaves) if leaf.requires_grad]
        if wanted:
            got = torch.autograd.grad(
                (qf, kf, kls),
                [leaves[i] for i in wanted],
                (dqf.view_as(qf).to(qf.dtype), dkf.view_as(kf).to(kf.dtype), dls.view_as(kls)),
                allow_unused=True,
            )
            for i, g in zip(wanted, got):
                grads[i] = g
        d_kv_in = d_k_sum_in = None
        if has_state:
            batch, heads = q.shape[:2]
            d_kv_in, d_k_sum_in = d_kv0.view(batch, heads, plan.feat, plan.dv), d_z0.view(batch, heads, plan.feat)
        return grads[0], grads[1], dv.view_as(v).to(v.dtype), grads[2], grads[3], d_kv_in, d_k_sum_in, *([None] * 5)


def trig_linear_attention(
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
) -> tuple[torch.Tensor, LinearAttentionState]:
    """Causal linear attention of the trig map ``trig_feature_map(x, omega, inv_temperature,
    paired=paired)`` applied to q and k, with the Triton kernels: q, k [B, H, N, d], v [B, H, N, Dv],
    omega [H, P, d], inv_temperature [H] -> (out [B, H, N, Dv] in v.dtype, fp32 state).

    Equals ``triton_linear_attention(phi(q), phi(k), kls(k), v, ...)``; differentiable w.r.t. q,
    k, v, omega, inv_temperature and the initial state's kv and k_sum.
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_triton_dtype(t, name)
    batch, heads, n, d = q.shape
    if k.shape != q.shape or v.shape[:3] != q.shape[:3]:
        raise ValueError(f"k, v: expected [B, H, N, *] matching q {tuple(q.shape)}, got {tuple(k.shape)}, {tuple(v.shape)}")
    if omega.dim() != 3 or omega.shape[0] != heads or omega.shape[2] != d or (paired and omega.shape[1] % 2):
        raise ValueError(f"omega: expected shape [{heads}, P, {d}] (P even when paired), got {tuple(omega.shape)}")
    if inv_temperature.shape != (heads,):
        raise ValueError(f"inv_temperature: expected shape ({heads},), got {tuple(inv_temperature.shape)}")
    check_options(normalization, chunk_size, eps)
    kv0 = z0 = log_max0 = None
    if initial_state is not None:
        kv0, z0, log_max0 = initial_state.kv, initial_state.k_sum, initial_state.log_max
    out, kv, k_sum, log_max = _TrigLinearAttention.apply(
        q, k, v, omega, inv_temperature, kv0, z0, log_max0, paired, normalization, chunk_size, eps
    )
    feat = kv.shape[1]
    offset = (0 if initial_state is None else initial_state.offset) + n
    return out, LinearAttentionState(
        kv=kv.view(batch, heads, feat, -1), k_sum=k_sum.view(batch, heads, feat), log_max=log_max.view(batch, heads), offset=offset
    )
