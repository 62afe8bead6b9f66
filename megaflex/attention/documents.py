"""Document boundaries in packed sequences (``data.document_boundaries: reset``).

A packed sample holds several documents, each ending with the tokenizer's EOD token. With resets,
attention never crosses a document start: a token attends only to the earlier tokens of its own
document, so the linear state restarts at each start, and softmax attention is block-causal.

The document structure reaches attention as ``document_starts`` [B, N] bool: True where a token
begins a document (the token after an EOD). A start at position 0 only matters when the call
continues a state (decoding, or a context-parallel slice): the state then belongs to another
document and is dropped.

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


# (starts on a GPU, its version, host copy): every layer of a forward gets the same starts tensor,
# so the host reads them once per forward (a device-to-host copy waits for the GPU), not per layer
_HOST_COPY: list = []


def _on_host(document_starts: torch.Tensor) -> torch.Tensor:
    if document_starts.device.type == "cpu":
        return document_starts
    if _HOST_COPY and _HOST_COPY[0] is document_starts and _HOST_COPY[1] == document_starts._version:
        return _HOST_COPY[2]
    host = document_starts.detach().cpu()
    _HOST_COPY[:] = [document_starts, document_starts._version, host]
    return host


def has_restarts(document_starts: torch.Tensor | None, continues_state: bool) -> bool:
    """Whether ``document_starts`` changes anything: a start after position 0, or at 0 when the
    call continues a state. False keeps the plain path (bit-identical to no boundaries)."""
    if document_starts is None:
        return False
    starts = _on_host(document_starts)
    return bool((starts if continues_state else starts[:, 1:]).any())


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
    document_starts: torch.Tensor,
    initial_state: LinearAttentionState | None,
) -> tuple[torch.Tensor, LinearAttentionState]:
    """``run`` over every document of every row on its own: ``per_token`` tensors [B, H, N, ...]
    (or None) are cut along dim 2; the first document of row b continues ``initial_state``'s row b
    unless it starts at position 0. Returns (out [B, H, N, Dv], the state after each row's last
    document, offset = initial offset + N)."""
    batch, n = document_starts.shape
    starts = _on_host(document_starts)
    row_outs: list[list[torch.Tensor]] = [[] for _ in range(batch)]
    finals: list[LinearAttentionState] = [None] * batch  # type: ignore[list-item]
    for b, lo, hi in _document_spans(document_starts):  # in order: a row's last document comes last
        carried = initial_state is not None and lo == 0 and not bool(starts[b, 0])
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


def _document_spans(document_starts: torch.Tensor) -> list[tuple[int, int, int]]:
    """(row, first token, end) of every document of every row, in order."""
    n = document_starts.shape[1]
    starts = _on_host(document_starts)
    spans = []
    for b in range(starts.shape[0]):
        cuts = [0, *(int(i) for i in torch.nonzero(starts[b, 1:]).flatten() + 1), n]
        spans.extend((b, lo, hi) for lo, hi in zip(cuts[:-1], cuts[1:]))
    return spans


def run_documents_batched(
    run: SegmentFn,
    per_token: Sequence[torch.Tensor],
    document_starts: torch.Tensor,
    initial_state: LinearAttentionState | None,
) -> torch.Tensor:
    """``run_by_document``'s outputs (not its state) with the documents batched: documents whose
    lengths round up to the same power of two become the rows of one call, right-padded with zeros
    (causal: the padding reaches no real token, and its outputs are dropped). ``per_token``
    [B, H, N, *]; ``run``'s state argument is the batched incoming state (a row per document: the
    row's own state for a row's first document when it does not start at 0, else an empty one)."""
    batch, n = document_starts.shape
    starts = _on_host(document_starts)
    buckets: dict[int, list[tuple[int, int, int]]] = {}
    for b, lo, hi in _document_spans(document_starts):
        buckets.setdefault(1 << (hi - lo - 1).bit_length(), []).append((b, lo, hi))
    device = per_token[0].device
    # token-major rows [B N + 1, H, *], the last one zeros: the padding's source
    rows = [torch.cat([t.transpose(1, 2).reshape(batch * n, *t.shape[1:2], *t.shape[3:]),
                       t.new_zeros(1, t.shape[1], *t.shape[3:])]) for t in per_token]  # fmt: skip
    outs, where = [], torch.empty(batch * n, dtype=torch.long)
    done = 0
    for length, docs in sorted(buckets.items()):
        offsets = torch.arange(length)
        index = torch.stack([torch.where(offsets < hi - lo, b * n + lo + offsets, batch * n) for b, lo, hi in docs])
        gathered = [r.index_select(0, index.flatten().to(device)).view(len(docs), length, *r.shape[1:]).transpose(1, 2)
                    for r in rows]  # fmt: skip
        state = None
        if initial_state is not None:
            carried = [b if lo == 0 and not bool(starts[b, 0]) else -1 for b, lo, _ in docs]
            state = _states_of(initial_state, carried)
        out, _ = run(gathered, state)  # [D, H, length, Dv]
        outs.append(out.transpose(1, 2).reshape(len(docs) * length, *out.shape[1:2], out.shape[-1]))
        for i, (b, lo, hi) in enumerate(docs):
            where[b * n + lo : b * n + hi] = done + i * length + torch.arange(hi - lo)
        done += len(docs) * length
    out = torch.cat(outs).index_select(0, where.to(device))  # [B N, H, Dv]
    return out.view(batch, n, *out.shape[1:]).transpose(1, 2)


def _states_of(state: LinearAttentionState, rows: list[int]) -> LinearAttentionState:
    """A state with ``state``'s row b for each b in ``rows``, the empty state for -1."""
    empty = LinearAttentionState.empty(1, state.kv.shape[1], state.kv.shape[2], state.kv.shape[3], state.kv.device,
                                       state.kv.dtype)  # fmt: skip
    index = torch.tensor([b if b >= 0 else state.kv.shape[0] for b in rows], device=state.kv.device)
    fields = [torch.cat([getattr(state, f), getattr(empty, f).to(getattr(state, f).dtype)]).index_select(0, index)
              for f in ("kv", "k_sum", "log_max")]  # fmt: skip
    return LinearAttentionState(*fields, offset=state.offset)
