"""The one-normaliser window's chunked form in torch ops under autograd (every block kept): the
reference ``ChunkedWindowNumerator`` is tested against, and the path of padded keys (``key_valid``)."""

from __future__ import annotations

import math

import torch

from .chunk import block_masks
from .common import WindowInputs, aligned_queries, finite_stabiliser, key_blocks, pad_keys


def blocks_numerators(x: WindowInputs, window: int, chunk_size: int) -> tuple[torch.Tensor, None]:
    """The chunked form in torch ops on the key-aligned sequence (autograd keeps every block)."""
    b, h, n, d = x.q.shape
    p, total = x.prefix, x.k.shape[2]
    c = min(chunk_size, total)
    chunks = -(-total // c)
    lookback = min(-(-window // c), chunks - 1)  # a window beyond the sequence needs no more than every chunk
    t_pad = chunks * c

    def queries(y: torch.Tensor) -> torch.Tensor:  # [B, H, N, *] -> [B, H, nC, C, *]
        return aligned_queries(y, p, t_pad).view(b, h, chunks, c, *y.shape[3:])

    q, qf, qls = queries(x.q), queries(x.qf), queries(x.qls)
    k, kf, v_aug = (pad_keys(y, t_pad) for y in (x.k, x.kf, x.v_aug))
    kls = pad_keys(x.kls, t_pad, float("-inf"))  # padded keys: no weight, and no effect on any max
    valid = torch.arange(t_pad, device=q.device) < total  # [T_pad]
    valid = valid.expand(b, t_pad) if x.key_valid is None else pad_keys(x.key_valid.unsqueeze(1), t_pad, False).squeeze(1)
    near_mask, far_mask = block_masks(c, lookback, window, q.device)
    valid_blocks = key_blocks(valid.unsqueeze(1), c, lookback, False)  # [B, 1, nC, (L + 1) C]
    near_mask = near_mask & valid_blocks.unsqueeze(-2)  # [B, 1, nC, C, (L + 1) C]

    # the shared stabiliser: window logits, and the running max of the far keys' log-scales
    logits = (q @ key_blocks(k, c, lookback, 0.0).transpose(-1, -2)) / math.sqrt(d)
    logits = logits.masked_fill(~near_mask, float("-inf"))
    kls_blocks = key_blocks(kls, c, lookback, float("-inf"))  # [B, H, nC, (L + 1) C]
    running = kls.detach().cummax(dim=-1).values
    far_max = torch.cat([running.new_full((b, h, min(window, t_pad)), float("-inf")), running], dim=-1)[..., :t_pad]
    far_max = torch.maximum(far_max, x.far.log_max.unsqueeze(-1)).view(b, h, chunks, c)
    m = finite_stabiliser(torch.maximum(logits.detach().amax(-1), qls.detach() + far_max)).unsqueeze(-1)  # [B, H, nC, C, 1]
    far_log = (qls.unsqueeze(-1) + kls_blocks.unsqueeze(-2)).masked_fill(~far_mask, float("-inf"))
    weights = torch.exp(logits - m) + (qf @ key_blocks(kf, c, lookback, 0.0).transpose(-1, -2)) * torch.exp(far_log - m)
    numer = weights @ key_blocks(v_aug, c, lookback, 0.0)  # [B, H, nC, C, Dv + 1]

    # the linear state of the chunks before c - L: S_{j+1} = exp(B_j - B_{j+1}) S_j + exp(E_j - B_{j+1}) U_j
    used = chunks - lookback  # states S_0 .. S_{used - 1} are read
    if used > 1:
        kls_c, kf_c = kls.reshape(b, h, chunks, c), kf.reshape(b, h, chunks, c, kf.shape[-1])
        ends = kls_c.detach().amax(-1)  # [B, H, nC], finite: every chunk holds a real key
        increments = (kf_c * torch.exp(kls_c - ends.unsqueeze(-1)).unsqueeze(-1)).transpose(-1, -2) @ v_aug.reshape(b, h, chunks, c, -1)
        states, bounds = [x.far.augmented()], [x.far.log_max]
        for j in range(used - 1):
            bound = torch.maximum(bounds[-1], ends[..., j])
            prev = torch.exp(bounds[-1] - bound).nan_to_num(0.0)[..., None, None]
            states.append(states[-1] * prev + increments[:, :, j] * torch.exp(ends[..., j] - bound)[..., None, None])
            bounds.append(bound)
        first = [0] * min(lookback, chunks)  # chunks before L read the carried state only
        index = torch.tensor(first + list(range(used)), device=q.device)
        s_read = torch.stack(states, dim=2).index_select(2, index)  # [B, H, nC, F, Dv + 1]
        b_read = torch.stack(bounds, dim=2).index_select(2, index)  # [B, H, nC]
    else:
        s_read = x.far.augmented().unsqueeze(2).expand(-1, -1, chunks, -1, -1)
        b_read = x.far.log_max.unsqueeze(-1).expand(-1, -1, chunks)
    carried = torch.exp(qls + b_read.unsqueeze(-1) - m.squeeze(-1)).unsqueeze(-1) * (qf @ s_read)
    numer = (numer + carried).view(b, h, t_pad, -1)
    return numer[:, :, p : p + n], None

