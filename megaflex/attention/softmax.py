"""Exact causal softmax attention (the baseline) with a KV cache for decoding.

Uses ``F.scaled_dot_product_attention`` (flash / memory-efficient kernels where available) with
its default 1/sqrt(d) scale, i.e. the kernel exp(q.k / sqrt d) the random-feature maps estimate.
The cache is a pair of [B, H, T, d] tensors grown by concatenation: simple, and the model-side
generation loop is short; ``offset`` = T is the position of the next token (used for RoPE).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class KVCache:
    """Keys/values of all tokens seen so far: k [B, H, T, d], v [B, H, T, Dv], offset = T."""

    k: torch.Tensor
    v: torch.Tensor
    offset: int = 0

    def detach(self) -> "KVCache":
        return KVCache(self.k.detach(), self.v.detach(), self.offset)


def softmax_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache | None = None
) -> tuple[torch.Tensor, KVCache]:
    """Causal softmax attention of q [B, H, N, d] over cache + k, v [B, H, N, *] -> (out [B, H, N, Dv], cache)."""
    n = q.shape[2]
    if cache is None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return out, KVCache(k, v, n)
    keys = torch.cat([cache.k, k], dim=2)  # [B, H, T + N, d]
    values = torch.cat([cache.v, v], dim=2)
    if n == 1:  # the new token sees everything: no mask needed
        out = F.scaled_dot_product_attention(q, keys, values)
    else:
        # query i sits at absolute position offset + i and sees keys 0..offset + i (SDPA's
        # is_causal would align the mask top-left instead, ignoring the cache)
        rows = torch.arange(n, device=q.device).unsqueeze(1) + cache.offset
        mask = rows >= torch.arange(keys.shape[2], device=q.device).unsqueeze(0)  # [N, T + N]
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
    return out, KVCache(keys, values, cache.offset + n)
