"""The one-normaliser window's quadratic form: materialised [N, P + N] weights (the reference)."""

from __future__ import annotations

import math

import torch

from .common import WindowInputs, finite_stabiliser, real_first_order


def quadratic_weights(
    q: torch.Tensor, qf: torch.Tensor, qls: torch.Tensor, k: torch.Tensor, kf: torch.Tensor, kls: torch.Tensor,
    window: int, far_log_max: torch.Tensor | None = None, key_valid: torch.Tensor | None = None,
    bidirectional: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The materialised weights w_ts [B, H, N, P + N] (zero outside s <= t) of N queries over P + N keys
    (the queries are the last N), and the stabiliser m_t [B, H, N]; ``far_log_max`` [B, H]: the
    log_max of a carried linear state (the far field before the keys). ``bidirectional`` (P = 0): the
    window is |t - s| < W counted in real tokens (``real_first_order``: padding between them does not
    widen it), every other key is far, and invalid keys are masked out of both parts."""
    n, p = q.shape[2], k.shape[2] - q.shape[2]
    t = torch.arange(p, p + n, device=q.device).unsqueeze(1)  # query positions among the keys
    s = torch.arange(p + n, device=q.device).unsqueeze(0)
    if bidirectional:
        order = real_first_order(key_valid)
        if order is not None:  # each token's place among the real tokens (padding after them)
            rank = torch.argsort(order, dim=1)[:, None]  # [B, 1, N]
            t, s = rank.unsqueeze(-1), rank.unsqueeze(-2)  # [B, 1, N, 1], [B, 1, 1, N]
        near = (s - t).abs() < window
        far = ~near
        if key_valid is not None:
            far = far & key_valid[:, None, None, :]
    else:
        near = (s <= t) & (s > t - window)  # [N, P + N]
        far = s <= t - window
    if key_valid is not None:
        near = near & key_valid[:, None, None, :]  # [B, 1, N, P + N]
    logits = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    logits = logits.masked_fill(~near, float("-inf"))
    far_log = (qls.unsqueeze(-1) + kls.unsqueeze(-2)).masked_fill(~far, float("-inf"))
    far_max = kls.detach().unsqueeze(-2).masked_fill(~far, float("-inf")).amax(-1)
    if far_log_max is not None:
        far_max = torch.maximum(far_max, far_log_max.unsqueeze(-1))
    m = finite_stabiliser(torch.maximum(logits.detach().amax(-1), qls.detach() + far_max))  # [B, H, N]
    weights = torch.exp(logits - m.unsqueeze(-1)) + (qf @ kf.transpose(-1, -2)) * torch.exp(far_log - m.unsqueeze(-1))
    return weights, m


def quadratic_numerators(x: WindowInputs, window: int, chunk_size: int) -> tuple[torch.Tensor, None]:
    """The numerators [B, H, N, Dv + 1] from the materialised weights (the reference form)."""
    weights, m = quadratic_weights(x.q, x.qf, x.qls, x.k, x.kf, x.kls, window, x.far.log_max, x.key_valid)
    carried = torch.exp(x.qls + x.far.log_max.unsqueeze(-1) - m).unsqueeze(-1) * (x.qf @ x.far.augmented())
    return weights @ x.v_aug + carried, None



def quadratic_bidirectional_numerators(x: WindowInputs, window: int, chunk_size: int) -> torch.Tensor:
    """The bidirectional window's numerators [B, H, N, Dv + 1] from the materialised weights (its reference)."""
    weights, _ = quadratic_weights(x.q, x.qf, x.qls, x.k, x.kf, x.kls, window, None, x.key_valid, bidirectional=True)
    return weights @ x.v_aug
