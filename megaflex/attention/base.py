"""Shared types of the attention package: the feature-map interface and the recurrent state.

A feature map turns queries or keys ``x`` of shape [batch, heads, seq, head_dim] into
``phi_tilde(x) = exp(log_scale)[..., None] * features`` where ``features`` are bounded
(trig or stabilised exponentials) and ``log_scale`` ([batch, heads, seq]) carries the
possibly huge magnitude (e.g. ||x||^2 / e^tau) in log space, so it never overflows.
The causal attention forms drop the query's ``log_scale`` (a per-query scalar that cancels
under either normalisation) and stabilise the key's with a running maximum.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class FeatureMapOutput:
    features: torch.Tensor  # [B, H, N, F]
    log_scale: torch.Tensor | None  # [B, H, N] or None (= zeros)


@dataclass
class LinearAttentionState:
    """Recurrent state of causal linear attention, always fp32.

    kv:       [B, H, F, Dv]  sum_s exp(ls_s - log_max) phi(k_s) v_s^T
    k_sum:    [B, H, F]      sum_s exp(ls_s - log_max) phi(k_s)
    log_max:  [B, H]         running max of key log-scales folded into kv/k_sum
    offset:   number of tokens consumed so far (positions for position-dependent maps)
    """

    kv: torch.Tensor
    k_sum: torch.Tensor
    log_max: torch.Tensor
    offset: int = 0


class FeatureMap(nn.Module):
    """Base class: per-head feature map [B, H, N, head_dim] -> FeatureMapOutput."""

    num_heads: int
    head_dim: int
    feature_dim: int  # F, the size of the last axis of ``features``
    positive: bool = False  # True when features are elementwise >= 0 (denominators are safe)

    def forward(self, x: torch.Tensor, offset: int = 0) -> FeatureMapOutput:  # pragma: no cover
        raise NotImplementedError
