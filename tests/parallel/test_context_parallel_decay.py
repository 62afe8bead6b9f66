"""Context parallelism with the decay of old keys (``model.kernel_decay``, ``attention/decay.py``): each rank's
state holds its keys decayed to its slice's last token and reaches rank r decayed by r - 1 - j more slices.

Single process: the incoming state each rank builds from the others' local states equals the state of the
whole prefix (the quadratic form's, native decay), with and without a document reset in between.
Multi process (gloo CPU ranks): the plain core and the window hybrid at CP 2 and 4 equal one rank, outputs
and every gradient (the decay logit's summed over the ranks, as the DP x CP reduction does).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from attention_helpers import decay_steps, make_map, make_qkv
from distributed import run_distributed
from megaflex.attention import AttentionCore, causal_linear_attention
from megaflex.attention.hybrid import LocalMixingCore
from megaflex.parallel import ContextParallelAttention, ParallelState, sequence_slice
from megaflex.parallel.context_parallel import _incoming_weights, mapped_local_state
from megaflex.parallel.context_parallel_window import ContextParallelWindowAttention
from numerics import assert_close, normwise_scale

LOG_DECAY = (-0.3, math.log(1 - 2**-5))


@pytest.mark.parametrize("reset", [False, True])
def test_incoming_states_are_the_decayed_prefix_states(reset: bool) -> None:
    """Three slices of 9 tokens: rank r's incoming state (``_incoming_weights`` over the local states,
    ``mapped_local_state`` with the decay) is the state after the first 9 r tokens. ``reset``: a document
    starts at token 12 (slice 1), so rank 2 sees slice 1's last document only."""
    cp, n = 3, 9
    fmap = make_map("flexformer_n", 2, 8, 16)
    g = torch.tensor(LOG_DECAY)
    q, k, v = make_qkv(2, 2, cp * n, 8, 6, seed=1)
    starts = torch.zeros(2, cp * n, dtype=torch.bool)
    if reset:
        starts[:, 12] = True
    states, maxes, resets = [], [], []
    for j in range(cp):
        sl = slice(j * n, (j + 1) * n)
        last = torch.where(starts[:, sl], torch.arange(n), 0).amax(-1, keepdim=True)
        keep = torch.arange(n) >= last  # the slice's last document
        s, m = mapped_local_state(fmap, k[:, :, sl], v[:, :, sl], j * n, keep, g)
        states.append(s)
        maxes.append(m)
        resets.append(starts[:, sl].any(-1, keepdim=True).expand(2, 2).float())
    m_in, w = _incoming_weights(torch.stack(maxes), torch.stack(resets) if reset else None, n * g)
    for r in range(1, cp):
        s_in = torch.einsum("jbh,jbhfl->bhfl", w[r], torch.stack(states))
        qm, km = fmap(q[:, :, : r * n]), fmap(k[:, :, : r * n])
        _, want = causal_linear_attention(qm.features, km.features, km.log_scale, v[:, :, : r * n], form="quadratic",
                                          log_decay=g, document_starts=starts[:, : r * n] if reset else None)  # fmt: skip
        # the same sums relative to the two stabilisers (equal up to the fold's rounding)
        got = s_in * torch.exp(m_in[r] - want.log_max)[..., None, None]
        steps = decay_steps(fmap, q, k, v, g) + 2 * cp
        assert_close(got, want.augmented(), steps=steps, name=f"incoming state of rank {r}")


def _core(kind: str, window: int, normalization: str, dtype: torch.dtype, form: str) -> torch.nn.Module:
    torch.manual_seed(0)
    core = AttentionCore(kind, 2, 8, feature_dim=16, normalization=normalization, chunk_size=8, form=form, decay="learned")
    with torch.no_grad():
        core.decay_logit.copy_(torch.tensor([1.0, 4.0]))  # gamma = 0.73 and 0.98
    return (LocalMixingCore(core, window=window) if window else core).to(dtype)


def _run(case, n: int, state: ParallelState | None, form: str = "chunked") -> dict:
    kind, window, normalization, dtype = case
    module = _core(kind, window, normalization, dtype, form)
    gen = torch.Generator().manual_seed(1)
    q, k, v, weight = (torch.randn(2, 2, n, 8, generator=gen).to(dtype) for _ in range(4))
    if state is not None:
        q, k, v, weight = (sequence_slice(t, state.cp_rank, state.cp_size, dim=2) for t in (q, k, v, weight))
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    if state is None:
        attend = module
    else:
        attend = (ContextParallelWindowAttention if window else ContextParallelAttention)(module, state)
    out, _ = attend(q, k, v)
    (out * weight).sum().backward()
    params = {name: p.grad.clone() for name, p in module.named_parameters()}
    if state is not None:
        for grad in params.values():
            dist.all_reduce(grad, group=state.cp_group)
    inner = module.core if window else module
    with torch.no_grad():
        logits = (q @ k.transpose(-1, -2)).abs().max().item() / math.sqrt(8) if window else 0.0
        steps = decay_steps(inner.feature_map, q, k, v, inner.log_decay(), n) + 2 * 3 * 2 * logits + 2 * (q[..., 0].numel() + 4)
    return {"out": out.detach(), "q": q.grad, "k": k.grad, "v": v.grad, "params": params, "steps": steps}


# (kind, W, normalization, dtype); the window cases need slices of at least W - 1 tokens
CASES = [("flexformer_n", 0, "rms", torch.float32), ("flexformer_n", 0, "capped_denominator", torch.float64),
         ("elu", 0, "denominator", torch.float32), ("flexformer_n", 5, "capped_denominator", torch.float32)]


def _worker(rank: int, world: int, n: int) -> list[str]:
    state = ParallelState.create(context_parallel_size=world)
    checked = []
    for case in CASES:
        ref, got = _run(case, n, None), _run(case, n, state)
        # the single-rank quadratic form: its distance from the chunked one measures the conditioning (signed
        # trig features under a denominator), which in fp64 exceeds the normwise bound, as in test_context_parallel
        plain = _run(case, n, None, form="quadratic")
        dtype, steps = case[3], max(ref["steps"], got["steps"])
        wants = {name: sequence_slice(ref[name], rank, world, dim=2) for name in ("out", "q", "k", "v")}
        terms = max(normwise_scale(g) for g in [*wants.values(), *ref["params"].values()][1:])
        for name, want in wants.items():
            assert_close(got[name], want, steps=steps, dtype=dtype, floor=0.0 if name == "out" else terms,
                         plain=sequence_slice(plain[name], rank, world, dim=2), name=f"{case} {name}")  # fmt: skip
        assert ref["params"].keys() == got["params"].keys()
        for name, want in ref["params"].items():
            floor = terms * n if "decay" in name else terms  # d/dgamma sums the keys' ages
            assert_close(got["params"][name], want, steps=steps, dtype=dtype, floor=floor, plain=plain["params"][name],
                         name=f"{case} {name}")  # fmt: skip
        checked.append(f"{case}: {sorted(ref['params'])}")
    return checked


@pytest.mark.slow
@pytest.mark.parametrize("cp,n", [(2, 42), (4, 44)])  # slices of 21 / 11 tokens: partial chunks of 8
def test_cp_with_decay_equals_single_rank(cp: int, n: int) -> None:
    results = run_distributed(_worker, cp, args=(n,))
    assert all(len(r) == len(CASES) for r in results)
    assert all("decay_logit" in line for line in results[0])
