"""Dispatcher over the causal linear-attention forms, input validation, and ``AttentionCore``.

``causal_linear_attention`` computes (see ``normalize.py`` for the normalisations)

    w_ts = (qf_t . kf_s) exp(kls_s - m_t),  s <= t (carried state included),
    m_t  = max(state.log_max, max_{s<=t} kls_s)   (detached),
    n_t  = sum_s w_ts v_s,  d_t = sum_s w_ts,  o_t = normalize(n_t, d_t)

with one of three forms that agree to fp rounding:

* ``quadratic``: materialised N x N weights; ground truth for tests.
* ``recurrent``: token-by-token scan; O(1) per token, the decoding path.
* ``chunked``:   parallel chunk form with a hand-written backward; training path. Three
  implementations, picked by ``backend`` (auto | torch | triton | fla, ``dispatch.chunked_backend``):
  ``linear/chunk.py`` (torch, CPU-tuned), ``triton/`` (Triton kernels; auto on CUDA tensors, or on
  CPU under TRITON_INTERPRET=1 when forced) and flash-linear-attention's ``chunk_simple_gla``
  (``linear/chunk_fla.py``; CUDA only, extra "gpu").

Which implementation runs: the core's build resolves its plan (``plan.plan_core``: the chunked forms on
each device, the refusal its settings meet), and ``AttentionCore._run`` picks the form of each call in
plain code, calling the imported function by name (rows ``linear.*`` and ``softmax.*`` of ``plan.py``).

Stabiliser: the key log-scale (e.g. ||k||^2 / e^tau, unbounded) only ever enters as
exp(kls_s - m_t) <= 1 with m_t the running max, so nothing overflows for any key norm; the
carried state stores its sums relative to its own ``log_max`` and is rescaled on arrival of a
larger one. m_t is a constant for autograd: the output is invariant to it up to ``eps``.
The query log-scale is never used: it multiplies n_t and d_t by the same per-query scalar,
which both normalisations cancel.

Decay (``log_decay``, ``AttentionCore(decay="learned")``): every weight times gamma_h^(t - s), natively in the
quadratic and recurrent forms, folded into kls and the state for the chunked ones (``decay.py``).

Mixed precision: every form accumulates in fp32 and returns ``v.dtype``.

``AttentionCore`` is what the model instantiates: a feature map and the linear forms (recurrent when
continuing from a state with few new tokens, the configured one otherwise) or exact softmax
attention with a ``KVCache``.

Bidirectional (``AttentionCore(causal=False)``, Request.form "bidirectional"): every query reads
every real key, by one global sum (``linear/bidirectional.py``; its reference is
``linear.naive.quadratic_bidirectional_linear_attention``) or non-causal SDPA; no state in or out.

Padding (``key_mask``, False at padded tokens): a padded key's features are zeroed (nothing
added to kv or k_sum) and its log-scale is lowered to the smallest real one of its row, so the
running max m_t is the max over real keys only, as without the pads; softmax masks the keys.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from .base import KernelParameter, LinearAttentionState
from .decay import check_kernel_decay, initial_decay_logits, log_decay_of
from .forms import ATTENTION_BACKENDS, RefusedAttention, check_backend, chunked_backend, refuse_call
from .documents import DocumentLayout, block_causal_mask
from .feature_maps import FEATURE_MAP_KINDS, build_feature_map
from .inputs import (
    FORMS, check_floating, checked_starts, mask_padded_keys, padding_mask, restarting, shape_of,
    validate_linear_attention_inputs,
)
from .normalize import check_normalization
from .plan import (
    CHUNKS_BY_DOCUMENT, DECODE_SCAN, DECODE_STEP, DOCUMENTS_BATCHED, PER_DOCUMENT, QUADRATIC, RECURRENT,
    SOFTMAX_BIDIRECTIONAL, SOFTMAX_CACHED, SOFTMAX_DOCUMENTS, CorePlan, chunked_forms, plan_core,
)
from .softmax import KVCache

ATTENTION_KINDS = FEATURE_MAP_KINDS + ("softmax",)

__all__ = [
    "ATTENTION_BACKENDS", "ATTENTION_KINDS", "FORMS", "AttentionCore", "causal_linear_attention", "chunked_backend",
    "mask_padded_keys", "padding_mask", "validate_linear_attention_inputs",
]


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
    log_decay: torch.Tensor | None = None,
) -> tuple[torch.Tensor, LinearAttentionState]:
    """Causal linear attention: qf, kf [B, H, N, F], kls [B, H, N] | None, v [B, H, N, Dv]
    -> (out [B, H, N, Dv] in v.dtype, fp32 state after the last token).
    ``log_decay`` [H] | None: log gamma per head, every weight times gamma^(t - s) (``decay.py``).

    ``form`` selects the algorithm (identical maths); ``chunk_size`` only affects "chunked", and
    ``backend`` (auto | torch | triton | fla, see ``dispatch.chunked_backend``) which implementation runs it.
    ``document_starts`` [B, N] bool (or its ``DocumentLayout``) restarts the state at each document
    start (``documents.py``): masked in the quadratic form, emptied in the recurrent one, one call per document in "chunked".
    """
    validate_linear_attention_inputs(
        qf, kf, kls, v, form=form, normalization=normalization, chunk_size=chunk_size, initial_state=initial_state, eps=eps,
        log_decay=log_decay,
    )
    check_backend(backend)
    layout = restarting(checked_starts(document_starts, qf), initial_state is not None)
    options = dict(normalization=normalization, chunk_size=chunk_size, eps=eps, log_decay=log_decay)
    if form in ("quadratic", "recurrent"):  # the reference forms restart at document starts themselves
        starts = {} if layout is None else {"document_starts": layout.starts}
        reference = QUADRATIC if form == "quadratic" else RECURRENT
        return reference(qf, kf, kls, v, initial_state=initial_state, **options, **starts)
    chunked = chunked_forms(backend, qf.device.type).features
    if layout is None:
        return chunked(qf, kf, kls, v, initial_state=initial_state, **options)
    # one chunked call per document
    run = lambda t, s: chunked(*t, initial_state=s, **options)  # noqa: E731
    return CHUNKS_BY_DOCUMENT(run, [qf, kf, kls, v], layout, initial_state)


AttentionState = LinearAttentionState | KVCache


@dataclass
class _Call:
    """One ``AttentionCore`` call after its checks: what the adapters feed the chosen implementation."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    state: AttentionState | None
    return_state: bool
    key_mask: torch.Tensor | None  # [B, offset + N], None when nothing is padding
    layout: DocumentLayout | None  # only when its starts restart something

    @property
    def offset(self) -> int:
        return 0 if self.state is None else self.state.offset

    @functools.cached_property
    def new_keys(self) -> torch.Tensor | None:
        """The key mask of the N new tokens, None when none of them is padding."""
        return None if self.key_mask is None else padding_mask(self.key_mask[:, self.offset :], *self.q.shape[0:3:2])

    def kept(self, out: torch.Tensor, state: AttentionState | None) -> tuple[torch.Tensor, AttentionState | None]:
        return out, (state if self.return_state else None)


class AttentionCore(nn.Module):
    """Causal attention of already-projected heads: q, k, v [B, H, N, d] -> out [B, H, N, d].

    ``kind`` is a feature-map kind (linear attention) or "softmax". For linear kinds, a call
    that continues from a ``state`` with at most ``recurrent_max_tokens`` new tokens (decoding)
    uses the recurrent form; everything else uses ``form`` (default "chunked") with the state as
    initial state. Position-dependent maps (cosformer) get ``state.offset`` as their offset.
    ``feature_kwargs`` go to ``build_feature_map`` (``max_seq_len`` is passed to cosformer only).

    ``causal=False``: bidirectional attention (``Request.form`` "bidirectional"): each query attends to
    every real key of the call; no state in or out (``dispatch.REFUSALS``).

    ``decay`` ("none" | "learned", ``decay.KERNEL_DECAYS``): "learned" gives each head a learnable decay
    gamma_h = sigmoid(decay_logit[h]) of old keys, w_ts times gamma^(t - s), in every form (``decay.py``).

    ``backend`` (auto | torch | triton | fla) picks the chunked form's implementation for training,
    evaluation and prefill alike (decoding keeps the recurrent form): trig maps
    (``feature_map.trig_spec()``) go through a fused map + attention that keeps no features alive for
    backward (Triton: ``trig_linear_attention``; torch on CPU: ``linear.chunk_trig``); other maps compute
    their features in torch first. ``plan.CORE_ROWS`` lists every path (``dispatch.ROWS``, all of them).
    """

    op = "core"  # what ``parallel.layers`` wraps for context parallelism

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
        causal: bool = True,
        decay: str = "none",
        **feature_kwargs: object,
    ) -> None:
        super().__init__()
        check_backend(backend)
        check_kernel_decay(decay)
        if decay != "none" and kind == "softmax":
            raise ValueError("kernel_decay: expected 'none' for attention kind 'softmax' (the decay weighs the kernel's "
                             f"keys), got {decay!r}")
        if not isinstance(causal, bool):
            raise ValueError(f"causal: expected a bool, got {causal!r}")
        if kind not in ATTENTION_KINDS:
            raise ValueError(f"kind: expected one of {ATTENTION_KINDS}, got {kind!r}")
        check_normalization(normalization)
        if form not in FORMS:
            raise ValueError(f"form: expected one of {FORMS}, got {form!r}")
        self.kind, self.num_heads, self.head_dim = kind, num_heads, head_dim
        self.normalization, self.chunk_size, self._form, self.eps = normalization, chunk_size, form, eps
        self.recurrent_max_tokens = recurrent_max_tokens
        self._backend = backend
        self.causal = causal
        self.max_seq_len = max_seq_len
        self.feature_map = None
        if kind != "softmax":
            if kind == "cosformer":
                feature_kwargs.setdefault("max_seq_len", max_seq_len)
            self.feature_map = build_feature_map(kind, num_heads, head_dim, feature_dim, **feature_kwargs)
        elif feature_kwargs:
            raise ValueError(f"feature_kwargs: 'softmax' takes none, got {sorted(feature_kwargs)}")
        # heads on dim 0 (tensor parallelism keeps this rank's); deterministic init (no RNG drawn)
        self.decay_logit = nn.Parameter(initial_decay_logits(num_heads)) if decay == "learned" else None
        self.plan = self._planned()

    def _planned(self) -> CorePlan:
        return plan_core(softmax=self.feature_map is None, algorithm=self._form, causal=self.causal,
                         backend=self._backend, decays=self.decays)  # fmt: skip

    @property
    def form(self) -> str:
        """The configured algorithm ("chunked" | "recurrent" | "quadratic"); setting it plans again."""
        return self._form

    @form.setter
    def form(self, form: str) -> None:
        self._form = form
        self.plan = self._planned()

    @property
    def backend(self) -> str:
        """The chunked form's backend (auto | torch | triton | fla); setting it plans again."""
        return self._backend

    @backend.setter
    def backend(self, backend: str) -> None:
        self._backend = backend
        self.plan = self._planned()

    @property
    def decays(self) -> bool:
        """Whether old keys fade (``decay`` "learned")."""
        return self.decay_logit is not None

    def log_decay(self) -> torch.Tensor | None:
        """log gamma [H] in fp32 (None without a decay): what the forms take as ``log_decay``."""
        return None if self.decay_logit is None else log_decay_of(self.decay_logit)

    def kernel_parameters(self) -> list[KernelParameter]:
        """The decay logit: a per-head scalar like tau, on the temperature LR group, never weight-decayed
        (decay would pull it to 0, i.e. gamma to 1/2). The feature map declares its own."""
        return [] if self.decay_logit is None else [KernelParameter("decay_logit", self.decay_logit, "temperature")]

    def _check_qkv(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        for name, t in (("q", q), ("k", k), ("v", v)):
            check_floating(name, t, 4)
        expected = (q.shape[0], self.num_heads, q.shape[2], self.head_dim)
        for name, t in (("q", q), ("k", k)):
            if shape_of(t) != expected:
                raise ValueError(
                    f"{name}: expected shape [B, {self.num_heads}, N, {self.head_dim}] = {expected} "
                    f"(num_heads={self.num_heads}, head_dim={self.head_dim}), got {shape_of(t)}"
                )
        if v.shape[:3] != q.shape[:3]:
            raise ValueError(f"v: expected shape [{q.shape[0]}, {self.num_heads}, {q.shape[2]}, Dv], got {shape_of(v)}")

    def _check_state(self, state: AttentionState | None) -> None:
        expected = KVCache if self.feature_map is None else LinearAttentionState
        if state is not None and not isinstance(state, expected):
            raise ValueError(f"state: expected a {expected.__name__} for kind {self.kind!r}, got {type(state).__name__}")

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
        layout = restarting(checked_starts(document_starts, q), state is not None, key_mask)
        offset = state.offset if state is not None else 0
        key_mask = padding_mask(key_mask, q.shape[0], offset + q.shape[2])
        self._check_state(state)
        return self._run(_Call(q, k, v, state, return_state, key_mask, layout))

    def _run(self, call: _Call) -> tuple[torch.Tensor, AttentionState | None]:
        """The form of this call: softmax, packed documents, or one linear form (``_linear``)."""
        if not self.causal:
            refuse_call(continues_state=call.state is not None, returns_state=call.return_state,
                        documents=call.layout is not None)  # fmt: skip
        if self.plan.refusal is not None:
            raise RefusedAttention(self.plan.refusal.message)
        if self.feature_map is None:
            return self._softmax(call)
        if call.layout is None:
            return self._linear(call)
        if call.return_state:  # one call per document: the state after each row's last one
            run = lambda t, s: self._linear(_Call(*t, s, True, None, None))  # noqa: E731
            return PER_DOCUMENT(run, [call.q, call.k, call.v], call.layout, call.state)
        # training: documents of similar length batched into one call
        run = lambda t, s: self._linear(_Call(*t, s, False, None, None))  # noqa: E731
        return DOCUMENTS_BATCHED(run, [call.q, call.k, call.v], call.layout, call.state), None

    def _linear(self, call: _Call) -> tuple[torch.Tensor, AttentionState | None]:
        """Decoding (few tokens after a state, no autograd), the bidirectional sums, or the configured
        form: quadratic, recurrent (also decoding under autograd) or chunked on the tensors' device."""
        decoding = call.state is not None and call.q.shape[2] <= self.recurrent_max_tokens
        if decoding and not torch.is_grad_enabled():
            return self._decode(DECODE_STEP if call.q.shape[2] == 1 else DECODE_SCAN, call)
        if not self.causal:
            return self._bidirectional(self.plan.bidirectional, call)
        algorithm = "recurrent" if decoding else self.form
        if algorithm == "quadratic":
            return self._on_features(QUADRATIC, call)
        if algorithm == "recurrent":
            return self._on_features(RECURRENT, call)
        chunked = self.plan.chunked_on(call.q.device.type)
        trig_spec = self._trig_spec()
        if chunked.fused is not None and trig_spec is not None and call.new_keys is None:
            return self._fused_trig(chunked.fused, trig_spec, call)
        return self._on_features(chunked.features, call)

    def _softmax(self, call: _Call) -> tuple[torch.Tensor, AttentionState | None]:
        if not self.causal:
            return SOFTMAX_BIDIRECTIONAL(call.q, call.k, call.v, key_mask=call.key_mask), None
        if call.layout is not None:
            if call.state is not None or call.return_state:
                raise ValueError("document_starts: expected no KVCache in or out (decode one document at a time)")
            return SOFTMAX_DOCUMENTS(call.q, call.k, call.v, mask=block_causal_mask(call.layout.starts))[0], None
        return call.kept(*SOFTMAX_CACHED(call.q, call.k, call.v, cache=call.state, key_mask=call.key_mask))

    @property
    def attention_form(self) -> str:
        """``Request.form`` of this module's calls: "causal" or "bidirectional"."""
        return "causal" if self.causal else "bidirectional"

    def _trig_spec(self) -> tuple[torch.Tensor, torch.Tensor, bool] | None:
        """(omega, inv_temperature, paired) when the feature map is a trig map, else None."""
        trig_spec = getattr(self.feature_map, "trig_spec", None)
        return trig_spec() if trig_spec is not None else None

    def _options(self, call: _Call) -> dict:
        """The contract's options (``base.LinearAttentionFn``)."""
        return dict(normalization=self.normalization, chunk_size=self.chunk_size, initial_state=call.state, eps=self.eps,
                    log_decay=self.log_decay())  # fmt: skip

    def _features(self, call: _Call) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(qf, kf, kls) of the new tokens, padded keys taken out of the sums (``mask_padded_keys``)."""
        self._check_positions(call)
        q_map, k_map = self.feature_map(call.q, call.offset), self.feature_map(call.k, call.offset)
        kf, kls = k_map.features, k_map.log_scale
        if call.new_keys is not None:
            kf, kls = mask_padded_keys(kf, kls, call.new_keys)
        return q_map.features, kf, kls

    def _check_positions(self, call: _Call) -> None:
        """The position-dependent cosformer map sees positions from the row's start: padding before
        (or between) real tokens would move them; padding after them does not, in the bidirectional
        form (an encoder's batch), where no later token continues the row."""
        mask = call.new_keys
        if mask is None or self.kind != "cosformer":
            return
        if self.attention_form == "causal" or bool((mask[:, 1:] > mask[:, :-1]).any()):
            raise ValueError("key_mask: padding is not supported by the position-dependent 'cosformer' map, "
                             "except after the real tokens in the bidirectional form (causal=False)")

    def _on_features(self, fn: Callable, call: _Call) -> tuple[torch.Tensor, AttentionState | None]:
        qf, kf, kls = self._features(call)
        options = self._options(call)
        validate_linear_attention_inputs(qf, kf, kls, call.v, form=self.form, **options)
        return call.kept(*fn(qf, kf, kls, call.v, **options))

    def _fused_trig(
        self, fn: Callable, trig_spec: tuple[torch.Tensor, torch.Tensor, bool], call: _Call
    ) -> tuple[torch.Tensor, AttentionState | None]:
        omega, inv_temperature, paired = trig_spec
        return call.kept(*fn(call.q, call.k, call.v, omega, inv_temperature, paired=paired, **self._options(call)))

    def _decode(self, fn: Callable, call: _Call) -> tuple[torch.Tensor, AttentionState | None]:
        """Inference continuing from the state with a few tokens: the recurrent form in fewer ops
        (decoding is bound by per-op overhead, not FLOPs): q and k go through the feature map as one
        batch; ``fn`` is ``recurrent_step`` for one token."""
        self._check_positions(call)
        batch = call.q.shape[0]
        both = self.feature_map(torch.cat([call.q, call.k]), call.offset)  # [2B, H, N, F]: queries then keys
        qf, kf = both.features[:batch], both.features[batch:]
        kls = None if both.log_scale is None else both.log_scale[batch:]
        if call.new_keys is not None:
            kf, kls = mask_padded_keys(kf, kls, call.new_keys)
        options = dict(normalization=self.normalization, initial_state=call.state, eps=self.eps, log_decay=self.log_decay())
        validate_linear_attention_inputs(qf, kf, kls, call.v, form="recurrent", **options)
        return call.kept(*fn(qf, kf, kls, call.v, **options))

    def _bidirectional(self, fn: Callable, call: _Call) -> tuple[torch.Tensor, None]:
        """The global sums (or their quadratic reference) over the features, padded keys masked."""
        qf, kf, kls = self._features(call)
        validate_linear_attention_inputs(qf, kf, kls, call.v, form=self.form, normalization=self.normalization, eps=self.eps)
        # the features already hold no padded key (``_features``): no key_mask to apply again
        return fn(qf, kf, kls, call.v, normalization=self.normalization, eps=self.eps), None

    def extra_repr(self) -> str:
        return (
            f"kind={self.kind}, num_heads={self.num_heads}, head_dim={self.head_dim}, "
            f"normalization={self.normalization}, backend={self.backend}" + ("" if self.causal else ", causal=False")
            + (", decay=learned" if self.decays else "")
        )

