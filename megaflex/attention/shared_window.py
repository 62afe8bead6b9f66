"""The one-normaliser hybrid: exact softmax over the last W keys, the learned kernel for older ones.

Per query t (LoLCATs / Based form), with window(t) = {s : t - W < s <= t} and far(t) = {s <= t - W}:

    w_ts = exp(q_t . k_s / sqrt d - m_t)                                   s in window(t)
    w_ts = (qf_t . kf_s) exp(qls_t + kls_s - m_t)  = phi~(q_t).phi~(k_s) e^-m_t    s in far(t)
    n_t  = sum_s w_ts v_s,   d_t = sum_s w_ts,   o_t = normalize(n_t, d_t)        (base.py)

One stabiliser per query, shared by both parts (detached, like every stabiliser here):

    m_t = max( max_{s in window(t)} q_t . k_s / sqrt d ,  qls_t + M_t ),   M_t = max_{s in far(t)} kls_s

so every exp argument is <= 0 (the far part's features are bounded; their magnitude lives in the
log-scales). Zero-width features (F = 0) with key log-scales -inf leave no far field: a pure
sliding-window softmax (``LocalMixingCore`` around a softmax core). Unlike plain linear attention the query log-scale qls_t does not cancel: it sets the
far part's scale against the exact window's. W = 0 is plain linear attention (qls_t + M_t = m_t:
the weights are the plain form's); with W >= t + 1 every key is in the window: exact softmax.

Guards (denominator normalisation): d_t is the window's softmax mass (> 0, at least e^0 = 1 for
the largest window logit when that sets m_t) plus the far part's kernel estimate, which can be
negative for signed (trig) features; the shared ``guard_denominator`` (|d_t| >= eps, sign kept)
is the only guard left, as for the plain kernel. A query with nothing to attend to (padding)
gets m_t := 0 and an all-zero numerator.

State after T keys (decoding, segments): a ``LinearAttentionState`` of every key that left the
window (s <= T - W) and a ``WindowCache`` of the last W - 1 keys (raw k for the window logits,
kf / kls for when they leave it, v).

Three forms that agree to rounding:

* ``quadratic``: materialised [N, P + N] weights (P cached keys); the reference.
* ``recurrent``: token by token: the key leaving the window enters the linear state, the window is
  the cached keys; O(W + F Dv) per token, the decoding path.
* ``chunked``: chunks of C queries; with L = ceil(W / C), chunk c attends to the keys of chunks
  c - L .. c as one [C, (L + 1) C] block (window and near far-field keys, by two complementary
  masks on t - s) and to the linear state of the chunks before c - L (a scan over chunk states,
  as in ``chunked.py``). No N x N or N x (W + N) mask or weight exists: memory is O(N (L + 1) C).
  One autograd Function that recomputes each group's blocks in the backward
  (``shared_window_chunked.py``); ``_chunked_blocks`` below, the same in torch ops under autograd,
  is its reference and serves padded keys (``key_valid``). On the "triton" backend (``auto`` on
  CUDA tensors) the same contract runs in Triton kernels (``triton/window.py``, ``TritonWindowNumerator``:
  C x C sub-blocks of the window and far-in-block keys, the linear state by the plain kernels' scans).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .base import LinearAttentionState, accumulation_dtype, normalize_output, reads_denominator
from .core import chunked_backend
from .shared_window_chunked import ChunkedWindowNumerator, block_masks, normalize_numerators

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
class _Inputs:
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


def _prepare(
    q, qf, qls, k, kf, kls, v, far_state, cache, key_valid,
) -> _Inputs:  # fmt: skip
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
    return _Inputs(q.to(acc), qf.to(acc), qls, k_all, kf_all, kls_all, v_aug, key_valid, far, v.dtype)


def _state_aug(state: LinearAttentionState) -> torch.Tensor:
    return torch.cat([state.kv, state.k_sum.unsqueeze(-1)], dim=-1)  # [B, H, F, Dv + 1]


def absorb(state: LinearAttentionState, kf: torch.Tensor, kls: torch.Tensor, v_aug: torch.Tensor) -> LinearAttentionState:
    """``state`` plus keys kf [B, H, r, F], kls [B, H, r], v_aug [B, H, r, Dv + 1] (r may be 0);
    the offset is left to the caller."""
    if kf.shape[2] == 0:
        return state
    log_max = torch.maximum(state.log_max, kls.detach().amax(-1))
    decay = torch.exp(state.log_max - log_max)  # 0 for the empty state
    scaled = kf * torch.exp(kls - log_max.unsqueeze(-1)).unsqueeze(-1)
    s = _state_aug(state) * decay[..., None, None] + scaled.transpose(-1, -2) @ v_aug
    return LinearAttentionState(s[..., :-1], s[..., -1], log_max, state.offset)


def _finite(m: torch.Tensor) -> torch.Tensor:
    """The stabiliser with rows that see nothing (-inf) set to 0 (their weights are all 0 anyway)."""
    return torch.where(torch.isfinite(m), m, torch.zeros_like(m))


def quadratic_weights(
    q: torch.Tensor, qf: torch.Tensor, qls: torch.Tensor, k: torch.Tensor, kf: torch.Tensor, kls: torch.Tensor,
    window: int, far_log_max: torch.Tensor | None = None, key_valid: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The materialised weights w_ts [B, H, N, P + N] (zero outside s <= t) of N queries over P + N keys
    (the queries are the last N), and the stabiliser m_t [B, H, N]; ``far_log_max`` [B, H]: the
    log_max of a carried linear state (the far field before the keys)."""
    n, p = q.shape[2], k.shape[2] - q.shape[2]
    t = torch.arange(p, p + n, device=q.device).unsqueeze(1)  # query positions among the keys
    s = torch.arange(p + n, device=q.device).unsqueeze(0)
    near = (s <= t) & (s > t - window)  # [N, P + N]
    far = s <= t - window
    if key_valid is not None:
        near = near & key_valid[:, None, None, :]  # [B, 1, N, P + N]
    logits = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    logits = logits.masked_fill(~near, float("-inf"))
    far_log = (qls.unsqueeze(-1) + kls.unsqueeze(-2)).masked_fill(~far, float("-inf"))
    far_max = kls.detach().unsqueeze(-2).masked_fill(~far, float("-inf")).amax(-1)
    if far_log_max is not None:
        far_max = torch.maximum(far_max, far_log_max.unsqueeze(-1))
    m = _finite(torch.maximum(logits.detach().amax(-1), qls.detach() + far_max))  # [B, H, N]
    weights = torch.exp(logits - m.unsqueeze(-1)) + (qf @ kf.transpose(-1, -2)) * torch.exp(far_log - m.unsqueeze(-1))
    return weights, m


def _quadratic(x: _Inputs, window: int) -> torch.Tensor:
    weights, m = quadratic_weights(x.q, x.qf, x.qls, x.k, x.kf, x.kls, window, x.far.log_max, x.key_valid)
    carried = torch.exp(x.qls + x.far.log_max.unsqueeze(-1) - m).unsqueeze(-1) * (x.qf @ _state_aug(x.far))
    return weights @ x.v_aug + carried


def _recurrent(x: _Inputs, window: int) -> tuple[torch.Tensor, LinearAttentionState]:
    """Token by token; returns the numerators and the linear state after the queries' last absorbed key."""
    n, p, scale = x.q.shape[2], x.prefix, 1.0 / math.sqrt(x.q.shape[-1])
    state, outs = x.far, []
    for i in range(n):
        t = p + i
        leaving = t - window  # the key that just left the window (W = 0: the query's own key)
        if leaving >= 0:
            state = absorb(state, x.kf[:, :, leaving : leaving + 1], x.kls[:, :, leaving : leaving + 1],
                           x.v_aug[:, :, leaving : leaving + 1])  # fmt: skip
        lo = max(0, t - window + 1)
        qt = x.q[:, :, t - p : t - p + 1]  # [B, H, 1, d]
        logits = (qt @ x.k[:, :, lo : t + 1].transpose(-1, -2)).squeeze(2) * scale  # [B, H, <= W]
        if x.key_valid is not None:
            logits = logits.masked_fill(~x.key_valid[:, None, lo : t + 1], float("-inf"))
        qls = x.qls[:, :, i]
        near_max = logits.detach().amax(-1) if logits.shape[-1] else torch.full_like(qls, float("-inf"))
        m = _finite(torch.maximum(near_max, qls.detach() + state.log_max))  # [B, H]
        near = (torch.exp(logits - m.unsqueeze(-1)).unsqueeze(2) @ x.v_aug[:, :, lo : t + 1]).squeeze(2)
        far = torch.exp(qls + state.log_max - m).unsqueeze(-1) * (x.qf[:, :, i : i + 1] @ _state_aug(state)).squeeze(2)
        outs.append(near + far)
    return torch.stack(outs, dim=2), state


def _blocks(x: torch.Tensor, c: int, lookback: int, fill: float) -> torch.Tensor:
    """Keys [B, H, T_pad, *] (T_pad = nC C) -> [B, H, nC, (L + 1) C, *]: chunk c's keys from chunks c - L .. c
    (``fill`` before the first key)."""
    front = x.new_full((*x.shape[:2], lookback * c, *x.shape[3:]), fill)
    padded = torch.cat([front, x], dim=2)
    blocks = padded.unfold(2, (lookback + 1) * c, c)  # [B, H, nC, *, (L + 1) C]
    return blocks.movedim(-1, 3) if x.dim() == 4 else blocks


def _pad(x: torch.Tensor, n_pad: int, fill: float = 0.0) -> torch.Tensor:
    n = x.shape[2]
    if n == n_pad:
        return x
    return torch.cat([x, x.new_full((*x.shape[:2], n_pad - n, *x.shape[3:]), fill)], dim=2)


def _aligned_queries(y: torch.Tensor, prefix: int, t_pad: int) -> torch.Tensor:
    """Queries [B, H, N, *] -> [B, H, T_pad, *] aligned with the keys: the P cached keys get
    placeholder queries (zeros: finite, their rows are dropped), the end is zero-padded."""
    aligned = torch.cat([y.new_zeros(*y.shape[:2], prefix, *y.shape[3:]), y], dim=2) if prefix else y
    return _pad(aligned, t_pad)


def _uses_triton(x: _Inputs, window: int, backend: str) -> bool:
    """``chunked_backend``'s choice for the chunked form: "triton" runs ``TritonWindowNumerator``
    (W >= 1; "auto" on CUDA keeps fp64 on the torch Function), anything else the torch Function."""
    if chunked_backend(backend, x.q.is_cuda) != "triton" or window < 1:
        return False
    return backend == "triton" or x.q.dtype != torch.float64


def _chunked(x: _Inputs, window: int, chunk_size: int, backend: str = "auto", denominators: bool = True) -> torch.Tensor:
    """The chunked form: ``ChunkedWindowNumerator`` (one autograd Function, ``shared_window_chunked.py``)
    or its Triton twin (``triton/window.py``; chunks of ``window_chunk``: a power of two in [16, 32]);
    with padded keys (``key_valid``) the torch-ops blocks below (the reference it is tested against).
    ``denominators`` False ("rms" reads none): the torch Function gets v and the state without their
    ones / k_sum column, so every value-side matmul is Dv wide, not Dv + 1 (a third slower in MKL at Dv = 32)."""
    if x.key_valid is not None:
        return _chunked_blocks(x, window, chunk_size)
    b, h, n, d = x.q.shape
    p, total = x.prefix, x.k.shape[2]
    triton = _uses_triton(x, window, backend)
    if triton:
        from .triton.window import TritonWindowNumerator as numerator
        from .triton.window import window_chunk

        c = window_chunk(min(chunk_size, total))
    else:
        numerator, c = ChunkedWindowNumerator, min(chunk_size, total)
    t_pad = -(-total // c) * c

    def flat(y: torch.Tensor) -> torch.Tensor:
        return y.reshape(b * h, t_pad, *y.shape[3:]).contiguous()

    q, qf, qls = (flat(_aligned_queries(y, p, t_pad)) for y in (x.q, x.qf, x.qls))
    columns = x.v_aug.shape[-1] - (not denominators and not triton)
    k, kf, v_aug = (flat(_pad(y, t_pad)) for y in (x.k, x.kf, x.v_aug[..., :columns]))
    if triton and x.input_dtype in (torch.float16, torch.bfloat16):
        # the kernels' dot operands in the inputs' half dtype (fp32 accumulation), as the linear kernels':
        # full-rate tensor cores and half the saved bytes; log-scales and the state stay fp32
        q, qf, k, kf, v_aug = (y.to(x.input_dtype) for y in (q, qf, k, kf, v_aug))
    kls = flat(_pad(x.kls, t_pad, float("-inf")))
    s0 = _state_aug(x.far)[..., :columns].flatten(0, 1)
    numer = numerator.apply(q, qf, qls, k, kf, kls, v_aug, s0, x.far.log_max.reshape(b * h), window, c)
    numer = numer.view(b, h, t_pad, -1)
    return numer if (p, n) == (0, t_pad) else numer[:, :, p : p + n]


def _chunked_blocks(x: _Inputs, window: int, chunk_size: int) -> torch.Tensor:
    """The chunked form in torch ops on the key-aligned sequence (autograd keeps every block)."""
    b, h, n, d = x.q.shape
    p, total = x.prefix, x.k.shape[2]
    c = min(chunk_size, total)
    chunks = -(-total // c)
    lookback = min(-(-window // c), chunks - 1)  # a window beyond the sequence needs no more than every chunk
    t_pad = chunks * c

    def queries(y: torch.Tensor) -> torch.Tensor:  # [B, H, N, *] -> [B, H, nC, C, *]
        return _aligned_queries(y, p, t_pad).view(b, h, chunks, c, *y.shape[3:])

    q, qf, qls = queries(x.q), queries(x.qf), queries(x.qls)
    k, kf, v_aug = (_pad(y, t_pad) for y in (x.k, x.kf, x.v_aug))
    kls = _pad(x.kls, t_pad, float("-inf"))  # padded keys: no weight, and no effect on any max
    valid = torch.arange(t_pad, device=q.device) < total  # [T_pad]
    valid = valid.expand(b, t_pad) if x.key_valid is None else _pad(x.key_valid.unsqueeze(1), t_pad, False).squeeze(1)
    near_mask, far_mask = block_masks(c, lookback, window, q.device)
    valid_blocks = _blocks(valid.unsqueeze(1), c, lookback, False)  # [B, 1, nC, (L + 1) C]
    near_mask = near_mask & valid_blocks.unsqueeze(-2)  # [B, 1, nC, C, (L + 1) C]

    # the shared stabiliser: window logits, and the running max of the far keys' log-scales
    logits = (q @ _blocks(k, c, lookback, 0.0).transpose(-1, -2)) / math.sqrt(d)
    logits = logits.masked_fill(~near_mask, float("-inf"))
    kls_blocks = _blocks(kls, c, lookback, float("-inf"))  # [B, H, nC, (L + 1) C]
    running = kls.detach().cummax(dim=-1).values
    far_max = torch.cat([running.new_full((b, h, min(window, t_pad)), float("-inf")), running], dim=-1)[..., :t_pad]
    far_max = torch.maximum(far_max, x.far.log_max.unsqueeze(-1)).view(b, h, chunks, c)
    m = _finite(torch.maximum(logits.detach().amax(-1), qls.detach() + far_max)).unsqueeze(-1)  # [B, H, nC, C, 1]
    far_log = (qls.unsqueeze(-1) + kls_blocks.unsqueeze(-2)).masked_fill(~far_mask, float("-inf"))
    weights = torch.exp(logits - m) + (qf @ _blocks(kf, c, lookback, 0.0).transpose(-1, -2)) * torch.exp(far_log - m)
    numer = weights @ _blocks(v_aug, c, lookback, 0.0)  # [B, H, nC, C, Dv + 1]

    # the linear state of the chunks before c - L: S_{j+1} = exp(B_j - B_{j+1}) S_j + exp(E_j - B_{j+1}) U_j
    used = chunks - lookback  # states S_0 .. S_{used - 1} are read
    if used > 1:
        kls_c, kf_c = kls.reshape(b, h, chunks, c), kf.reshape(b, h, chunks, c, kf.shape[-1])
        ends = kls_c.detach().amax(-1)  # [B, H, nC], finite: every chunk holds a real key
        increments = (kf_c * torch.exp(kls_c - ends.unsqueeze(-1)).unsqueeze(-1)).transpose(-1, -2) @ v_aug.reshape(b, h, chunks, c, -1)
        states, bounds = [_state_aug(x.far)], [x.far.log_max]
        for j in range(used - 1):
            bound = torch.maximum(bounds[-1], ends[..., j])
            prev = torch.exp(bounds[-1] - bound).nan_to_num(0.0)[..., None, None]
            states.append(states[-1] * prev + increments[:, :, j] * torch.exp(ends[..., j] - bound)[..., None, None])
            bounds.append(bound)
        first = [0] * min(lookback, chunks)  # chunks before L read the carried state only
        index = torch.tensor(first + list(range(used)), device=q.device)
        s_read = torch.stack(states, dim=2).index_select(2, index)  # [B, H, nC, F, Dv + 1]
        b_read = torch.stack(bounds, dim=2).index_select(2, index)  # [B, H, nC]
    else:
        s_read = _state_aug(x.far).unsqueeze(2).expand(-1, -1, chunks, -1, -1)
        b_read = x.far.log_max.unsqueeze(-1).expand(-1, -1, chunks)
    carried = torch.exp(qls + b_read.unsqueeze(-1) - m.squeeze(-1)).unsqueeze(-1) * (qf @ s_read)
    numer = (numer + carried).view(b, h, t_pad, -1)
    return numer[:, :, p : p + n]


def windowed_linear_attention(
    q: torch.Tensor, qf: torch.Tensor, qls: torch.Tensor | None,
    k: torch.Tensor, kf: torch.Tensor, kls: torch.Tensor | None, v: torch.Tensor,
    *, window: int, form: str = "chunked", normalization: str = "rms", chunk_size: int = 64,
    far_state: LinearAttentionState | None = None, cache: WindowCache | None = None, eps: float = 1e-6,
    key_valid: torch.Tensor | None = None, return_state: bool = True, backend: str = "auto",
) -> tuple[torch.Tensor, LinearAttentionState | None, WindowCache | None]:
    """The one-normaliser hybrid (module doc) of N new tokens after ``cache`` (P <= W - 1 keys) and
    ``far_state`` (the keys before them).

    q, k [B, H, N, d] (raw, for the window's q.k / sqrt d), qf, kf [B, H, N, F] and qls, kls
    [B, H, N] | None (= 0) their features and log-scales, v [B, H, N, Dv]; ``key_valid`` [B, P + N]
    bool (False: a padded key, kept out of the window; its far-field features must already be 0).
    ``backend`` (auto | torch | triton | fla, ``core.chunked_backend``): the chunked form's
    implementation ("triton": the Triton kernels; "fla", which has no window kernel, and "torch":
    the torch Function).
    Returns (out [B, H, N, Dv] in v.dtype, the linear state of every key that left the window,
    the new cache) or (out, None, None) without ``return_state``.
    """
    if isinstance(window, bool) or not isinstance(window, int) or window < 0:
        raise ValueError(f"window: expected an int >= 0, got {window!r}")
    if form not in WINDOW_FORMS:
        raise ValueError(f"form: expected one of {WINDOW_FORMS}, got {form!r}")
    if cache is not None and cache.length > max(window - 1, 0):
        raise ValueError(f"cache: expected at most W - 1 = {max(window - 1, 0)} keys, got {cache.length}")
    x = _prepare(q, qf, qls, k, kf, kls, v, far_state, cache, key_valid)
    dv = v.shape[-1]
    with torch.autocast(device_type=q.device.type, enabled=False):
        if form == "recurrent":
            numer, absorbed = _recurrent(x, window)
        else:
            numer = _quadratic(x, window) if form == "quadratic" else _chunked(x, window, chunk_size, backend, reads_denominator(normalization))
        if form == "chunked" and numer.shape[-1] == dv + reads_denominator(normalization):
            out = normalize_numerators(numer, normalization, eps).to(v.dtype)  # the training path: fused
        else:
            out = normalize_output(numer[..., :dv], numer[..., dv], normalization, eps).to(v.dtype)
        if not return_state:
            return out, None, None
        total = x.k.shape[2]
        first_kept = max(total - max(window - 1, 0), 0)  # keys from here on stay in the window cache
        if form == "recurrent":  # the loop absorbed the keys up to the last query's t - W
            start, state = max(total - window, 0), absorbed
        else:
            start, state = 0, x.far
        state = absorb(state, x.kf[:, :, start:first_kept], x.kls[:, :, start:first_kept], x.v_aug[:, :, start:first_kept])
        state = LinearAttentionState(state.kv, state.k_sum, state.log_max, x.far.offset + q.shape[2])
        # copies: a view would keep the whole sequence's keys and features alive with the cache
        kept = WindowCache(*(t[:, :, first_kept:].clone() for t in (x.k, x.kf, x.kls, x.v_aug[..., :dv])))
    return out, state, kept
