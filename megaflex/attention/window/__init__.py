"""The one-normaliser hybrid: exact softmax over the last W keys, the learned kernel for older ones.

Per query t (LoLCATs / Based form), with window(t) = {s : t - W < s <= t} and far(t) = {s <= t - W}:

    w_ts = exp(q_t . k_s / sqrt d - m_t)                                   s in window(t)
    w_ts = (qf_t . kf_s) exp(qls_t + kls_s - m_t)  = phi~(q_t).phi~(k_s) e^-m_t    s in far(t)
    n_t  = sum_s w_ts v_s,   d_t = sum_s w_ts,   o_t = normalize(n_t, d_t)        (normalize.py)

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

Decay (``log_decay``, ``model.kernel_decay``; ``decay.py``): far weights times gamma^(t - s - W), folded into
qls, kls and the far state (``common.fold_decay``), so every form below takes it unchanged.

State after T keys (decoding, segments): a ``LinearAttentionState`` of every key that left the
window (s <= T - W) and a ``WindowCache`` of the last W - 1 keys (raw k for the window logits,
kf / kls for when they leave it, v).

Three forms that agree to rounding (``_numerators`` picks one in plain code: the rows ``WINDOW_ROWS``):

* ``quadratic`` (``naive.py``): materialised [N, P + N] weights (P cached keys); the reference.
* ``recurrent`` (``recurrent.py``): token by token: the key leaving the window enters the linear state, the window is
  the cached keys; O(W + F Dv) per token, the decoding path.
* ``chunked`` (``chunk.py``): chunks of C queries; with L = ceil(W / C), chunk c attends to the keys of chunks
  c - L .. c as one [C, (L + 1) C] block (window and near far-field keys, by two complementary
  masks on t - s) and to the linear state of the chunks before c - L (a scan over chunk states,
  as in ``linear/chunk.py``). No N x N or N x (W + N) mask or weight exists: memory is O(N (L + 1) C).
  One autograd Function that recomputes each group's blocks in the backward
  (``chunk.py``); ``chunk_blocks.py``, the same in torch ops under autograd,
  is its reference and serves padded keys (``key_valid``). On the "triton" backend (``auto`` on
  CUDA tensors) the same contract runs in Triton kernels (``triton/window.py``, ``TritonWindowNumerator``:
  C x C sub-blocks of the window and far-in-block keys, the linear state by the plain kernels' scans).

Bidirectional (``bidirectional_windowed_attention``): the window |t - s| < W around each query, the
kernel for every other key, the same one normaliser (``bidirectional.py``: maths and the blocked form;
``naive.quadratic_bidirectional_numerators``: its reference). Rows ``window.bidirectional.*``.

Files: ``common.py`` (inputs, cache, state updates), ``naive.py``, ``recurrent.py``, ``chunk.py``,
``chunk_blocks.py``, ``segments.py`` (long sequences in recomputed segments; ``hybrid.py`` uses it).
"""

from __future__ import annotations

import torch

from ..base import LinearAttentionState
from ..decay import fold_origin, leave
from ..forms import BIDIRECTIONAL, RefusedAttention, Row, check_backend, chunked_backend, refused_build, row
from ..normalize import normalize_numerators, normalize_output, reads_denominator
from ..triton.window import TritonWindowNumerator, window_chunk
from .bidirectional import banded_numerators
from .chunk import ChunkedWindowNumerator
from .chunk_blocks import blocks_numerators
from .common import WINDOW_FORMS, WindowCache, WindowInputs, absorb, aligned_queries, fold_decay, pad_keys, prepare_inputs
from .naive import quadratic_bidirectional_numerators, quadratic_numerators, quadratic_weights
from .recurrent import recurrent_numerators

__all__ = [
    "WINDOW_FORMS", "WindowCache", "absorb", "bidirectional_windowed_attention", "quadratic_weights",
    "windowed_linear_attention",
]


def _function_numerators(
    numerator: type, x: WindowInputs, window: int, c: int, columns: int, operand_dtype: torch.dtype | None
) -> torch.Tensor:
    """The chunked form by one autograd Function ``numerator`` (the contract of ``ChunkedWindowNumerator``)
    over chunks of ``c`` on the first ``columns`` value columns (Dv + 1, or Dv without denominators),
    dot operands in ``operand_dtype`` when given."""
    b, h, n, d = x.q.shape
    p, total = x.prefix, x.k.shape[2]
    t_pad = -(-total // c) * c

    def flat(y: torch.Tensor) -> torch.Tensor:
        return y.reshape(b * h, t_pad, *y.shape[3:]).contiguous()

    q, qf, qls = (flat(aligned_queries(y, p, t_pad)) for y in (x.q, x.qf, x.qls))
    k, kf, v_aug = (flat(pad_keys(y, t_pad)) for y in (x.k, x.kf, x.v_aug[..., :columns]))
    if operand_dtype is not None:
        q, qf, k, kf, v_aug = (y.to(operand_dtype) for y in (q, qf, k, kf, v_aug))
    kls = flat(pad_keys(x.kls, t_pad, float("-inf")))
    s0 = x.far.augmented()[..., :columns].flatten(0, 1)
    numer = numerator.apply(q, qf, qls, k, kf, kls, v_aug, s0, x.far.log_max.reshape(b * h), window, c)
    numer = numer.view(b, h, t_pad, -1)
    return numer if (p, n) == (0, t_pad) else numer[:, :, p : p + n]


def _torch_function(numerator: type, x: WindowInputs, window: int, chunk_size: int, denominators: bool) -> tuple[torch.Tensor, None]:
    """``ChunkedWindowNumerator``; without ``denominators`` ("rms" reads none) v and the state lose their
    ones / k_sum column, so every value-side matmul is Dv wide, not Dv + 1 (a third slower in MKL at Dv = 32)."""
    columns = x.v_aug.shape[-1] - (not denominators)
    return _function_numerators(numerator, x, window, min(chunk_size, x.k.shape[2]), columns, None), None


def _triton_function(numerator: type, x: WindowInputs, window: int, chunk_size: int, denominators: bool) -> tuple[torch.Tensor, None]:
    """``TritonWindowNumerator``: chunks of ``window_chunk`` (a power of two in [16, 32]); half inputs give the
    kernels' dot operands in that dtype (fp32 accumulation), as the linear kernels': full-rate tensor cores
    and half the saved bytes; log-scales and the state stay fp32."""
    half = x.input_dtype if x.input_dtype in (torch.float16, torch.bfloat16) else None
    c = window_chunk(min(chunk_size, x.k.shape[2]))
    return _function_numerators(numerator, x, window, c, x.v_aug.shape[-1], half), None


# the one-normaliser window's numerator forms; padded keys: the torch-ops blocks; "fla" has no window kernel
QUADRATIC = row("window.quadratic", quadratic_numerators, "numerators", runs="quadratic")
RECURRENT = row("window.recurrent", recurrent_numerators, "numerators", runs="recurrent")
BLOCKS = row("window.chunk.padded", blocks_numerators, "numerators", runs="chunked", padded=True)
TRITON = row("window.chunk.triton", TritonWindowNumerator, "triton_function", runs="chunked", backend="triton",
             has_window=True)
# "auto" on CUDA keeps fp64 on the torch Function (the kernels' dots are at most fp32)
TRITON_AUTO = row("window.chunk.triton_auto", TritonWindowNumerator, "triton_function", runs="chunked", backend="auto",
                  chunk_backend="triton", has_window=True, fp64=False)
TORCH = row("window.chunk.torch", ChunkedWindowNumerator, "torch_function", runs="chunked")
QUADRATIC_BIDIRECTIONAL = row("window.bidirectional.quadratic", quadratic_bidirectional_numerators, "bidirectional",
                              runs="quadratic", **BIDIRECTIONAL)
BANDED = row("window.bidirectional.blocks", banded_numerators, "bidirectional", runs="chunked", **BIDIRECTIONAL)
WINDOW_ROWS: tuple[Row, ...] = (QUADRATIC, RECURRENT, BLOCKS, TRITON, TRITON_AUTO, TORCH, QUADRATIC_BIDIRECTIONAL, BANDED)


def _numerators(
    x: WindowInputs, form: str, window: int, chunk_size: int, backend: str, padded: bool, denominators: bool
) -> tuple[torch.Tensor, LinearAttentionState | None]:
    """(numerators [B, H, N, Dv(+1)], the linear state the recurrent loop absorbed, or None) by ``form``;
    the chunked one on ``backend``: Triton kernels when asked ("auto": on CUDA, fp64 excepted), else the
    torch Function, or its torch-ops reference for padded keys."""
    if form == "quadratic":
        return QUADRATIC(x, window, chunk_size)
    if form == "recurrent":
        return RECURRENT(x, window, chunk_size)
    if padded:
        return BLOCKS(x, window, chunk_size)
    if window >= 1 and backend == "triton":
        return _triton_function(TRITON.chosen(), x, window, chunk_size, denominators)
    on_cuda = x.q.device.type == "cuda"
    if window >= 1 and backend == "auto" and chunked_backend(backend, on_cuda) == "triton" and x.q.dtype != torch.float64:
        return _triton_function(TRITON_AUTO.chosen(), x, window, chunk_size, denominators)
    return _torch_function(TORCH.chosen(), x, window, chunk_size, denominators)


def windowed_linear_attention(
    q: torch.Tensor, qf: torch.Tensor, qls: torch.Tensor | None,
    k: torch.Tensor, kf: torch.Tensor, kls: torch.Tensor | None, v: torch.Tensor,
    *, window: int, form: str = "chunked", normalization: str = "rms", chunk_size: int = 64,
    far_state: LinearAttentionState | None = None, cache: WindowCache | None = None, eps: float = 1e-6,
    key_valid: torch.Tensor | None = None, return_state: bool = True, backend: str = "auto",
    log_decay: torch.Tensor | None = None,
) -> tuple[torch.Tensor, LinearAttentionState | None, WindowCache | None]:
    """The one-normaliser hybrid (module doc) of N new tokens after ``cache`` (P <= W - 1 keys) and
    ``far_state`` (the keys before them).

    q, k [B, H, N, d] (raw, for the window's q.k / sqrt d), qf, kf [B, H, N, F] and qls, kls
    [B, H, N] | None (= 0) their features and log-scales, v [B, H, N, Dv]; ``key_valid`` [B, P + N]
    bool (False: a padded key, kept out of the window; its far-field features must already be 0).
    ``backend`` (auto | torch | triton | fla, ``dispatch.chunked_backend``): the chunked form's
    implementation ("triton": the Triton kernels; "fla", which has no window kernel, and "torch":
    the torch Function).
    Returns (out [B, H, N, Dv] in v.dtype, the linear state of every key that left the window,
    the new cache) or (out, None, None) without ``return_state``. ``log_decay`` [H] | None: the far field's
    per-head decay, gamma^(t - s - W) on each far key (``decay.py``; folded into qls, kls and the far state,
    the cache keeps the raw kls, the state returned is decayed to the last token).
    """
    if isinstance(window, bool) or not isinstance(window, int) or window < 0:
        raise ValueError(f"window: expected an int >= 0, got {window!r}")
    if form not in WINDOW_FORMS:
        raise ValueError(f"form: expected one of {WINDOW_FORMS}, got {form!r}")
    if cache is not None and cache.length > max(window - 1, 0):
        raise ValueError(f"cache: expected at most W - 1 = {max(window - 1, 0)} keys, got {cache.length}")
    check_backend(backend)
    x = prepare_inputs(q, qf, qls, k, kf, kls, v, far_state, cache, key_valid)
    raw_kls = x.kls  # the cache keeps them: the next call folds them at its own positions
    origin = fold_origin(q.shape[2])  # the middle of the call: |t - c| <= N / 2 bounds the fold's rounding
    if log_decay is not None:
        x = fold_decay(x, log_decay, window, origin)
    dv = v.shape[-1]
    with torch.autocast(device_type=q.device.type, enabled=False):
        numer, absorbed = _numerators(x, form, window, chunk_size, backend, key_valid is not None,
                                      reads_denominator(normalization))  # fmt: skip
        if form == "chunked" and numer.shape[-1] == dv + reads_denominator(normalization):
            out = normalize_numerators(numer, normalization, eps).to(v.dtype)  # the training path: fused
        else:
            out = normalize_output(numer[..., :dv], numer[..., dv], normalization, eps).to(v.dtype)
        if not return_state:
            return out, None, None
        total = x.k.shape[2]
        first_kept = max(total - max(window - 1, 0), 0)  # keys from here on stay in the window cache
        if absorbed is not None:  # the recurrent loop absorbed the keys up to the last query's t - W
            start, state = max(total - window, 0), absorbed
        else:
            start, state = 0, x.far
        state = absorb(state, x.kf[:, :, start:first_kept], x.kls[:, :, start:first_kept], x.v_aug[:, :, start:first_kept])
        state = LinearAttentionState(state.kv, state.k_sum, state.log_max, x.far.offset + q.shape[2])
        if log_decay is not None:
            state = leave(state, log_decay, q.shape[2], origin)
        # copies: a view would keep the whole sequence's keys and features alive with the cache
        kept = WindowCache(*(t[:, :, first_kept:].clone() for t in (x.k, x.kf, raw_kls, x.v_aug[..., :dv])))
    return out, state, kept


def bidirectional_windowed_attention(
    q: torch.Tensor, qf: torch.Tensor, qls: torch.Tensor | None,
    k: torch.Tensor, kf: torch.Tensor, kls: torch.Tensor | None, v: torch.Tensor,
    *, window: int, form: str = "chunked", normalization: str = "rms", chunk_size: int = 64, eps: float = 1e-6,
    key_valid: torch.Tensor | None = None, backend: str = "auto",
) -> torch.Tensor:
    """The bidirectional one-normaliser hybrid (``bidirectional.py``): exact softmax over the keys with
    |t - s| < ``window``, the kernel for the others. Inputs as ``windowed_linear_attention``'s without a
    cache or far state; ``key_valid`` [B, N] bool (False: padding, kept out of both parts). ``form``:
    "chunked" (the blocked form) or "quadratic" (the reference). Returns out [B, H, N, Dv] in v.dtype."""
    if isinstance(window, bool) or not isinstance(window, int) or window < 0:
        raise ValueError(f"window: expected an int >= 0, got {window!r}")
    if form not in WINDOW_FORMS:
        raise ValueError(f"form: expected one of {WINDOW_FORMS}, got {form!r}")
    check_backend(backend)
    refusal = refused_build("window", form="bidirectional", algorithm=form)  # the recurrent scan is causal
    if refusal is not None:
        raise RefusedAttention(refusal.message)
    x = prepare_inputs(q, qf, qls, k, kf, kls, v, None, None, key_valid)
    dv = v.shape[-1]
    with torch.autocast(device_type=q.device.type, enabled=False):
        numerators = QUADRATIC_BIDIRECTIONAL if form == "quadratic" else BANDED
        numer = numerators(x, window, chunk_size)
        return normalize_output(numer[..., :dv], numer[..., dv], normalization, eps).to(v.dtype)
