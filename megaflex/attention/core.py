"""Dispatcher over the causal linear-attention forms, input validation, and ``AttentionCore``.

``causal_linear_attention`` computes (see ``base.py`` for the normalisations)

    w_ts = (qf_t . kf_s) exp(kls_s - m_t),  s <= t (carried state included),
    m_t  = max(state.log_max, max_{s<=t} kls_s)   (detached),
    n_t  = sum_s w_ts v_s,  d_t = sum_s w_ts,  o_t = normalize(n_t, d_t)

with one of three forms that agree to fp rounding:

* ``quadratic``: materialised N x N weights; ground truth for tests.
* ``recurrent``: token-by-token scan; O(1) per token, the decoding path.
* ``chunked``:   parallel chunk form with a hand-written backward; training path. Three
  implementations, picked by ``backend`` (auto | torch | triton | fla, ``chunked_backend``):
  ``chunked.py`` (torch, CPU-tuned), ``triton/`` (Triton kernels; auto on CUDA tensors, or on
  CPU under TRITON_INTERPRET=1 when forced) and flash-linear-attention's ``chunk_simple_gla``
  (``chunked_cuda.py``; CUDA only, extra "gpu").

Stabiliser: the key log-scale (e.g. ||k||^2 / e^tau, unbounded) only ever enters as
exp(kls_s - m_t) <= 1 with m_t the running max, so nothing overflows for any key norm; the
carried state stores its sums relative to its own ``log_max`` and is rescaled on arrival of a
larger one. m_t is a constant for autograd: the output is invariant to it up to ``eps``.
The query log-scale is never used: it multiplies n_t and d_t by the same per-query scalar,
which both normalisations cancel.

Mixed precision: every form accumulates in fp32 and returns ``v.dtype``.

``AttentionCore`` is what the model instantiates: feature map + form selection for linear kinds
(recurrent when continuing from a state with few new tokens, chunked otherwise) or exact
softmax attention with a ``KVCache``.

Padding (``key_mask``, False at padded tokens): a padded key's features are zeroed (nothing
added to kv or k_sum) and its log-scale is lowered to the smallest real one of its row, so the
running max m_t is the max over real keys only, as without the pads; softmax masks the keys.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from .base import NORMALIZATIONS, LinearAttentionState
from .documents import DocumentLayout, block_causal_mask, document_layout, run_by_document, run_documents_batched
from .feature_maps import FEATURE_MAP_KINDS, build_feature_map
from .linear.naive import quadratic_linear_attention
from .linear.recurrent import recurrent_linear_attention, recurrent_step
from .softmax import KVCache, softmax_attention
from .validation import FORMS, _check_floating, _shape, validate_linear_attention_inputs

ATTENTION_KINDS = FEATURE_MAP_KINDS + ("softmax",)

LinearAttentionFn = Callable[..., "tuple[torch.Tensor, LinearAttentionState]"]

ATTENTION_BACKENDS = ("auto", "torch", "triton", "fla")


def check_backend(backend: str) -> None:
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend: expected one of {ATTENTION_BACKENDS}, got {backend!r}")


def chunked_backend(backend: str, on_cuda: bool) -> str:
    """The one decision of which implementation runs the chunked form of CUDA (``on_cuda``) or
    CPU tensors: "auto" is "triton" on CUDA and "torch" on CPU; the others are taken as given
    ("triton" on CPU tensors needs TRITON_INTERPRET=1; "fla" needs CUDA and flash-linear-attention)."""
    check_backend(backend)
    if backend == "auto":
        return "triton" if on_cuda else "torch"
    return backend


def _chunked_impl(backend: str, on_cuda: bool) -> LinearAttentionFn:
    which = chunked_backend(backend, on_cuda)
    if which == "triton":
        from .triton import triton_linear_attention

        return triton_linear_attention
    if which == "fla":
        from .linear.chunk_fla import fla_linear_attention

        return fla_linear_attention
    from .linear.chunk import chunked_linear_attention

    return chunked_linear_attention


def causal_linear_attention(
    qf: torch.Tensor,
    kf: torch.Tensor,
    kls: torch.Tensor | None,
    v: torch.Tensor,
    *,
    form: str = "chunked",
    normalization: str = "rms",
    chunk_size: int = 64,
    initial_state: LinearAttentionState | None = None,
    eps: float = 1e-6,
    backend: str = "auto",
    document_starts: DocumentLayout | torch.Tensor | None = None,
) -> tuple[torch.Tensor, LinearAttentionState]:
    """Causal linear attention: qf, kf [B, H, N, F], kls [B, H, N] | None, v [B, H, N, Dv]
    -> (out [B, H, N, Dv] in v.dtype, fp32 state after the last token).

    ``form`` selects the algorithm (identical maths); ``chunk_size`` only affects "chunked", and
    ``backend`` (auto | torch | triton | fla, see ``chunked_backend``) which implementation runs it.
    ``document_starts`` [B, N] bool (or its ``DocumentLayout``) restarts the state at each document
    start (``documents.py``): masked in the quadratic form, emptied in the recurrent one, one call per document in "chunked".
    """
    validate_linear_attention_inputs(
        qf, kf, kls, v, form=form, normalization=normalization, chunk_size=chunk_size, initial_state=initial_state, eps=eps
    )
    check_backend(backend)
    layout = _checked_starts(document_starts, qf)
    restarts = layout is not None and layout.has_restarts(initial_state is not None)
    starts = layout.starts if restarts else None
    if form == "quadratic":
        return quadratic_linear_attention(
            qf, kf, kls, v, normalization=normalization, initial_state=initial_state, eps=eps, document_starts=starts
        )
    if form == "recurrent":
        return recurrent_linear_attention(
            qf, kf, kls, v, normalization=normalization, initial_state=initial_state, eps=eps, document_starts=starts
        )
    chunked = _chunked_impl(backend, qf.is_cuda)
    options = dict(normalization=normalization, chunk_size=chunk_size, eps=eps)
    if restarts:
        return run_by_document(lambda t, s: chunked(*t, initial_state=s, **options), [qf, kf, kls, v], layout, initial_state)
    return chunked(qf, kf, kls, v, initial_state=initial_state, **options)


def _checked_starts(
    document_starts: DocumentLayout | torch.Tensor | None, like: torch.Tensor
) -> DocumentLayout | None:
    """The layout of ``document_starts`` after checking its starts are a [B, N] bool tensor matching
    ``like`` [B, H, N, *]."""
    if document_starts is None:
        return None
    starts = document_starts.starts if isinstance(document_starts, DocumentLayout) else document_starts
    expected = (like.shape[0], like.shape[2])
    if starts.dtype != torch.bool or tuple(starts.shape) != expected:
        raise ValueError(
            f"document_starts: expected a bool tensor of shape {expected} ([B, N]), "
            f"got {starts.dtype} {tuple(starts.shape)}"
        )
    return document_layout(document_starts)


AttentionState = LinearAttentionState | KVCache


def padding_mask(key_mask: torch.Tensor | None, batch: int, length: int, name: str = "key_mask") -> torch.Tensor | None:
    """``key_mask`` as bool [batch, length] (ValueError naming ``name`` on another shape), or None
    when it masks nothing."""
    if key_mask is None:
        return None
    if key_mask.dim() != 2 or tuple(key_mask.shape) != (batch, length):
        raise ValueError(f"{name}: expected shape [{batch}, {length}] (every token so far, cached ones first), "
                         f"got {tuple(key_mask.shape)}")
    key_mask = key_mask.bool()
    return None if bool(key_mask.all()) else key_mask


def mask_padded_keys(
    features: torch.Tensor, log_scale: torch.Tensor | None, key_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Key features [B, H, N, F] and log-scales [B, H, N] with padded keys (``key_mask`` [B, N]
    False) removed from the sums: zero features, and a log-scale no larger than the row's real
    ones (not -inf: the chunked forms' row scales exp(M_c - m_t) must stay finite)."""
    real = key_mask[:, None, :]  # [B, 1, N]
    features = torch.where(real.unsqueeze(-1), features, torch.zeros_like(features))
    if log_scale is not None:
        lowest_real = torch.where(real, log_scale, torch.full_like(log_scale, float("inf"))).amin(-1, keepdim=True)
        has_real = real.any(-1, keepdim=True)
        log_scale = torch.where(real | ~has_real, log_scale, lowest_real.detach())
    return features, log_scale


class AttentionCore(nn.Module):
    """Causal attention of already-projected heads: q, k, v [B, H, N, d] -> out [B, H, N, d].

    ``kind`` is a feature-map kind (linear attention) or "softmax". For linear kinds, a call
    that continues from a ``state`` with at most ``recurrent_max_tokens`` new tokens (decoding)
    uses the recurrent form; everything else uses ``form`` (default "chunked") with the state as
    initial state. Position-dependent maps (cosformer) get ``state.offset`` as their offset.
    ``feature_kwargs`` go to ``build_feature_map`` (``max_seq_len`` is passed to cosformer only).

    ``backend`` (auto | torch | triton | fla) picks the chunked form's implementation for training,
    evaluation and prefill alike (decoding keeps the recurrent form): with Triton, trig maps
    (``feature_map.trig_spec()``) go through ``trig_linear_attention``, which keeps no features
    alive for backward; other maps compute their features in torch, then run the same kernels.
    With the torch backend on CPU, trig maps go through ``chunked_trig.trig_linear_attention_chunked``
    (the same fusion: long sequences keep no features alive; short ones use the plain path).
    """

    def __init__(
        self,
        kind: str,
        num_heads: int,
        head_dim: int,
        *,
        feature_dim: int = 128,
        normalization: str = "rms",
        chunk_size: int = 64,
        max_seq_len: int = 2048,
        form: str = "chunked",
        recurrent_max_tokens: int = 16,
        eps: float = 1e-6,
        backend: str = "auto",
        **feature_kwargs: object,
    ) -> None:
        super().__init__()
        check_backend(backend)
        if kind not in ATTENTION_KINDS:
            raise ValueError(f"kind: expected one of {ATTENTION_KINDS}, got {kind!r}")
        if normalization not in NORMALIZATIONS:
            raise ValueError(f"normalization: expected one of {NORMALIZATIONS}, got {normalization!r}")
        if form not in FORMS:
            raise ValueError(f"form: expected one of {FORMS}, got {form!r}")
        self.kind, self.num_heads, self.head_dim = kind, num_heads, head_dim
        self.normalization, self.chunk_size, self.form, self.eps = normalization, chunk_size, form, eps
        self.recurrent_max_tokens = recurrent_max_tokens
        self.backend = backend
        self.max_seq_len = max_seq_len
        self.feature_map = None
        if kind != "softmax":
            if kind == "cosformer":
                feature_kwargs.setdefault("max_seq_len", max_seq_len)
            self.feature_map = build_feature_map(kind, num_heads, head_dim, feature_dim, **feature_kwargs)
        elif feature_kwargs:
            raise ValueError(f"feature_kwargs: 'softmax' takes none, got {sorted(feature_kwargs)}")

    def _check_qkv(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        for name, t in (("q", q), ("k", k), ("v", v)):
            _check_floating(name, t, 4)
        expected = (q.shape[0], self.num_heads, q.shape[2], self.head_dim)
        for name, t in (("q", q), ("k", k)):
            if _shape(t) != expected:
                raise ValueError(
                    f"{name}: expected shape [B, {self.num_heads}, N, {self.head_dim}] = {expected} "
                    f"(num_heads={self.num_heads}, head_dim={self.head_dim}), got {_shape(t)}"
                )
        if v.shape[:3] != q.shape[:3]:
            raise ValueError(f"v: expected shape [{q.shape[0]}, {self.num_heads}, {q.shape[2]}, Dv], got {_shape(v)}")

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, state: AttentionState | None = None,
        return_state: bool = False, key_mask: torch.Tensor | None = None,
        document_starts: DocumentLayout | torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, AttentionState | None]:
        """q, k, v [B, H, N, d] (+ state from the previous call) -> (out [B, H, N, d], new state | None).

        ``key_mask`` [B, T] (bool, False = padding; optional) covers every token so far: the
        state's ``offset`` tokens, then the N new ones (see module doc).
        ``document_starts`` [B, N] bool or its ``DocumentLayout`` (``documents.py``): no token attends
        across a document start (softmax: a block-causal mask; linear kinds: each document runs on its own)."""
        self._check_qkv(q, k, v)
        layout = _checked_starts(document_starts, q)
        restarts = layout is not None and layout.has_restarts(state is not None)
        if restarts and key_mask is not None:
            raise ValueError("key_mask and document_starts: padded batches of packed documents are not supported")
        offset = state.offset if state is not None else 0
        key_mask = padding_mask(key_mask, q.shape[0], offset + q.shape[2])
        if self.feature_map is None:
            if state is not None and not isinstance(state, KVCache):
                raise ValueError(f"state: expected a KVCache for kind 'softmax', got {type(state).__name__}")
            if restarts:
                if state is not None or return_state:
                    raise ValueError("document_starts: expected no KVCache in or out (decode one document at a time)")
                return softmax_attention(q, k, v, mask=block_causal_mask(layout.starts))[0], None
            out, cache = softmax_attention(q, k, v, cache=state, key_mask=key_mask)
            return out, (cache if return_state else None)
        if state is not None and not isinstance(state, LinearAttentionState):
            raise ValueError(f"state: expected a LinearAttentionState for kind {self.kind!r}, got {type(state).__name__}")
        if restarts and return_state:  # the state after each row's last document: one call per document
            return run_by_document(lambda t, s: self.forward(*t, state=s, return_state=True), [q, k, v], layout, state)
        if restarts:  # training: documents of similar length batched into one call
            return run_documents_batched(lambda t, s: self.forward(*t, state=s), [q, k, v], layout, state), None
        new_keys = None if key_mask is None else padding_mask(key_mask[:, offset:], q.shape[0], q.shape[2])
        if new_keys is not None and self.kind == "cosformer":
            raise ValueError("key_mask: padding is not supported by the position-dependent 'cosformer' map")
        decoding = state is not None and q.shape[2] <= self.recurrent_max_tokens
        if decoding and not torch.is_grad_enabled():
            return self._decode(q, k, v, state, return_state, new_keys)
        form = "recurrent" if decoding else self.form
        which = chunked_backend(self.backend, q.is_cuda) if form == "chunked" else None
        if new_keys is not None:  # the fused trig paths compute key features internally: mask them here
            q_map, k_map = self.feature_map(q, offset), self.feature_map(k, offset)
            kf, kls = mask_padded_keys(k_map.features, k_map.log_scale, new_keys)
            out, new_state = causal_linear_attention(
                q_map.features, kf, kls, v, form=form, normalization=self.normalization, chunk_size=self.chunk_size,
                initial_state=state, eps=self.eps, backend=self.backend,
            )  # fmt: skip
            return out, (new_state if return_state else None)
        if which == "triton":
            out, new_state = self._triton_chunked(q, k, v, state, offset)
            return out, (new_state if return_state else None)
        spec = self._trig_spec()
        if which == "torch" and spec is not None and q.device.type == "cpu":
            # CPU: the trig map fused into the chunked form, no [B, H, N, F] features kept for backward
            from .linear.chunk_trig import trig_linear_attention_chunked

            omega, inv_temperature, paired = spec
            out, new_state = trig_linear_attention_chunked(
                q, k, v, omega, inv_temperature, paired=paired, normalization=self.normalization,
                chunk_size=self.chunk_size, initial_state=state, eps=self.eps,
            )  # fmt: skip
            return out, (new_state if return_state else None)
        q_map = self.feature_map(q, offset)
        k_map = self.feature_map(k, offset)
        out, new_state = causal_linear_attention(
            q_map.features,
            k_map.features,
            k_map.log_scale,
            v,
            form=form,
            normalization=self.normalization,
            chunk_size=self.chunk_size,
            initial_state=state,
            eps=self.eps,
            backend=self.backend,
        )
        return out, (new_state if return_state else None)

    def _trig_spec(self) -> tuple[torch.Tensor, torch.Tensor, bool] | None:
        """(omega, inv_temperature, paired) when the feature map is a trig map, else None."""
        trig_spec = getattr(self.feature_map, "trig_spec", None)
        return trig_spec() if trig_spec is not None else None

    def _triton_chunked(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, state: LinearAttentionState | None, offset: int
    ) -> tuple[torch.Tensor, LinearAttentionState]:
        """The chunked form in the Triton kernels; trig maps fused with the attention (see class doc)."""
        from .triton import trig_linear_attention, triton_linear_attention

        options = dict(normalization=self.normalization, chunk_size=self.chunk_size, initial_state=state, eps=self.eps)
        spec = self._trig_spec()
        if spec is not None:
            omega, inv_temperature, paired = spec
            return trig_linear_attention(q, k, v, omega, inv_temperature, paired=paired, **options)
        q_map, k_map = self.feature_map(q, offset), self.feature_map(k, offset)
        return triton_linear_attention(q_map.features, k_map.features, k_map.log_scale, v, **options)

    def _decode(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, state: LinearAttentionState, return_state: bool,
        key_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, LinearAttentionState | None]:
        """Inference continuing from ``state`` with a few tokens: the same maths as ``forward``'s
        recurrent form in fewer ops (decoding is bound by per-op overhead, not FLOPs): q and k go
        through the feature map as one batch, and a single token takes ``recurrent_step``."""
        batch = q.shape[0]
        both = self.feature_map(torch.cat([q, k]), state.offset)  # [2B, H, N, F]: queries then keys
        qf, kf = both.features[:batch], both.features[batch:]
        kls = None if both.log_scale is None else both.log_scale[batch:]
        if key_mask is not None:
            kf, kls = mask_padded_keys(kf, kls, key_mask)
        validate_linear_attention_inputs(
            qf, kf, kls, v, form="recurrent", normalization=self.normalization, initial_state=state, eps=self.eps
        )
        if q.shape[2] == 1:
            out, new_state = recurrent_step(qf, kf, kls, v, state, normalization=self.normalization, eps=self.eps)
        else:
            out, new_state = recurrent_linear_attention(
                qf, kf, kls, v, normalization=self.normalization, initial_state=state, eps=self.eps
            )
        return out, (new_state if return_state else None)

    def extra_repr(self) -> str:
        return (
            f"kind={self.kind}, num_heads={self.num_heads}, head_dim={self.head_dim}, "
            f"normalization={self.normalization}, backend={self.backend}"
        )
