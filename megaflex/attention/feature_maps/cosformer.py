"""cosFormer feature map (Qin et al. 2022): ReLU features with cos/sin position re-weighting.

    phi(x_i) = [relu(x_i) cos(pi i / (2M)) ; relu(x_i) sin(pi i / (2M))],   F = 2d

so phi(q_i) . phi(k_j) = relu(q_i) . relu(k_j) cos(pi (i - j) / (2M)): a locality bias decaying
with distance, decomposed so it stays linear. Positions are absolute, ``offset + arange(N)``
(``offset`` = tokens already consumed, e.g. ``state.offset`` when decoding), and M =
``max_seq_len``; positions must stay below M (angles in [0, pi/2), features non-negative), so
going past it raises. ``feature_dim`` is fixed to 2 * head_dim (the factory's is ignored).
"""

from __future__ import annotations

import math

import torch

from ..base import FeatureMap, FeatureMapOutput
from .common import fp32_region, upcast


class CosformerFeatureMap(FeatureMap):
    """ReLU features re-weighted by cos/sin of the absolute position."""

    positive = True

    def __init__(self, num_heads: int, head_dim: int, *, max_seq_len: int = 2048) -> None:
        super().__init__()
        if max_seq_len <= 0:
            raise ValueError(f"max_seq_len: expected a positive length, got {max_seq_len}")
        self.num_heads, self.head_dim = num_heads, head_dim
        self.feature_dim = self.output_dim(head_dim, head_dim)
        self.max_seq_len = max_seq_len

    @staticmethod
    def output_dim(head_dim: int, feature_dim: int) -> int:
        return 2 * head_dim

    def forward(self, x: torch.Tensor, offset: int = 0) -> FeatureMapOutput:
        self.check_input(x)
        n = x.shape[2]
        if offset < 0 or offset + n > self.max_seq_len:
            raise ValueError(
                f"offset: positions offset..offset+N-1 must lie in [0, max_seq_len={self.max_seq_len}), "
                f"got offset={offset}, N={n}"
            )
        with fp32_region(x):
            relu = torch.relu(upcast(x))  # [B, H, N, d]
            positions = torch.arange(offset, offset + n, device=x.device, dtype=relu.dtype)
            angle = (math.pi / (2 * self.max_seq_len)) * positions  # [N]
            features = torch.cat([relu * torch.cos(angle)[:, None], relu * torch.sin(angle)[:, None]], dim=-1)
        return FeatureMapOutput(features.to(x.dtype), None)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, max_seq_len={self.max_seq_len}"
