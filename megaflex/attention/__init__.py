"""megaflex.attention: Flexformer and baseline causal attention (feature maps, forms, AttentionCore).

All tensors are [B, H, N, d]. See ``core.py`` for the maths shared by every form and
``feature_maps/`` for the maps. Public API:

* ``build_feature_map(kind, num_heads, head_dim, feature_dim, **kwargs)``
* ``causal_linear_attention(qf, kf, kls, v, *, form, normalization, chunk_size, initial_state, eps, backend)``
  (``backend``: auto | torch | triton | fla, the chunked form's implementation)
* ``ROWS`` / ``select(Request(...))``: the one table that decides which implementation runs (``dispatch.py``)
* ``AttentionCore(kind, num_heads, head_dim, ...)``: the module the model uses
* ``softmax_attention`` / ``KVCache``: exact baseline
* ``redraw_random_features(module, step)``: Performer redraws, call once per optimiser step
* ``named_kernel_parameters(module)``: every learnable kernel parameter with its optimisation role
  (declared by the feature maps' ``kernel_parameters()``); ``feature_dim_of(kind, d, F)``
"""

from __future__ import annotations

from torch import nn

from .base import (
    KERNEL_ROLES,
    NORMALIZATIONS,
    FeatureMap,
    FeatureMapOutput,
    KernelParameter,
    LinearAttentionState,
    named_kernel_parameters,
)
from .core import ATTENTION_KINDS, AttentionCore, causal_linear_attention
from .dispatch import ATTENTION_BACKENDS, ROWS, NoAttentionImplementation, Request, Row, chunked_backend, select
from .feature_maps import FEATURE_MAP_KINDS, build_feature_map, feature_dim_of
from .linear.naive import quadratic_linear_attention
from .linear.recurrent import recurrent_linear_attention
from .inputs import FORMS, mask_padded_keys, padding_mask, validate_linear_attention_inputs
from .softmax import KVCache, softmax_attention


def redraw_random_features(module: nn.Module, step: int) -> int:
    """Let every redrawable feature map in ``module`` redraw for optimiser step ``step``.

    Deterministic in ``step`` (identical on all ranks, reproducible on resume); returns how
    many maps redrew. A no-op for maps without ``redraw_interval``.
    """
    return sum(int(m.maybe_redraw(step)) for m in module.modules() if isinstance(m, FeatureMap))


__all__ = [
    "ATTENTION_BACKENDS",
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
    "ROWS",
    "Request",
    "Row",
    "build_feature_map",
    "causal_linear_attention",
    "chunked_backend",
    "feature_dim_of",
    "mask_padded_keys",
    "named_kernel_parameters",
    "padding_mask",
    "quadratic_linear_attention",
    "recurrent_linear_attention",
    "redraw_random_features",
    "select",
    "softmax_attention",
    "validate_linear_attention_inputs",
]
