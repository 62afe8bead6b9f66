"""Hedgehog feature map (Zhang et al. 2024): a learnable per-head map trained to mimic softmax.

    phi(x) = softmax([x W ; -x W]) over the feature axis,   W: [H, d, F/2]

The +-xW pair and the softmax make features positive and "spiky" like softmax attention
weights. Init: W is the (rectangular) identity eye(d, F/2), so at init phi is a softmax over
[x ; -x] (the original paper's identity-like start); columns past d start at zero. No log-scale:
features are bounded in [0, 1].

Optimisation: W is declared as a ``"map_weight"`` kernel parameter: main learning rate and *no*
weight decay. Decay would pull W towards 0, where phi is the uniform 1/F vector and attention
becomes a plain running mean; that is a change of kernel, not a capacity regulariser.
"""

from __future__ import annotations

import torch
from torch import nn

from ..base import FeatureMap, FeatureMapOutput, KernelParameter
from .common import check_even_feature_dim, fp32_region, upcast


class HedgehogFeatureMap(FeatureMap):
    """Learnable softmax feature map with weight ``W`` [H, d, F/2]."""

    positive = True

    def __init__(self, num_heads: int, head_dim: int, feature_dim: int) -> None:
        super().__init__()
        self.num_heads, self.head_dim, self.feature_dim = num_heads, head_dim, feature_dim
        half = check_even_feature_dim("hedgehog", feature_dim)
        self.W = nn.Parameter(torch.empty(num_heads, head_dim, half))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.W.copy_(torch.eye(self.head_dim, self.W.shape[-1]).expand_as(self.W))

    def kernel_parameters(self) -> list[KernelParameter]:
        return [KernelParameter("W", self.W, "map_weight")]

    def forward(self, x: torch.Tensor, offset: int = 0) -> FeatureMapOutput:
        self.check_input(x)
        with fp32_region(x):
            x32 = upcast(x)
            proj = torch.einsum("bhnd,hdf->bhnf", x32, self.W.to(x32.dtype))  # [B, H, N, F/2]
            features = torch.softmax(torch.cat([proj, -proj], dim=-1), dim=-1)  # [B, H, N, F]
        return FeatureMapOutput(features.to(x.dtype), None)
