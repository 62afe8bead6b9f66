"""ELU+1 feature map (Katharopoulos et al., "Transformers are RNNs"): phi(x) = elu(x) + 1, F = d.

Strictly positive, parameter-free, no log-scale. ``feature_dim`` is fixed to ``head_dim``
(the factory's ``feature_dim`` argument is ignored for this kind).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..base import FeatureMap, FeatureMapOutput
from .common import fp32_region, upcast


class EluFeatureMap(FeatureMap):
    """phi(x) = elu(x) + 1."""

    positive = True

    def __init__(self, num_heads: int, head_dim: int) -> None:
        super().__init__()
        self.num_heads, self.head_dim = num_heads, head_dim
        self.feature_dim = self.output_dim(head_dim, head_dim)

    @staticmethod
    def output_dim(head_dim: int, feature_dim: int) -> int:
        return head_dim

    def forward(self, x: torch.Tensor, offset: int = 0) -> FeatureMapOutput:
        self.check_input(x)
        with fp32_region(x):
            features = F.elu(upcast(x)) + 1.0  # [B, H, N, d]
        return FeatureMapOutput(features.to(x.dtype), None)
