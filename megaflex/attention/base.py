"""Shared types of the attention package: the feature-map interface and the recurrent state.

A feature map turns queries or keys ``x`` of shape [batch, heads, seq, head_dim] into
``phi_tilde(x) = exp(log_scale)[..., None] * features`` where ``features`` are bounded
(trig or stabilised exponentials) and ``log_scale`` ([batch, heads, seq]) carries the
possibly huge magnitude (e.g. ||x||^2 / e^tau) in log space, so it never overflows.
The causal attention forms drop the query's ``log_scale`` (a per-query scalar that cancels
under either normalisation) and stabilise the key's with a running maximum.

Output normalisation: ``normalize.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Protocol

import torch
from torch import nn


@dataclass
class FeatureMapOutput:
    features: torch.Tensor  # [B, H, N, F]
    log_scale: torch.Tensor | None  # [B, H, N] or None (= zeros)


@dataclass
class LinearAttentionState:
    """Recurrent state of causal linear attention, fp32 (fp64 only for fp64 inputs).

    kv:       [B, H, F, Dv]  sum_s exp(ls_s - log_max) phi(k_s) v_s^T
    k_sum:    [B, H, F]      sum_s exp(ls_s - log_max) phi(k_s)
    log_max:  [B, H]         running max of key log-scales folded into kv/k_sum
    offset:   number of tokens consumed so far (positions for position-dependent maps)
    """

    kv: torch.Tensor
    k_sum: torch.Tensor
    log_max: torch.Tensor
    offset: int = 0


    @classmethod
    def empty(
        cls,
        batch: int,
        heads: int,
        feature_dim: int,
        value_dim: int,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> "LinearAttentionState":
        """State before any token: zero sums and log_max = -inf (so it rescales to nothing)."""
        return cls(
            kv=torch.zeros(batch, heads, feature_dim, value_dim, device=device, dtype=dtype),
            k_sum=torch.zeros(batch, heads, feature_dim, device=device, dtype=dtype),
            log_max=torch.full((batch, heads), float("-inf"), device=device, dtype=dtype),
            offset=0,
        )

    def detach(self) -> "LinearAttentionState":
        """Same state cut from the autograd graph (truncated backprop across segments)."""
        return LinearAttentionState(self.kv.detach(), self.k_sum.detach(), self.log_max.detach(), self.offset)

    def augmented(self) -> torch.Tensor:
        """[kv, k_sum] as one [B, H, F, Dv + 1] tensor: the state of the values augmented with a ones
        column (v_aug = [v, 1]), so numerator and denominator come out of one matmul."""
        return torch.cat([self.kv, self.k_sum.unsqueeze(-1)], dim=-1)

    @classmethod
    def from_augmented(cls, s: torch.Tensor, log_max: torch.Tensor, offset: int) -> "LinearAttentionState":
        """The inverse of ``augmented``: s [B, H, F, Dv + 1] split into kv and k_sum."""
        return cls(kv=s[..., :-1], k_sum=s[..., -1], log_max=log_max, offset=offset)


class LinearAttentionFn(Protocol):
    """The contract every causal linear-attention implementation on features meets (``linear/``,
    ``triton.triton_linear_attention``): qf, kf [B, H, N, F], kls [B, H, N] | None, v [B, H, N, Dv]
    -> (out [B, H, N, Dv] in v.dtype, the fp32 state after the last token). ``log_decay`` [H] | None:
    log gamma per head, the decay of old keys (``decay.py``)."""

    def __call__(
        self, qf: torch.Tensor, kf: torch.Tensor, kls: torch.Tensor | None, v: torch.Tensor, *,
        normalization: str = "rms", chunk_size: int = 64, initial_state: "LinearAttentionState | None" = None,
        eps: float = 1e-6, log_decay: torch.Tensor | None = None,
    ) -> "tuple[torch.Tensor, LinearAttentionState]": ...


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for half/bf16/fp32 inputs; fp64 stays fp64 (gradcheck, reference computations)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def fp32_inputs(
    qf: torch.Tensor,
    kf: torch.Tensor,
    kls: torch.Tensor | None,
    v: torch.Tensor,
    initial_state: LinearAttentionState | None,
    operand_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, LinearAttentionState]:
    """Common prologue of the attention forms: upcast to the accumulation dtype (fp32, or fp64
    for fp64 inputs), ``kls=None`` -> zeros, ``initial_state=None`` -> the empty state.
    ``operand_dtype``: qf, kf, v go to it instead (a kernel that accumulates in fp32 itself)."""
    batch, heads, n, feat = qf.shape
    acc = accumulation_dtype(v.dtype)
    op = operand_dtype or acc
    ls = torch.zeros(batch, heads, n, device=qf.device, dtype=acc) if kls is None else kls.to(acc)
    state = initial_state
    if state is None:
        state = LinearAttentionState.empty(batch, heads, feat, v.shape[-1], device=qf.device, dtype=acc)
    else:
        state = LinearAttentionState(state.kv.to(acc), state.k_sum.to(acc), state.log_max.to(acc), state.offset)
    return qf.to(op), kf.to(op), ls, v.to(op), state


# Optimisation roles of learnable kernel parameters (``KernelParameter.role``):
#   "frequencies": random-Fourier frequencies Omega [H, D, d] (own LR multiplier, no weight decay)
#   "temperature": per-head scalars: log-temperature tau [H], the hybrid's window-mix logit [H, 1, 1]
#                  (own LR multiplier, no weight decay)
#   "map_weight":  a learned projection inside the map (hedgehog's W [H, d, F/2]): main LR, no
#                  weight decay (decaying it pulls the map towards a constant, i.e. uniform attention)
KERNEL_ROLES = ("frequencies", "temperature", "map_weight")


@dataclass(frozen=True)
class KernelParameter:
    """One learnable kernel parameter, declared by the feature map that owns it.

    Heads are always dim 0 (tensor parallelism shards it there). ``name`` is the attribute name
    inside the map; ``role`` one of ``KERNEL_ROLES``.
    """

    name: str
    param: nn.Parameter
    role: str

    def __post_init__(self) -> None:
        if self.role not in KERNEL_ROLES:
            raise ValueError(f"role: expected one of {KERNEL_ROLES}, got {self.role!r}")


class FeatureMap(nn.Module):
    """Base class: per-head feature map [B, H, N, head_dim] -> FeatureMapOutput.

    Subclasses with learnable parameters list them in ``kernel_parameters()``: the single place
    the optimizer (LR groups, weight decay), tensor parallelism (dim-0 tags), the trainer's kernel
    statistics and ZeRO-3 registration learn about them (``named_kernel_parameters``).
    """

    num_heads: int
    head_dim: int
    feature_dim: int  # F, the size of the last axis of ``features``
    positive: bool = False  # True when features are elementwise >= 0 (denominators are safe)

    def forward(self, x: torch.Tensor, offset: int = 0) -> FeatureMapOutput:  # pragma: no cover
        raise NotImplementedError

    def check_input(self, x: torch.Tensor, name: str = "x") -> None:
        """ValueError unless ``x`` is a floating [B, num_heads, N, head_dim] tensor."""
        if not torch.is_floating_point(x):
            raise ValueError(f"{name}: expected a floating-point tensor, got dtype {x.dtype}")
        if x.dim() != 4 or x.shape[1] != self.num_heads or x.shape[3] != self.head_dim:
            raise ValueError(
                f"{name}: expected shape [B, {self.num_heads}, N, {self.head_dim}] (heads={self.num_heads}, "
                f"head_dim={self.head_dim} of the {type(self).__name__}), got {tuple(x.shape)}"
            )

    def kernel_parameters(self) -> list[KernelParameter]:
        """The map's learnable kernel parameters with their optimisation role (none by default)."""
        return []

    @staticmethod
    def output_dim(head_dim: int, feature_dim: int) -> int:
        """F of the map built with these arguments (maps whose F is fixed by head_dim override it)."""
        return feature_dim

    def maybe_redraw(self, step: int) -> bool:
        """Resample random features for optimiser step ``step`` if the map does that (Performer)."""
        return False

    def extra_repr(self) -> str:
        return f"num_heads={self.num_heads}, head_dim={self.head_dim}, feature_dim={self.feature_dim}"


def named_kernel_parameters(module: nn.Module) -> Iterator[tuple[str, KernelParameter]]:
    """(qualified parameter name in ``module``, KernelParameter) for every kernel parameter inside it.

    Declared by every submodule with a ``kernel_parameters()`` method (the feature maps, and
    attention wrappers such as ``hybrid.LocalMixingCore``). The qualified name matches
    ``module.named_parameters()``; each declaring module must declare exactly its own (non-recursive)
    parameters (one it forgets is an error, not a silent default).
    """
    for prefix, sub in module.named_modules():
        declare = getattr(sub, "kernel_parameters", None)
        if not callable(declare) or isinstance(sub, nn.ModuleList):
            continue
        declared = declare()
        own = [p for p in sub.parameters(recurse=False)]
        if {id(kp.param) for kp in declared} != {id(p) for p in own} or len(declared) != len(own):
            names = sorted(n for n, _ in sub.named_parameters(recurse=False))
            raise ValueError(
                f"{type(sub).__name__}.kernel_parameters(): expected exactly its parameters {names}, "
                f"got {sorted(kp.name for kp in declared)}"
            )
        for kp in declared:
            yield (f"{prefix}.{kp.name}" if prefix else kp.name), kp
