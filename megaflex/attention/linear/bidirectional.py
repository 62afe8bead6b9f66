"""Bidirectional (non-causal) linear attention: one global sum over the keys, read by every query.

    S = sum_j exp(kls_j - M) kf_j v_j^T,   z = sum_j exp(kls_j - M) kf_j,   M = max_j kls_j (real keys, detached)
    n_i = qf_i S,   d_i = qf_i . z,   o_i = normalize(n_i, d_i)              (``base.py``)

The causal forms' stabiliser with the running max replaced by the max over every key: each exp
argument is <= 0 whatever the key norms (the flexformer's exp(||k||^2 / e^tau) lives in kls), and
the query log-scale is dropped as there (a per-query scalar every normalisation cancels). The sums
are the window's ``absorb`` of all keys into the empty state. O(N F Dv) time, O(F Dv) state;
autograd differentiates it (a handful of matmuls: nothing to gain from a hand-written backward).

Padded keys (``key_mask`` False) are taken out by ``inputs.mask_padded_keys`` (zero features, a
log-scale that cannot raise M); padded queries read the same sums (finite, unused).
"""

from __future__ import annotations

import torch

from ..base import LinearAttentionState, fp32_inputs
from ..inputs import mask_padded_keys
from ..normalize import normalize_output, reads_denominator
from ..window.common import absorb


def global_sums(kf: torch.Tensor, kls: torch.Tensor, v: torch.Tensor, with_denominator: bool = True) -> LinearAttentionState:
    """The stabilised sums of every key: kf [B, H, N, F], kls [B, H, N], v [B, H, N, Dv] (accumulation dtype)
    -> a state whose kv is S, k_sum is z (zeros without ``with_denominator``) and log_max is M."""
    b, h, _, feat = kf.shape
    ones = v.new_ones(*v.shape[:3], 1) if with_denominator else v.new_zeros(*v.shape[:3], 1)
    empty = LinearAttentionState.empty(b, h, feat, v.shape[-1], device=v.device, dtype=v.dtype)
    return absorb(empty, kf, kls, torch.cat([v, ones], dim=-1))


def bidirectional_linear_attention(
    qf: torch.Tensor, kf: torch.Tensor, kls: torch.Tensor | None, v: torch.Tensor, *,
    normalization: str = "rms", eps: float = 1e-6, key_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """qf, kf [B, H, N, F], kls [B, H, N] | None (= 0), v [B, H, N, Dv], ``key_mask`` [B, N] bool | None
    (False: padding) -> out [B, H, N, Dv] in v.dtype (accumulated in fp32, fp64 for fp64 inputs).
    Inputs are assumed valid (``inputs.validate_linear_attention_inputs``)."""
    with torch.autocast(device_type=qf.device.type, enabled=False):
        q, k, ls, vv, _ = fp32_inputs(qf, kf, kls, v, None)
        if key_mask is not None:
            k, ls = mask_padded_keys(k, ls, key_mask)
        sums = global_sums(k, ls, vv, reads_denominator(normalization))
        numerator = q @ sums.kv  # [B, H, N, Dv]
        denominator = (q @ sums.k_sum.unsqueeze(-1)).squeeze(-1) if reads_denominator(normalization) else None
        return normalize_output(numerator, denominator, normalization, eps).to(v.dtype)
