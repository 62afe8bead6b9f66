"""Context parallelism (LASP-2 style) for causal linear attention: one sequence split over CP ranks.

CP rank r holds tokens [r N / CP, (r + 1) N / CP) of every sequence. What it needs from the
ranks before it is a fixed-size state, whatever their number of tokens (notation of
``megaflex.attention.core``; the augmented value v_aug = [v, 1] puts k_sum in the last column):

    S_j = sum_{s on rank j} exp(kls_s - M_j) kf_s v_aug_s^T,   M_j = max_{s on rank j} kls_s

1. Each rank computes its local S_j, M_j: [F, n] x [n, Dv + 1] matmuls over blocks of rows, no
   chunk scan; the keys' features are made per block and remade in backward, never kept.
2. One all-gather of the packed fp32 (S_j, M_j) over the CP group: B H (F (Dv + 1) + 1) floats
   per rank, independent of N (LASP-2; LASP-1 passes the state around a serial ring instead).
3. Rank r combines the states before it into its incoming state, rescaled to a common max as
   the recurrent form does:  M_in = max_{j<r} M_j,  S_in = sum_{j<r} exp(M_j - M_in) S_j.
   With a decay (``model.kernel_decay``, ``attention/decay.py``) each S_j holds its keys decayed to
   its slice's last token (kls_s + (n - 1 - s) g) and reaches rank r decayed by r - 1 - j more
   slices: M_j + (r - 1 - j) n g in place of M_j (``slice_lags``); d g of that is one more sum in
   the backward (``slice_decay_grad``).
4. Rank r runs its attention core (the same path as at CP=1: on CPU the fused trig map + chunked
   form, which keeps no features) over its slice from the initial state (S_in, M_in). That form
   already combines the inter-rank term exp(M_in - m_t) q_t S_in with the local numerator under the running max m_t = max(M_in, max_{s<=t} kls_s) and normalises after
   combining ("rms" or "denominator"), so the outputs are those of the single-rank chunked form
   up to fp rounding, whatever the key scales.

Backward mirrors it: the chunked form returns dL/dS_in; one all-gather of those (same fixed
size) lets rank j collect dL/dS_j = sum_{r>j} exp(M_j - M_in(r)) dL/dS_in(r), which flows into
its kf, kls, v and from there into the feature-map parameters (Omega, tau). Those parameters
are replicated over CP ranks, so their gradients are reduced over DP x CP like any other
(``DeepSpeedMPU``). The stabilisers M are constants for autograd, as in every form.

Rank 0 also takes the (empty) incoming state as its initial state, so every CP rank runs the
backward all-gather of every layer in the same order.

Memory: per rank the CP path keeps what the CP=1 path keeps for its slice (the core's saved
tensors; k and v are made contiguous once and shared by the core and the local-state blocks),
plus the O(1) states. Nothing of size N / CP x F lives between forward and backward.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

from megaflex.attention import AttentionCore, LinearAttentionState
from megaflex.attention.base import accumulation_dtype
from megaflex.attention.decay import fold_keys
from megaflex.attention.documents import DocumentLayout, document_layout
from megaflex.parallel.state import ParallelState


def _check_cp_groups(state: ParallelState) -> None:
    if state.cp_size > 1 and state.cp_group is None:
        raise RuntimeError(f"{state} has no process groups (built with single()/detached()); cannot communicate")


def cp_all_gather(x: torch.Tensor, state: ParallelState) -> torch.Tensor:
    """[...] on every CP rank -> [CP, ...] in CP-rank order."""
    _check_cp_groups(state)
    out = x.new_empty(state.cp_size, *x.shape)
    dist.all_gather(list(out.unbind(0)), x.contiguous(), group=state.cp_group)
    return out


def local_state(
    kf: torch.Tensor, kls: torch.Tensor | None, v: torch.Tensor, keep: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """This slice's state relative to its own max: kf [B, H, N, F], kls [B, H, N] | None, v [B, H, N, Dv]
    -> (S [B, H, F, Dv + 1] = [kv, k_sum] in fp32, log_max [B, H], detached). ``keep`` [B, N] bool:
    only those keys count (the slice's last document); log_max is -inf where none does."""
    acc = accumulation_dtype(v.dtype)
    kf, v = kf.to(acc), v.to(acc)
    if keep is not None:
        kls = kf.new_zeros(kf.shape[:3]) if kls is None else kls.to(acc)
        kls = kls.masked_fill(~keep.unsqueeze(1), float("-inf"))
    if kls is None:
        weight, log_max = kf.new_ones(kf.shape[:3]), kf.new_zeros(kf.shape[:2])
    else:
        kls = kls.to(acc)
        log_max = kls.detach().amax(dim=-1)  # [B, H]
        finite_max = log_max if keep is None else log_max.nan_to_num(neginf=0.0)  # no kept key: weights 0, not nan
        weight = torch.exp(kls - finite_max.unsqueeze(-1))  # [B, H, N], every weight <= 1
    # the weights go on v and into a [1, N] row, so autograd keeps no new [N, F] tensor (kf is kept anyway)
    kv = kf.transpose(-1, -2) @ (v * weight.unsqueeze(-1))  # [B, H, F, Dv]
    k_sum = weight.unsqueeze(-2) @ kf  # [B, H, 1, F]
    return torch.cat([kv, k_sum.transpose(-1, -2)], dim=-1), log_max


# rows of keys mapped at once by ``mapped_local_state``: about 2^20 feature elements (4 MiB in fp32)
_STATE_BLOCK_ELEMENTS = 1 << 20


def _block_state(
    feature_map: nn.Module, k: torch.Tensor, v: torch.Tensor, offset: int, keep: torch.Tensor | None,
    log_decay: torch.Tensor | None = None, first: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    mapped = feature_map(k, offset)
    kls = mapped.log_scale
    if log_decay is not None:  # decayed to the slice's last token: kls_s + (n - 1 - s) g
        kls = fold_keys(kls, log_decay, tuple(k.shape[:3]), first=first)
    return local_state(mapped.features, kls, v, keep)


def mapped_local_state(
    feature_map: nn.Module, k: torch.Tensor, v: torch.Tensor, offset: int, keep: torch.Tensor | None = None,
    log_decay: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``local_state`` of the features ``feature_map(k, offset)``, k [B, H, N, d], v [B, H, N, Dv], without
    keeping any [B, H, N, F] tensor: the keys are mapped a block of rows at a time, and each block
    is recomputed in backward (activation checkpointing), so between forward and backward only
    k and v live (the attention core keeps them too). Blocks are combined like ranks: rescaled
    to their common max. ``keep`` [B, N] bool: only those keys count (``local_state``).
    ``log_decay`` [H] (``attention/decay.py``): each key decayed to the slice's last token, gamma^(n - 1 - s)."""
    batch, heads, n, _ = k.shape
    rows = max(256, _STATE_BLOCK_ELEMENTS // (batch * heads * feature_map.feature_dim))
    states, maxes = [], []
    for start in range(0, n, rows):
        block_keep = None if keep is None else keep[:, start : start + rows]
        blocks = (k[:, :, start : start + rows], v[:, :, start : start + rows], offset + start, block_keep)
        if log_decay is not None:  # fold_keys' positions count back from the last token: start - (n - 1)
            blocks += (log_decay, start - (n - 1))
        if torch.is_grad_enabled():
            s, m = checkpoint(_block_state, feature_map, *blocks, use_reentrant=False)
        else:
            s, m = _block_state(feature_map, *blocks)
        states.append(s)
        maxes.append(m)
    if len(states) == 1:
        return states[0], maxes[0]
    maxes_all = torch.stack(maxes)  # [blocks, B, H]
    log_max = maxes_all.amax(dim=0)
    scale = torch.exp(maxes_all - log_max)  # <= 1
    return sum(s * w[..., None, None] for s, w in zip(states, scale.unbind(0))), log_max


def slice_lags(cp: int, device: torch.device) -> torch.Tensor:
    """[CP(r), CP(j), 1, 1]: the whole slices between rank j's last token and rank r's first, r - 1 - j
    (0 where j >= r): how many slice decays rank j's state takes on its way to rank r."""
    r = torch.arange(cp, device=device)
    return (r.view(cp, 1) - 1 - r.view(1, cp)).clamp(min=0).view(cp, cp, 1, 1)


def _incoming_weights(
    log_maxes: torch.Tensor, resets: torch.Tensor | None = None, slice_decay: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """log_maxes [CP, B, H] -> (M_in [CP, B, H]: max over the ranks before each rank (-inf for rank 0),
    W [CP(r), CP(j), B, H] = exp(M_j - M_in(r)) for j < r, else 0). ``resets`` [CP, B, H] (1: a
    document starts in rank j's slice, whose state then holds its last document only): rank j
    reaches rank r only if no rank strictly between them resets. ``slice_decay`` [H] (n g, the decay
    of one whole slice): rank j's state reaches rank r as M_j + (r - 1 - j) n g (``slice_lags``)."""
    cp = log_maxes.shape[0]
    earlier = torch.ones(cp, cp, dtype=torch.bool, device=log_maxes.device).tril(-1).view(cp, cp, 1, 1)
    seen = log_maxes.unsqueeze(0)  # [1 or CP(r), CP(j), B, H]: rank j's log_max as rank r sees it
    if slice_decay is not None:
        seen = seen + slice_lags(cp, log_maxes.device) * slice_decay.detach()
    if resets is not None:
        count = resets.cumsum(dim=0)  # resets in ranks 0..j
        count_before = torch.cat([torch.zeros_like(count[:1]), count[:-1]])  # in ranks 0..r-1
        earlier = earlier & (count_before.unsqueeze(1) == count.unsqueeze(0))  # none in j+1..r-1
    if resets is None and slice_decay is None:
        before = torch.cat([torch.full_like(log_maxes[:1], float("-inf")), log_maxes[:-1]])
        m_in = before.cummax(dim=0).values
    else:
        m_in = seen.expand(cp, *log_maxes.shape).masked_fill(~earlier, float("-inf")).amax(dim=1)
    w = torch.exp(seen - m_in.unsqueeze(1)).masked_fill(~earlier, 0.0)
    return m_in, w.nan_to_num(0.0)  # nan only for an empty (-inf) rank state: it contributes nothing


def slice_decay_grad(w_j: torch.Tensor, grads: torch.Tensor, s_j: torch.Tensor, j: int) -> torch.Tensor:
    """d(n g) [H] through rank j's weights W[:, j] = exp(M_j + (r - 1 - j) n g - M_in(r)): the sum over r and
    the batch of (r - 1 - j) W[r, j] <dL/dS_in(r), S_j>; w_j [CP(r), B, H], grads [CP(r), B, H, L], s_j
    [B, H, L]. Each rank adds its own j; the DP x CP reduction of the replicated decay sums them."""
    lags = slice_lags(w_j.shape[0], w_j.device)[:, j]  # [CP(r), 1, 1]
    return (lags * w_j * (grads * s_j).sum(-1)).sum(dim=(0, 1))


class _PrefixState(torch.autograd.Function):
    """(S_local [B, H, L], M_local [B, H]) -> (S_in [B, H, L], M_in [B, H]) over the CP group.

    Forward: one all-gather of [S, M]; backward: one all-gather of dL/dS_in (both N-independent)."""

    @staticmethod
    def forward(ctx, s_local, m_local, state, resets, slice_decay):  # type: ignore[override]
        packed = [s_local, m_local.unsqueeze(-1)] + ([] if resets is None else [resets.to(s_local.dtype).unsqueeze(-1)])
        gathered = cp_all_gather(torch.cat(packed, dim=-1), state)  # [CP, B, H, L + 1 (+ 1)]
        size = s_local.shape[-1]
        m_in, w = _incoming_weights(gathered[..., size], None if resets is None else gathered[..., size + 1], slice_decay)
        r = state.cp_rank
        s_in = torch.einsum("jbh,jbhl->bhl", w[r], gathered[..., :size])
        ctx.state, ctx.w = state, w
        if slice_decay is not None:
            ctx.save_for_backward(s_local)
        ctx.mark_non_differentiable(m_in)
        return s_in, m_in[r].clone()

    @staticmethod
    def backward(ctx, d_s_in, _d_m_in):  # type: ignore[override]
        grads = cp_all_gather(d_s_in, ctx.state)  # [CP(r), B, H, L]
        j = ctx.state.cp_rank
        d_decay = None
        if ctx.needs_input_grad[4]:
            d_decay = slice_decay_grad(ctx.w[:, j], grads, ctx.saved_tensors[0], j)
        return torch.einsum("rbh,rbhl->bhl", ctx.w[:, j], grads), None, None, None, d_decay


def incoming_state(
    s_local: torch.Tensor, m_local: torch.Tensor, state: ParallelState, offset: int, resets: torch.Tensor | None = None,
    slice_decay: torch.Tensor | None = None,
) -> LinearAttentionState:
    """This rank's local state (``local_state``: S [B, H, F, Dv + 1], M [B, H]) -> the state of all
    tokens before its slice (steps 2-3 above), starting at global position ``offset``. ``resets``
    [B] bool: a document starts in this slice (whose S then holds its last document only).
    ``slice_decay`` [H]: n g, the decay of one slice of n tokens (each state decayed to its slice's last
    token, ``mapped_local_state``): the incoming state is decayed to the last token before this slice."""
    batch, heads, feat, dv_aug = s_local.shape
    if resets is not None:
        resets = resets.view(batch, 1).expand(batch, heads)
    with torch.autocast(device_type=s_local.device.type, enabled=False):
        s_in, m_in = _PrefixState.apply(s_local.flatten(2), m_local, state, resets, slice_decay)
    s_in = s_in.view(batch, heads, feat, dv_aug)
    return LinearAttentionState(kv=s_in[..., :-1], k_sum=s_in[..., -1], log_max=m_in, offset=offset)


def check_whole_sequences(state: object, return_state: bool) -> None:
    """Context parallelism neither continues nor returns a decoding state."""
    if state is not None or return_state:
        raise ValueError(
            "state/return_state: context parallelism runs whole sequences split over ranks; "
            "decode (carry states) with context_parallel_size=1"
        )


class ContextParallelAttention:
    """Stands in for ``AttentionCore.forward`` when sequences are split over CP ranks.

    Uses the core's feature map (so its Omega/tau are the model's parameters) at global
    positions and its form/normalisation settings. Not a module: it owns no parameters and is
    built per call by ``TensorParallelLayers.attention``. Whole sequences only: decoding from
    a state (or returning one) is a single-rank job.
    """

    def __init__(self, core: AttentionCore, state: ParallelState) -> None:
        if core.feature_map is None:
            raise ValueError(
                f"context_parallel_size: expected 1 for attention kind {core.kind!r} (exact softmax attention has "
                f"no fixed-size state to pass between ranks), got {state.cp_size}"
            )
        self.core, self.state = core, state

    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, state: object = None, return_state: bool = False,
        document_starts: DocumentLayout | torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, None]:
        """As ``AttentionCore.forward`` over this rank's slice; ``document_starts`` [B, N] (this slice's,
        or its ``DocumentLayout``):
        the state passed on holds the slice's last document only, and a slice continues the ranks
        before it only up to its first start (see ``_incoming_weights``)."""
        check_whole_sequences(state, return_state)
        offset = self.state.cp_rank * q.shape[2]  # global position of this slice's first token
        # one contiguous k and v shared with the core (which keeps them for its backward anyway)
        k, v = k.contiguous(), v.contiguous()
        keep = resets = None
        layout = document_layout(document_starts)
        if layout is not None:
            index = torch.arange(q.shape[2], device=q.device)
            last_start = torch.where(layout.starts, index, 0).amax(dim=-1, keepdim=True)  # [B, 1]
            keep, resets = index >= last_start, layout.starts.any(dim=-1)
        log_decay = self.core.log_decay()
        with torch.autocast(device_type=q.device.type, enabled=False):
            s_local, m_local = mapped_local_state(self.core.feature_map, k, v, offset, keep, log_decay)
        slice_decay = None if log_decay is None else q.shape[2] * log_decay
        incoming = incoming_state(s_local, m_local, self.state, offset, resets, slice_decay)
        # the core's own path (fused trig map on CPU, Triton on CUDA, ...) from the incoming state, as
        # at CP=1 (a slice of at most core.recurrent_max_tokens tokens takes the recurrent form: same maths)
        doc_kwargs = {} if layout is None else {"document_starts": layout}
        out, _ = self.core(q, k, v, state=incoming, **doc_kwargs)
        return out, None


class _SequenceSum(torch.autograd.Function):
    """Forward: sum over the CP group. Backward: identity (each rank differentiates its own part)."""

    @staticmethod
    def forward(ctx, x, state):  # type: ignore[override]
        _check_cp_groups(state)
        total = x.detach().clone()
        dist.all_reduce(total, group=state.cp_group)
        return total

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return grad, None


def sequence_sum(x: torch.Tensor, state: ParallelState) -> torch.Tensor:
    """Sum of ``x`` over the CP ranks of this sequence (e.g. the loss of all its tokens).

    The gradient reaching this rank is that of its own term only: the gradients of replicated
    parameters are then this rank's share, summed over CP by the DP x CP reduction (the trainer
    scales the loss by CP because that reduction averages)."""
    if state.cp_size == 1:
        return x
    return _SequenceSum.apply(x, state)


def sequence_slice(x: torch.Tensor, cp_rank: int, cp_size: int, dim: int = 1) -> torch.Tensor:
    """CP rank ``cp_rank``'s contiguous slice (of ``cp_size`` equal ones) of ``x`` along ``dim`` (the sequence)."""
    n = x.shape[dim]
    if n % cp_size != 0:
        raise ValueError(f"sequence length: expected a multiple of context_parallel_size {cp_size}, got {n} (shape {tuple(x.shape)})")
    return x.narrow(dim, cp_rank * (n // cp_size), n // cp_size)
