"""Context parallelism of the one-normaliser window hybrid: CP = 2 equals one rank (outputs, every gradient)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from distributed import run_distributed
from megaflex.attention import AttentionCore
from megaflex.attention.hybrid import LocalMixingCore
from megaflex.parallel import ParallelState
from megaflex.parallel.context_parallel import sequence_slice
from megaflex.parallel.context_parallel_window import ContextParallelWindowAttention
from attention_helpers import attention_steps, log_scale_spread
from numerics import assert_close, normwise_scale

CASES = [("flexformer_n", 1, "rms"), ("flexformer_n", 16, "rms"), ("flexformer_n", 21, "denominator"),
         ("performer", 8, "rms"), ("softmax", 8, "rms")]  # (kind, W, normalization); slices of 21 tokens


def _run(kind: str, window: int, normalization: str, n: int, state: ParallelState | None) -> dict:
    torch.manual_seed(0)
    kwargs = {} if kind == "softmax" else dict(feature_dim=16, normalization=normalization)
    core = LocalMixingCore(AttentionCore(kind, 2, 8, chunk_size=8, **kwargs), window=window)
    gen = torch.Generator().manual_seed(1)
    q, k, v, weight = (torch.randn(2, 2, n, 8, generator=gen) for _ in range(4))
    if state is not None:
        q, k, v, weight = (sequence_slice(t, state.cp_rank, state.cp_size, dim=2) for t in (q, k, v, weight))
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    attend = core if state is None else ContextParallelWindowAttention(core, state)
    out, _ = attend(q, k, v)
    (out * weight).sum().backward()
    params = {name: p.grad.clone() for name, p in core.named_parameters()}
    if state is not None:
        for g in params.values():
            dist.all_reduce(g, group=state.cp_group)
    with torch.no_grad():
        fm = core.core.feature_map
        spread = 0.0 if fm is None else log_scale_spread(fm(q, 0).log_scale, fm(k, 0).log_scale)
        logits = (q @ k.transpose(-1, -2)).abs().max().item() / math.sqrt(8)
    steps = attention_steps(n, 16, 8, spread + 2 * logits, 8) + 2 * (q[..., 0].numel() + 2) + 8
    return {"out": out.detach(), "q": q.grad, "k": k.grad, "v": v.grad, "params": params, "steps": steps}


def _worker(rank: int, world: int, n: int) -> list[str]:
    state = ParallelState.create(context_parallel_size=world)
    checked = []
    for case in CASES:
        ref, got = _run(*case, n, None), _run(*case, n, state)
        steps = max(ref["steps"], got["steps"])
        wants = {name: sequence_slice(ref[name], rank, world, dim=2) for name in ("out", "q", "k", "v")}
        terms = max(normwise_scale(g) for g in [*wants.values(), *ref["params"].values()][1:])
        for name, want in wants.items():
            assert_close(got[name], want, steps=steps, floor=0.0 if name == "out" else terms, name=f"{case} {name}")
        assert ref["params"].keys() == got["params"].keys()
        for name, want in ref["params"].items():
            assert_close(got["params"][name], want, steps=steps, floor=terms, name=f"{case} {name}")
        checked.append(f"{case}: {sorted(ref['params'])}")
    return checked


@pytest.mark.slow
def test_window_hybrid_cp2_equals_single_rank() -> None:
    results = run_distributed(_worker, 2, args=(42,))
    assert all(len(r) == len(CASES) for r in results)
    assert any("omega1" in line for line in results[0])


def test_cp_window_refuses_what_it_cannot_split() -> None:
    state = ParallelState.single()
    core = AttentionCore("flexformer_n", 2, 8, feature_dim=16)
    for bad in (LocalMixingCore(core, window=4, mixing="gated"), LocalMixingCore(core, window=4, conv_size=2)):
        with pytest.raises(ValueError, match="context_parallel_size"):
            ContextParallelWindowAttention(bad, state)
