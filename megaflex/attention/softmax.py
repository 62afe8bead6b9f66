"""Exact causal softmax attention (the baseline) with a KV cache for decoding.

Uses ``F.scaled_dot_product_attention`` (flash / memory-efficient kernels where available) with
its default 1/sqrt(d) scale, i.e. the kernel exp(q.k / sqrt d) the random-feature maps estimate.

The cache appends into preallocated buffers whose capacity doubles when full, so a decode step
copies only the new token's keys and values (amortised O(1)) instead of the whole cache; without
that the softmax baseline would pay an extra O(T) copy per token. Caches stay values: appending
to a cache that is not the newest of its buffers (a fork: two continuations of one prefix)
copies the prefix first, so no cache ever sees another's tokens. Under autograd the cache falls
back to concatenation, because in-place writes would invalidate tensors saved for backward.
``bidirectional_softmax_attention`` is the non-causal form (an encoder's: no cache, key padding only).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

_MIN_CAPACITY = 256  # tokens; the first append after a prefill reserves at least this many


class _Buffers:
    """Storage shared by a cache and the caches appended from it; ``length`` = slots written."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor, length: int) -> None:
        self.k, self.v, self.length = k, v, length


class KVCache:
    """Keys/values of all tokens seen so far: k [B, H, T, d], v [B, H, T, Dv]; ``offset`` = T is the
    position of the next token (used for RoPE)."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor) -> None:
        self._buffers = _Buffers(k, v, k.shape[2])  # no copy here: the first append reallocates
        self.offset = k.shape[2]  # tokens held; this cache's view of the shared buffers

    @classmethod
    def _view(cls, buffers: _Buffers, length: int) -> "KVCache":
        cache = cls.__new__(cls)
        cache._buffers, cache.offset = buffers, length
        return cache

    @property
    def k(self) -> torch.Tensor:
        return self._buffers.k[:, :, : self.offset]

    @property
    def v(self) -> torch.Tensor:
        return self._buffers.v[:, :, : self.offset]

    @property
    def capacity(self) -> int:
        """Tokens the current buffers hold before the next reallocation."""
        return self._buffers.k.shape[2]

    def detach(self) -> "KVCache":
        return KVCache(self.k.detach(), self.v.detach())

    def append(self, k: torch.Tensor, v: torch.Tensor) -> "KVCache":
        """A new cache holding this one's tokens followed by k [B, H, N, d], v [B, H, N, Dv]."""
        n, length = k.shape[2], self.offset
        if torch.is_grad_enabled() and (k.requires_grad or v.requires_grad or self.k.requires_grad):
            return KVCache(torch.cat([self.k, k], dim=2), torch.cat([self.v, v], dim=2))
        buffers = self._buffers
        if buffers.length != length or length + n > self.capacity:  # forked, or full: reallocate
            capacity = max(2 * (length + n), _MIN_CAPACITY)
            new_k = k.new_empty(k.shape[0], k.shape[1], capacity, k.shape[3])
            new_v = v.new_empty(v.shape[0], v.shape[1], capacity, v.shape[3])
            new_k[:, :, :length] = self.k
            new_v[:, :, :length] = self.v
            buffers = _Buffers(new_k, new_v, length)
        buffers.k[:, :, length : length + n] = k
        buffers.v[:, :, length : length + n] = v
        buffers.length = length + n
        return KVCache._view(buffers, length + n)

    def __repr__(self) -> str:
        return f"KVCache(tokens={self.offset}, capacity={self.capacity})"


def softmax_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache | None = None,
    key_mask: torch.Tensor | None = None, mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, KVCache]:
    """Causal softmax attention of q [B, H, N, d] over cache + k, v [B, H, N, *] -> (out [B, H, N, Dv], cache).

    ``key_mask`` [B, T + N] (bool, False = padding): padded keys are never attended to (they stay
    in the cache, masked on every later call that passes the mask).
    ``mask`` (no cache, no key_mask): a bool [B, 1, N, N] mask (True: attend) replacing the causal
    one, e.g. block-causal."""
    n = q.shape[2]
    if mask is not None:
        if cache is not None or key_mask is not None:
            raise ValueError("mask: expected no cache and no key_mask with an explicit mask")
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask), KVCache(k, v)
    if key_mask is not None:
        offset = 0 if cache is None else cache.offset
        cache = KVCache(k, v) if cache is None else cache.append(k, v)
        queries = torch.arange(n, device=q.device).unsqueeze(1) + offset
        allowed = padded_causal_mask(queries, torch.arange(cache.offset, device=q.device).unsqueeze(0), key_mask)
        return F.scaled_dot_product_attention(q, cache.k, cache.v, attn_mask=allowed), cache
    if cache is None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return out, KVCache(k, v)
    offset = cache.offset
    cache = cache.append(k, v)
    keys, values = cache.k, cache.v  # [B, H, T + N, *]
    if n == 1:  # the new token sees everything: no mask needed
        out = F.scaled_dot_product_attention(q, keys, values)
    else:
        # query i sits at absolute position offset + i and sees keys 0..offset + i (SDPA's
        # is_causal would align the mask top-left instead, ignoring the cache)
        rows = torch.arange(n, device=q.device).unsqueeze(1) + offset
        mask = rows >= torch.arange(keys.shape[2], device=q.device).unsqueeze(0)  # [N, T + N]
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
    return out, cache


def padded_causal_mask(queries: torch.Tensor, keys: torch.Tensor, key_mask: torch.Tensor,
                       visible: torch.Tensor | None = None) -> torch.Tensor:
    """[B, 1, N, T] SDPA mask: query positions ``queries`` [N, 1] see key positions ``keys`` [1, T]
    at or before them (and within ``visible`` [N, T] when given) that are not padding (``key_mask``
    [B, T]). A padded query sees itself too, so no row is empty (its output is unused but finite)."""
    allowed = keys <= queries if visible is None else visible
    allowed = allowed.unsqueeze(0) & key_mask[:, None, :]
    return (allowed | (keys == queries).unsqueeze(0)).unsqueeze(1)


def bidirectional_softmax_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Non-causal softmax attention: every query of q [B, H, N, d] over every real key of k, v
    [B, H, N, *] -> out [B, H, N, Dv]. ``key_mask`` [B, N] (bool, False = padding): padded keys are never
    attended to; a row without any real key attends to all of its keys (finite, unused)."""
    if key_mask is None:
        return F.scaled_dot_product_attention(q, k, v)
    allowed = key_mask | ~key_mask.any(dim=-1, keepdim=True)  # [B, N]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed[:, None, None, :])
