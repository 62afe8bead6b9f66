"""THE table: which implementation runs an attention call. Decisions only, no maths.

A caller describes its call as a ``Request`` (op, form, algorithm, backend, device, dtype, state,
grad, padding, documents, ...) and ``select`` returns the first ``Row`` of ``ROWS`` whose conditions
all hold; a request no row takes raises ``NoAttentionImplementation`` naming it. Each row names its
implementation as "module:function" (imported on first use, so CUDA-only ones cost nothing on CPU)
and an ``adapter``: how the calling entry point feeds it (``core.py``, ``hybrid.py``, ``window/``
run ``adapter(row.implementation(), ...)``: one call, no further choice).

Ops (the ``op`` axis):

* ``softmax``:      exact softmax attention (``softmax.py``).
* ``linear``:       causal linear attention (``AttentionCore``, ``causal_linear_attention``).
* ``local_mixing``: the hybrid's module-level paths (``hybrid.LocalMixingCore``).
* ``window``:       the one-normaliser window's numerator forms (``window/``).
* ``module``:       the attention module a model builds (``hybrid.build_attention``).

``form`` is "causal" or "bidirectional" (an encoder: every query reads every real key). The
bidirectional rows sit next to the causal ones; what has no bidirectional meaning (a state carried in
or out, packed documents, the causal q/k/v convolution, the gated window, the recurrent scan, context
parallelism, the decay) is refused by ``REFUSALS`` before any row is tried, with a message naming the setting and
the fix. The refusals that a model's settings alone decide (``SETTING_FIELDS``) are also what the
configs check before anything is built: ``refused_setting``.
Nothing here imports an implementation at import time, so this module imports nothing of the package.
"""

from __future__ import annotations

import importlib
from contextlib import contextmanager
from dataclasses import dataclass, fields
from typing import Any, Callable, Iterator

import torch

ATTENTION_BACKENDS = ("auto", "torch", "triton", "fla")
ATTENTION_FORMS = ("causal", "bidirectional")
# "auto" per device type: Triton kernels on CUDA, torch elsewhere
_AUTO_BACKEND = {"cuda": "triton"}


def check_backend(backend: str) -> None:
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend: expected one of {ATTENTION_BACKENDS}, got {backend!r}")


def chunked_backend(backend: str, on_cuda: bool) -> str:
    """The backend that runs the chunked forms for ``backend`` on CUDA (``on_cuda``) or CPU tensors:
    "auto" is "triton" on CUDA and "torch" on CPU; the others are taken as given ("triton" on CPU
    tensors needs TRITON_INTERPRET=1; "fla" needs CUDA and flash-linear-attention)."""
    check_backend(backend)
    if backend == "auto":
        return _AUTO_BACKEND.get("cuda" if on_cuda else "cpu", "torch")
    return backend


@dataclass(frozen=True)
class Request:
    """One attention call, as far as choosing its implementation goes."""

    op: str  # "softmax" | "linear" | "local_mixing" | "window" | "module"
    algorithm: str = "chunked"  # the configured one: "chunked" | "recurrent" | "quadratic"
    form: str = "causal"  # "causal" | "bidirectional"
    backend: str = "auto"  # as requested: auto | torch | triton | fla
    device: str = "cpu"  # torch device type of the inputs
    dtype: torch.dtype = torch.float32
    tokens: int = 1  # new tokens N
    chunk_size: int = 64
    continues_state: bool = False  # a state from an earlier call comes in
    recurrent_max_tokens: int = 0  # a continuing call with at most this many tokens is decoding
    grad: bool = False  # autograd records the call
    trig: bool = False  # the feature map is a trig map the kernels can fuse (``trig_spec``)
    padded: bool = False  # some key is padding (a key mask that masks something)
    documents: str = "none"  # "none" | "restart" (the op restarts itself) | "restart_state" | "restart_batched"
    mixing: str = "shared_normaliser"  # local_mixing: "shared_normaliser" | "gated"
    window: int = 0  # local_mixing, window: W
    segment_tokens: int = 0  # local_mixing: the segment length of long training sequences
    conv_size: int = 0  # module, local_mixing: the q/k/v convolution's taps
    returns_state: bool = False  # the caller asks for the state after the call (decoding, segments)
    context_parallel: bool = False  # the sequence is split over ranks that pass prefix states (parallel/context_parallel.py)
    decays: bool = False  # old keys fade by a learned per-head gamma^(t - s) (``decay.py``; every causal row)

    @property
    def mixes_locally(self) -> bool:
        """module: a window or a convolution around the core."""
        return self.window >= 1 or self.conv_size >= 1

    @property
    def convolves(self) -> bool:
        return self.conv_size >= 1

    @property
    def chunk_backend(self) -> str:
        return chunked_backend(self.backend, self.device == "cuda")

    @property
    def decoding(self) -> bool:
        return self.continues_state and self.tokens <= self.recurrent_max_tokens

    @property
    def runs(self) -> str:
        """The algorithm that runs: decoding continues with the recurrent one."""
        return "recurrent" if self.decoding else self.algorithm

    @property
    def single_token(self) -> bool:
        return self.tokens == 1

    @property
    def fp64(self) -> bool:
        return self.dtype == torch.float64

    @property
    def has_window(self) -> bool:
        return self.window >= 1

    @property
    def shared_window(self) -> bool:
        """local_mixing: the one-normaliser window (else the core, with the gated window if any)."""
        return self.window >= 1 and self.mixing == "shared_normaliser"

    @property
    def segmented(self) -> bool:
        """Long enough to train in recomputed segments (more than two segments)."""
        return self.tokens > 2 * max(self.segment_tokens, self.chunk_size)


@dataclass(frozen=True)
class Row:
    """``target`` ("module:function") runs every request of ``op`` meeting all ``conditions``
    (attribute of ``Request`` -> the values it may take), fed by the caller's ``adapter``."""

    name: str
    op: str
    target: str
    adapter: str
    conditions: tuple[tuple[str, tuple[Any, ...]], ...] = ()

    def applies(self, request: Request) -> bool:
        return request.op == self.op and all(getattr(request, key) in allowed for key, allowed in self.conditions)

    def implementation(self) -> Callable[..., Any]:
        module, _, name = self.target.partition(":")
        # relative to this package, so that a bundled copy (the HF export) imports its own modules
        found = importlib.import_module(module.replace("megaflex.attention", __package__, 1))
        for attribute in name.split("."):  # "Class.method" too
            found = getattr(found, attribute)
        return found

    def __str__(self) -> str:
        rule = ", ".join(f"{k} in {v}" if len(v) > 1 else f"{k}={v[0]!r}" for k, v in self.conditions)
        return f"{self.name}: {rule or 'always'} -> {self.target} ({self.adapter})"


def _pairs(conditions: dict[str, Any]) -> tuple[tuple[str, tuple[Any, ...]], ...]:
    return tuple((k, v if isinstance(v, tuple) else (v,)) for k, v in conditions.items())


def _row(name: str, target: str, adapter: str, **conditions: Any) -> Row:
    """A row of op ``name``'s first part; causal unless ``form`` is among the conditions."""
    op = name.split(".")[0]
    return Row(name, op, "megaflex.attention." + target, adapter, _pairs({"form": "causal", **conditions}))


_BIDI = dict(form="bidirectional")


_CORE = "core:"
_HYBRID = "hybrid:LocalMixingCore."
_TRITON = "triton:"
_WINDOW = "window."
_NO_DOCS = dict(documents="none")

ROWS: tuple[Row, ...] = (
    # the module a model layer holds: the core alone, or wrapped by the local closers
    _row("module.local_mixing", "hybrid:LocalMixingCore", "wrap", mixes_locally=True, form=ATTENTION_FORMS),
    _row("module.core", "core:AttentionCore", "as_is", mixes_locally=False, form=ATTENTION_FORMS),
    # softmax: a block-causal mask for packed documents, else the KV cache and key mask
    _row("softmax.documents", "softmax:softmax_attention", "softmax_documents",
         documents=("restart_state", "restart_batched")),
    _row("softmax.cached", "softmax:softmax_attention", "softmax", **_NO_DOCS),
    # linear: packed documents first (each document runs as its own call, which comes back here)
    _row("linear.documents.per_document", "documents:run_by_document", "by_document", documents="restart_state"),
    _row("linear.documents.batched", "documents:run_documents_batched", "documents_batched",
         documents="restart_batched"),
    # decoding without autograd: q and k through the map as one batch, one token by the single step
    _row("linear.decode.step", "linear.recurrent:recurrent_step", "decode",
         decoding=True, grad=False, single_token=True, **_NO_DOCS),
    _row("linear.decode.scan", "linear.recurrent:recurrent_linear_attention", "decode",
         decoding=True, grad=False, **_NO_DOCS),
    # the reference forms restart at document starts themselves
    _row("linear.quadratic", "linear.naive:quadratic_linear_attention", "features",
         runs="quadratic", documents=("none", "restart")),
    _row("linear.recurrent", "linear.recurrent:recurrent_linear_attention", "features",
         runs="recurrent", documents=("none", "restart")),
    _row("linear.chunk.by_document", "documents:run_by_document", "chunks_by_document",
         runs="chunked", documents="restart"),
    # the chunked form: trig maps fused into the kernels (no features kept for backward) unless keys are masked
    _row("linear.chunk.triton_trig", _TRITON + "trig_linear_attention", "trig",
         runs="chunked", chunk_backend="triton", trig=True, padded=False, **_NO_DOCS),
    _row("linear.chunk.triton", _TRITON + "triton_linear_attention", "features",
         runs="chunked", chunk_backend="triton", **_NO_DOCS),
    _row("linear.chunk.fla", "linear.chunk_fla:fla_linear_attention", "features",
         runs="chunked", chunk_backend="fla", **_NO_DOCS),
    _row("linear.chunk.torch_trig_cpu", "linear.chunk_trig:trig_linear_attention_chunked", "trig",
         runs="chunked", chunk_backend="torch", trig=True, padded=False, device="cpu", **_NO_DOCS),
    _row("linear.chunk.torch", "linear.chunk:chunked_linear_attention", "features",
         runs="chunked", chunk_backend="torch", **_NO_DOCS),
    # the hybrid (LocalMixingCore): the core with a convolution and/or the gated window, or the one-normaliser window
    _row("local_mixing.core", _HYBRID + "_core_forward", "method", shared_window=False),
    _row("local_mixing.documents", "documents:run_documents_batched", "documents_batched",
         shared_window=True, documents=("restart_state", "restart_batched")),
    _row("local_mixing.segments", _HYBRID + "_segmented", "shared",
         shared_window=True, grad=True, padded=False, algorithm="chunked", segmented=True, **_NO_DOCS),
    _row("local_mixing.shared", _HYBRID + "_shared_forward", "shared", shared_window=True, **_NO_DOCS),
    # the one-normaliser window's numerators; padded keys: the torch-ops blocks; "fla" has no window kernel
    _row("window.quadratic", _WINDOW + "naive:quadratic_numerators", "numerators", runs="quadratic"),
    _row("window.recurrent", _WINDOW + "recurrent:recurrent_numerators", "numerators", runs="recurrent"),
    _row("window.chunk.padded", _WINDOW + "chunk_blocks:blocks_numerators", "numerators", runs="chunked", padded=True),
    _row("window.chunk.triton", _TRITON + "TritonWindowNumerator", "triton_function",
         runs="chunked", backend="triton", has_window=True),
    # "auto" on CUDA keeps fp64 on the torch Function (the kernels' dots are at most fp32)
    _row("window.chunk.triton_auto", _TRITON + "TritonWindowNumerator", "triton_function",
         runs="chunked", backend="auto", chunk_backend="triton", has_window=True, fp64=False),
    _row("window.chunk.torch", _WINDOW + "chunk:ChunkedWindowNumerator", "torch_function", runs="chunked"),
    # bidirectional (after ``REFUSALS``: no state, documents, convolution, gated window or recurrent scan)
    _row("softmax.bidirectional", "softmax:bidirectional_softmax_attention", "softmax_bidirectional", **_BIDI),
    _row("linear.bidirectional.quadratic", "linear.naive:quadratic_bidirectional_linear_attention", "bidirectional",
         runs="quadratic", **_BIDI),
    _row("linear.bidirectional.global", "linear.bidirectional:bidirectional_linear_attention", "bidirectional",
         runs="chunked", **_BIDI),
    _row("local_mixing.bidirectional", _HYBRID + "_bidirectional_forward", "method", shared_window=True, **_BIDI),
    _row("window.bidirectional.quadratic", _WINDOW + "naive:quadratic_bidirectional_numerators", "bidirectional",
         runs="quadratic", **_BIDI),
    _row("window.bidirectional.blocks", _WINDOW + "bidirectional:banded_numerators", "bidirectional",
         runs="chunked", **_BIDI),
)


@dataclass(frozen=True)
class Refusal:
    """A request that no implementation can serve as asked: ``select`` raises ``message`` for it."""

    name: str
    conditions: tuple[tuple[str, tuple[Any, ...]], ...]
    message: str

    def applies(self, request: Request) -> bool:
        return all(getattr(request, key) in allowed for key, allowed in self.conditions)


def _refusal(name: str, message: str, **conditions: Any) -> Refusal:
    return Refusal(name, _pairs({"form": "bidirectional", **conditions}), message)


_FIX = "or build the model causal (ModelConfig.causal=True, AttentionCore(causal=True))"
REFUSALS: tuple[Refusal, ...] = (
    _refusal("bidirectional.state_in", "state: bidirectional attention reads the whole sequence in one call, so "
             "nothing continues from a state (no decoding, KV cache or segments): pass state=None, " + _FIX,
             continues_state=True),
    _refusal("bidirectional.state_out", "return_state: bidirectional attention has no state to continue from "
             "(no decoding or KV cache): pass return_state=False, " + _FIX, returns_state=True),
    _refusal("bidirectional.documents", "document_starts: packed documents do not restart bidirectional attention: "
             "put one document per row (padding with attention_mask / key_mask), " + _FIX,
             documents=("restart", "restart_state", "restart_batched")),
    _refusal("bidirectional.convolution", "qkv_conv_size: the q/k/v convolution is causal (it reads only earlier "
             "tokens): set qkv_conv_size=0 (conv_size=0) with causal=False, " + _FIX, convolves=True),
    _refusal("bidirectional.gated_window", "window_mixing: the 'gated' window is causal only: use window_mixing="
             "'shared_normaliser' with causal=False, " + _FIX, op="local_mixing", has_window=True, mixing="gated"),
    _refusal("bidirectional.decay", "kernel_decay: the decay gamma^(t - s) weighs keys by their age before the query, "
             "which bidirectional attention does not have: set kernel_decay='none' (AttentionCore(decay='none')) with "
             "causal=False, " + _FIX, decays=True),
    _refusal("bidirectional.recurrent", "form: 'recurrent' is the causal token-by-token scan: bidirectional attention "
             "runs form 'chunked' (global sums) or 'quadratic' (the reference), " + _FIX, algorithm="recurrent"),
    _refusal("bidirectional.context_parallel", "context_parallel_size: context parallelism passes each rank the causal "
             "prefix state of the tokens before it: set context_parallel_size=1 with causal=False, " + _FIX,
             context_parallel=True),
)

# The ``Request`` fields that a model's settings fix before any call (model.causal, qkv_conv_size,
# softmax_window, window_mixing; a run's document resets and context parallelism); the others
# describe one call (its tensors, a state in or out, autograd).
SETTING_FIELDS = ("form", "conv_size", "window", "mixing", "documents", "context_parallel")
OPS = tuple(dict.fromkeys(row.op for row in ROWS))


def refusal_of(request: Request) -> Refusal | None:
    """The first of ``REFUSALS`` that ``request`` meets, or None."""
    return next((refusal for refusal in REFUSALS if refusal.applies(request)), None)


def refused_setting(**settings: Any) -> Refusal | None:
    """The refusal that a model set up with ``settings`` (``SETTING_FIELDS``, the rest at their
    defaults) meets in some op before any call, or None: what a config check reports, one line
    before anything is built, instead of a traceback at the first forward."""
    unknown = sorted(set(settings) - set(SETTING_FIELDS))
    if unknown:
        raise TypeError(f"refused_setting: {unknown} are not settings; expected some of {SETTING_FIELDS}")
    for op in OPS:
        found = refusal_of(Request(op, **settings))
        if found is not None:
            return found
    return None


class NoAttentionImplementation(ValueError):
    """No row of the dispatch table takes this request."""


class RefusedAttention(ValueError):
    """The request asks for something its form cannot mean (``REFUSALS``); the message says the fix."""


_observers: list[Callable[[Request, Row], None]] = []


def select(request: Request, rows: tuple[Row, ...] = ROWS) -> Row:
    """The first row of ``rows`` that takes ``request``; ``RefusedAttention`` for a refused one."""
    refusal = refusal_of(request)
    if refusal is not None:
        raise RefusedAttention(refusal.message)
    for row in rows:
        if row.applies(request):
            for observe in _observers:
                observe(request, row)
            return row
    described = ", ".join(f"{f.name}={getattr(request, f.name)!r}" for f in fields(request))
    raise NoAttentionImplementation(f"no attention implementation for Request({described})")


@contextmanager
def recording() -> Iterator[list[tuple[Request, Row]]]:
    """Every (request, row) ``select`` answers inside the block, in order (tests: which rows ran)."""
    seen: list[tuple[Request, Row]] = []
    observe = lambda request, row: seen.append((request, row))  # noqa: E731
    _observers.append(observe)
    try:
        yield seen
    finally:
        _observers.remove(observe)


def describe(rows: tuple[Row, ...] = ROWS) -> str:
    """The table, one row a line."""
    return "\n".join(str(row) for row in rows)
