"""Norm control of q and k before the feature map (``model.qk_norm``; issue 46, remedy (c)).

Why: selective attention needs large |q . k|, which a random-feature kernel buys with large ||q||
and ||k||; but a trig estimator's error grows like exp(||q + k||^2 / e^tau) (Performer, Lemma 2),
and Flexformer-N's magnitude exp(||x||^2 / e^tau) ties each key's weight to its own norm. Fixing the
norms and learning the scale separately gives the kernel its sharpness through one per-head number
instead of through the norms of the token vectors.

* ``"rms"``: x <- g_h x / rms(x), rms over the head dim, for q and k alike, with a learned per-head
  gain g_h = exp(s_h) (init s_h = 0: ||q|| = ||k|| = sqrt d), shared by q and k, so s_h is a learned
  log-temperature of the logits q.k / sqrt d = g_h^2 sqrt d cos(q, k). For Flexformer-N the
  magnitude exp(||x||^2 / e^tau) = exp(g_h^2 d / e^tau) is then the same for every token of a head:
  it cancels in the normaliser, the kernel depends on the angle only, and the estimator's error is
  bounded by the sphere's radius. s_h is declared a "temperature" (the kernel temperature LR group).
* ``"affine_rms"`` (ReBased's affine + norm, with an RMS norm): x <- w ⊙ x / rms(x) + b with a learned
  per-head, per-channel gain w (init 1) and bias b (init 0), separate for q and k: at init the same as
  ``"rms"``; the bias lets the norm vary again, in learned directions. Both "map_weight" (main LR).

It runs in the attention layer on q and k before RoPE (the norm of a vector is unchanged by the
rotation, the affine channels are the head's own) and before any attention form, so every form
(quadratic, chunked, recurrent, Triton, the window hybrid, context parallelism) sees the same
normalised q and k. Computed in fp32, returned in the input dtype. Parameters have heads on dim 0
(tensor parallelism keeps this rank's heads).
"""

from __future__ import annotations

import torch
from torch import nn

from .base import KernelParameter, accumulation_dtype

QK_NORMS = ("none", "rms", "affine_rms")


class QKNorm(nn.Module):
    """q, k [B, H, N, d] -> normalised q, k (module docstring); ``kind`` "rms" or "affine_rms"."""

    def __init__(self, kind: str, num_heads: int, head_dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        if kind not in QK_NORMS[1:]:
            raise ValueError(f"kind: expected one of {QK_NORMS[1:]}, got {kind!r}")
        self.kind, self.eps = kind, eps
        if kind == "rms":
            self.log_gain = nn.Parameter(torch.zeros(num_heads, 1, 1))  # [H, 1, 1]: broadcasts over [B, H, N, d]
        else:
            self.weight = nn.Parameter(torch.ones(num_heads, 2, head_dim))  # [H, {q, k}, d]
            self.bias = nn.Parameter(torch.zeros(num_heads, 2, head_dim))

    def kernel_parameters(self) -> list[KernelParameter]:
        """No weight decay for either: decay would pull the gain to 1 / the channel gains to 0."""
        if self.kind == "rms":
            return [KernelParameter("log_gain", self.log_gain, "temperature")]
        return [KernelParameter("weight", self.weight, "map_weight"), KernelParameter("bias", self.bias, "map_weight")]

    def forward(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self._normalise(q, 0), self._normalise(k, 1)

    def _normalise(self, x: torch.Tensor, which: int) -> torch.Tensor:
        acc = x.to(accumulation_dtype(x.dtype))
        acc = acc * torch.rsqrt(acc.square().mean(-1, keepdim=True) + self.eps)
        if self.kind == "rms":
            acc = acc * torch.exp(self.log_gain.to(acc.dtype))
        else:
            acc = acc * self.weight[:, which, None].to(acc.dtype) + self.bias[:, which, None].to(acc.dtype)
        return acc.to(x.dtype)

    def extra_repr(self) -> str:
        return f"kind={self.kind}, eps={self.eps:g}"
