"""megaflex.attention: Flexformer and baseline attention, causal and bidirectional (feature maps, forms, AttentionCore).

All tensors are [B, H, N, d]. See ``core.py`` for the maths shared by every form and
``feature_maps/`` for the maps. Public API:

* ``build_feature_map(kind, num_heads, head_dim, feature_dim, **kwargs)``
* ``causal_linear_attention(qf, kf, kls, v, *, form, normalization, chunk_size, initial_state, eps, backend, log_decay)``
  (``backend``: auto | torch | triton | fla, the chunked form's implementation; ``log_decay``: the per-head
  decay of old keys, ``decay.py``)
* ``ROWS`` / ``select(Request(...))``: what runs where, gathered from the forms the modules call (``dispatch.py``)
* ``AttentionCore(kind, num_heads, head_dim, ..., causal=True, decay="none")``: the module the model uses
  (``decay="learned"``: a learnable per-head gamma^(t - s) on every weight, ``decay.py``)
  (``causal=False``: bidirectional, ``Request.form`` "bidirectional"; what it cannot do is refused
  by ``dispatch.REFUSALS`` with ``RefusedAttention``)
* ``bidirectional_linear_attention(qf, kf, kls, v, *, normalization, eps, key_mask)`` (global sums) and
  its reference ``quadratic_bidirectional_linear_attention``; ``bidirectional_softmax_attention``
* ``softmax_attention`` / ``KVCache``: exact baseline
* ``redraw_random_features(module, step)``: Performer redraws, call once per optimiser step
* ``named_kernel_parameters(module)``: every learnable kernel parameter with its optimisation role
  (declared by the feature maps' ``kernel_parameters()``); ``feature_dim_of(kind, d, F)``
"""

from __future__ import annotations

from torch import nn

from .base import (
    KERNEL_ROLES,
    FeatureMap,
    FeatureMapOutput,
    KernelParameter,
    LinearAttentionState,
    named_kernel_parameters,
)
from .core import ATTENTION_KINDS, AttentionCore, causal_linear_attention
from .dispatch import (
    ATTENTION_BACKENDS, ATTENTION_FORMS, REFUSALS, ROWS, NoAttentionImplementation, RefusedAttention, Request, Row,
    chunked_backend, select,
)
from .feature_maps import FEATURE_MAP_KINDS, build_feature_map, feature_dim_of
from .linear.bidirectional import bidirectional_linear_attention
from .linear.naive import quadratic_bidirectional_linear_attention, quadratic_linear_attention
from .linear.recurrent import recurrent_linear_attention
from .inputs import FORMS, mask_padded_keys, padding_mask, validate_linear_attention_inputs
from .normalize import NORMALIZATIONS
from .softmax import KVCache, bidirectional_softmax_attention, softmax_attention


def redraw_random_features(module: nn.Module, step: int) -> int:
    """Let every redrawable feature map in ``module`` redraw for optimiser step ``step``.

    Deterministic in ``step`` (identical on all ranks, reproducible on resume); returns how
    many maps redrew. A no-op for maps without ``redraw_interval``.
    """
    return sum(int(m.maybe_redraw(step)) for m in module.modules() if isinstance(m, FeatureMap))


__all__ = [
    "ATTENTION_BACKENDS",
    "ATTENTION_FORMS",
    "ATTENTION_KINDS",
    "FEATURE_MAP_KINDS",
    "FORMS",
    "KERNEL_ROLES",
    "NORMALIZATIONS",
    "AttentionCore",
    "FeatureMap",
    "FeatureMapOutput",
    "KVCache",
    "KernelParameter",
    "LinearAttentionState",
    "NoAttentionImplementation",
    "RefusedAttention",
    "REFUSALS",
    "ROWS",
    "Request",
    "Row",
    "bidirectional_linear_attention",
    "bidirectional_softmax_attention",
    "build_feature_map",
    "causal_linear_attention",
    "chunked_backend",
    "feature_dim_of",
    "mask_padded_keys",
    "named_kernel_parameters",
    "padding_mask",
    "quadratic_bidirectional_linear_attention",
    "quadratic_linear_attention",
    "recurrent_linear_attention",
    "redraw_random_features",
    "select",
    "softmax_attention",
    "validate_linear_attention_inputs",
]
