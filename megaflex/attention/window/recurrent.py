"""The one-normaliser window's recurrent form: token by token, the key leaving the window enters the
linear state, the window is the cached keys; O(W + F Dv) per token, the decoding path."""

from __future__ import annotations

import math

import torch

from ..base import LinearAttentionState
from .common import WindowInputs, absorb, finite_stabiliser


def recurrent_numerators(x: WindowInputs, window: int, chunk_size: int) -> tuple[torch.Tensor, LinearAttentionState]:
    """Token by token; returns the numerators and the linear state after the queries' last absorbed key."""
    n, p, scale = x.q.shape[2], x.prefix, 1.0 / math.sqrt(x.q.shape[-1])
    state, outs = x.far, []
    for i in range(n):
        t = p + i
        leaving = t - window  # the key that just left the window (W = 0: the query's own key)
        if leaving >= 0:
            state = absorb(state, x.kf[:, :, leaving : leaving + 1], x.kls[:, :, leaving : leaving + 1],
                           x.v_aug[:, :, leaving : leaving + 1])  # fmt: skip
        lo = max(0, t - window + 1)
        qt = x.q[:, :, t - p : t - p + 1]  # [B, H, 1, d]
        logits = (qt @ x.k[:, :, lo : t + 1].transpose(-1, -2)).squeeze(2) * scale  # [B, H, <= W]
        if x.key_valid is not None:
            logits = logits.masked_fill(~x.key_valid[:, None, lo : t + 1], float("-inf"))
        qls = x.qls[:, :, i]
        near_max = logits.detach().amax(-1) if logits.shape[-1] else torch.full_like(qls, float("-inf"))
        m = finite_stabiliser(torch.maximum(near_max, qls.detach() + state.log_max))  # [B, H]
        near = (torch.exp(logits - m.unsqueeze(-1)).unsqueeze(2) @ x.v_aug[:, :, lo : t + 1]).squeeze(2)
        far = torch.exp(qls + state.log_max - m).unsqueeze(-1) * (x.qf[:, :, i : i + 1] @ state.augmented()).squeeze(2)
        outs.append(near + far)
    return torch.stack(outs, dim=2), state

