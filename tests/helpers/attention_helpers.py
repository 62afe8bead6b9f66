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


def attention_steps(n: int, feat: int, dv: int, log_scale_spread: float = 0.0, head_dim: int = 0) -> float:
    """Rounding-error growth (``steps`` of tests/numerics.py) of a feature map + causal linear
    attention and its backward: sums over the n tokens (plus a carried state), the feat features,
    the dv values (rms) and the head_dim inputs of the map, and the exp arguments, which carry
    their size x u of absolute error: the chunked forms split exp(kls_s - m_t) into up to three
    factors (within the chunk, chunk to chunk, the carried state's rescale), each with an argument
    up to the log-scales' spread; all of it forward and again in the backward's recomputation."""
    return 2 * (n + 1 + feat + dv + head_dim + 3 * log_scale_spread)


def log_scale_spread(*log_scales: torch.Tensor | None) -> float:
    """A bound on |kls_s - m_t| over every exp argument: twice the largest |log-scale| given."""
    return 2 * max((ls.detach().double().abs().max().item() for ls in log_scales if ls is not None and ls.numel()), default=0.0)


def form_steps(fmap: FeatureMap, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, extra_tokens: int = 0) -> float:
    """``attention_steps`` of ``attend(fmap, q, k, v)`` (plus ``extra_tokens`` carried in a state);
    a trig map's cos/sin arguments x . omega carry their size x u too (forward and backward)."""
    with torch.no_grad():
        fq, fk = fmap(q, 0), fmap(k, 0)
        projection = 0.0
        spec = fmap.trig_spec() if hasattr(fmap, "trig_spec") else None  # None: not a trig map (positive Performer)
        if spec is not None:
            omega = spec[0].double()
            projection = max(torch.einsum("bhnd,hpd->bhnp", x.double(), omega).abs().max().item() for x in (q, k))
    steps = attention_steps(
        q.shape[2] + extra_tokens, fk.features.shape[-1], v.shape[-1], log_scale_spread(fq.log_scale, fk.log_scale),
        q.shape[-1],
    )
    return steps + 2 * projection


def decay_steps(fmap: FeatureMap, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, log_decay: torch.Tensor,
                extra_tokens: int = 0) -> float:  # fmt: skip
    """``form_steps`` with the decay of old keys (``megaflex/attention/decay.py``): folded in, it moves every
    key log-scale by up to (N + carried) |g|, so the exp arguments' spread grows by twice that (counted like
    ``attention_steps``: three factors, forward and backward)."""
    n = q.shape[2] + extra_tokens
    return form_steps(fmap, q, k, v, extra_tokens) + 2 * 3 * 2 * n * log_decay.detach().abs().max().item()


def map_steps(x: torch.Tensor, omega: torch.Tensor) -> float:
    """Error growth (tests/numerics.py) of the trig map and its backward: head_dim-term projections
    and norms, cos/sin of projections up to max |x . omega| (absolute error |arg| u), pair sums and
    the scale; x's gradient sums over the P rows, omega's / inv_t's over every (batch, token)."""
    projection = torch.einsum("bhnd,hpd->bhnp", x.detach().double(), omega.detach().double()).abs().max().item()
    return 2 * (x.shape[-1] + omega.shape[1] + x.shape[0] * x.shape[2] + 4) + 2 * projection


def saved_bytes(fn) -> int:
    """Bytes of the distinct storages autograd keeps for backward while ``fn()`` runs."""
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(storages.values())
