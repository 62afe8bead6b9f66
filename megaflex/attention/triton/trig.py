"""Trig feature map + Triton attention in one autograd function (no saved [B, H, N, F] features).

Saved for backward: q, k, v, the map's parameters and the incoming state only, so between a
layer's forward and backward only the raw [B, H, N, d] inputs are alive, as for softmax
attention. Two ways to get the features (``fused_map``):

* ``fused_map=True`` (default; what ``AttentionCore`` runs on CUDA): the kernels take the raw
  q, k and omega and compute each [C, BF] feature tile in registers where they need it
  (``kernels._features``: projection over head-dim blocks, cos by range reduction and
  polynomials, pair sums, scale); the key log-scale ||k||^2 inv_temperature is a [B, H, N]
  torch expression. Backward: the attention backward kernels (recomputing features the same
  way) give the feature gradients [B H, N, F] (fp32, transient), and ``trig_grads`` turns them
  into dq, dk and per-(batch, head) domega, recomputing projections in registers. No
  projection, cos or sin tensor exists. Compiled for every shipped shape it fits shared memory
  on sm_80 and sm_90 with no bf16 spills at 247M/41M and at most 16 B at 1.3B
  (docs/results/triton_aot.json).
* ``fused_map=False`` (the reference beside it): forward computes the features in torch
  (``trig_feature_map_reference``, vectorised: no loop over heads) and runs the attention
  kernels on them; backward recomputes them with autograd on, runs the attention backward
  kernels and backpropagates the feature gradients through the map. The features and the
  map's intermediates exist transiently.
"""

from __future__ import annotations

import torch

from ..base import LinearAttentionState
from ..decay import fold_keys, run_folded
from ..feature_maps.trig import feature_scale, trig_feature_map_reference
from .launch import ChunkPlan, TrigMap
from .linear import (
    attention_backward,
    attention_forward,
    check_options,
    check_triton_dtype,
    flat_inputs,
    map_backward,
)


def _key_log_scale(k: torch.Tensor, inv_temperature: torch.Tensor) -> torch.Tensor:
    """||k||^2 inv_temperature[h] [B, H, N] fp32 (as ``trig_feature_map``)."""
    k32 = k.float()
    return (k32 * k32).sum(dim=-1) * inv_temperature.float()[:, None]


def _features(q, k, omega, inv_temperature, paired):
    """(qf, kf, kls) [B, H, N, *] of the trig map in torch (the query's log-scale is never used)."""
    qf, _ = trig_feature_map_reference(q, omega, inv_temperature, paired=paired)
    kf, kls = trig_feature_map_reference(k, omega, inv_temperature, paired=paired)
    return qf, kf, kls


def _folded(kls: torch.Tensor, log_decay: torch.Tensor | None, origin: int) -> torch.Tensor:
    """The key log-scales with the decay folded in about ``origin`` (``decay.fold_keys``): kls_s - (s - c) g."""
    return kls if log_decay is None else fold_keys(kls, log_decay, tuple(kls.shape), -origin)


def _decay_grad(dls: torch.Tensor, log_decay: torch.Tensor | None, shape, origin: int) -> torch.Tensor | None:  # noqa: ANN001
    """d g [H] = -sum_{b, s} (s - c) dkls'_s from the folded key log-scales' gradient dls [B H, N]."""
    if log_decay is None:
        return None
    batch, heads, n = shape[:3]
    tokens = torch.arange(-origin, n - origin, device=dls.device, dtype=dls.dtype)
    return -(dls.view(batch, heads, n) * tokens).sum(dim=(0, 2))


def _prepare(q, k, v, omega, inv_temperature, log_decay, origin, state, paired, fused, chunk_size):
    """Flat kernel inputs and the plan: the features (default), or with ``fused`` the raw q, k
    and a plan whose TrigMap lets the kernels map them; the key log-scales with the decay folded in."""
    if not fused:
        qf, kf, kls = _features(q, k, omega, inv_temperature, paired)
        return flat_inputs(qf, kf, _folded(kls, log_decay, origin), v, state, chunk_size)
    rows = omega.shape[1]
    kls = _folded(_key_log_scale(k, inv_temperature), log_decay, origin)
    flat, kv0, z0, plan = flat_inputs(q, k, kls, v, state, chunk_size, feat=rows if paired else 2 * rows)
    plan.trig = TrigMap(omega.detach().float().contiguous(), paired, feature_scale(rows, paired))
    return flat, kv0, z0, plan


def _map_grads_fused(q, k, dqf, dkf, dls, inv_temperature, plan: ChunkPlan, shape):
    """dq, dk [B, H, N, d] fp32, domega [H, P, d] fp32, dinv_temperature [H] from the feature and
    key log-scale gradients, by ``trig_grads`` (+ the log-scale's [B, H, N] terms in torch)."""
    batch, heads, n, d = shape
    dq, d_omega_q = map_backward(q, dqf, plan)
    dk, d_omega_k = map_backward(k, dkf, plan)
    # the key log-scale ||k||^2 inv_t[h]: dk += 2 k dls inv_t[h], dinv_t[h] = sum_{b, n} dls ||k||^2
    k32 = k.float().view(batch, heads, n, d)
    dls = dls.view(batch, heads, n)
    dk = dk.view(batch, heads, n, d).addcmul_(k32, (2 * dls * inv_temperature.float()[:, None]).unsqueeze(-1))
    d_inv = (dls * (k32 * k32).sum(dim=-1)).sum(dim=(0, 2))
    d_omega = (d_omega_q + d_omega_k).view(batch, heads, *plan.trig.omega.shape[1:]).sum(dim=0)
    return dq.view(batch, heads, n, d), dk, d_omega, d_inv


class _TrigLinearAttention(torch.autograd.Function):
    """(q, k, v, omega, inv_temperature, log_decay | None, kv0, k_sum0, log_max0 | None, paired, fused_map,
    normalization, chunk_size, eps, origin) -> (out [B, H, N, Dv], kv [BH, F, Dv], k_sum [BH, F], log_max [BH]).
    ``log_decay`` [H]: the decay folded into the key log-scales about ``origin`` (the state's part is the caller's)."""

    @staticmethod
    def forward(ctx, q, k, v, omega, inv_temperature, log_decay, kv0, z0, log_max0, paired, fused, normalization, chunk_size, eps, origin):  # type: ignore[override]
        batch, heads, n, _ = q.shape
        state = None if log_max0 is None else LinearAttentionState(kv0, z0, log_max0)
        (qq, kk, ls, vv), kv0_flat, z0_flat, plan = _prepare(
            q, k, v, omega, inv_temperature, log_decay, origin, state, paired, fused, chunk_size
        )
        out, kv, k_sum = attention_forward(qq, kk, ls, vv, kv0_flat, z0_flat, plan, normalization, eps, v.dtype)
        ctx.save_for_backward(q, k, v, omega, inv_temperature, log_decay, kv0_flat, z0_flat, ls if fused else None)
        ctx.plan, ctx.meta = plan, (paired, normalization, eps, kv0 is not None, origin)
        ctx.set_materialize_grads(False)
        log_max = plan.chunk_max[:, -1]
        ctx.mark_non_differentiable(log_max)  # a stabiliser: a constant for autograd
        return out.view(batch, heads, n, plan.dv), kv, k_sum, log_max

    @staticmethod
    def backward(ctx, d_out, d_kv, d_k_sum, _d_log_max):  # type: ignore[override]
        q, k, v, omega, inv_temperature, log_decay, kv0, z0, ls = ctx.saved_tensors
        paired, normalization, eps, has_state, origin = ctx.meta
        plan: ChunkPlan = ctx.plan
        bh, n = plan.bh, plan.n
        d_out = None if d_out is None else d_out.reshape(bh, n, plan.dv)
        flat_v = v.reshape(bh, n, plan.dv).contiguous()
        grads: list[torch.Tensor | None] = [None] * 4
        if plan.trig is not None:
            qq, kk = q.reshape(bh, n, -1).contiguous(), k.reshape(bh, n, -1).contiguous()
            dqf, dkf, dls, dv, d_kv0, d_z0 = attention_backward(qq, kk, ls, flat_v, kv0, z0, plan, normalization, eps, d_out, d_kv, d_k_sum)
            grads = list(_map_grads_fused(qq, kk, dqf, dkf, dls, inv_temperature, plan, q.shape))
            d_decay = _decay_grad(dls, log_decay, q.shape, origin)
        else:
            needs = ctx.needs_input_grad
            leaves = [t.detach().requires_grad_(needs[i]) for t, i in zip((q, k, omega, inv_temperature), (0, 1, 3, 4))]
            with torch.enable_grad():
                qf, kf, kls = _features(*leaves, paired)
            dqf, dkf, dls, dv, d_kv0, d_z0 = attention_backward(
                qf.detach().reshape(bh, n, plan.feat).contiguous(),
                kf.detach().reshape(bh, n, plan.feat).contiguous(),
                _folded(kls.detach().float(), log_decay, origin).reshape(bh, n).contiguous(),
                flat_v, kv0, z0, plan, normalization, eps, d_out, d_kv, d_k_sum,
            )  # fmt: skip
            d_decay = _decay_grad(dls, log_decay, q.shape, origin)
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
        dq, dk, d_omega, d_inv = (None if g is None else g.to(t.dtype) for g, t in zip(grads, (q, k, omega, inv_temperature)))
        d_decay = None if d_decay is None else d_decay.to(log_decay.dtype)
        return dq, dk, dv.view_as(v).to(v.dtype), d_omega, d_inv, d_decay, d_kv_in, d_k_sum_in, *([None] * 7)


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
    fused_map: bool = True,
    log_decay: torch.Tensor | None = None,
) -> tuple[torch.Tensor, LinearAttentionState]:
    """Causal linear attention of the trig map ``trig_feature_map(x, omega, inv_temperature,
    paired=paired)`` applied to q and k, with the Triton kernels: q, k [B, H, N, d], v [B, H, N, Dv],
    omega [H, P, d], inv_temperature [H] -> (out [B, H, N, Dv] in v.dtype, fp32 state).

    Equals ``triton_linear_attention(phi(q), phi(k), kls(k), v, ...)``; differentiable w.r.t. q,
    k, v, omega, inv_temperature and the initial state's kv and k_sum. ``fused_map`` (default): the
    kernels compute the features themselves; False: torch computes them (the reference; see the
    module docstring). ``log_decay`` [H] | None: the per-head decay of old keys, folded into the key
    log-scales and the state (``decay.py``): the kernels are unchanged.
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
    if log_decay is not None and log_decay.shape != (heads,):
        raise ValueError(f"log_decay: expected shape ({heads},), got {tuple(log_decay.shape)}")

    def run(lo: int, hi: int, origin: int, state: LinearAttentionState | None) -> tuple[torch.Tensor, LinearAttentionState]:
        """Tokens lo .. hi - 1 through the Function, from ``state`` (with a decay: folded about ``origin``)."""
        kv0 = z0 = log_max0 = None
        if state is not None:
            kv0, z0, log_max0 = state.kv, state.k_sum, state.log_max
        out, kv, k_sum, log_max = _TrigLinearAttention.apply(
            q[:, :, lo:hi], k[:, :, lo:hi], v[:, :, lo:hi], omega, inv_temperature,
            None if log_decay is None else log_decay.float(), kv0, z0, log_max0, paired, fused_map, normalization,
            chunk_size, eps, origin,
        )  # fmt: skip
        feat = kv.shape[1]
        return out, LinearAttentionState(
            kv=kv.view(batch, heads, feat, -1), k_sum=k_sum.view(batch, heads, feat), log_max=log_max.view(batch, heads),
            offset=(0 if state is None else state.offset) + hi - lo,
        )  # fmt: skip

    if log_decay is None:
        return run(0, n, 0, initial_state)
    return run_folded(run, n, log_decay, initial_state)
