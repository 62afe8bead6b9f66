"""Performer (FAVOR) random features: fixed orthogonal Gaussian frequencies, optional redraws.

``omega`` is a buffer [H, D, d] of orthogonal random features (ORF) scaled by d^-1/4, so
``omega.x`` has the statistics of N(0, I) . (x / d^1/4). Two variants:

* ``trig``:     phi_tilde(x) = exp(||x||^2 / (2 sqrt d)) D^-1/2 [cos(omega x) ; sin(omega x)]
  (Flexformer-S with frozen frequencies); unbiased for exp(q.k / sqrt d) but signed.
* ``positive`` (FAVOR+): phi_tilde(x) = D^-1/2 exp(omega x - ||x||^2 / (2 sqrt d)), returned as
  ``features = D^-1/2 exp(omega x - max_j omega_j x)`` (in (0, D^-1/2]) and
  ``log_scale = max_j(omega_j x) - ||x||^2 / (2 sqrt d)``: the per-token max keeps ``exp`` from
  overflowing. Since E[exp(omega.(q + k))] = exp(||q + k||^2 / (2 sqrt d)) the kernel is an unbiased,
  strictly positive estimate of exp(q.k / sqrt d). The max is detached: the product
  features * exp(log_scale) does not depend on it, so gradients are unchanged.

Redraws (``redraw_interval=K``): ``maybe_redraw(step)`` resamples omega whenever ``step // K``
changes. Each head's draw comes from a generator seeded by (its entry of the ``head_seeds``
buffer, draw index), so every rank computes identical frequencies without communication, a
tensor-parallel shard (which slices dim 0 of every buffer, ``head_seeds`` included) redraws
exactly its heads, and a resumed run reproduces the draw from the step alone.
``head_seeds`` is taken from the global RNG at construction (``seed=`` overrides), so layers differ.
"""

from __future__ import annotations

import torch

from ..base import FeatureMap, FeatureMapOutput
from .common import check_even_feature_dim, fp32_region, orthogonal_gaussian, project, quarter_root, sq_norm
from .trig import trig_feature_map

PERFORMER_VARIANTS = ("positive", "trig")
_SEED_MIX = 1_000_003  # combines (head seed, draw index) into one generator seed


class PerformerFeatureMap(FeatureMap):
    """Fixed orthogonal random features (FAVOR+ ``positive`` or ``trig``), redrawable every K steps."""

    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        feature_dim: int,
        *,
        variant: str = "positive",
        redraw_interval: int | None = None,
        seed: int | None = None,
    ) -> None:
        super().__init__()
        if variant not in PERFORMER_VARIANTS:
            raise ValueError(f"variant: expected one of {PERFORMER_VARIANTS}, got {variant!r}")
        if redraw_interval is not None and redraw_interval <= 0:
            raise ValueError(f"redraw_interval: expected a positive number of steps or None, got {redraw_interval}")
        self.num_heads, self.head_dim, self.variant = num_heads, head_dim, variant
        if variant == "trig":
            self.num_frequencies = check_even_feature_dim("performer", feature_dim)
        else:
            if feature_dim <= 0:
                raise ValueError(f"feature_dim: expected a positive number for performer 'positive', got {feature_dim}")
            self.num_frequencies = feature_dim
        self.feature_dim = feature_dim
        self.positive = variant == "positive"
        self.redraw_interval = redraw_interval
        if seed is None:
            head_seeds = torch.randint(0, 2**31 - 1, (num_heads,), dtype=torch.int64)
        else:
            head_seeds = seed * _SEED_MIX + torch.arange(num_heads, dtype=torch.int64)
        self.register_buffer("head_seeds", head_seeds)  # [H]
        self.register_buffer("omega", torch.empty(num_heads, self.num_frequencies, head_dim))  # [H, D, d]
        self._draw = 0
        self.redraw(0)

    @torch.no_grad()
    def redraw(self, draw: int) -> None:
        """Resample ``omega`` deterministically as draw number ``draw`` (same on every rank)."""
        generator = torch.Generator()
        for h, head_seed in enumerate(self.head_seeds.tolist()):
            generator.manual_seed(int(head_seed) * _SEED_MIX + draw)
            omega = orthogonal_gaussian(self.num_frequencies, self.head_dim, generator)
            self.omega[h].copy_(omega * quarter_root(self.head_dim))
        self._draw = draw

    def maybe_redraw(self, step: int) -> bool:
        """Redraw if ``step`` entered a new interval of ``redraw_interval`` steps; True if it did."""
        if self.redraw_interval is None:
            return False
        draw = step // self.redraw_interval
        if draw == self._draw:
            return False
        self.redraw(draw)
        return True

    def trig_spec(self) -> tuple[torch.Tensor, torch.Tensor, bool] | None:
        """``trig``: (omega [H, D, d], inv_temperature [H] = 1 / (2 sqrt d), paired=False), the
        arguments of ``trig_feature_map`` (the Triton path fuses it); None for ``positive``."""
        if self.variant != "trig":
            return None
        inv_temperature = self.omega.new_full((self.num_heads,), 1.0 / (2.0 * self.head_dim**0.5), dtype=torch.float32)
        return self.omega, inv_temperature, False

    def forward(self, x: torch.Tensor, offset: int = 0) -> FeatureMapOutput:
        self.check_input(x)
        spec = self.trig_spec()
        with fp32_region(x):
            if spec is not None:  # Flexformer-S with frozen frequencies: the same fused map
                omega, inv_temperature, paired = spec
                return FeatureMapOutput(*trig_feature_map(x, omega, inv_temperature, paired=paired))
            proj = project(x, self.omega)  # [B, H, N, D]
            half_sq_norm = sq_norm(x) / (2.0 * self.head_dim**0.5)  # [B, H, N]
            peak = proj.amax(dim=-1, keepdim=True).detach()  # [B, H, N, 1] stabiliser
            features = torch.exp(proj - peak) * self.num_frequencies**-0.5
            log_scale = peak.squeeze(-1) - half_sq_norm
        return FeatureMapOutput(features.to(x.dtype), log_scale)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, variant={self.variant}, redraw_interval={self.redraw_interval}"
