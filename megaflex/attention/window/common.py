"""The one-normaliser window's shared pieces: its inputs (queries, then cached and new keys), the
window cache, the linear state's update by keys leaving the window, and the block helpers of the chunked forms."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ..base import LinearAttentionState, accumulation_dtype
from ..decay import enter, fold_keys, fold_queries

WINDOW_FORMS = ("quadratic", "recurrent", "chunked")


@dataclass
class WindowCache:
    """The last keys of the window (at most W - 1): k [B, H, P, d], kf [B, H, P, F], kls [B, H, P], v [B, H, P, Dv]."""

    k: torch.Tensor
    kf: torch.Tensor
    kls: torch.Tensor
    v: torch.Tensor

    @property
    def length(self) -> int:
        return self.k.shape[2]

    def detach(self) -> "WindowCache":
        return WindowCache(self.k.detach(), self.kf.detach(), self.kls.detach(), self.v.detach())


@dataclass
class WindowInputs:
    """Queries (N) and keys (the P cached ones, then the N new ones), in the accumulation dtype."""

    q: torch.Tensor  # [B, H, N, d]
    qf: torch.Tensor  # [B, H, N, F]
    qls: torch.Tensor  # [B, H, N]
    k: torch.Tensor  # [B, H, P + N, d]
    kf: torch.Tensor  # [B, H, P + N, F]
    kls: torch.Tensor  # [B, H, P + N]
    v_aug: torch.Tensor  # [B, H, P + N, Dv + 1], ones column last
    key_valid: torch.Tensor | None  # [B, P + N] bool or None
    far: LinearAttentionState
    input_dtype: torch.dtype  # v's: half inputs run the Triton kernels' dots on half operands

    @property
    def prefix(self) -> int:
        return self.k.shape[2] - self.q.shape[2]


def prepare_inputs(
    q, qf, qls, k, kf, kls, v, far_state, cache, key_valid,
) -> WindowInputs:  # fmt: skip
    acc = accumulation_dtype(v.dtype)
    b, h, n, _ = q.shape
    zeros = q.new_zeros(b, h, n, dtype=acc)
    qls = zeros if qls is None else qls.to(acc)
    kls = zeros if kls is None else kls.to(acc)
    keys = [k.to(acc), kf.to(acc), kls, v.to(acc)]
    if cache is not None and cache.length:
        keys = [torch.cat([c.to(acc), x], dim=2) for c, x in zip((cache.k, cache.kf, cache.kls, cache.v), keys)]
    k_all, kf_all, kls_all, v_all = keys
    v_aug = torch.cat([v_all, v_all.new_ones(*v_all.shape[:3], 1)], dim=-1)
    if far_state is None:
        far = LinearAttentionState.empty(b, h, kf.shape[-1], v.shape[-1], device=q.device, dtype=acc)
    else:
        far = LinearAttentionState(far_state.kv.to(acc), far_state.k_sum.to(acc), far_state.log_max.detach().to(acc),
                                   far_state.offset)  # fmt: skip
    if key_valid is not None and tuple(key_valid.shape) != (b, k_all.shape[2]):
        raise ValueError(f"key_valid: expected shape [{b}, {k_all.shape[2]}] (cached keys, then new), got {tuple(key_valid.shape)}")
    return WindowInputs(q.to(acc), qf.to(acc), qls, k_all, kf_all, kls_all, v_aug, key_valid, far, v.dtype)


def fold_decay(x: WindowInputs, log_decay: torch.Tensor, window: int, origin: int) -> WindowInputs:
    """``x`` with the far field's decay gamma^(t - s - W) folded in about ``origin`` c (``decay.py``): keys at
    positions -P .. N - 1 get kls - (s - c) g, queries at 0 .. N - 1 get qls + (t - c - W) g, the far state
    log_max + (c + 1) g."""
    b, h, total = x.kls.shape
    kls = fold_keys(x.kls, log_decay, (b, h, total), first=-x.prefix - origin)
    qls = fold_queries(x.qls, log_decay, first=-window - origin)
    far = enter(x.far, log_decay, origin)
    return dataclasses.replace(x, qls=qls.to(x.qls.dtype), kls=kls.to(x.kls.dtype), far=far)


def absorb(state: LinearAttentionState, kf: torch.Tensor, kls: torch.Tensor, v_aug: torch.Tensor) -> LinearAttentionState:
    """``state`` plus keys kf [B, H, r, F], kls [B, H, r], v_aug [B, H, r, Dv + 1] (r may be 0);
    the offset is left to the caller."""
    if kf.shape[2] == 0:
        return state
    log_max = torch.maximum(state.log_max, kls.detach().amax(-1))
    # -inf while no real key came (padded keys at -inf, bidirectional blocks): scale by 0 instead of nan
    safe = finite_stabiliser(log_max)
    decay = torch.exp(state.log_max - safe)  # 0 for the empty state
    scaled = kf * torch.exp(kls - safe.unsqueeze(-1)).unsqueeze(-1)
    s = state.augmented() * decay[..., None, None] + scaled.transpose(-1, -2) @ v_aug
    return LinearAttentionState.from_augmented(s, log_max, state.offset)


def real_first_order(key_valid: torch.Tensor | None) -> torch.Tensor | None:
    """[B, N] the order that puts each row's real tokens first, as they come, and its padding after
    them; None when no padding precedes a real token (the order is the identity). The bidirectional
    window measures |i - j| in this order, i.e. in real tokens, whatever padding sits between them."""
    if key_valid is None or not bool((key_valid[:, 1:] & ~key_valid[:, :-1]).any()):
        return None
    return torch.argsort((~key_valid).to(torch.uint8), dim=1, stable=True)


def finite_stabiliser(m: torch.Tensor) -> torch.Tensor:
    """The stabiliser with rows that see nothing (-inf) set to 0 (their weights are all 0 anyway)."""
    return torch.where(torch.isfinite(m), m, torch.zeros_like(m))



def key_blocks(x: torch.Tensor, c: int, lookback: int, fill: float) -> torch.Tensor:
    """Keys [B, H, T_pad, *] (T_pad = nC C) -> [B, H, nC, (L + 1) C, *]: chunk c's keys from chunks c - L .. c
    (``fill`` before the first key)."""
    front = x.new_full((*x.shape[:2], lookback * c, *x.shape[3:]), fill)
    padded = torch.cat([front, x], dim=2)
    blocks = padded.unfold(2, (lookback + 1) * c, c)  # [B, H, nC, *, (L + 1) C]
    return blocks.movedim(-1, 3) if x.dim() == 4 else blocks


def pad_keys(x: torch.Tensor, n_pad: int, fill: float = 0.0) -> torch.Tensor:
    n = x.shape[2]
    if n == n_pad:
        return x
    return torch.cat([x, x.new_full((*x.shape[:2], n_pad - n, *x.shape[3:]), fill)], dim=2)


def aligned_queries(y: torch.Tensor, prefix: int, t_pad: int) -> torch.Tensor:
    """Queries [B, H, N, *] -> [B, H, T_pad, *] aligned with the keys: the P cached keys get
    placeholder queries (zeros: finite, their rows are dropped), the end is zero-padded."""
    aligned = torch.cat([y.new_zeros(*y.shape[:2], prefix, *y.shape[3:]), y], dim=2) if prefix else y
    return pad_keys(aligned, t_pad)

