"""Flexformer-S: a single learnable set of random-Fourier frequencies per head.

    phi_tilde(x) = exp(||x||^2 / (2 sqrt d)) * D^-1/2 [cos(omega x) ; sin(omega x)]   omega: [H, D, d]

Kernel: phi_tilde(q) . phi_tilde(k) = exp((||q||^2 + ||k||^2) / (2 sqrt d)) * mean_j cos(omega_j.(q - k)).
Init omega ~ N(0, I) * d^-1/4, so E[cos(omega.(q - k))] = exp(-||q - k||^2 / (2 sqrt d)) and the
kernel is an unbiased estimate of exp(q.k / sqrt d), the softmax kernel (Rahimi & Recht random
Fourier features). Training then moves omega away from Gaussian: the spectrum becomes learned.
The magnitude exp(||x||^2 / (2 sqrt d)) is returned as ``log_scale`` and never materialised.
"""

from __future__ import annotations

import torch
from torch import nn

from ..base import FeatureMap, FeatureMapOutput, KernelParameter
from .common import check_even_feature_dim, fp32_region, quarter_root
from .trig import trig_feature_map


class FlexformerSFeatureMap(FeatureMap):
    """Learnable single-frequency-set random-Fourier map; ``omega`` is [H, D, d], D = F // 2."""

    def __init__(self, num_heads: int, head_dim: int, feature_dim: int) -> None:
        super().__init__()
        self.num_heads, self.head_dim, self.feature_dim = num_heads, head_dim, feature_dim
        self.num_frequencies = check_even_feature_dim("flexformer_s", feature_dim)
        self.omega = nn.Parameter(torch.empty(num_heads, self.num_frequencies, head_dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.omega, std=quarter_root(self.head_dim))

    def trig_spec(self) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """(omega [H, D, d], inv_temperature [H] = 1 / (2 sqrt d), paired=False): the map is
        ``trig_feature_map(x, *spec)`` (the Triton path fuses it)."""
        inv_temperature = self.omega.new_full((self.num_heads,), 1.0 / (2.0 * self.head_dim**0.5), dtype=torch.float32)
        return self.omega, inv_temperature, False

    def kernel_parameters(self) -> list[KernelParameter]:
        return [KernelParameter("omega", self.omega, "frequencies")]

    def forward(self, x: torch.Tensor, offset: int = 0) -> FeatureMapOutput:
        self.check_input(x)
        omega, inv_temperature, paired = self.trig_spec()
        with fp32_region(x):
            features, log_scale = trig_feature_map(x, omega, inv_temperature, paired=paired)
        return FeatureMapOutput(features, log_scale)  # [B, H, N, 2D] in x.dtype, [B, H, N] fp32
