"""Feature maps for causal linear attention, one module per map, and the factory.

Every map follows ``megaflex.attention.base.FeatureMap``: ``forward(x [B, H, N, d], offset=0)
-> FeatureMapOutput(features [B, H, N, F], log_scale [B, H, N] | None)``. Every parameter and
buffer has heads as dim 0 so tensor parallelism shards a map by slicing dim 0.

* ``flexformer_n``: (4D)^-1/2 [cos O1x + cos O2x ; sin O1x + sin O2x], log_scale ||x||^2 / e^tau;
  F = 2D; learnable O1, O2 [H, D, d] and tau [H].
* ``flexformer_s``: D^-1/2 [cos wx ; sin wx], log_scale ||x||^2 / (2 sqrt d); F = 2D; learnable w.
* ``performer``: fixed orthogonal Gaussian frequencies (buffer), ``variant`` "positive" (FAVOR+,
  F = D) or "trig" (F = 2D); optional seeded redraws.
* ``elu``: elu(x) + 1; F = d.
* ``cosformer``: relu(x) re-weighted by [cos ; sin](pi i / 2M); F = 2d.
* ``hedgehog``: softmax([xW ; -xW]); learnable W [H, d, F/2].
"""

from __future__ import annotations

import inspect

from ..base import FeatureMap
from .cosformer import CosformerFeatureMap
from .elu import EluFeatureMap
from .flexformer_n import FlexformerNFeatureMap
from .flexformer_s import FlexformerSFeatureMap
from .hedgehog import HedgehogFeatureMap
from .performer import PERFORMER_VARIANTS, PerformerFeatureMap

FEATURE_MAPS: dict[str, type[FeatureMap]] = {
    "flexformer_n": FlexformerNFeatureMap,
    "flexformer_s": FlexformerSFeatureMap,
    "performer": PerformerFeatureMap,
    "elu": EluFeatureMap,
    "cosformer": CosformerFeatureMap,
    "hedgehog": HedgehogFeatureMap,
}
FEATURE_MAP_KINDS = tuple(FEATURE_MAPS)


def feature_dim_of(kind: str, head_dim: int, feature_dim: int) -> int:
    """F (features per head) of the map ``kind`` built with ``feature_dim``: elu d, cosformer 2d."""
    if kind not in FEATURE_MAPS:
        raise ValueError(f"kind: expected one of {FEATURE_MAP_KINDS}, got {kind!r}")
    return FEATURE_MAPS[kind].output_dim(head_dim, feature_dim)


def build_feature_map(kind: str, num_heads: int, head_dim: int, feature_dim: int, **kwargs: object) -> FeatureMap:
    """Construct the feature map ``kind`` for ``num_heads`` heads of size ``head_dim``.

    ``feature_dim`` (F) is ignored by maps whose F is fixed by ``head_dim`` (elu: d,
    cosformer: 2d). ``kwargs`` are map-specific (flexformer_n: ``min_log_temperature``, ``max_log_temperature``, ``omega_init``, ``omega_noise``, ``omega_correlation``;
    performer: ``variant``, ``redraw_interval``, ``seed``; cosformer: ``max_seq_len``).
    """
    if kind not in FEATURE_MAPS:
        raise ValueError(f"kind: expected one of {FEATURE_MAP_KINDS}, got {kind!r}")
    for name, value in (("num_heads", num_heads), ("head_dim", head_dim)):
        if not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name}: expected a positive int, got {value!r}")
    cls = FEATURE_MAPS[kind]
    params = inspect.signature(cls.__init__).parameters
    accepted = [n for n, p in params.items() if p.kind is inspect.Parameter.KEYWORD_ONLY]
    unknown = sorted(set(kwargs) - set(accepted))
    if unknown:
        raise ValueError(f"kwargs: {kind!r} accepts {accepted}, got unknown {unknown}")
    if "feature_dim" in params:
        return cls(num_heads, head_dim, feature_dim, **kwargs)
    return cls(num_heads, head_dim, **kwargs)


__all__ = [
    "FEATURE_MAPS",
    "FEATURE_MAP_KINDS",
    "PERFORMER_VARIANTS",
    "CosformerFeatureMap",
    "EluFeatureMap",
    "FlexformerNFeatureMap",
    "FlexformerSFeatureMap",
    "HedgehogFeatureMap",
    "PerformerFeatureMap",
    "build_feature_map",
    "feature_dim_of",
]
