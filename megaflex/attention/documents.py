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
at the cost of one call per document.
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


def has_restarts(document_starts: torch.Tensor | None, continues_state: bool) -> bool:
    """Whether ``document_starts`` changes anything: a start after position 0, or at 0 when the
    call continues a state. False keeps the plain path (bit-identical to no boundaries)."""
    if document_starts is None:
        return False
    starts = document_starts if continues_state else document_starts[:, 1:]
    return bool(starts.any())


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
    outs, finals = [], []
    starts = document_starts.detach().cpu()
    for b in range(batch):
        cuts = [0, *(int(i) for i in torch.nonzero(starts[b, 1:]).flatten() + 1), n]
        row_outs, state = [], None
        for lo, hi in zip(cuts[:-1], cuts[1:]):
            carried = initial_state is not None and lo == 0 and not bool(starts[b, 0])
            sliced = [None if t is None else t[b : b + 1, :, lo:hi] for t in per_token]
            out, state = run(sliced, _row_state(initial_state, b) if carried else None)
            row_outs.append(out)
        outs.append(torch.cat(row_outs, dim=2))
        finals.append(state)
    offset = (0 if initial_state is None else initial_state.offset) + n
    final = LinearAttentionState(
        kv=torch.cat([s.kv for s in finals]),
        k_sum=torch.cat([s.k_sum for s in finals]),
        log_max=torch.cat([s.log_max for s in finals]),
        offset=offset,
    )
    return torch.cat(outs), final
