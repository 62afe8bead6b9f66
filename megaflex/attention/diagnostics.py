"""Attention-weight diagnostics: the explicit causal weights of a layer and how spread they are.

For a linear kind the weight of key s for query t is ``w_ts = phi(q_t) . phi_tilde(k_s)`` (the
key's log-scale included, stabilised by the row max, which cancels below); for softmax it is the
softmax probability. Both are compared through

* ``negative_fraction``: share of causal weights (s <= t) below zero (trig features are signed
  Monte-Carlo estimates; a classic denominator sum_s w_ts can then cross zero);
* ``effective_keys``: exp(entropy of |w_t.| / sum_s |w_ts|), averaged over queries t: the number
  of keys a query effectively attends to (1 = one key, t + 1 = uniform over its prefix).

For the one-normaliser window hybrid (``window/``) the weights are the hybrid's own
(exact softmax weights in the window, the kernel before it, one stabiliser), and
``far_share`` is the far field's share of each query's absolute weight mass, averaged over the
queries that have a far field (t >= W).

O(N^2) memory: for a small probe batch at logging intervals, never for training.
"""

from __future__ import annotations

import torch

from .base import FeatureMap
from .decay import fold_keys, fold_queries
from .window import quadratic_weights


def causal_weights(
    q: torch.Tensor, k: torch.Tensor, feature_map: FeatureMap | None, log_decay: torch.Tensor | None = None
) -> torch.Tensor:
    """q, k [B, H, N, d] -> causal weights [B, H, N(t), N(s)] in fp32, zero above the diagonal.

    ``feature_map`` None means softmax attention (scale 1/sqrt d, as ``softmax_attention``).
    ``log_decay`` [H] (``AttentionCore.log_decay()``): the weights of a decaying core, times gamma^(t - s).
    """
    n = q.shape[2]
    causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    if feature_map is None:
        scores = (q.float() @ k.float().transpose(-1, -2)) * q.shape[-1] ** -0.5
        return torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1)
    qf = feature_map(q, 0).features.float()
    k_map = feature_map(k, 0)
    kf = k_map.features.float()
    weights = qf @ kf.transpose(-1, -2)  # [B, H, N, N]
    ls = None if k_map.log_scale is None else k_map.log_scale.float().unsqueeze(-2)  # [B, H, 1, N]
    if log_decay is not None:  # + (t - s) g
        lag = (torch.arange(n, device=q.device)[:, None] - torch.arange(n, device=q.device)).clamp(min=0)
        ls = (0.0 if ls is None else ls) + lag * log_decay.float()[:, None, None]
    if ls is not None:  # exp(kls_s - max_{s<=t} kls): the per-query max cancels in both statistics
        ls = ls.masked_fill(~causal, float("-inf"))  # [B, H, N, N]
        weights = weights * torch.exp(ls - ls.amax(dim=-1, keepdim=True))
    return weights.masked_fill(~causal, 0.0)


def window_causal_weights(
    q: torch.Tensor, k: torch.Tensor, feature_map: FeatureMap | None, window: int,
    far_log_gain: torch.Tensor | None = None, log_decay: torch.Tensor | None = None,
) -> torch.Tensor:
    """q, k [B, H, N, d] -> the one-normaliser hybrid's causal weights [B, H, N, N] in fp32 (each row
    up to its stabiliser, which cancels in every statistic); ``feature_map`` None: sliding-window softmax;
    ``far_log_gain`` [H]: the hybrid's learned far-field gain (log), if it has one; ``log_decay`` [H]:
    the far field's decay gamma^(t - s - W) (``decay.py``)."""
    q, k = q.float(), k.float()
    zeros = q.new_zeros(q.shape[:3])
    if feature_map is None:
        empty = q.new_zeros(*q.shape[:3], 0)
        weights, _ = quadratic_weights(q, empty, zeros, k, empty, torch.full_like(zeros, float("-inf")), window)
        return weights
    qm, km = feature_map(q, 0), feature_map(k, 0)
    qls = zeros if qm.log_scale is None else qm.log_scale.float()
    if far_log_gain is not None:  # e^b_h on every far weight, as the forward adds it (hybrid.LocalMixingCore)
        qls = qls + far_log_gain.float()[:, None]
    kls = zeros if km.log_scale is None else km.log_scale.float()
    if log_decay is not None:
        qls, kls = fold_queries(qls, log_decay.float(), first=-window), fold_keys(kls, log_decay.float(), tuple(kls.shape))
    weights, _ = quadratic_weights(q, qm.features.float(), qls, k, km.features.float(), kls, window)
    return weights


def far_share(weights: torch.Tensor, window: int) -> float:
    """Mean over queries t >= ``window`` of sum_{s <= t - W} |w_ts| / sum_s |w_ts| (nan when N <= W)."""
    n = weights.shape[-1]
    lag = torch.arange(n, device=weights.device).unsqueeze(1) - torch.arange(n, device=weights.device)
    mag = weights.abs()
    share = (mag * (lag >= window)).sum(-1) / mag.sum(-1).clamp_min(torch.finfo(mag.dtype).tiny)  # [B, H, N]
    return share[..., window:].mean().item() if n > window else float("nan")


def weight_statistics(weights: torch.Tensor) -> dict[str, float]:
    """``negative_fraction`` and ``effective_keys`` (see the module docstring) of causal weights."""
    n = weights.shape[-1]
    causal = torch.ones(n, n, dtype=torch.bool, device=weights.device).tril()
    negative = ((weights < 0) & causal).sum().item() / (causal.sum().item() * weights[..., 0, 0].numel())
    mag = weights.abs()
    p = mag / mag.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(mag.dtype).tiny)
    entropy = -(p * torch.log(p.clamp_min(torch.finfo(p.dtype).tiny))).sum(dim=-1)  # [B, H, N]
    return {"negative_fraction": float(negative), "effective_keys": entropy.exp().mean().item()}
