"""Quadratic (materialised) causal linear attention: the ground truth the other forms are tested against.

Builds the full masked N x N weight matrix

    w_ts = (qf_t . kf_s) * exp(kls_s - m_t)  for s <= t,   m_t = max(state.log_max, max_{s<=t} kls_s)

plus the carried state's contribution rescaled by exp(state.log_max - m_t), in fp32. O(N^2)
memory: meant for tests and short sequences, not training. Inputs are assumed valid (the
dispatcher ``megaflex.attention.causal_linear_attention`` validates them).
"""

from __future__ import annotations

import torch

from ..base import LinearAttentionState, fp32_inputs
from ..documents import block_causal_mask, document_ids
from ..normalize import normalize_output
from ..window.common import finite_stabiliser


def quadratic_linear_attention(
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

    ``document_starts`` [B, N] bool (``documents.py``): keys of other documents are masked, only
    tokens before the first start read the carried state, and the returned state is the last document's.
    ``log_decay`` [H] (``decay.py``): log gamma per head, applied natively (not folded): every weight,
    the carried state's included, times gamma^(t - s), and the stabiliser is their running max."""
    q, k, ls, vv, state = fp32_inputs(qf, kf, kls, v, initial_state)
    n = q.shape[2]
    # the stabiliser is a constant for autograd everywhere (the carried log_max included, as in
    # the recurrent and chunked forms): [B, H]
    log_max = state.log_max.detach()
    key_log, carry_log = ls.unsqueeze(-2), log_max.unsqueeze(-1)  # [B, H, 1, N], [B, H, 1]: log weights before m_t
    if log_decay is not None:  # + (t - s) g for the keys, (t + 1) g for the state (its last token is at -1)
        g = log_decay.to(ls.dtype)[:, None, None]
        t = torch.arange(n, device=q.device, dtype=ls.dtype)
        key_log = key_log + (t[:, None] - t[None, :]).clamp(min=0) * g  # [B, H, N, N]
        carry_log = carry_log + (t + 1) * g[..., 0]  # [B, H, N]
    if document_starts is None:
        allowed = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        if log_decay is None:
            m = torch.maximum(ls.detach().cummax(dim=-1).values, log_max.unsqueeze(-1))  # running max [B, H, N]
        else:
            m = key_log.detach().masked_fill(~allowed, float("-inf")).amax(dim=-1)
            m = torch.maximum(m, carry_log.detach())
    else:  # the running max restarts with each document; only the first reads the carried state
        allowed = block_causal_mask(document_starts)  # [B, 1, N, N]
        first_doc = (document_ids(document_starts) == 0).unsqueeze(1)  # [B, 1, N]
        m = key_log.detach().masked_fill(~allowed, float("-inf")).amax(dim=-1)
        m = torch.maximum(m, carry_log.detach().masked_fill(~first_doc, float("-inf")))
    # exponent masked to -inf *before* exp: future keys may have larger log-scales than m_t
    exponent = (key_log - m.unsqueeze(-1)).masked_fill(~allowed, float("-inf"))  # [B, H, N, N]
    weights = (q @ k.transpose(-1, -2)) * torch.exp(exponent)  # [B, H, N(t), N(s)]
    carry = torch.exp(carry_log - m)  # [B, H, N] rescales the carried state
    if document_starts is not None:
        carry = carry.masked_fill(~first_doc, 0.0)
    numerator = weights @ vv + carry.unsqueeze(-1) * (q @ state.kv)  # [B, H, N, Dv]
    denominator = weights.sum(dim=-1) + carry * (q @ state.k_sum.unsqueeze(-1)).squeeze(-1)  # [B, H, N]
    out = normalize_output(numerator, denominator, normalization, eps)

    m_last = m[..., -1]  # [B, H]
    last_log = ls if log_decay is None else key_log[..., -1, :]  # [B, H, N]: as the last token weighs them
    w_last = torch.exp(last_log - m_last.unsqueeze(-1))  # [B, H, N] key weights relative to m_N
    decay = torch.exp(carry_log[..., -1] - m_last)  # [B, H]
    if document_starts is not None:  # the state after the last token holds its document only
        last_doc = exponent[..., -1, :] > float("-inf")  # [B, H, N]: the keys the last token sees
        w_last = torch.exp((last_log - m_last.unsqueeze(-1)).masked_fill(~last_doc, float("-inf")))
        decay = decay.masked_fill(~first_doc[..., -1], 0.0)
    kv = state.kv * decay[..., None, None] + torch.einsum("bhn,bhnf,bhnd->bhfd", w_last, k, vv)
    k_sum = state.k_sum * decay[..., None] + torch.einsum("bhn,bhnf->bhf", w_last, k)
    new_state = LinearAttentionState(kv=kv, k_sum=k_sum, log_max=m_last, offset=state.offset + n)
    return out.to(v.dtype), new_state


def quadratic_bidirectional_linear_attention(
    qf: torch.Tensor, kf: torch.Tensor, kls: torch.Tensor | None, v: torch.Tensor, *,
    normalization: str = "rms", eps: float = 1e-6, key_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """The bidirectional form's reference (``linear/bidirectional.py``): the full masked weights

        w_ij = (qf_i . kf_j) exp(kls_j - M)  over real keys j,   M = max over real keys of kls (detached)

    -> out [B, H, N, Dv] in v.dtype. ``key_mask`` [B, N] bool (False: padding) masks the weights
    themselves (no key is zeroed beforehand), so it also checks the global form's padding."""
    q, k, ls, vv, _ = fp32_inputs(qf, kf, kls, v, None)
    real = torch.ones_like(ls, dtype=torch.bool) if key_mask is None else key_mask[:, None, :].expand_as(ls)
    m = finite_stabiliser(ls.detach().masked_fill(~real, float("-inf")).amax(-1, keepdim=True))  # [B, H, 1]
    exponent = (ls - m).masked_fill(~real, float("-inf"))  # masked before exp: a pad's kls may exceed M
    weights = (q @ k.transpose(-1, -2)) * torch.exp(exponent).unsqueeze(-2)  # [B, H, N(i), N(j)]
    out = normalize_output(weights @ vv, weights.sum(dim=-1), normalization, eps)
    return out.to(v.dtype)
