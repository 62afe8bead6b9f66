"""Helpers shared by the attention tests (not a test module)."""

from __future__ import annotations

import torch

from megaflex.attention import FEATURE_MAP_KINDS, LinearAttentionState, build_feature_map, causal_linear_attention
from megaflex.attention.base import FeatureMap

LINEAR_KINDS = FEATURE_MAP_KINDS
AVAILABLE_FORMS = ("quadratic", "recurrent", "chunked")  # the forms the suite compares


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Normwise relative error max|a - e| / max|e| (in fp64)."""
    actual, expected = actual.double(), expected.double()
    return ((actual - expected).abs().max() / expected.abs().max().clamp_min(1e-30)).item()


def make_qkv(
    batch: int, heads: int, n: int, head_dim: int, value_dim: int | None = None, *, scale: float = 0.5, seed: int = 0,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Deterministic q, k [B, H, N, d] ~ N(0, scale^2) and v [B, H, N, Dv] ~ N(0, 1)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, n, head_dim, generator=g, dtype=dtype) * scale
    k = torch.randn(batch, heads, n, head_dim, generator=g, dtype=dtype) * scale
    v = torch.randn(batch, heads, n, value_dim or head_dim, generator=g, dtype=dtype)
    return q, k, v


def make_map(kind: str, heads: int, head_dim: int, feature_dim: int, seed: int = 0, **kwargs) -> FeatureMap:
    """Feature map initialised from a fixed seed (random maps get their own generator state)."""
    torch.manual_seed(seed)
    if kind == "cosformer":
        kwargs.setdefault("max_seq_len", 256)
    return build_feature_map(kind, heads, head_dim, feature_dim, **kwargs)


def attend(
    fmap: FeatureMap,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    form: str,
    normalization: str = "rms",
    state: LinearAttentionState | None = None,
    chunk_size: int = 16,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, LinearAttentionState]:
    """Feature map + causal linear attention, continuing from ``state`` (offset taken from it)."""
    offset = 0 if state is None else state.offset
    fq, fk = fmap(q, offset), fmap(k, offset)
    return causal_linear_attention(
        fq.features, fk.features, fk.log_scale, v, form=form, normalization=normalization,
        chunk_size=chunk_size, initial_state=state, eps=eps,
    )
