"""Rotary position embedding (RoPE, Su et al. 2021).

RoPE rotates pairs of query/key channels by angles proportional to the absolute position. The
rotation is applied to q and k *before* the attention feature map, so it composes with any
attention form: the recurrent/decoding path only needs the absolute position of the first new
token (``state.offset``). Rotations preserve norms, so norm-based log-scales (e.g.
||x||^2 / e^tau of Flexformer) are unchanged.
"""

from __future__ import annotations

import torch
from torch import nn


class RotaryEmbedding(nn.Module):
    """Rotate-half RoPE over the full head dim (pairs (i, i + d/2) share one frequency)."""

    def __init__(self, head_dim: int, theta: float = 10000.0) -> None:
        super().__init__()
        if head_dim % 2 != 0:
            raise ValueError(f"RoPE needs an even head_dim, got {head_dim}")
        self.head_dim = head_dim
        # A plain attribute, not a buffer: derived from (head_dim, theta), so checkpoints stay free
        # of it, and module casts (``model.to(torch.bfloat16)``, DeepSpeed before 0.19.2 casting
        # buffers) never round it: bf16 would move the frequencies by up to 0.4%.
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
        self._inv_freq = inv_freq.float()

    @property
    def inv_freq(self) -> torch.Tensor:
        """[d/2] fp32 rotation frequencies theta^(-2i/d), whatever the module's dtype."""
        return self._inv_freq

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, offset: int = 0, positions: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q, k [B, H, N, d] -> rotated q, k at absolute positions offset .. offset + N - 1, or at
        per-row ``positions`` [B, N] when given (padded batches: each row counts from its first
        token; packed documents with data.reset_positions: each token's position in its document)."""
        n = q.shape[-2]
        if self._inv_freq.device != q.device:  # follows the activations (module.to moves no plain attribute)
            self._inv_freq = self._inv_freq.to(q.device)
        if positions is None:
            positions = torch.arange(offset, offset + n, device=q.device, dtype=torch.float32)
        angles = positions.float().unsqueeze(-1) * self._inv_freq  # [N, d/2] or [B, N, d/2]
        if angles.dim() == 3:
            angles = angles.unsqueeze(1)  # [B, 1, N, d/2]: every head
        cos, sin = angles.cos(), angles.sin()
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # Rotation in fp32 (angles at large positions lose precision in bf16), result in x.dtype.
    x1, x2 = x.float().chunk(2, dim=-1)  # [B, H, N, d/2] each
    rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return rotated.to(x.dtype)
