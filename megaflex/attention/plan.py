"""The forms of an ``AttentionCore``, as imported functions, and its plan: which of them it runs,
resolved once when the core is built (``plan_core``).

A core's build fixes its kind (softmax or a feature map), its algorithm (``form``: chunked, recurrent,
quadratic), ``causal`` and ``backend``; only the device of the tensors, decoding, padding and packed
documents are left to each call. ``CorePlan`` holds what the build decides: the refusal the settings
meet (if any) and the chunked forms on each device (``ChunkedForms``: the fused trig-map kernel and the
on-features one). ``AttentionCore._run`` then picks among decode / documents / softmax / chunked in
plain code and calls the row by name (fla's layers: the form chosen in one line, then the kernel).

``CORE_ROWS`` is this module's part of the inspectable list (``dispatch.ROWS``): each row holds the
function it runs and the conditions under which ``AttentionCore`` / ``causal_linear_attention`` pick it.
"""

from __future__ import annotations

from dataclasses import dataclass

from .forms import BIDIRECTIONAL, NO_DOCUMENTS, Refusal, Row, check_backend, chunked_backend, refused_build, row
from .documents import run_by_document, run_documents_batched
from .linear.bidirectional import bidirectional_linear_attention
from .linear.chunk import chunked_linear_attention
from .linear.chunk_fla import fla_linear_attention
from .linear.chunk_trig import trig_linear_attention_chunked
from .linear.naive import quadratic_bidirectional_linear_attention, quadratic_linear_attention
from .linear.recurrent import recurrent_linear_attention, recurrent_step
from .softmax import bidirectional_softmax_attention, softmax_attention
from .triton import trig_linear_attention, triton_linear_attention

# softmax: a block-causal mask for packed documents, else the KV cache and key mask
SOFTMAX_DOCUMENTS = row("softmax.documents", softmax_attention, "softmax_documents",
                        documents=("restart_state", "restart_batched"))
SOFTMAX_CACHED = row("softmax.cached", softmax_attention, "softmax", **NO_DOCUMENTS)
# linear: packed documents first (each document runs as its own call, by the rows below)
PER_DOCUMENT = row("linear.documents.per_document", run_by_document, "by_document", documents="restart_state")
DOCUMENTS_BATCHED = row("linear.documents.batched", run_documents_batched, "documents_batched",
                        documents="restart_batched")
# decoding without autograd: q and k through the map as one batch, one token by the single step
DECODE_STEP = row("linear.decode.step", recurrent_step, "decode", decoding=True, grad=False, single_token=True,
                  **NO_DOCUMENTS)
DECODE_SCAN = row("linear.decode.scan", recurrent_linear_attention, "decode", decoding=True, grad=False, **NO_DOCUMENTS)
# the reference forms restart at document starts themselves
QUADRATIC = row("linear.quadratic", quadratic_linear_attention, "features", runs="quadratic",
                documents=("none", "restart"))
RECURRENT = row("linear.recurrent", recurrent_linear_attention, "features", runs="recurrent",
                documents=("none", "restart"))
CHUNKS_BY_DOCUMENT = row("linear.chunk.by_document", run_by_document, "chunks_by_document", runs="chunked",
                         documents="restart")
# the chunked form: trig maps fused into the kernels (no features kept for backward) unless keys are masked
TRITON_TRIG = row("linear.chunk.triton_trig", trig_linear_attention, "trig", runs="chunked", chunk_backend="triton",
                  trig=True, padded=False, **NO_DOCUMENTS)
TRITON = row("linear.chunk.triton", triton_linear_attention, "features", runs="chunked", chunk_backend="triton",
             **NO_DOCUMENTS)
FLA = row("linear.chunk.fla", fla_linear_attention, "features", runs="chunked", chunk_backend="fla", **NO_DOCUMENTS)
TORCH_TRIG_CPU = row("linear.chunk.torch_trig_cpu", trig_linear_attention_chunked, "trig", runs="chunked",
                     chunk_backend="torch", trig=True, padded=False, device="cpu", **NO_DOCUMENTS)
TORCH = row("linear.chunk.torch", chunked_linear_attention, "features", runs="chunked", chunk_backend="torch",
            **NO_DOCUMENTS)
# bidirectional (no state, documents or recurrent scan: ``dispatch.REFUSALS``)
SOFTMAX_BIDIRECTIONAL = row("softmax.bidirectional", bidirectional_softmax_attention, "softmax_bidirectional",
                            **BIDIRECTIONAL)
QUADRATIC_BIDIRECTIONAL = row("linear.bidirectional.quadratic", quadratic_bidirectional_linear_attention,
                              "bidirectional", runs="quadratic", **BIDIRECTIONAL)
GLOBAL_BIDIRECTIONAL = row("linear.bidirectional.global", bidirectional_linear_attention, "bidirectional",
                           runs="chunked", **BIDIRECTIONAL)

CORE_ROWS: tuple[Row, ...] = (
    SOFTMAX_DOCUMENTS, SOFTMAX_CACHED, PER_DOCUMENT, DOCUMENTS_BATCHED, DECODE_STEP, DECODE_SCAN, QUADRATIC, RECURRENT,
    CHUNKS_BY_DOCUMENT, TRITON_TRIG, TRITON, FLA, TORCH_TRIG_CPU, TORCH,
    SOFTMAX_BIDIRECTIONAL, QUADRATIC_BIDIRECTIONAL, GLOBAL_BIDIRECTIONAL,
)  # fmt: skip


@dataclass(frozen=True)
class ChunkedForms:
    """The chunked form on one device: ``fused`` takes q, k and the trig map's parameters (unpadded keys
    only; None where the backend has no fused kernel), ``features`` takes the mapped features."""

    fused: Row | None
    features: Row


def chunked_forms(backend: str, device: str) -> ChunkedForms:
    """The chunked forms ``backend`` (auto | torch | triton | fla) runs on tensors of ``device`` type
    ("auto": Triton on CUDA, torch elsewhere; ``dispatch.chunked_backend``)."""
    runs_on = chunked_backend(backend, device == "cuda")
    if runs_on == "triton":
        return ChunkedForms(TRITON_TRIG, TRITON)
    if runs_on == "fla":
        return ChunkedForms(None, FLA)
    return ChunkedForms(TORCH_TRIG_CPU if device == "cpu" else None, TORCH)


@dataclass(frozen=True)
class CorePlan:
    """What a core's build decides: ``refusal`` (raised at its calls, after the calls' own ones: a core
    is built before the model is, and ``build_attention`` raises it there), and ``chunked``, the
    chunked forms per device type (CPU and CUDA resolved at build; others on the spot)."""

    backend: str
    algorithm: str  # "chunked" | "recurrent" | "quadratic"
    causal: bool
    refusal: Refusal | None
    chunked: dict[str, ChunkedForms]

    def chunked_on(self, device: str) -> ChunkedForms:
        found = self.chunked.get(device)
        return found if found is not None else chunked_forms(self.backend, device)

    @property
    def bidirectional(self) -> Row:
        """The bidirectional linear form of ``algorithm`` (the recurrent one is refused)."""
        return QUADRATIC_BIDIRECTIONAL if self.algorithm == "quadratic" else GLOBAL_BIDIRECTIONAL


def plan_core(*, softmax: bool, algorithm: str, causal: bool, backend: str, decays: bool) -> CorePlan:
    """The plan of a core of these build settings."""
    check_backend(backend)
    form = "causal" if causal else "bidirectional"
    refusal = refused_build("softmax" if softmax else "linear", form=form, algorithm=algorithm, decays=decays)
    chunked = {device: chunked_forms(backend, device) for device in ("cpu", "cuda")}
    return CorePlan(backend, algorithm, causal, refusal, chunked)
