"""A learned per-head decay of linear attention (RetNet / GLA style): old keys fade.

With ``model.kernel_decay: learned`` every causal linear weight is multiplied by gamma_h^(t - s), the
head's decay per token of age (0 < gamma_h < 1), in the numerator and in every normaliser's sums:

    w_ts = gamma^(t - s) (qf_t . kf_s) exp(kls_s - m_t)      s <= t (carried state included)

In log space, with g = log gamma < 0, the factor is exp((t - c) g) exp(-(s - c) g) for any origin c: a
per-query scalar times a per-key one. So the decay folds into the log-scales the forms already
stabilise (docs/attention.md):

* keys:    kls'_s = kls_s - (s - c) g        (s = the key's position in the call, c the fold's origin)
* queries: exp((t - c) g) is a per-query scalar, which every normalisation cancels (``base.py``); the
  stabiliser m'_t = max_{s <= t} kls'_s absorbs it exactly: exp(kls'_s - m'_t) is the same number as
  exp(kls_s + (t - s) g - m_t) with m_t = m'_t + (t - c) g, the decayed weights' own running max. Every
  exponent stays <= 0 and nothing overflows, for any key norm and any gamma.
* state:   a ``LinearAttentionState`` holds its sums decayed to its last token (the one before the
  call, position -1): in the folded coordinates its log_max is log_max + (c + 1) g (``enter``); the
  folded state after the call, log_max M', is decayed to token N - 1 by M' + (N - 1 - c) g
  (``leave``). Both are exact; the sums are untouched.

So any implementation of the undecayed contract (chunked torch, fused trig, Triton, fla) computes the
decayed attention on folded inputs, with no kernel change (``folded``, ``run_folded``); the reference
forms (``linear/naive.py``, ``linear/recurrent.py``) apply gamma natively, which is what the tests
compare the folded forms with. Precision: |kls'_s| grows by |g| per token from the origin, and every
exp argument kls'_s - m'_t carries about 2 u |t - c| |g| of absolute rounding (u = 2^-24 in fp32), a
relative error of each weight. So calls longer than ``FOLD_SEGMENT`` tokens run in segments, each
folded about its middle (the state carried between them), which bounds it by 4 u (FOLD_SEGMENT / 2)
|g|: 8e-6 at gamma = 1 - 2^-5, 2e-4 at gamma = 1/2 (a half-life of one token), below bf16's 2^-8
for every gamma above e^-15.

Gradients: the stabilisers (and a state's log_max) are constants for autograd, as everywhere, so the
state's g-dependence rides on its sums by a factor exp(j (g - g.detach())) = 1 (``enter``, ``leave``):
the same numbers, and d/dg = j times the sums. Keys get theirs through kls'.

Parametrisation: gamma_h = sigmoid(a_h), a_h = ``AttentionCore.decay_logit`` (a "temperature"-role
kernel parameter: per-head scalar, no weight decay, which would pull a_h to 0, i.e. gamma to 1/2).
For gamma near 1, a_h ~ -log(1 - gamma): an Adam step moves log(1 - gamma) by about the LR, the same
relative change at every time scale. Initialised RetNet-style (Sun et al. 2023: gamma_h = 1 - 2^(-5-h)),
but spread over 1 - gamma in [2^-12, 2^-5] whatever the number of heads (half-lives from ~22 to ~2,800
tokens), so that a model starts with heads at every time scale and learns which to keep.

The window hybrid (``window/``) decays its far field only, counted from the window's edge: a far key
s <= t - W weighs gamma^(t - s - W) times its kernel weight (1 for the newest far key, so the hybrid
starts continuous at the edge); the window's exact softmax weights are not decayed. There the query
log-scale does not cancel, so it is folded too: qls'_t = qls_t + (t - c - W) g.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from .base import LinearAttentionState

KERNEL_DECAYS = ("none", "learned")
# RetNet's spectrum 1 - gamma = 2^-5 .. 2^-12 (its 8 heads), spread over any number of heads
_FASTEST_EXPONENT, _SLOWEST_EXPONENT = 5.0, 12.0
# tokens per fold origin: a longer call runs in segments (``run_folded``); 2,048 keeps the shipped
# training lengths in one call
FOLD_SEGMENT = 2048

# (first token, end, the fold's origin in the segment, the folded state entering it) -> (out, folded state after it)
FoldedStep = Callable[[int, int, int, "LinearAttentionState | None"], "tuple[torch.Tensor, LinearAttentionState]"]


def check_kernel_decay(decay: str) -> None:
    if decay not in KERNEL_DECAYS:
        raise ValueError(f"kernel_decay: expected one of {KERNEL_DECAYS}, got {decay!r}")


def initial_decay_logits(num_heads: int) -> torch.Tensor:
    """a_h [H] with sigmoid(a_h) = 1 - 2^-e_h, e_h evenly from 5 to 12 over the heads (one head: 5)."""
    if num_heads == 1:
        exponents = torch.tensor([_FASTEST_EXPONENT], dtype=torch.float64)
    else:
        exponents = torch.linspace(_FASTEST_EXPONENT, _SLOWEST_EXPONENT, num_heads, dtype=torch.float64)
    # logit(1 - 2^-e) = log((1 - 2^-e) / 2^-e) = log(2^e - 1)
    return torch.log(torch.exp2(exponents) - 1.0).float()


def log_decay_of(logits: torch.Tensor) -> torch.Tensor:
    """g = log sigmoid(a) = -softplus(-a) [H], in fp32 (fp64 stays fp64): log gamma, < 0."""
    acc = torch.float64 if logits.dtype == torch.float64 else torch.float32
    return -F.softplus(-logits.to(acc))


def fold_origin(n: int) -> int:
    """The fold's origin c of a call (or segment) of n tokens: its middle, so |t - c| <= n / 2."""
    return (n - 1) // 2


def _unit(log_decay: torch.Tensor, steps: float) -> torch.Tensor | None:
    """exp(steps (g - g.detach())) [H]: 1, carrying d/dg = steps; None when nothing differentiates g."""
    if steps == 0 or not (torch.is_grad_enabled() and log_decay.requires_grad):
        return None
    return torch.exp(steps * (log_decay - log_decay.detach()))


def _shifted(state: LinearAttentionState, log_decay: torch.Tensor, steps: float) -> LinearAttentionState:
    """``state`` with its sums decayed by ``steps`` tokens (gamma^steps): log_max + steps g."""
    g = log_decay.detach().to(state.log_max.dtype)
    kv, k_sum = state.kv, state.k_sum
    unit = _unit(log_decay, steps)
    if unit is not None:
        unit = unit.to(kv.dtype)
        kv, k_sum = kv * unit[:, None, None], k_sum * unit[:, None]
    return LinearAttentionState(kv, k_sum, state.log_max + steps * g, state.offset)


def enter(state: LinearAttentionState | None, log_decay: torch.Tensor, origin: int = 0) -> LinearAttentionState | None:
    """A carried state (decayed to the token before the call) in the call's coordinates folded about ``origin``."""
    return None if state is None else _shifted(state, log_decay, float(origin + 1))


def leave(state: LinearAttentionState, log_decay: torch.Tensor, n: int, origin: int = 0) -> LinearAttentionState:
    """The folded state after a call of ``n`` tokens (folded about ``origin``), decayed to its last token."""
    return _shifted(state, log_decay, float(n - 1 - origin))


def positions(n: int, first: int, like: torch.Tensor) -> torch.Tensor:
    """first .. first + n - 1 [n] in ``like``'s dtype and device."""
    return torch.arange(first, first + n, device=like.device, dtype=like.dtype)


def fold_keys(kls: torch.Tensor | None, log_decay: torch.Tensor, shape: tuple[int, int, int], first: int = 0) -> torch.Tensor:
    """kls'_s = kls_s - s g [B, H, N] (``kls`` None: zeros) for keys at positions s = first .. first + N - 1
    (relative to the fold's origin), in the wider of the two dtypes (fp32 at least)."""
    g = log_decay if kls is None else log_decay.to(torch.promote_types(log_decay.dtype, kls.dtype))
    shift = -positions(shape[2], first, g) * g[:, None]  # [H, N]
    return shift.expand(shape) if kls is None else kls.to(g.dtype) + shift


def fold_queries(qls: torch.Tensor, log_decay: torch.Tensor, first: int) -> torch.Tensor:
    """qls'_t = qls_t + t g [B, H, N] for queries at positions t = first .. first + N - 1 (the window hybrid)."""
    g = log_decay.to(torch.promote_types(log_decay.dtype, qls.dtype))
    return qls.to(g.dtype) + positions(qls.shape[2], first, g) * g[:, None]


def run_folded(
    step: FoldedStep, n: int, log_decay: torch.Tensor, initial_state: LinearAttentionState | None
) -> tuple[torch.Tensor, LinearAttentionState]:
    """The decayed attention of n tokens by an undecayed ``step`` on folded inputs: segments of at most
    ``FOLD_SEGMENT`` tokens, each folded about its middle, the state entering and leaving each unfolded
    (module doc). -> (out [B, H, N, Dv], the state after the last token)."""
    outs, state = [], initial_state
    for lo in range(0, n, FOLD_SEGMENT):
        hi = min(lo + FOLD_SEGMENT, n)
        origin = fold_origin(hi - lo)
        out, folded_state = step(lo, hi, origin, enter(state, log_decay, origin))
        outs.append(out)
        state = leave(folded_state, log_decay, hi - lo, origin)
    return (outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)), state


def folded(
    fn: Callable[..., tuple[torch.Tensor, LinearAttentionState]], qf: torch.Tensor, kf: torch.Tensor,
    kls: torch.Tensor | None, v: torch.Tensor, log_decay: torch.Tensor, *,
    initial_state: LinearAttentionState | None = None, **options: object,
) -> tuple[torch.Tensor, LinearAttentionState]:
    """``fn`` (an undecayed implementation of ``base.LinearAttentionFn``) computing the decayed attention
    on folded key log-scales (``run_folded``)."""

    def step(lo: int, hi: int, origin: int, state: LinearAttentionState | None) -> tuple[torch.Tensor, LinearAttentionState]:
        part = None if kls is None else kls[:, :, lo:hi]
        folded_kls = fold_keys(part, log_decay, (*qf.shape[:2], hi - lo), first=-origin)
        return fn(qf[:, :, lo:hi], kf[:, :, lo:hi], folded_kls, v[:, :, lo:hi], initial_state=state, **options)

    return run_folded(step, qf.shape[2], log_decay, initial_state)
