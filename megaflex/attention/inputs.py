"""Checks and preparation of attention inputs, one copy each: the forms' validation, padding masks,
padded keys, document starts (and the refusal of padded batches of packed documents). Shared by
``core.py``, ``hybrid.py``, ``linear/``, ``triton/`` and the model; its own module so that none of them
imports another for it."""

from __future__ import annotations

import torch

from .base import LinearAttentionState
from .documents import DocumentLayout, document_layout
from .normalize import check_normalization

FORMS = ("chunked", "recurrent", "quadratic")


def shape_of(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(t.shape)


def check_floating(name: str, t: torch.Tensor, rank: int) -> None:
    """ValueError unless ``t`` is a floating-point tensor of rank ``rank``."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if not torch.is_floating_point(t):
        raise ValueError(f"{name}: expected a floating-point tensor, got dtype {t.dtype}")
    if t.dim() != rank:
        raise ValueError(f"{name}: expected a rank-{rank} tensor, got shape {shape_of(t)} (rank {t.dim()})")


def validate_linear_attention_inputs(
    qf: torch.Tensor,
    kf: torch.Tensor,
    kls: torch.Tensor | None,
    v: torch.Tensor,
    *,
    form: str = "chunked",
    normalization: str = "rms",
    chunk_size: int = 64,
    initial_state: LinearAttentionState | None = None,
    eps: float = 1e-6,
    log_decay: torch.Tensor | None = None,
) -> None:
    """ValueError naming the argument, expected vs got, for any malformed input of the forms."""
    check_floating("qf", qf, 4)
    check_floating("kf", kf, 4)
    check_floating("v", v, 4)
    batch, heads, n, feat = qf.shape
    if kf.shape != qf.shape:
        raise ValueError(f"kf: expected shape {shape_of(qf)} (same as qf [B, H, N, F]), got {shape_of(kf)}")
    if v.shape[:3] != qf.shape[:3]:
        raise ValueError(f"v: expected shape [{batch}, {heads}, {n}, Dv] (B, H, N of qf), got {shape_of(v)}")
    if n < 1:
        raise ValueError(f"qf: expected at least one token (N >= 1), got shape {shape_of(qf)}")
    if kls is not None:
        check_floating("kls", kls, 3)
        if kls.shape != qf.shape[:3]:
            raise ValueError(f"kls: expected shape [{batch}, {heads}, {n}] (B, H, N of qf) or None, got {shape_of(kls)}")
    if log_decay is not None:
        check_floating("log_decay", log_decay, 1)
        if log_decay.shape[0] != heads:
            raise ValueError(f"log_decay: expected shape [{heads}] (one log gamma per head) or None, got {shape_of(log_decay)}")
    if form not in FORMS:
        raise ValueError(f"form: expected one of {FORMS}, got {form!r}")
    check_normalization(normalization)
    if not isinstance(chunk_size, int) or chunk_size <= 0:
        raise ValueError(f"chunk_size: expected a positive int, got {chunk_size!r}")
    if not eps > 0:
        raise ValueError(f"eps: expected a positive float, got {eps!r}")
    if initial_state is not None:
        if not isinstance(initial_state, LinearAttentionState):
            raise ValueError(f"initial_state: expected a LinearAttentionState or None, got {type(initial_state).__name__}")
        dv = v.shape[-1]
        expected = {
            "kv": (batch, heads, feat, dv),
            "k_sum": (batch, heads, feat),
            "log_max": (batch, heads),
        }
        for field, shape in expected.items():
            t = getattr(initial_state, field)
            if not isinstance(t, torch.Tensor) or not torch.is_floating_point(t) or shape_of(t) != shape:
                got = f"{shape_of(t)} {t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(f"initial_state.{field}: expected a floating tensor of shape {shape}, got {got}")
        if initial_state.offset < 0:
            raise ValueError(f"initial_state.offset: expected >= 0, got {initial_state.offset}")


def padding_mask(key_mask: torch.Tensor | None, batch: int, length: int, name: str = "key_mask") -> torch.Tensor | None:
    """``key_mask`` as bool [batch, length] (ValueError naming ``name`` on another shape), or None
    when it masks nothing."""
    if key_mask is None:
        return None
    if key_mask.dim() != 2 or tuple(key_mask.shape) != (batch, length):
        raise ValueError(f"{name}: expected shape [{batch}, {length}] (every token so far, cached ones first), "
                         f"got {tuple(key_mask.shape)}")
    key_mask = key_mask.bool()
    return None if bool(key_mask.all()) else key_mask


def mask_padded_keys(
    features: torch.Tensor, log_scale: torch.Tensor | None, key_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Key features [B, H, N, F] and log-scales [B, H, N] with padded keys (``key_mask`` [B, N]
    False) removed from the sums: zero features, and a log-scale no larger than the row's real
    ones (not -inf: the chunked forms' row scales exp(M_c - m_t) must stay finite)."""
    real = key_mask[:, None, :]  # [B, 1, N]
    features = torch.where(real.unsqueeze(-1), features, torch.zeros_like(features))
    if log_scale is not None:
        lowest_real = torch.where(real, log_scale, torch.full_like(log_scale, float("inf"))).amin(-1, keepdim=True)
        has_real = real.any(-1, keepdim=True)
        log_scale = torch.where(real | ~has_real, log_scale, lowest_real.detach())
    return features, log_scale


def refuse_padded_documents(padded: bool, packed: bool, names: str = "key_mask and document_starts") -> None:
    """The one refusal of padded batches of packed documents (``names``: the two arguments, as the caller calls them)."""
    if padded and packed:
        raise ValueError(f"{names}: padded batches of packed documents are not supported")


def checked_starts(document_starts: DocumentLayout | torch.Tensor | None, like: torch.Tensor) -> DocumentLayout | None:
    """The layout of ``document_starts`` after checking its starts are a [B, N] bool tensor matching
    ``like`` [B, H, N, *]."""
    if document_starts is None:
        return None
    starts = document_starts.starts if isinstance(document_starts, DocumentLayout) else document_starts
    expected = (like.shape[0], like.shape[2])
    if starts.dtype != torch.bool or tuple(starts.shape) != expected:
        raise ValueError(
            f"document_starts: expected a bool tensor of shape {expected} ([B, N]), "
            f"got {starts.dtype} {tuple(starts.shape)}"
        )
    return document_layout(document_starts)


def restarting(
    layout: DocumentLayout | None, continues_state: bool, key_mask: torch.Tensor | None = None
) -> DocumentLayout | None:
    """``layout`` when its document starts change anything (a restart after the first token, or one at
    the first token of a call that continues a state), else None; refuses padding (``key_mask``) with it."""
    if layout is None or not layout.has_restarts(continues_state):
        return None
    refuse_padded_documents(key_mask is not None, True)
    return layout
