"""Recurrent (token-by-token) causal linear attention: O(1) work and memory per token.

The decoding form. For each token t, in fp32:

    m_t   = max(m_{t-1} + g, kls_t)                      (detached stabiliser; m_0 = state.log_max)
    S_t   = exp(m_{t-1} + g - m_t) S_{t-1} + exp(kls_t - m_t) kf_t v_t^T     [B, H, F, Dv]
    z_t   = exp(m_{t-1} + g - m_t) z_{t-1} + exp(kls_t - m_t) kf_t           [B, H, F]
    n_t   = qf_t S_t,  d_t = qf_t . z_t

which is algebraically the quadratic form; g = log gamma is the per-head decay (``decay.py``; 0
without it). A Python loop over N: fine for decoding (N = 1) and for tests; training uses the chunked form. Inputs are assumed valid (the dispatcher validates).
"""

from __future__ import annotations

import torch

from ..base import LinearAttentionState, accumulation_dtype, fp32_inputs
from ..normalize import normalize_output, reads_denominator


def recurrent_linear_attention(
    qf: torch.Tensor,
    kf: torch.Tensor,
    kls: torch.Tensor | None,
    v: torch.Tensor,
    *,
    normalization: str = "rms",
    chunk_size: int = 64,  # the shared contract's (``base.LinearAttentionFn``); no chunks here
    initial_state: LinearAttentionState | None = None,
    eps: float = 1e-6,
    document_starts: torch.Tensor | None = None,
    log_decay: torch.Tensor | None = None,
) -> tuple[torch.Tensor, LinearAttentionState]:
    """qf, kf [B, H, N, F], kls [B, H, N] | None, v [B, H, N, Dv] -> (out [B, H, N, Dv], state).
    ``document_starts`` [B, N] bool: the state is emptied before each token that starts a document.
    ``log_decay`` [H] (``decay.py``): log gamma per head, applied natively: the state decays by gamma
    per token (log_max + g), the stabiliser following it."""
    q, k, ls, vv, state = fp32_inputs(qf, kf, kls, v, initial_state)
    kv, k_sum, log_max = state.kv, state.k_sum, state.log_max.detach()
    g = None if log_decay is None else log_decay.to(ls.dtype)
    numerators, denominators = [], []
    for t in range(q.shape[2]):
        if document_starts is not None:
            restart = document_starts[:, t, None]  # [B, 1]
            kv = kv.masked_fill(restart[..., None, None], 0.0)
            k_sum = k_sum.masked_fill(restart[..., None], 0.0)
            log_max = log_max.masked_fill(restart, float("-inf"))
        aged = log_max if g is None else log_max + g  # the state's log weight one token later
        m = torch.maximum(aged.detach(), ls[..., t].detach())  # [B, H]
        decay = torch.exp(aged - m)  # [B, H]; 0 for the empty state (log_max = -inf)
        weighted_k = torch.exp(ls[..., t] - m).unsqueeze(-1) * k[:, :, t]  # [B, H, F]
        kv = kv * decay[..., None, None] + weighted_k.unsqueeze(-1) * vv[:, :, t].unsqueeze(-2)
        k_sum = k_sum * decay[..., None] + weighted_k
        numerators.append(torch.einsum("bhf,bhfd->bhd", q[:, :, t], kv))
        denominators.append((q[:, :, t] * k_sum).sum(dim=-1))
        log_max = m
    numerator = torch.stack(numerators, dim=2)  # [B, H, N, Dv]
    denominator = torch.stack(denominators, dim=2)  # [B, H, N]
    out = normalize_output(numerator, denominator, normalization, eps)
    new_state = LinearAttentionState(kv=kv, k_sum=k_sum, log_max=log_max, offset=state.offset + q.shape[2])
    return out.to(v.dtype), new_state


def recurrent_step(
    qf: torch.Tensor,
    kf: torch.Tensor,
    kls: torch.Tensor | None,
    v: torch.Tensor,
    initial_state: LinearAttentionState,
    *,
    normalization: str = "rms",
    eps: float = 1e-6,
    log_decay: torch.Tensor | None = None,
) -> tuple[torch.Tensor, LinearAttentionState]:
    """One decoding token: ``recurrent_linear_attention`` for N = 1 without autograd, in the fewest ops.

    qf, kf [B, H, 1, F], kls [B, H, 1] | None, v [B, H, 1, Dv], state (required) ->
    (out [B, H, 1, Dv] in v.dtype, state). ``initial_state`` as the contract calls it. Same maths as the loop above (which is its test
    reference); per token it is op-count-bound, so S is updated by one batched matmul-add on
    [B*H] heads, and the denominator is only formed for normalization="denominator".
    """
    state = initial_state
    batch, heads, _, feat = qf.shape
    bh, value_dim = batch * heads, v.shape[-1]
    acc = accumulation_dtype(v.dtype)
    log_max = state.log_max.to(acc)
    if log_decay is not None:  # the state one token older
        log_max = log_max + log_decay.to(acc)
    k = kf.to(acc).reshape(batch, heads, feat)
    ls = torch.zeros_like(log_max) if kls is None else kls.to(acc).reshape(batch, heads)
    m = torch.maximum(log_max, ls)  # [B, H]
    decay = torch.exp(log_max - m).unsqueeze(-1)  # [B, H, 1]; 0 for the empty state
    weight = torch.exp(ls - m).unsqueeze(-1)
    # S = decay S + k (weight v)^T ;  z = decay z + weight k
    kv = torch.baddbmm(
        (state.kv.to(acc) * decay.unsqueeze(-1)).reshape(bh, feat, value_dim),
        k.reshape(bh, feat, 1),
        (v.to(acc).reshape(batch, heads, value_dim) * weight).reshape(bh, 1, value_dim),
    )
    k_sum = torch.addcmul(state.k_sum.to(acc) * decay, weight, k)  # [B, H, F]
    q = qf.to(acc).reshape(bh, 1, feat)
    numerator = torch.bmm(q, kv).reshape(batch, heads, 1, value_dim)
    denominator = None
    if reads_denominator(normalization):
        denominator = (q.reshape(batch, heads, 1, feat) * k_sum.unsqueeze(2)).sum(dim=-1)  # [B, H, 1]
    out = normalize_output(numerator, denominator, normalization, eps)
    new_state = LinearAttentionState(
        kv=kv.reshape(batch, heads, feat, value_dim), k_sum=k_sum, log_max=m, offset=state.offset + 1
    )
    return out.to(v.dtype), new_state
