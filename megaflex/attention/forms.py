"""The pieces of the attention forms that every module holding some imports: ``Row`` (a form: the
imported function it runs, and when it runs), ``Request`` (the axes a row's conditions read),
``REFUSALS`` (what no form serves, with the fix) and the chunked backends. Imports nothing of the package
(``dispatch.py`` gathers the rows; ``plan.py``, ``hybrid.py`` and ``window/`` hold them).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
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
    """One form: ``fn`` (an imported function or autograd Function) runs the requests of ``op`` (the
    first part of ``name``) meeting all ``conditions`` (attribute of ``Request`` -> the values it may
    take), called with the ``adapter`` calling convention. The modules pick their rows in plain code
    and call them (``row(...)``, or ``row.chosen()`` for a class); the conditions describe that choice."""

    name: str
    fn: Callable[..., Any]
    adapter: str
    conditions: tuple[tuple[str, tuple[Any, ...]], ...] = ()

    @property
    def op(self) -> str:
        return self.name.split(".")[0]

    @property
    def target(self) -> str:
        """"module:qualname" of ``fn``, read off the function (for the docs and tests)."""
        return f"{self.fn.__module__}:{self.fn.__qualname__}"

    def applies(self, request: Request) -> bool:
        return request.op == self.op and all(getattr(request, key) in allowed for key, allowed in self.conditions)

    def implementation(self) -> Callable[..., Any]:
        return self.fn

    def chosen(self) -> Callable[..., Any]:
        """``fn``, after telling ``recording`` that this row runs."""
        for observe in _observers:
            observe(None, self)
        return self.fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.chosen()(*args, **kwargs)

    def __str__(self) -> str:
        rule = ", ".join(f"{k} in {v}" if len(v) > 1 else f"{k}={v[0]!r}" for k, v in self.conditions)
        return f"{self.name}: {rule or 'always'} -> {self.target} ({self.adapter})"


def _pairs(conditions: dict[str, Any]) -> tuple[tuple[str, tuple[Any, ...]], ...]:
    return tuple((k, v if isinstance(v, tuple) else (v,)) for k, v in conditions.items())


def row(name: str, fn: Callable[..., Any], adapter: str, **conditions: Any) -> Row:
    """A row; causal unless ``form`` is among the conditions."""
    return Row(name, fn, adapter, _pairs({"form": "causal", **conditions}))


BIDIRECTIONAL = dict(form="bidirectional")
NO_DOCUMENTS = dict(documents="none")


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

_REFUSAL_MESSAGES = {refusal.name: refusal.message for refusal in REFUSALS}

# The ``Request`` fields that a model's settings fix before any call (model.causal, qkv_conv_size,
# softmax_window, window_mixing; a run's document resets and context parallelism); the others
# describe one call (its tensors, a state in or out, autograd).
SETTING_FIELDS = ("form", "conv_size", "window", "mixing", "decays", "documents", "context_parallel")
# every op of ``ROWS``, in its order (a test checks that they agree)
OPS = ("module", "softmax", "linear", "local_mixing", "window")


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


# The ``Request`` fields a module's construction fixes (``plan.plan_core``, ``LocalMixingCore``): a
# refusal they meet is raised when the module is built, not at its first call.
BUILD_FIELDS = ("form", "algorithm", "conv_size", "window", "mixing", "decays")


def refused_build(op: str, **settings: Any) -> Refusal | None:
    """The refusal that a module of ``op`` built with ``settings`` (``BUILD_FIELDS``) meets, or None."""
    unknown = sorted(set(settings) - set(BUILD_FIELDS))
    if unknown:
        raise TypeError(f"refused_build: {unknown} are not build settings; expected some of {BUILD_FIELDS}")
    return refusal_of(Request(op, **settings))


def refuse_call(*, continues_state: bool, returns_state: bool, documents: bool) -> None:
    """``RefusedAttention`` for what one bidirectional call asks beyond its module's settings (a state in
    or out, packed documents), in ``REFUSALS``' order."""
    for name, asked in (("state_in", continues_state), ("state_out", returns_state), ("documents", documents)):
        if asked:
            raise RefusedAttention(_REFUSAL_MESSAGES["bidirectional." + name])


class NoAttentionImplementation(ValueError):
    """No row of ``dispatch.ROWS`` describes this request."""


class RefusedAttention(ValueError):
    """The request asks for something its form cannot mean (``REFUSALS``); the message says the fix."""


_observers: list[Callable[[None, Row], None]] = []


@contextmanager
def recording() -> Iterator[list[tuple[None, Row]]]:
    """(None, row) for every row that runs inside the block, in order (tests: which rows ran)."""
    seen: list[tuple[None, Row]] = []
    observe = lambda request, ran: seen.append((request, ran))  # noqa: E731
    _observers.append(observe)
    try:
        yield seen
    finally:
        _observers.remove(observe)
