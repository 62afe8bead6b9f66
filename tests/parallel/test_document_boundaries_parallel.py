"""Document boundaries under context parallelism (gloo CPU ranks): each rank's slice of a packed
batch matches the single-rank run, which ``test_document_boundaries`` checks against the documents
run separately. The rows cut documents inside slices, exactly at a slice start, and let one
document span slices, so a rank continues only the ranks after the last reset before it."""

from __future__ import annotations

import pytest
import torch

from distributed import run_distributed
from megaflex.attention import AttentionCore
from megaflex.parallel import ParallelState, sequence_slice
from attention_helpers import form_steps
from numerics import assert_close, normwise_scale
from test_context_parallel import outputs_and_grads

N = 36
# row 0: starts at 7 and 12 (the start of rank 1's slice at CP=3), then one document to the end;
# row 1: one start at 20 (inside the middle slice at CP=3, the second at CP=2)
ROW_STARTS = ((7, 12), (20,))


def _starts() -> torch.Tensor:
    starts = torch.zeros(len(ROW_STARTS), N, dtype=torch.bool)
    for b, row in enumerate(ROW_STARTS):
        starts[b, list(row)] = True
    return starts


def _run(state: ParallelState | None) -> dict:
    torch.manual_seed(0)
    core = AttentionCore("flexformer_n", 2, 8, feature_dim=16, chunk_size=8, backend="torch")
    gen = torch.Generator().manual_seed(1)
    q, k, v, weight = (torch.randn(2, 2, N, 8, generator=gen) for _ in range(4))
    k = 3 * k  # spread the key log-scales, so the ranks' maxima differ
    starts = _starts()
    steps = form_steps(core.feature_map, q, k, v) + 2 * (q[..., 0].numel() + 3)
    if state is not None:
        q, k, v, weight = (sequence_slice(t, state.cp_rank, state.cp_size, dim=2) for t in (q, k, v, weight))
        starts = sequence_slice(starts, state.cp_rank, state.cp_size, dim=1)
    return {**outputs_and_grads(core, state, q, k, v, weight, document_starts=starts), "steps": steps}


def _worker(rank: int, world: int) -> int:
    state = ParallelState.create(context_parallel_size=world)
    ref, got = _run(None), _run(state)
    terms = max(normwise_scale(g) for g in [ref["q"], ref["k"], ref["v"], *ref["params"].values()])
    for name in ("out", "q", "k", "v"):
        want = sequence_slice(ref[name], state.cp_rank, state.cp_size, dim=2)
        assert_close(got[name], want, steps=ref["steps"], floor=0.0 if name == "out" else terms, name=f"rank {rank} {name}")
    for name, want in ref["params"].items():
        assert_close(got["params"][name], want, steps=ref["steps"], floor=terms, name=f"rank {rank} {name}")
    return len(ref["params"])


@pytest.mark.slow
@pytest.mark.parametrize("cp", [2, 3])
def test_context_parallel_restarts_at_document_starts(cp: int) -> None:
    assert all(count > 0 for count in run_distributed(_worker, cp))
