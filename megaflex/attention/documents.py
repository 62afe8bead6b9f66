"""Document boundaries in packed sequences (``data.document_boundaries: reset``).

A packed sample holds several documents, each ending with the tokenizer's EOD token. With resets,
attention never crosses a document start: a token attends only to the earlier tokens of its own
document, so the linear state restarts at each start, and softmax attention is block-causal.

The document structure reaches attention as ``document_starts``: a [B, N] bool tensor, True where a
token begins a document (the token after an EOD), or its ``DocumentLayout`` (the starts read to the
host, the documents' spans and the batched plan: built once per forward by ``GPT.forward`` and
shared by every layer and the backward recompute; a plain tensor gets its layout on the spot).
A start at position 0 only matters when the call continues a state (decoding, or a context-parallel
slice): the state then belongs to another document and is dropped.

``run_by_document`` is the restart for any linear form or backend: each row is cut at its starts
and each document runs on its own (the first from the incoming state unless it starts at 0, the
others from empty). So every form agrees with running the documents separately by construction,
at the cost of one call per document. ``run_documents_batched`` (no final state wanted: training)
batches the documents instead: those of similar length (padded on the right to the next power of
two, which no real token attends to) go through one call, so a batch costs a few calls, not one
per document.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from .base import LinearAttentionState

# (token-sliced tensors, initial state | None) -> (out [1, H, n, Dv], state after the slice)
SegmentFn = Callable[[Sequence[torch.Tensor | None], LinearAttentionState | None], tuple[torch.Tensor, LinearAttentionState]]


def document_positions(input_ids: torch.Tensor, eod_id: int) -> torch.Tensor:
    """input_ids [B, N] -> [B, N] int64 position of each token within its document (0 at a start:
    position 0 and every token after an EOD; a sample that begins mid-document counts from 0)."""
    n = input_ids.shape[-1]
    index = torch.arange(n, device=input_ids.device).expand_as(input_ids)
    starts = torch.zeros_like(input_ids, dtype=torch.bool)
    starts[..., 1:] = input_ids[..., :-1] == eod_id
    start_index = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=-1).values
    return index - start_index


def document_ids(document_starts: torch.Tensor) -> torch.Tensor:
    """[B, N] bool starts -> [B, N] int64 index of each token's document in its row (0 before the first start)."""
    return document_starts.long().cumsum(dim=-1)


class DocumentLayout:
    """The document structure of one [B, N] ``starts`` tensor, for every layer of a forward: the
    starts are read to the host once (a device-to-host copy waits for the GPU), the documents'
    spans are cut once, and ``run_documents_batched``'s plan (length buckets, gather indices) is
    built at its first use. Build it with ``from_starts``; it assumes ``starts`` does not change."""

    def __init__(self, starts: torch.Tensor, host: torch.Tensor, spans: list[tuple[int, int, int]]) -> None:
        self.starts = starts  # [B, N] bool, on the compute device
        self.host = host  # the same on the host
        self.spans = spans  # (row, first token, end) of every document of every row, in order
        self._ids: torch.Tensor | None = None
        self._plan: _BatchedPlan | None = None

    @classmethod
    def from_starts(cls, starts: torch.Tensor) -> "DocumentLayout":
        if starts.dtype != torch.bool or starts.dim() != 2:
            raise ValueError(
                f"document_starts: expected a [B, N] bool tensor, got {starts.dtype} {tuple(starts.shape)}"
            )
        host = starts if starts.device.type == "cpu" else starts.detach().cpu()
        return cls(starts, host, _document_spans(host))

    @property
    def shape(self) -> tuple[int, int]:
        return (self.starts.shape[0], self.starts.shape[1])

    def has_restarts(self, continues_state: bool) -> bool:
        """Whether the starts change anything: a start after position 0, or at 0 when the call
        continues a state. False keeps the plain path (bit-identical to no boundaries)."""
        return bool((self.host if continues_state else self.host[:, 1:]).any())

    def continues_state(self, row: int) -> bool:
        """Whether row ``row``'s first document continues an incoming state (it does not start at 0)."""
        return not bool(self.host[row, 0])

    @property
    def ids(self) -> torch.Tensor:
        """[B, N] int64 index of each token's document in its row (``document_ids``)."""
        if self._ids is None:
            self._ids = document_ids(self.starts)
        return self._ids

    @property
    def batched_plan(self) -> "_BatchedPlan":
        if self._plan is None:
            self._plan = _BatchedPlan.of(self)
        return self._plan


def document_layout(document_starts: DocumentLayout | torch.Tensor | None) -> DocumentLayout | None:
    """``document_starts`` as a ``DocumentLayout`` (a [B, N] bool tensor gets one built on the spot)."""
    if document_starts is None or isinstance(document_starts, DocumentLayout):
        return document_starts
    return DocumentLayout.from_starts(document_starts)


def has_restarts(document_starts: DocumentLayout | torch.Tensor | None, continues_state: bool) -> bool:
    """Whether ``document_starts`` changes anything (``DocumentLayout.has_restarts``)."""
    layout = document_layout(document_starts)
    return layout is not None and layout.has_restarts(continues_state)


def block_causal_mask(document_starts: torch.Tensor) -> torch.Tensor:
    """[B, N] starts -> [B, 1, N, N] bool, True where key s <= query t lies in t's document."""
    docs = document_ids(document_starts)
    n = docs.shape[-1]
    causal = torch.ones(n, n, dtype=torch.bool, device=docs.device).tril()
    return (causal & (docs.unsqueeze(-1) == docs.unsqueeze(-2))).unsqueeze(1)


def _row_state(state: LinearAttentionState, b: int) -> LinearAttentionState:
    return LinearAttentionState(state.kv[b : b + 1], state.k_sum[b : b + 1], state.log_max[b : b + 1], state.offset)


def run_by_document(
    run: SegmentFn,
    per_token: Sequence[torch.Tensor | None],
    document_starts: DocumentLayout | torch.Tensor,
    initial_state: LinearAttentionState | None,
) -> tuple[torch.Tensor, LinearAttentionState]:
    """``run`` over every document of every row on its own: ``per_token`` tensors [B, H, N, ...]
    (or None) are cut along dim 2; the first document of row b continues ``initial_state``'s row b
    unless it starts at position 0. Returns (out [B, H, N, Dv], the state after each row's last
    document, offset = initial offset + N)."""
    layout = document_layout(document_starts)
    batch, n = layout.shape
    row_outs: list[list[torch.Tensor]] = [[] for _ in range(batch)]
    finals: list[LinearAttentionState] = [None] * batch  # type: ignore[list-item]
    for b, lo, hi in layout.spans:  # in order: a row's last document comes last
        carried = initial_state is not None and lo == 0 and layout.continues_state(b)
        sliced = [None if t is None else t[b : b + 1, :, lo:hi] for t in per_token]
        out, finals[b] = run(sliced, _row_state(initial_state, b) if carried else None)
        row_outs[b].append(out)
    outs = [torch.cat(parts, dim=2) for parts in row_outs]
    offset = (0 if initial_state is None else initial_state.offset) + n
    final = LinearAttentionState(
        kv=torch.cat([s.kv for s in finals]),
        k_sum=torch.cat([s.k_sum for s in finals]),
        log_max=torch.cat([s.log_max for s in finals]),
        offset=offset,
    )
    return torch.cat(outs), final


def _document_spans(starts: torch.Tensor) -> list[tuple[int, int, int]]:
    """(row, first token, end) of every document of every row of host ``starts`` [B, N], in order."""
    n = starts.shape[1]
    spans = []
    for b in range(starts.shape[0]):
        cuts = [0, *(int(i) for i in torch.nonzero(starts[b, 1:]).flatten() + 1), n]
        spans.extend((b, lo, hi) for lo, hi in zip(cuts[:-1], cuts[1:]))
    return spans


class _BatchedPlan:
    """How ``run_documents_batched`` batches a layout's documents: one bucket per power-of-two
    length (the documents that round up to it), each with the gather index of its rows' tokens into
    token-major rows [B N + 1] (the last one zeros: the padding's source), and ``where``, each
    token's place in the buckets' concatenated outputs. Index tensors live on the starts' device."""

    def __init__(
        self, buckets: list[tuple[int, list[tuple[int, int, int]], torch.Tensor]], where: torch.Tensor
    ) -> None:
        self.buckets = buckets  # (length, documents (row, lo, hi), gather index [D length]), by length
        self.where = where  # [B N]

    @classmethod
    def of(cls, layout: DocumentLayout) -> "_BatchedPlan":
        batch, n = layout.shape
        by_length: dict[int, list[tuple[int, int, int]]] = {}
        for b, lo, hi in layout.spans:
            by_length.setdefault(1 << (hi - lo - 1).bit_length(), []).append((b, lo, hi))
        device = layout.starts.device
        buckets, where, done = [], torch.empty(batch * n, dtype=torch.long), 0
        for length, docs in sorted(by_length.items()):
            offsets = torch.arange(length)
            index = torch.stack([torch.where(offsets < hi - lo, b * n + lo + offsets, batch * n) for b, lo, hi in docs])
            buckets.append((length, docs, index.flatten().to(device)))
            for i, (b, lo, hi) in enumerate(docs):
                where[b * n + lo : b * n + hi] = done + i * length + torch.arange(hi - lo)
            done += len(docs) * length
        return cls(buckets, where.to(device))


def run_documents_batched(
    run: SegmentFn,
    per_token: Sequence[torch.Tensor],
    document_starts: DocumentLayout | torch.Tensor,
    initial_state: LinearAttentionState | None,
) -> torch.Tensor:
    """``run_by_document``'s outputs (not its state) with the documents batched: documents whose
    lengths round up to the same power of two become the rows of one call, right-padded with zeros
    (causal: the padding reaches no real token, and its outputs are dropped). ``per_token``
    [B, H, N, *]; ``run``'s state argument is the batched incoming state (a row per document: the
    row's own state for a row's first document when it does not start at 0, else an empty one)."""
    layout = document_layout(document_starts)
    batch, n = layout.shape
    plan = layout.batched_plan
    device = per_token[0].device
    # token-major rows [B N + 1, H, *], the last one zeros: the padding's source
    rows = [torch.cat([t.transpose(1, 2).reshape(batch * n, *t.shape[1:2], *t.shape[3:]),
                       t.new_zeros(1, t.shape[1], *t.shape[3:])]) for t in per_token]  # fmt: skip
    outs = []
    for length, docs, index in plan.buckets:
        gathered = [r.index_select(0, index.to(device)).view(len(docs), length, *r.shape[1:]).transpose(1, 2)
                    for r in rows]  # fmt: skip
        state = None
        if initial_state is not None:
            carried = [b if lo == 0 and layout.continues_state(b) else -1 for b, lo, _ in docs]
            state = _states_of(initial_state, carried)
        out, _ = run(gathered, state)  # [D, H, length, Dv]
        outs.append(out.transpose(1, 2).reshape(len(docs) * length, *out.shape[1:2], out.shape[-1]))
    out = torch.cat(outs).index_select(0, plan.where.to(device))  # [B N, H, Dv]
    return out.view(batch, n, *out.shape[1:]).transpose(1, 2)


def _states_of(state: LinearAttentionState, rows: list[int]) -> LinearAttentionState:
    """A state with ``state``'s row b for each b in ``rows``, the empty state for -1."""
    empty = LinearAttentionState.empty(1, state.kv.shape[1], state.kv.shape[2], state.kv.shape[3], state.kv.device,
                                       state.kv.dtype)  # fmt: skip
    index = torch.tensor([b if b >= 0 else state.kv.shape[0] for b in rows], device=state.kv.device)
    fields = [torch.cat([getattr(state, f), getattr(empty, f).to(getattr(state, f).dtype)]).index_select(0, index)
              for f in ("kv", "k_sum", "log_max")]  # fmt: skip
    return LinearAttentionState(*fields, offset=state.offset)
