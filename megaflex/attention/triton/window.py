"""Torch glue of the one-normaliser hybrid's Triton kernels (``window_kernels.py``): the autograd
Function ``TritonWindowNumerator``, ``ChunkedWindowNumerator``'s contract (``window/chunk.py``).

Forward: the chunk stabilisers B_j (``launch.chunk_plan``: B_0 = m0, B_{j+1} = the running max of the
key log-scales at chunk j's end), the state entering every chunk (``chunk_states`` of
``linear_kernels.py``, run on v_aug: the ones column makes the k_sum column), then ``window_outputs``.
Saved for backward: the inputs and m [BH, T] (no states, no blocks).

Backward: the states again (one O(T F Dv) scan), dL/dS from the reads by the reverse scan
``chunk_state_grads`` of ``linear_kernels.py``: state j is read by chunk j + L with the coefficient
exp(qls_t + B_j - m_t) = exp(B_j - (m_t - qls_t)), so the scan runs on the queries, output
gradients and (m - qls) shifted back by L chunks; chunks 0 .. L - 1, which read S_0 too, add
theirs to dL/dS_0 here (L C tokens, one small matmul). Then ``window_grads_q`` and
``window_grads_k`` (dU_j = dS_{j+1} for the keys' share of the state), and the log-scale
gradients as rowsums qf . dqf, kf . dkf.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import ModuleType

import torch

from .launch import LOOP_TILE, ChunkPlan, block_size, chunk_plan, chunk_states, kernel_chunk, launch
from .linear import check_triton_dtype, kernels_for


# The window kernels hold [C, C] blocks (weights, their gradients) and [C, Dv] tiles in registers:
# at C = 64 window_grads_k spilled 448 B per thread (bf16, sm_80, the 1.3B shape), at C = 32 none
# of them spills (benchmarks/triton_aot.py). The chunk length changes nothing but rounding.
_WINDOW_MAX_CHUNK = 32


def window_chunk(chunk_size: int) -> int:
    """The chunk length the window kernels use: ``kernel_chunk(chunk_size)``, at most 32."""
    return min(kernel_chunk(chunk_size), _WINDOW_MAX_CHUNK)


@dataclass
class WindowPlan:
    """Sizes and stabilisers of one call (the same in forward and backward)."""

    bh: int
    t: int
    head_dim: int
    feat: int
    dv: int  # Dv: v_aug has Dv + 1 columns
    window: int
    chunk: int
    chunks: int
    lookback: int  # L = min(ceil(W / C), NC - 1)
    scan: ChunkPlan  # the linear state's plan over Dv + 1 columns (chunk_max: the bounds B_j)

    def blocks(self, kernel: str) -> dict[str, int]:
        """Loop blocks over the head dim, F and (the backward kernels) Dv: 32 wide, as the linear
        kernels' loops; ``window_outputs`` holds its [C, Dv] numerator whole (online rescaling)."""
        loop = lambda size: min(block_size(size), LOOP_TILE)  # noqa: E731
        return dict(BD=loop(self.head_dim), BF=loop(self.feat), BV=block_size(self.dv) if kernel == "window_outputs" else loop(self.dv))


def window_plan(q: torch.Tensor, kf: torch.Tensor, kls: torch.Tensor, v_aug: torch.Tensor, m0: torch.Tensor,
                window: int, c: int) -> WindowPlan:  # fmt: skip
    """The plan of key-aligned [BH, T, *] inputs (T a multiple of ``c``, a kernel chunk)."""
    bh, t, head_dim = q.shape
    if c != kernel_chunk(c) or t % c:
        raise ValueError(f"c: expected a power of two in [16, 128] dividing T = {t}, got {c}")
    if window < 1:
        raise ValueError(f"window: the Triton form takes W >= 1, got {window} (W = 0 is plain linear attention)")
    feat, dv = kf.shape[-1], v_aug.shape[-1] - 1
    chunks = t // c
    scan = chunk_plan(kls, m0.float(), feat, dv + 1, c)
    return WindowPlan(bh, t, head_dim, feat, dv, window, c, chunks, min(-(-window // c), chunks - 1), scan)


def window_kernels_for(device: torch.device) -> ModuleType:
    """The window kernels (after ``kernels_for``'s checks: triton present, interpreter iff CPU)."""
    kernels_for(device)
    from . import window_kernels

    return window_kernels


def _launch_window(wkern, kernel: str, plan: WindowPlan, *args) -> None:
    getattr(wkern, kernel)[(plan.chunks, plan.bh)](
        *args, plan.t, plan.head_dim, plan.feat, plan.dv, plan.chunks, plan.lookback, plan.window,
        1.0 / math.sqrt(plan.head_dim), CHUNK=plan.chunk, PREC="tf32", **plan.blocks(kernel),
    )  # fmt: skip


def _features_or_placeholder(plan: WindowPlan, qf: torch.Tensor, kf: torch.Tensor, like: torch.Tensor):
    """F = 0 (a softmax core: no far field): the kernels never read the features; pass a real pointer."""
    return (qf, kf) if plan.feat else (like, like)


def _states(kern, plan: WindowPlan, kf, kls, v_aug, s0) -> torch.Tensor:
    """The state entering every chunk [BH, NC, F, Dv + 1] fp32 (a placeholder when F = 0)."""
    if not plan.feat:
        return torch.zeros(1, device=kf.device)
    z0 = torch.zeros(plan.bh, plan.feat, device=kf.device)
    states, _, _, _ = chunk_states(kern, kf, v_aug, kls, plan.scan, s0, z0)
    return states


def window_forward(q, qf, qls, k, kf, kls, v_aug, s0, plan: WindowPlan, kern=None, wkern=None):
    """Numerators [BH, T, Dv + 1] and the stabiliser m [BH, T] (fp32). ``kern``, ``wkern``: the
    kernels modules (default: ``kernels_for``; the AOT harness passes recorders)."""
    kern = kern or kernels_for(q.device)
    wkern = wkern or window_kernels_for(q.device)
    states = _states(kern, plan, kf, kls, v_aug, s0)
    numer = torch.empty(plan.bh, plan.t, plan.dv + 1, device=q.device)
    m = torch.empty(plan.bh, plan.t, device=q.device)
    qf, kf = _features_or_placeholder(plan, qf, kf, q)
    _launch_window(wkern, "window_outputs", plan, q, qf, qls, k, kf, kls, v_aug, plan.scan.chunk_max, states, numer, m)
    return numer, m


def _state_grads(kern, plan: WindowPlan, qf, qls, m, m0, d_numer) -> torch.Tensor:
    """dL/dS_{j+1} for every chunk j [BH, NC, F, Dv + 1] (from the reads alone: the Function returns
    no state) and dL/dS_0 [BH, F, Dv + 1]."""
    f32 = dict(device=qf.device, dtype=torch.float32)
    shift = plan.lookback * plan.chunk

    def shifted(x: torch.Tensor, fill: float) -> torch.Tensor:  # x[t + L C], ``fill`` past the end
        if not shift:
            return x.contiguous()
        return torch.cat([x[:, shift:], x.new_full((x.shape[0], shift, *x.shape[2:]), fill)], dim=1).contiguous()

    # rows past the end read nothing: zero queries, and m - qls = +inf (their coefficient exp(B - inf) = 0)
    q_read, m_read, dn_read = shifted(qf, 0.0), shifted(m - qls, float("inf")), shifted(d_numer, 0.0)
    dv1 = plan.dv + 1
    d_states = torch.empty(plan.bh, plan.chunks, plan.feat, dv1, **f32)
    d_sums = torch.empty(plan.bh, plan.chunks, plan.feat, **f32)
    d_s0, d_z0 = torch.empty(plan.bh, plan.feat, dv1, **f32), torch.empty(plan.bh, plan.feat, **f32)
    zeros_n, zeros_s, zeros_z = torch.zeros(plan.bh, plan.t, **f32), torch.zeros(plan.bh, plan.feat, dv1, **f32), torch.zeros(plan.bh, plan.feat, **f32)
    bf, bv = plan.scan.scan_blocks()
    launch(
        kern, "chunk_state_grads", (plan.bh, -(-plan.feat // bf), -(-dv1 // bv)), plan.scan,
        q_read, m_read, plan.scan.chunk_max, dn_read, zeros_n, zeros_s, zeros_z, d_states, d_sums, d_s0, d_z0,
        plan.t, plan.feat, dv1, plan.chunks, BF=bf, BV=bv,
    )  # fmt: skip
    if shift:  # chunks 0 .. L - 1 read S_0 as well, with exp(qls_t + m0 - m_t)
        coef = torch.exp(qls[:, :shift] + m0.float().unsqueeze(-1) - m[:, :shift]).nan_to_num_(0.0)
        d_s0 += (qf[:, :shift].float() * coef.unsqueeze(-1)).transpose(1, 2) @ d_numer[:, :shift]
    return d_states, d_s0


def window_backward(q, qf, qls, k, kf, kls, v_aug, s0, m0, m, d_numer, plan: WindowPlan, kern=None, wkern=None):
    """Gradients of q, qf, qls, k, kf, kls, v_aug (fp32) and of s0 (fp32; None when F = 0)."""
    kern = kern or kernels_for(q.device)
    wkern = wkern or window_kernels_for(q.device)
    f32 = dict(device=q.device, dtype=torch.float32)
    d_numer = d_numer.float().contiguous()
    states = _states(kern, plan, kf, kls, v_aug, s0)
    if plan.feat:
        d_states, d_s0 = _state_grads(kern, plan, qf, qls, m, m0, d_numer)
        dqf, dkf = torch.zeros(plan.bh, plan.t, plan.feat, **f32), torch.zeros(plan.bh, plan.t, plan.feat, **f32)
    else:
        d_states, d_s0 = states, None
        dqf = dkf = torch.zeros(1, **f32)
    qf_, kf_ = _features_or_placeholder(plan, qf, kf, q)
    dq, dk = torch.zeros_like(q, dtype=torch.float32), torch.zeros_like(k, dtype=torch.float32)
    dv = torch.zeros(plan.bh, plan.t, plan.dv + 1, **f32)
    chunk_max = plan.scan.chunk_max
    _launch_window(wkern, "window_grads_q", plan, q, qf_, qls, k, kf_, kls, v_aug, m, chunk_max, states, d_numer, dq, dqf)
    _launch_window(wkern, "window_grads_k", plan, q, qf_, qls, k, kf_, kls, v_aug, m, chunk_max, d_states, d_numer, dk, dkf, dv)
    if not plan.feat:
        dqf, dkf = torch.zeros_like(qf, dtype=torch.float32), torch.zeros_like(kf, dtype=torch.float32)
    # every path of a log-scale into the loss is exp(ls) times its features: dls = features . dfeatures
    dqls, dkls = (qf.float() * dqf).sum(-1), (kf.float() * dkf).sum(-1)
    return dq, dqf, dqls, dk, dkf, dkls, dv, d_s0


class TritonWindowNumerator(torch.autograd.Function):
    """``ChunkedWindowNumerator`` (``window/chunk.py``) in Triton kernels: (q, qf, qls, k, kf,
    kls, v_aug [BH, T, *] key-aligned, T a multiple of C, padded keys with k = kf = v_aug = 0 and
    kls = -inf; s0 [BH, F, Dv + 1], m0 [BH]; window W >= 1, C a power of two in [16, 128])
    -> numerators [BH, T, Dv + 1] fp32. q, qf, k, kf, v_aug in one of fp16 / bf16 / fp32 (the dots'
    operand dtype; fp32 accumulation), log-scales and s0 fp32; gradients in the inputs' dtypes."""

    @staticmethod
    def forward(ctx, q, qf, qls, k, kf, kls, v_aug, s0, m0, window, c):  # type: ignore[override]
        for name, t in (("q", q), ("qf", qf), ("k", k), ("kf", kf), ("v_aug", v_aug)):
            check_triton_dtype(t, name)
            if t.dtype != q.dtype:
                raise ValueError(f"{name}: expected q's dtype {q.dtype}, got {t.dtype}")
        q, qf, k, kf, v_aug = (t.contiguous() for t in (q, qf, k, kf, v_aug))
        qls, kls, s0 = (t.float().contiguous() for t in (qls, kls, s0))
        plan = window_plan(q, kf, kls, v_aug, m0, window, c)
        numer, m = window_forward(q, qf, qls, k, kf, kls, v_aug, s0, plan)
        ctx.save_for_backward(q, qf, qls, k, kf, kls, v_aug, s0, m0, m)
        ctx.plan = plan
        return numer

    @staticmethod
    def backward(ctx, d_numer):  # type: ignore[override]
        q, qf, qls, k, kf, kls, v_aug, s0, m0, m = ctx.saved_tensors
        grads = window_backward(q, qf, qls, k, kf, kls, v_aug, s0, m0, m, d_numer, ctx.plan)
        dq, dqf, dqls, dk, dkf, dkls, dv, d_s0 = grads
        like = (q, qf, qls, k, kf, kls, v_aug)
        out = [g.to(t.dtype) for g, t in zip((dq, dqf, dqls, dk, dkf, dkls, dv), like)]
        if d_s0 is None:
            d_s0 = torch.zeros_like(s0)
        return (*out, d_s0 if ctx.needs_input_grad[7] else None, None, None, None)
