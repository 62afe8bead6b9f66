"""Optional quality closers around a linear ``AttentionCore`` (both off by default).

``LocalMixingCore`` wraps a linear-attention core with one or both of

* a short causal depthwise convolution (``conv_size`` K > 0) over the sequence on q, k and v,
  per head and channel: ``x'_t = sum_{j<K} w[h, c, :, j] * x_{t-K+1+j}`` (zeros before the first
  token). Init: identity (the last tap 1, the others 0), so it starts as a no-op. It runs on the
  core's inputs, i.e. after RoPE (the core is what sees q, k, v; the taps are learned, so they can
  adapt to the rotation of a K-token neighbourhood). Decoding keeps the last K - 1 raw q, k, v.
* a sliding window of exact softmax attention (``window`` W > 0), mixed in one of two ways
  (``mixing``):

  - ``"shared_normaliser"`` (default; LoLCATs / Based): exact softmax weights exp(q.k / sqrt d)
    for the last W keys and the learned kernel phi~(q).phi~(k) for every older key, in one
    normaliser with one log-space stabiliser per query (``window/``, which has the maths
    and the quadratic / chunked / recurrent forms). Near keys are counted once, the two parts keep
    their relative mass, and nothing is learned for the mix (unless ``far_gain``, below). No [N, N] or
    [N, W + N] mask. Decoding keeps a W - 1 key window cache plus the linear state of the keys that left it.
    ``far_gain`` (``model.window_far_gain``; issue 46, remedy (e)): a learned per-head factor e^b_h on
    every far-field weight against the window's (LoLCATs learns one per head), init b_h = 0: today's
    hybrid. The far weights are (qf_t . kf_s) exp(qls_t + kls_s - m_t), so the factor is exactly b_h
    added to the query log-scale qls_t, which every form (quadratic, chunked, recurrent, Triton, the
    segments, the bidirectional window, context parallelism) takes from ``window_features``: one
    place, the same maths everywhere, and the shared stabiliser m_t (which reads qls_t) stays exact.
  - ``"gated"`` (the first design, kept as an ablation arm): ``out = (1 - g_h) linear(q, k, v) +
    g_h local``, ``local`` the softmax attention of q_t over keys s in (t - W, t], RMS-normalised
    with the core's "rms"; ``g_h = sigmoid(m_h)`` a learned per-head mix (init 1/2). The linear
    branch covers every token (near ones twice). The window branch materialises an [N, W + N]
    band mask (O(N^2) memory). Decoding keeps the last W - 1 keys and values.

With a bidirectional core (``AttentionCore(causal=False)``) only the one-normaliser window applies: exact
softmax for the keys with |t - s| < W, the kernel for every other key (``window/bidirectional.py``); the
convolution and the gated window are causal and refused when the module is built (``dispatch.REFUSALS``).

Both are position-local and causal, so the result is the same for any linear form (chunked,
recurrent, quadratic) and for decoding token by token from a ``HybridState`` as for the full
sequence.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .base import KernelParameter, LinearAttentionState
from .core import AttentionCore
from .forms import RefusedAttention, Row, refuse_call, refused_build, row
from .documents import DocumentLayout, document_layout, run_documents_batched
from .inputs import mask_padded_keys, padding_mask, restarting
from .normalize import is_rms_norm, normalize_output
from .softmax import padded_causal_mask
from .window import WindowCache, bidirectional_windowed_attention, windowed_linear_attention
from .window.segments import run_segments

WINDOW_MIXINGS = ("shared_normaliser", "gated")
# padded keys' log-scale below the row's lowest real one (finite: no -inf - -inf anywhere); exp(-1e4) = 0
_PAD_LOG_SCALE_MARGIN = 1e4
# training sequences longer than twice this run in recomputed segments of this many tokens (memory)
_SEGMENT_TOKENS = 512


@dataclass
class HybridState:
    """Decoding state of ``LocalMixingCore``: the linear state plus the local caches."""

    linear: LinearAttentionState  # "shared_normaliser": only the keys that left the window
    window_k: torch.Tensor | None  # "gated": [B, H, <= W - 1, d], the latest keys (window branch)
    window_v: torch.Tensor | None  # "gated": [B, H, <= W - 1, Dv]
    conv_tail: torch.Tensor | None  # [B, H, 3, K - 1, d]: the latest raw q, k, v (convolution)
    window_cache: WindowCache | None = None  # "shared_normaliser": the last <= W - 1 keys

    @property
    def offset(self) -> int:
        return self.linear.offset


class _QKTap(nn.Module):
    """A no-op the one-normaliser path calls with its (convolved) q, k: hooks read them there."""

    def forward(self, q: torch.Tensor, k: torch.Tensor) -> None:
        return None


class LocalMixingCore(nn.Module):
    """A linear ``AttentionCore`` plus a causal q/k/v convolution and/or a sliding softmax window."""

    op = "local_mixing"  # what ``parallel.layers`` wraps for context parallelism

    def __init__(
        self, core: AttentionCore, *, window: int = 0, conv_size: int = 0, mixing: str = "shared_normaliser",
        far_gain: bool = False,
    ) -> None:
        super().__init__()
        if mixing not in WINDOW_MIXINGS:
            raise ValueError(f"mixing: expected one of {WINDOW_MIXINGS}, got {mixing!r}")
        if core.feature_map is None and (mixing != "shared_normaliser" or not window):
            raise ValueError("core: expected a linear-attention AttentionCore, got kind 'softmax' (a softmax core "
                             "takes only a window with mixing 'shared_normaliser': sliding-window softmax)")
        for name, value in (("window", window), ("conv_size", conv_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name}: expected an int >= 0 (0: off), got {value!r}")
        if window == 0 and conv_size == 0:
            raise ValueError("LocalMixingCore: expected window > 0 or conv_size > 0, got both 0")
        check_far_gain(far_gain, window, mixing, core.feature_map is not None)
        refusal = refused_build("local_mixing", form=core.attention_form, algorithm=core.form, conv_size=conv_size,
                                window=window, mixing=mixing, decays=core.decays)  # fmt: skip
        if refusal is not None:
            raise RefusedAttention(refusal.message)
        self.core, self.window, self.conv_size, self.mixing = core, window, conv_size, mixing
        self.num_heads, self.head_dim = core.num_heads, core.head_dim
        self.conv_weight = self.window_mix = self.far_log_gain = None
        self.qk_tap = _QKTap()
        self.segment_tokens = _SEGMENT_TOKENS
        if window and mixing == "gated":
            self.window_mix = nn.Parameter(torch.zeros(core.num_heads, 1, 1))  # heads on dim 0 (TP); sigmoid(0) = 1/2
        if far_gain:
            self.far_log_gain = nn.Parameter(torch.zeros(core.num_heads))  # heads on dim 0 (TP); e^0 = 1: today's hybrid
        if conv_size:
            weight = torch.zeros(core.num_heads, 3, core.head_dim, conv_size)  # heads on dim 0 (TP)
            weight[..., -1] = 1.0  # identity: a no-op at init
            self.conv_weight = nn.Parameter(weight)

    @property
    def feature_map(self) -> nn.Module:
        return self.core.feature_map

    def kernel_parameters(self) -> list[KernelParameter]:
        """No weight decay for either (decay would pull the taps to 0, i.e. no q, k, v at all, and the
        mix to an even one). The taps: main LR. The mix logit is a per-head scalar like tau, so it
        rides on the temperature LR group: at the main LR Adam could move it by ~0.3 over a 300-step
        run, i.e. the mix could not leave 0.43..0.57 (logged as layerXX/window_mix_*)."""
        out = [] if self.conv_weight is None else [KernelParameter("conv_weight", self.conv_weight, "map_weight")]
        if self.window_mix is not None:
            out.append(KernelParameter("window_mix", self.window_mix, "temperature"))
        if self.far_log_gain is not None:  # a per-head scalar like the mix logit: the temperature LR group
            out.append(KernelParameter("far_log_gain", self.far_log_gain, "temperature"))
        return out

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, state: HybridState | None = None,
        return_state: bool = False, key_mask: torch.Tensor | None = None,
        document_starts: DocumentLayout | torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, HybridState | None]:
        """q, k, v [B, H, N, d] (+ the state of the previous call) -> (out [B, H, N, d], state | None).

        ``key_mask`` [B, T] (False = padding) covers the state's tokens, then the new ones: padded
        tokens enter the convolution as zeros (as before the first token) and no branch sees them.
        ``document_starts`` [B, N] bool or its ``DocumentLayout``: neither branch nor the convolution
        reaches across a document start."""
        if state is not None and not isinstance(state, HybridState):
            raise ValueError(f"state: expected a HybridState, got {type(state).__name__}")
        offset = 0 if state is None else state.offset
        key_mask = padding_mask(key_mask, q.shape[0], offset + q.shape[2])
        layout = restarting(document_layout(document_starts), state is not None, key_mask)
        return self._run(q, k, v, state, return_state, key_mask, layout)

    def _run(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, state: HybridState | None, return_state: bool,
        key_mask: torch.Tensor | None, layout: DocumentLayout | None,
    ) -> tuple[torch.Tensor, HybridState | None]:
        """The path of this call: the core (with the convolution and/or the gated window), or the
        one-normaliser window: bidirectional, over packed documents, or ``_one_normaliser``."""
        if not self.core.causal:
            refuse_call(continues_state=state is not None, returns_state=return_state, documents=layout is not None)
        if not self.window or self.mixing == "gated":
            return CORE(self, q, k, v, state, return_state, key_mask, layout)
        if not self.core.causal:
            return BIDIRECTIONAL_WINDOW(self, q, k, v, key_mask)
        if layout is None:
            return self._one_normaliser(q, k, v, state, return_state, key_mask)
        # packed documents: one document per row, convolution included
        if state is not None or return_state:
            raise ValueError("document_starts: expected no state in or out (decode one document at a time)")
        run = lambda t, s: (self._one_normaliser(*t, None, False, None)[0], None)  # noqa: E731
        return DOCUMENTS(run, [q, k, v], layout, None), None

    def _core_forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, state: HybridState | None, return_state: bool,
        key_mask: torch.Tensor | None, layout: DocumentLayout | None,
    ) -> tuple[torch.Tensor, HybridState | None]:
        """The core over (convolved) q, k, v, and the gated window mixed in."""
        docs = None  # document index per token (0: the document the state belongs to), when documents restart
        if layout is not None:
            if return_state:
                raise ValueError("document_starts: expected return_state=False (decode one document at a time)")
            docs = layout.ids
        conv_tail = None
        if self.conv_weight is not None:
            q, k, v, conv_tail = self._convolve(q, k, v, state, key_mask, docs)
        out, linear_state = self.core(
            q, k, v, state=None if state is None else state.linear, return_state=return_state, key_mask=key_mask,
            document_starts=layout,
        )  # fmt: skip
        window_k = window_v = None
        if self.window:
            local, window_k, window_v = self._window_attention(q, k, v, state, key_mask, docs)
            if is_rms_norm(self.core.normalization):
                local = normalize_output(local, None, "rms", self.core.eps)
            # in fp32 whatever the module's dtype: a bf16 mix moves in steps of 1/256 around 1/2
            mix = torch.sigmoid(self.window_mix.float())
            out = torch.lerp(out.float(), local.float(), mix).to(out.dtype)
        return out, (HybridState(linear_state, window_k, window_v, conv_tail) if return_state else None)

    def _one_normaliser(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, state: HybridState | None, return_state: bool,
        key_mask: torch.Tensor | None,
    ) -> tuple[torch.Tensor, HybridState | None]:
        """The one-normaliser window (``window/``) after the optional convolution: in recomputed segments
        for long training sequences (``_segmented``), else one call (``_shared_forward``)."""
        core = self.core
        decoding = state is not None and q.shape[2] <= core.recurrent_max_tokens
        segmented = (torch.is_grad_enabled() and key_mask is None and core.form == "chunked"
                     and q.shape[2] > 2 * max(self.segment_tokens, core.chunk_size))  # fmt: skip
        conv_tail = None
        if self.conv_weight is not None:
            q, k, v, conv_tail = self._convolve(q, k, v, state, key_mask)
        core._check_qkv(q, k, v)
        if segmented:
            out, far, cache = SEGMENTS(self, q, k, v, state)
        else:
            out, far, cache = SHARED(self, q, k, v, state, key_mask, return_state, "recurrent" if decoding else core.form)
        return out, (HybridState(far, None, None, conv_tail, cache) if return_state else None)

    def _shared_forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, state: HybridState | None,
        key_mask: torch.Tensor | None, return_state: bool, form: str,
    ) -> tuple[torch.Tensor, LinearAttentionState | None, WindowCache | None]:
        """One call of ``windowed_linear_attention`` over the whole sequence (decoding: its recurrent form)."""
        offset = 0 if state is None else state.offset
        qf, qls, kf, kls = self.window_features(q, k, offset)
        cache = None if state is None else state.window_cache
        key_valid = None
        if key_mask is not None:
            real = key_mask[:, None, offset:]  # [B, 1, N]
            kf, kls = mask_padded_keys(kf, kls, key_mask[:, offset:])
            if kls is not None:  # far below every real key: a pad never sets the far field's max, hence m_t
                kls = torch.where(real, kls, kls - _PAD_LOG_SCALE_MARGIN)
            prefix = 0 if cache is None else cache.length
            key_valid = key_mask[:, offset - prefix :]
        return windowed_linear_attention(
            q, qf, qls, k, kf, kls, v, window=self.window, form=form, normalization=self.core.normalization,
            chunk_size=self.core.chunk_size, far_state=None if state is None else state.linear, cache=cache,
            eps=self.core.eps, key_valid=key_valid, return_state=return_state, backend=self.core.backend,
            log_decay=self.core.log_decay(),
        )  # fmt: skip

    def _bidirectional_forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor | None
    ) -> tuple[torch.Tensor, None]:
        """The bidirectional one-normaliser window over the whole call (no convolution, no state: ``REFUSALS``)."""
        self.core._check_qkv(q, k, v)
        qf, qls, kf, kls = self.window_features(q, k, 0)
        if key_mask is not None and self.core.feature_map is not None:
            kf, kls = mask_padded_keys(kf, kls, key_mask)
        out = bidirectional_windowed_attention(
            q, qf, qls, k, kf, kls, v, window=self.window, form=self.core.form, normalization=self.core.normalization,
            chunk_size=self.core.chunk_size, eps=self.core.eps, key_valid=key_mask, backend=self.core.backend,
        )  # fmt: skip
        return out, None

    def _segmented(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, state: HybridState | None
    ) -> tuple[torch.Tensor, LinearAttentionState, WindowCache]:
        """Training on long sequences: segments of ``segment_tokens`` (at least a chunk, whole chunks), each
        continuing the previous one's (far state, window cache) (``window/segments.py``), so between forward
        and backward only q, k, v, the output and a state per segment live (no features, no [N, (L + 1) C]
        blocks); the backward recomputes one segment at a time. Same maths as one call (segments agree to rounding)."""
        offset = 0 if state is None else state.offset
        segment = max(self.segment_tokens, self.core.chunk_size)
        segment -= segment % self.core.chunk_size
        far = None if state is None else state.linear
        cache = None if state is None else state.window_cache
        carried = [] if far is None else [far.kv, far.k_sum, far.log_max]
        carried += [] if cache is None else [cache.k, cache.kf, cache.kls, cache.v]
        # what a segment reads that may need gradients: the feature map's parameters and the far-field gain
        params = [*self.core.parameters(), *([] if self.far_log_gain is None else [self.far_log_gain])]
        out, *new = run_segments(self._segment, offset, segment, q, k, v, carried, far is not None, cache is not None,
                                 params)  # fmt: skip
        far = LinearAttentionState(new[0], new[1], new[2].detach(), offset + q.shape[2])
        return out, far, WindowCache(*new[3:])

    def _segment(self, offset: int, has_far: bool, has_cache: bool, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 *carried: torch.Tensor) -> tuple[torch.Tensor, ...]:  # fmt: skip
        far = LinearAttentionState(*carried[:3], offset) if has_far else None
        cache = WindowCache(*carried[3 * has_far :]) if has_cache else None
        qf, qls, kf, kls = self.window_features(q, k, offset)
        out, far, cache = windowed_linear_attention(
            q, qf, qls, k, kf, kls, v, window=self.window, form="chunked", normalization=self.core.normalization,
            chunk_size=self.core.chunk_size, far_state=far, cache=cache, eps=self.core.eps, backend=self.core.backend,
            log_decay=self.core.log_decay(),
        )  # fmt: skip
        return out, far.kv, far.k_sum, far.log_max, cache.k, cache.kf, cache.kls, cache.v

    def window_features(
        self, q: torch.Tensor, k: torch.Tensor, offset: int
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
        """(qf, qls, kf, kls) of the one-normaliser window; a softmax core has no far field (zero-width
        features, key log-scales -inf: sliding-window softmax)."""
        self.qk_tap(q, k)  # the kernel statistics' probe catches q, k here
        if self.core.feature_map is None:
            empty = q.new_zeros(*q.shape[:3], 0)
            return empty, None, empty, q.new_full(q.shape[:3], float("-inf"), dtype=torch.float32)
        q_map, k_map = self.core.feature_map(q, offset), self.core.feature_map(k, offset)
        qls = q_map.log_scale
        if self.far_log_gain is not None:  # e^b_h on every far weight (module docstring)
            if qls is None:
                qls = q.new_zeros(q.shape[:3], dtype=torch.float32)
            qls = qls + self.far_log_gain.to(qls.dtype)[:, None]
        return q_map.features, qls, k_map.features, k_map.log_scale

    def _convolve(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, state: HybridState | None,
        key_mask: torch.Tensor | None, docs: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Causal depthwise convolution of q, k, v along the sequence after the state's tail; returns the
        new tail. Padded tokens (``key_mask`` [B, T]) enter as zeros. ``docs`` [B, N] document indices:
        taps reaching into another document (or the tail, from index 1 on) read 0."""
        tail = None if state is None else state.conv_tail
        if key_mask is not None:
            real = key_mask[:, None, key_mask.shape[1] - q.shape[2] :, None]  # [B, 1, N, 1]
            q, k, v = (torch.where(real, x, torch.zeros_like(x)) for x in (q, k, v))
        x = torch.stack([q, k, v], dim=2)  # [B, H, 3, N, d]
        if tail is None:
            tail = x.new_zeros(*x.shape[:3], self.conv_size - 1, x.shape[-1])
        padded = torch.cat([tail.to(x.dtype), x], dim=3)  # [B, H, 3, K - 1 + N, d]
        windows = padded.unfold(3, self.conv_size, 1)  # [B, H, 3, N, d, K]
        if docs is not None:
            padded_docs = torch.cat([docs.new_zeros(docs.shape[0], self.conv_size - 1), docs], dim=1)
            same = padded_docs.unfold(1, self.conv_size, 1) == docs.unsqueeze(-1)  # [B, N, K]
            windows = windows * same[:, None, None, :, None, :].to(windows.dtype)
        mixed = torch.einsum("bhcndk,hcdk->bhcnd", windows, self.conv_weight.to(x.dtype))
        new_tail = padded[:, :, :, padded.shape[3] - (self.conv_size - 1) :]
        return mixed[:, :, 0], mixed[:, :, 1], mixed[:, :, 2], new_tail

    def _window_attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, state: HybridState | None,
        key_mask: torch.Tensor | None = None, docs: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Softmax over the last ``window`` keys of each query (cached keys first); new cache. ``docs``
        [B, N] document indices: keys of other documents are masked (cached keys are document 0's)."""
        if state is not None and state.window_k is not None:
            k_all, v_all = torch.cat([state.window_k.to(k.dtype), k], dim=2), torch.cat([state.window_v.to(v.dtype), v], dim=2)
        else:
            k_all, v_all = k, v
        n, prefix = q.shape[2], k_all.shape[2] - q.shape[2]
        query_pos = torch.arange(prefix, prefix + n, device=q.device).unsqueeze(1)  # [N, 1] indices into k_all
        key_pos = torch.arange(k_all.shape[2], device=q.device).unsqueeze(0)  # [1, P + N]
        band = (key_pos <= query_pos) & (key_pos > query_pos - self.window)  # [N, P + N]
        if key_mask is not None:  # the cached keys are the last P tokens before the new ones
            band = padded_causal_mask(query_pos, key_pos, key_mask[:, key_mask.shape[1] - k_all.shape[2] :], band)
        if docs is not None:
            key_docs = torch.cat([docs.new_zeros(docs.shape[0], prefix), docs], dim=1)  # [B, P + N]
            band = (band & (docs.unsqueeze(-1) == key_docs.unsqueeze(-2))).unsqueeze(1)  # [B, 1, N, P + N]
        out = F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=band)
        # the last W - 1 keys, or all of them while fewer are held (a negative start would slice from the end)
        first = max(k_all.shape[2] - (self.window - 1), 0)
        return out, k_all[:, :, first:], v_all[:, :, first:]

    def extra_repr(self) -> str:
        gain = ", far_gain=True" if self.far_log_gain is not None else ""
        return f"window={self.window}, conv_size={self.conv_size}, mixing={self.mixing}{gain}"


def check_far_gain(far_gain: bool, window: int, mixing: str, linear: bool) -> None:
    """ValueError naming the setting to change unless the far-field gain has a far field to act on:
    a one-normaliser window (``model.softmax_window`` > 0, ``model.window_mixing: shared_normaliser``)
    around a linear kernel."""
    if not far_gain:
        return
    if not window or mixing != "shared_normaliser":
        raise ValueError(f"window_far_gain: expected softmax_window > 0 with window_mixing 'shared_normaliser' (it "
                         f"scales the far field against the window in one normaliser), got softmax_window={window}, "
                         f"window_mixing={mixing!r}; set window_far_gain=false or a one-normaliser window")
    if not linear:
        raise ValueError("window_far_gain: expected a linear attention kind (softmax with a window has no far field); "
                         "set window_far_gain=false")


# the hybrid's paths (``LocalMixingCore._run``): the core with a convolution and/or the gated window, or the
# one-normaliser window (segments for long training sequences, packed documents, bidirectional)
CORE = row("local_mixing.core", LocalMixingCore._core_forward, "method", shared_window=False)
DOCUMENTS = row("local_mixing.documents", run_documents_batched, "documents_batched", shared_window=True,
                documents=("restart_state", "restart_batched"))
SEGMENTS = row("local_mixing.segments", LocalMixingCore._segmented, "method", shared_window=True, grad=True,
               padded=False, algorithm="chunked", segmented=True, documents="none")
SHARED = row("local_mixing.shared", LocalMixingCore._shared_forward, "method", shared_window=True, documents="none")
BIDIRECTIONAL_WINDOW = row("local_mixing.bidirectional", LocalMixingCore._bidirectional_forward, "method",
                           shared_window=True, form="bidirectional")
LOCAL_MIXING_ROWS: tuple[Row, ...] = (CORE, DOCUMENTS, SEGMENTS, SHARED, BIDIRECTIONAL_WINDOW)
# the module a model layer holds (``build_attention``): the core alone, or wrapped by the local closers
WRAPPED = row("module.local_mixing", LocalMixingCore, "wrap", mixes_locally=True, form=("causal", "bidirectional"))
AS_IS = row("module.core", AttentionCore, "as_is", mixes_locally=False, form=("causal", "bidirectional"))
MODULE_ROWS: tuple[Row, ...] = (WRAPPED, AS_IS)


def build_attention(
    core: AttentionCore, *, window: int = 0, conv_size: int = 0, mixing: str = "shared_normaliser", far_gain: bool = False,
) -> AttentionCore | LocalMixingCore:
    """The attention module of a model layer: ``core``, wrapped in a ``LocalMixingCore`` when a ``window``
    or a convolution (``conv_size``) is asked for; ``far_gain``: the window's learned far-field gain (needs
    that window). What the settings refuse (``dispatch.REFUSALS``) is raised here, before any call."""
    check_far_gain(far_gain, window, mixing, core.feature_map is not None)
    refusal = refused_build("module", form=core.attention_form, window=window, conv_size=conv_size, decays=core.decays)
    refusal = refusal or core.plan.refusal
    if refusal is not None:
        raise RefusedAttention(refusal.message)
    if window >= 1 or conv_size >= 1:
        return WRAPPED(core, window=window, conv_size=conv_size, mixing=mixing, far_gain=far_gain)
    AS_IS.chosen()  # noted for ``dispatch.recording``: the core is the module
    return core
