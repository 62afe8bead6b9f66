"""Helpers shared by the feature maps: fp32 projection, frequency sampling (trig features: ``trig.py``).

Precision policy (all maps): features are computed in fp32 (fp64 for fp64 inputs) with autocast
disabled and cast back to the input dtype; ``log_scale`` stays fp32. Random-Fourier arguments ``omega @ x`` reach O(10)
and bf16 keeps ~3 significant digits, so cos/sin of a bf16 argument would be noise; the log-scale
enters an ``exp`` and an O(1) error there is a multiplicative error of the kernel.
"""

from __future__ import annotations

import contextlib
import math
from typing import Iterator

import torch

from ..base import accumulation_dtype


@contextlib.contextmanager
def fp32_region(x: torch.Tensor) -> Iterator[None]:
    """Disable autocast on ``x``'s device so the enclosed ops really run in fp32."""
    with torch.autocast(device_type=x.device.type, enabled=False):
        yield


def upcast(t: torch.Tensor) -> torch.Tensor:
    """``t`` in fp32 (fp64 stays fp64, for gradcheck)."""
    return t.to(accumulation_dtype(t.dtype))


def sq_norm(x: torch.Tensor) -> torch.Tensor:
    """||x||^2 over the head dim in fp32: [B, H, N, d] -> [B, H, N]."""
    x = upcast(x)
    return (x * x).sum(dim=-1)


def project(x: torch.Tensor, omega: torch.Tensor) -> torch.Tensor:
    """Per-head projection in fp32: x [B, H, N, d], omega [H, D, d] -> [B, H, N, D]."""
    x = upcast(x)
    return torch.einsum("bhnd,hfd->bhnf", x, omega.to(x.dtype))


def check_even_feature_dim(kind: str, feature_dim: int) -> int:
    """Number of frequencies D = F // 2 for a trig map; ValueError unless F is positive and even."""
    if feature_dim <= 0 or feature_dim % 2:
        raise ValueError(f"feature_dim: expected a positive even number for {kind!r} (F = 2 * frequencies), got {feature_dim}")
    return feature_dim // 2


def orthogonal_gaussian(num_rows: int, dim: int, generator: torch.Generator) -> torch.Tensor:
    """[num_rows, dim] rows ~ N(0, I) marginally, exactly orthogonal within each block of ``dim`` rows.

    Performer's ORF: QR of a Gaussian block gives orthonormal directions; row norms are redrawn
    from the chi(dim) distribution (norms of Gaussian vectors) so each row is still N(0, I).
    Orthogonality lowers the estimator's variance without biasing it.
    """
    blocks = []
    for start in range(0, num_rows, dim):
        rows = min(dim, num_rows - start)
        gauss = torch.randn(dim, dim, generator=generator, dtype=torch.float64)
        q, r = torch.linalg.qr(gauss)
        q = q * torch.sign(torch.diagonal(r)).unsqueeze(0)  # unique (Haar) QR: fix column signs
        norms = torch.randn(rows, dim, generator=generator, dtype=torch.float64).norm(dim=-1, keepdim=True)
        blocks.append(q.T[:rows] * norms)
    return torch.cat(blocks, dim=0).float()


def quarter_root(head_dim: int) -> float:
    """d^-1/4: frequencies ~ N(0, I) * d^-1/4 make cos(omega.(q-k)) estimate exp(-||q-k||^2 / (2 sqrt d))."""
    return head_dim ** -0.25


def log_sqrt_scale(head_dim: int) -> float:
    """log(2 sqrt d): the Flexformer temperature at which the kernel is exp(q.k / sqrt d)."""
    return math.log(2.0 * math.sqrt(head_dim))
