"""Chunked causal linear attention: the training fast path, with a hand-written backward.

Same maths as the quadratic and recurrent forms (see ``core.py``): for token t in chunk c
(chunks of C tokens, the last one possibly shorter), with the per-token stabiliser
m_t = max(state.log_max, max_{s<=t} kls_s) (detached) and M_c = m at the end of chunk c,

    S_c   = exp(M_{c-1} - M_c) S_{c-1} + sum_{s in c} exp(kls_s - M_c) kf_s v_s^T     (chunk states)
    n_t   = sum_{s in c, s<=t} (qf_t . kf_s) exp(kls_s - m_t) v_s                    (intra-chunk, C x C)
          + exp(M_{c-1} - m_t) qf_t S_{c-1}                                         (inter-chunk)

Every exp argument is <= 0, so nothing overflows whatever the key norms. The denominator
d_t is the same sum with v_s := 1, so we append a ones column to v ("v_aug" [.., Dv + 1]): the
last column of the numerator is d_t and the last column of the state is k_sum. One code path
then serves both normalisations and returns the full state.

Performance design (CPU; the GPU hook is in ``core.register_fused_backend``):

* All compute in fp32 (fp64 for fp64 inputs) with autocast off, whatever the input dtype.
* Work is done per head and per *group* of G chunks, so every temporary (the C x C weights,
  scaled keys, ...) is ~1 MiB: it stays in cache and the allocator reuses it, instead of
  multi-hundred-MiB temporaries that page-fault on every call.
* Within a group all chunks go through one batched matmul (``bmm``/``baddbmm`` into
  preallocated outputs); the only Python loop over chunks is the O(F Dv) state scan.
* Backward recomputes the C x C weights from q, k (cheap: one bmm + a few elementwise passes)
  and keeps only the O(N / C) boundary states S_c from the forward. Gradients:

      dW'_ts = (dn_t . v_s) exp(kls_s - m_t)            (masked, s <= t)
      dq     = dW' K + exp(M_{c-1} - m_t) dn S_{c-1}^T
      dk     = dW'^T Q + exp(kls_s - M_c) V dS_c^T,      dv = W^T dn + exp(kls_s - M_c) K dS_c
      dS_c   = exp(M_c - M_{c+1}) dS_{c+1} + sum_{t in c+1} exp(M_c - m_t) qf_t dn_t^T  (reverse scan)
      dkls_s = kf_s . dk_s        (every path of kls_s into the output is exp(kls_s - .) kf_s)

  The gradient of the returned state seeds the reverse scan, so truncated-BPTT through
  carried states works; the initial state gets kv/k_sum gradients (and log_max through the
  exp(log_max - m) rescaling).
"""

from __future__ import annotations

import functools
from typing import Iterator

import torch

from .base import LinearAttentionState, fp32_inputs, normalize_output
from .core import validate_linear_attention_inputs

# target number of elements of a group's C x C weight block (x 4 bytes = 1 MiB)
_GROUP_ELEMENTS = 1 << 18


@functools.lru_cache(maxsize=32)
def _future_mask(c: int, device: torch.device) -> torch.Tensor:
    """[c, c] bool, True where s > t (key after query): those weights are zero."""
    return torch.ones(c, c, dtype=torch.bool, device=device).triu(1)


def _groups(n: int, c: int) -> Iterator[tuple[int, int, int, int]]:
    """Split N tokens into groups of whole chunks: yields (first token, chunks, chunk length, first chunk).

    Full chunks are grouped ``G`` at a time (G * C * C ~ _GROUP_ELEMENTS); a shorter last chunk
    (N not a multiple of C) forms its own group.
    """
    full = n // c
    per_group = max(1, _GROUP_ELEMENTS // (c * c))
    for first in range(0, full, per_group):
        chunks = min(per_group, full - first)
        yield first * c, chunks, c, first
    if n % c:
        yield full * c, 1, n % c, full


def _decay_weights(lam: torch.Tensor, m: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """E_ts = exp(kls_s - m_t) for s <= t, else 0: lam, m [g, c] -> [g, c(t), c(s)]."""
    e = lam.unsqueeze(-2) - m.unsqueeze(-1)
    # mask *before* exp: a later key can have kls_s > m_t, whose exp could overflow
    return e.masked_fill_(mask, float("-inf")).exp_()


class _ChunkedLinearAttention(torch.autograd.Function):
    """(q, k [BH, N, F], lam [BH, N], v [BH, N, Dv], s0 [BH, F, Dv+1], m0 [BH])
    -> (n_aug [BH, N, Dv+1], final state [BH, F, Dv+1], final log_max [BH]). All one dtype."""

    @staticmethod
    def forward(ctx, q, k, lam, v, s0, m0, chunk_size):  # type: ignore[override]
        bh, n, feat = q.shape
        dv = v.shape[-1]
        c = min(chunk_size, n)
        num_chunks = -(-n // c)
        v_aug = torch.cat([v, v.new_ones(bh, n, 1)], dim=-1)  # [BH, N, Dv+1]
        # per-token stabiliser m_t and per-boundary M_j (M_0 = initial log_max)
        m = torch.maximum(lam.cummax(dim=-1).values, m0.unsqueeze(-1))  # [BH, N]
        ends = torch.arange(1, num_chunks + 1, device=q.device) * c
        ends[-1] = n
        bounds = torch.cat([m0.unsqueeze(-1), m[:, ends - 1]], dim=-1)  # [BH, L+1]
        # exp(M_{j} - M_{j+1}); nan only for an all -inf prefix (-inf - -inf): treat as empty
        decay = torch.exp(bounds[:, :-1] - bounds[:, 1:]).nan_to_num_(0.0)  # [BH, L]

        # states[:, j] = S_j, the state after j chunks ([:, 0] = initial state)
        states = q.new_empty(bh, num_chunks + 1, feat, dv + 1)
        states[:, 0] = s0
        for h in range(bh):  # chunk increments sum_s exp(kls_s - M_c) kf_s v_s^T
            for t0, g, cl, c0 in _groups(n, c):
                t1 = t0 + g * cl
                w = torch.exp(lam[h, t0:t1].view(g, cl) - bounds[h, c0 + 1 : c0 + 1 + g, None])  # [g, cl]
                kw = k[h, t0:t1].view(g, cl, feat) * w.unsqueeze(-1)
                torch.bmm(kw.transpose(1, 2), v_aug[h, t0:t1].view(g, cl, dv + 1), out=states[h, c0 + 1 : c0 + 1 + g])
        for j in range(num_chunks):  # sequential scan, O(F Dv) per chunk
            states[:, j + 1].addcmul_(states[:, j], decay[:, j, None, None])

        out = q.new_empty(bh, n, dv + 1)
        for h in range(bh):
            for t0, g, cl, c0 in _groups(n, c):
                t1 = t0 + g * cl
                qg, kg = q[h, t0:t1].view(g, cl, feat), k[h, t0:t1].view(g, cl, feat)
                mg = m[h, t0:t1].view(g, cl)
                e = _decay_weights(lam[h, t0:t1].view(g, cl), mg, _future_mask(cl, q.device))
                weights = torch.bmm(qg, kg.transpose(1, 2)).mul_(e)  # [g, cl(t), cl(s)]
                og = out[h, t0:t1].view(g, cl, dv + 1)
                torch.bmm(qg, states[h, c0 : c0 + g], out=og)  # inter-chunk, then rescale rows
                og.mul_(torch.exp(bounds[h, c0 : c0 + g, None] - mg).unsqueeze(-1))
                og.baddbmm_(weights, v_aug[h, t0:t1].view(g, cl, dv + 1))

        ctx.save_for_backward(q, k, lam, v_aug, s0, m, bounds, decay, states)
        ctx.chunk = c
        log_max = bounds[:, -1].clone()
        ctx.mark_non_differentiable(log_max)
        return out, states[:, -1].clone(), log_max

    @staticmethod
    def backward(ctx, d_out, d_final, _d_log_max):  # type: ignore[override]
        q, k, lam, v_aug, s0, m, bounds, decay, states = ctx.saved_tensors
        c = ctx.chunk
        bh, n, feat = q.shape
        dva = v_aug.shape[-1]
        num_chunks = states.shape[1] - 1
        d_out = torch.zeros_like(v_aug) if d_out is None else d_out.contiguous()

        # d_states[:, j] = dL/dS_j; seeded by the returned state's gradient, then reverse scan
        d_states = q.new_empty(bh, num_chunks + 1, feat, dva)
        if d_final is None:
            d_states[:, -1].zero_()
        else:
            d_states[:, -1] = d_final
        for h in range(bh):  # direct use of S_c by the queries of chunk c: sum_t exp(M_c - m_t) q_t dn_t^T
            for t0, g, cl, c0 in _groups(n, c):
                t1 = t0 + g * cl
                scale = torch.exp(bounds[h, c0 : c0 + g, None] - m[h, t0:t1].view(g, cl))
                dns = d_out[h, t0:t1].view(g, cl, dva) * scale.unsqueeze(-1)
                torch.bmm(q[h, t0:t1].view(g, cl, feat).transpose(1, 2), dns, out=d_states[h, c0 : c0 + g])
        for j in range(num_chunks - 1, -1, -1):
            d_states[:, j].addcmul_(d_states[:, j + 1], decay[:, j, None, None])

        dq, dk, dv_aug = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v_aug)
        for h in range(bh):
            for t0, g, cl, c0 in _groups(n, c):
                t1 = t0 + g * cl
                qg, kg = q[h, t0:t1].view(g, cl, feat), k[h, t0:t1].view(g, cl, feat)
                vg, dng = v_aug[h, t0:t1].view(g, cl, dva), d_out[h, t0:t1].view(g, cl, dva)
                lg, mg = lam[h, t0:t1].view(g, cl), m[h, t0:t1].view(g, cl)
                s_prev, ds_next = states[h, c0 : c0 + g], d_states[h, c0 + 1 : c0 + 1 + g]
                e = _decay_weights(lg, mg, _future_mask(cl, q.device))
                weights = torch.bmm(qg, kg.transpose(1, 2)).mul_(e)
                key_w = torch.exp(lg - bounds[h, c0 + 1 : c0 + 1 + g, None]).unsqueeze(-1)  # [g, cl, 1]
                # dv = W^T dn + exp(kls_s - M_c) K dS_c
                dvg = dv_aug[h, t0:t1].view(g, cl, dva)
                torch.bmm(weights.transpose(1, 2), dng, out=dvg)
                dvg.baddbmm_(kg * key_w, ds_next)
                # dW' = (dn V^T) * E
                dw = torch.bmm(dng, vg.transpose(1, 2)).mul_(e)
                # dq = dW' K + exp(M_{c-1} - m_t) dn S_{c-1}^T
                dqg = dq[h, t0:t1].view(g, cl, feat)
                torch.bmm(dw, kg, out=dqg)
                dns = dng * torch.exp(bounds[h, c0 : c0 + g, None] - mg).unsqueeze(-1)
                dqg.baddbmm_(dns, s_prev.transpose(1, 2))
                # dk = dW'^T Q + exp(kls_s - M_c) V dS_c^T
                dkg = dk[h, t0:t1].view(g, cl, feat)
                torch.bmm(dw.transpose(1, 2), qg, out=dkg)
                dkg.baddbmm_(vg * key_w, ds_next.transpose(1, 2))
        d_lam = (k * dk).sum(dim=-1)
        d_s0 = d_states[:, 0] if ctx.needs_input_grad[4] else None
        # S_0 enters as exp(M_0 - m) S_0, so dL/dM_0 = <S_0, dL/dS_0> (m itself is a constant)
        d_m0 = (s0 * d_states[:, 0]).sum(dim=(-1, -2)) if ctx.needs_input_grad[5] else None
        return dq, dk, d_lam, dv_aug[..., :-1], d_s0, d_m0, None


def chunked_linear_attention(
    qf: torch.Tensor,
    kf: torch.Tensor,
    kls: torch.Tensor | None,
    v: torch.Tensor,
    *,
    normalization: str = "rms",
    chunk_size: int = 64,
    initial_state: LinearAttentionState | None = None,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, LinearAttentionState]:
    """Chunked causal linear attention (training path): same result as the quadratic form.

    qf, kf [B, H, N, F]; kls [B, H, N] or None (= zeros); v [B, H, N, Dv]; any N >= 1, any
    ``chunk_size`` (a shorter last chunk is handled without padding).
    Returns (out [B, H, N, Dv] in v.dtype, state in fp32, or fp64 for fp64 inputs).
    Differentiable w.r.t. qf, kf, kls, v and the initial state's tensors.
    """
    validate_linear_attention_inputs(
        qf, kf, kls, v, form="chunked", normalization=normalization, chunk_size=chunk_size, initial_state=initial_state, eps=eps
    )
    batch, heads, n, feat = qf.shape
    dv = v.shape[-1]
    with torch.autocast(device_type=qf.device.type, enabled=False):
        q, k, lam, vv, state = fp32_inputs(qf, kf, kls, v, initial_state)
        s0 = torch.cat([state.kv, state.k_sum.unsqueeze(-1)], dim=-1)  # [B, H, F, Dv+1]
        bh = batch * heads
        out_aug, final, log_max = _ChunkedLinearAttention.apply(
            q.reshape(bh, n, feat).contiguous(),
            k.reshape(bh, n, feat).contiguous(),
            lam.reshape(bh, n).contiguous(),
            vv.reshape(bh, n, dv).contiguous(),
            s0.reshape(bh, feat, dv + 1),
            state.log_max.reshape(bh),
            chunk_size,
        )
        out_aug = out_aug.view(batch, heads, n, dv + 1)
        out = normalize_output(out_aug[..., :dv], out_aug[..., dv], normalization, eps)
        final = final.view(batch, heads, feat, dv + 1)
    new_state = LinearAttentionState(
        kv=final[..., :dv], k_sum=final[..., dv], log_max=log_max.view(batch, heads), offset=state.offset + n
    )
    return out.to(v.dtype), new_state
