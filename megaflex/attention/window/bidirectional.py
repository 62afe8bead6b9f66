"""The bidirectional one-normaliser window: exact softmax for keys with |i - j| < W, the kernel beyond.

    near(i) = {j : |i - j| < W}  (the query and W - 1 keys on either side),   far(i) = every other key
    (i, j count real tokens: padding between them does not widen the window)
    w_ij = exp(q_i . k_j / sqrt d - m_i)  (near),   (qf_i . kf_j) exp(qls_i + kls_j - m_i)  (far)
    m_i  = max(max_near q_i . k_j / sqrt d, qls_i + max_far kls_j)   (detached, as the causal window's)

``|i - j| < W`` makes the causal window (t - W, t] the half j <= i of this one. ``banded_numerators``
computes it in blocks of C >= W queries: the window of a query in block b lies in blocks b - 1 .. b + 1,
whose 3C keys are one [C, 3C] block (near and far by two complementary masks on j - i, as the causal
chunked form's); every other key is far, read from the prefix state of the blocks <= b - 2 and the
suffix state of the blocks >= b + 2 (``absorb`` scans, each relative to its own max, so the far field
needs no "global sum minus the band" subtraction, which cancels catastrophically when a band key
dominates the kernel). O(N C (d + F + Dv) + N F Dv) time, O(N C + (N / C) F Dv) memory, under
autograd. ``naive.quadratic_bidirectional_numerators`` is its reference.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from ..base import LinearAttentionState
from .common import WindowInputs, absorb, finite_stabiliser, real_first_order


def _blocks(x: torch.Tensor, c: int, fill: float) -> torch.Tensor:
    """[B, H, nb C, *] -> [B, H, nb, 3C, *]: block b's keys from blocks b - 1 .. b + 1 (``fill`` outside)."""
    edge = x.new_full((*x.shape[:2], c, *x.shape[3:]), fill)
    blocks = torch.cat([edge, x, edge], dim=2).unfold(2, 3 * c, c)  # [B, H, nb, *, 3C]
    return blocks.movedim(-1, 3) if x.dim() == 4 else blocks


def _scan(kf: torch.Tensor, kls: torch.Tensor, v_aug: torch.Tensor, c: int, reverse: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """States [B, H, nb + 1, F, Dv + 1] and their log_max [B, H, nb + 1]: index j holds the keys of the
    first j blocks (``reverse``: of the blocks >= j; index nb is then the empty state)."""
    b, h, t, feat = kf.shape
    nb = t // c
    state = LinearAttentionState.empty(b, h, feat, v_aug.shape[-1] - 1, device=kf.device, dtype=kf.dtype)
    states, maxima = [state.augmented()], [state.log_max]
    for j in (range(nb - 1, -1, -1) if reverse else range(nb)):
        part = slice(j * c, (j + 1) * c)
        state = absorb(state, kf[:, :, part], kls[:, :, part], v_aug[:, :, part])
        states.append(state.augmented())
        maxima.append(state.log_max)
    if reverse:
        states, maxima = states[::-1], maxima[::-1]
    return torch.stack(states, dim=2), torch.stack(maxima, dim=2)


def _pad(x: torch.Tensor, t: int, fill: float = 0.0) -> torch.Tensor:
    n = x.shape[2]
    return x if n == t else torch.cat([x, x.new_full((*x.shape[:2], t - n, *x.shape[3:]), fill)], dim=2)


def _take(y: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """[B, H, N, *] (or [B, N]) tokens reordered along N by ``order`` [B, N]."""
    if y.dim() == 2:
        return torch.take_along_dim(y, order, dim=1)
    index = order[:, None, :].expand(*y.shape[:3])
    return torch.take_along_dim(y, index.unsqueeze(-1) if y.dim() == 4 else index, dim=2)


def banded_numerators(x: WindowInputs, window: int, chunk_size: int) -> torch.Tensor:
    """Numerators [B, H, N, Dv + 1] (denominator last) of the bidirectional window (module doc); no cache
    or carried state (P = 0). Invalid keys (``x.key_valid``) are masked out of both parts here. Padding
    before a real token: the tokens are reordered real ones first (``real_first_order``), so the blocks'
    index distance is the distance in real tokens, and the numerators put back in place."""
    order = real_first_order(x.key_valid)
    if order is not None:
        fields = {name: _take(getattr(x, name), order) for name in ("q", "qf", "qls", "k", "kf", "kls", "v_aug", "key_valid")}
        return _take(banded_numerators(replace(x, **fields), window, chunk_size), torch.argsort(order, dim=1))
    b, h, n, d = x.q.shape
    c = min(max(window, chunk_size), n)  # C >= W, or one block holding every key
    nb = -(-n // c)
    t = nb * c
    valid = torch.ones(b, n, dtype=torch.bool, device=x.q.device) if x.key_valid is None else x.key_valid
    valid = _pad(valid[:, None], t, False)[:, 0] if t != n else valid  # [B, T]
    kls = _pad(x.kls, t, float("-inf")).masked_fill(~valid[:, None], float("-inf"))
    kf = _pad(x.kf, t) * valid[:, None, :, None].to(x.kf.dtype)
    v_aug = _pad(x.v_aug, t)
    q, qf, qls = _pad(x.q, t), _pad(x.qf, t), _pad(x.qls, t)

    # the prefix state of blocks <= b - 2 (first max(b - 1, 0) blocks) and the suffix one of blocks >= b + 2
    prefix, prefix_max = _scan(kf, kls, v_aug, c, reverse=False)
    suffix, suffix_max = _scan(kf, kls, v_aug, c, reverse=True)
    idx = torch.arange(nb, device=q.device)
    before, after = (idx - 1).clamp(min=0), (idx + 2).clamp(max=nb)
    p_state, p_max = prefix[:, :, before], prefix_max[:, :, before]  # [B, H, nb, F, Dv + 1], [B, H, nb]
    s_state, s_max = suffix[:, :, after], suffix_max[:, :, after]

    def queries(y: torch.Tensor) -> torch.Tensor:  # [B, H, T, *] -> [B, H, nb, C, *]
        return y.reshape(b, h, nb, c, *y.shape[3:])

    qb, qfb, qlb = queries(q), queries(qf), queries(qls)  # qlb [B, H, nb, C]
    kb, kfb, vb = _blocks(_pad(x.k, t), c, 0.0), _blocks(kf, c, 0.0), _blocks(v_aug, c, 0.0)
    klb = _blocks(kls, c, float("-inf"))  # [B, H, nb, 3C]
    offset = torch.arange(3 * c, device=q.device) - c - torch.arange(c, device=q.device).unsqueeze(1)  # j - i [C, 3C]
    near = (offset.abs() < window) & _blocks(valid[:, None].float(), c, 0.0).bool()[:, :, :, None, :]  # [B, 1, nb, C, 3C]
    logits = (qb @ kb.transpose(-1, -2) / math.sqrt(d)).masked_fill(~near, float("-inf"))  # [B, H, nb, C, 3C]
    far_log = (qlb.unsqueeze(-1) + klb.unsqueeze(-2)).masked_fill(near, float("-inf"))  # pads: kls -inf
    outside = torch.maximum(p_max, s_max).unsqueeze(-1)  # [B, H, nb, 1]
    far_max = torch.maximum(far_log.detach().amax(-1), qlb.detach() + outside)
    m = finite_stabiliser(torch.maximum(logits.detach().amax(-1), far_max)).unsqueeze(-1)  # [B, H, nb, C, 1]
    weights = torch.exp(logits - m) + (qfb @ kfb.transpose(-1, -2)) * torch.exp(far_log - m)
    numer = weights @ vb  # [B, H, nb, C, Dv + 1]
    for state, log_max in ((p_state, p_max), (s_state, s_max)):
        scale = torch.exp(qlb.unsqueeze(-1) + log_max[..., None, None] - m)  # 0 for an empty state (-inf)
        numer = numer + scale * (qfb @ state)
    return numer.reshape(b, h, t, -1)[:, :, :n]
