"""Input validation of the causal linear-attention forms (shared by core.py, chunked.py and the
Triton backend; its own module so that none of them imports another for it)."""

from __future__ import annotations

import torch

from .base import NORMALIZATIONS, LinearAttentionState

FORMS = ("chunked", "recurrent", "quadratic")


def _shape(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(t.shape)


def _check_floating(name: str, t: torch.Tensor, rank: int) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if not torch.is_floating_point(t):
        raise ValueError(f"{name}: expected a floating-point tensor, got dtype {t.dtype}")
    if t.dim() != rank:
        raise ValueError(f"{name}: expected a rank-{rank} tensor, got shape {_shape(t)} (rank {t.dim()})")


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
) -> None:
    """ValueError naming the argument, expected vs got, for any malformed input of the forms."""
    _check_floating("qf", qf, 4)
    _check_floating("kf", kf, 4)
    _check_floating("v", v, 4)
    batch, heads, n, feat = qf.shape
    if kf.shape != qf.shape:
        raise ValueError(f"kf: expected shape {_shape(qf)} (same as qf [B, H, N, F]), got {_shape(kf)}")
    if v.shape[:3] != qf.shape[:3]:
        raise ValueError(f"v: expected shape [{batch}, {heads}, {n}, Dv] (B, H, N of qf), got {_shape(v)}")
    if n < 1:
        raise ValueError(f"qf: expected at least one token (N >= 1), got shape {_shape(qf)}")
    if kls is not None:
        _check_floating("kls", kls, 3)
        if kls.shape != qf.shape[:3]:
            raise ValueError(f"kls: expected shape [{batch}, {heads}, {n}] (B, H, N of qf) or None, got {_shape(kls)}")
    if form not in FORMS:
        raise ValueError(f"form: expected one of {FORMS}, got {form!r}")
    if normalization not in NORMALIZATIONS:
        raise ValueError(f"normalization: expected one of {NORMALIZATIONS}, got {normalization!r}")
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
            if not isinstance(t, torch.Tensor) or not torch.is_floating_point(t) or _shape(t) != shape:
                got = f"{_shape(t)} {t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(f"initial_state.{field}: expected a floating tensor of shape {shape}, got {got}")
        if initial_state.offset < 0:
            raise ValueError(f"initial_state.offset: expected >= 0, got {initial_state.offset}")
