"""The fused CPU trig map + chunked form (``chunked_trig.py``) against the plain-autograd reference
(``trig_feature_map_reference`` + ``quadratic_linear_attention`` in fp64): outputs and every gradient."""

from __future__ import annotations

import pytest
import torch
from attention_helpers import attention_steps, form_steps, log_scale_spread

from megaflex.attention import AttentionCore, LinearAttentionState
from megaflex.attention.linear import chunk_trig as chunked_trig
from megaflex.attention.linear.chunk_trig import trig_linear_attention_chunked
from megaflex.attention.feature_maps.trig import trig_feature_map_reference
from megaflex.attention.linear.naive import quadratic_linear_attention
from numerics import assert_close, assert_close_to_reference, normwise_scale

pytestmark = pytest.mark.numerics

HEAD_DIM, VALUE_DIM = 8, 5


def _inputs(batch: int, heads: int, n: int, p: int, temp_scale: float, seed: int) -> list[torch.Tensor]:
    """q, k, v, omega [H, P, d], inv_temperature (small projections: the denominator stays away from 0)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, n, HEAD_DIM, generator=g) * 0.4
    k = torch.randn(batch, heads, n, HEAD_DIM, generator=g) * 0.4
    v = torch.randn(batch, heads, n, VALUE_DIM, generator=g)
    omega = torch.randn(heads, p, HEAD_DIM, generator=g) * 0.5
    inv_t = (torch.rand(heads, generator=g) + 0.5) * temp_scale
    return [q, k, v, omega, inv_t]


def _state(batch: int, heads: int, feat: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed + 1)
    kv = torch.randn(batch, heads, feat, VALUE_DIM, generator=g) * 0.1
    k_sum = torch.rand(batch, heads, feat, generator=g) + 1.0
    log_max = torch.randn(batch, heads, generator=g)
    return kv, k_sum, log_max


def _run(fn, tensors, log_max, paired, normalization, chunk_size, probes):
    q, k, v, omega, inv_t, kv, k_sum = tensors
    state = LinearAttentionState(kv, k_sum, log_max, 3)
    out, new = fn(q, k, v, omega, inv_t, paired=paired, normalization=normalization, chunk_size=chunk_size, initial_state=state)
    loss = (out * probes[0]).sum() + (new.kv * probes[1]).sum() + (new.k_sum * probes[2]).sum()
    grads = torch.autograd.grad(loss, tensors, allow_unused=True)
    return out, new, [torch.zeros_like(t) if gr is None else gr for t, gr in zip(tensors, grads)]


def _reference(q, k, v, omega, inv_t, *, paired, normalization, chunk_size, initial_state):
    qf, _ = trig_feature_map_reference(q, omega, inv_t, paired=paired)
    kf, kls = trig_feature_map_reference(k, omega, inv_t, paired=paired)
    return quadratic_linear_attention(qf, kf, kls, v, normalization=normalization, initial_state=initial_state)


CASES = [  # (batch, heads, N, P): B * H == 1 always takes the fused (long) path; N=1100, F=128 too
    (1, 1, 1, 16),
    (1, 1, 65, 16),
    (1, 1, 200, 16),
    (2, 2, 65, 16),  # short N, several heads: the plain fallback
    (1, 2, 1100, 128),
]


@pytest.mark.parametrize("batch, heads, n, p", CASES)
@pytest.mark.parametrize("chunk_size", [16, 64])
@pytest.mark.parametrize("paired", [True, False])
@pytest.mark.parametrize("normalization", ["rms", "denominator"])
@pytest.mark.parametrize("temp_scale", [1.0, 100.0])
def test_matches_reference(batch, heads, n, p, chunk_size, paired, normalization, temp_scale):
    x = _inputs(batch, heads, n, p, temp_scale, seed=n + p)
    feat = p if paired else 2 * p
    kv, k_sum, log_max = _state(batch, heads, feat, seed=n)
    tensors = [t.clone().requires_grad_() for t in (*x, kv, k_sum)]
    g = torch.Generator().manual_seed(7)
    probes = (torch.randn(batch, heads, n, VALUE_DIM, generator=g), torch.randn(batch, heads, feat, VALUE_DIM, generator=g),
              torch.randn(batch, heads, feat, generator=g))  # fmt: skip
    out, new, grads = _run(trig_linear_attention_chunked, tensors, log_max, paired, normalization, chunk_size, probes)
    ref_tensors = [t.detach().double().requires_grad_() for t in tensors]
    ref_probes = tuple(pr.double() for pr in probes)
    ref_out, ref_new, ref_grads = _run(_reference, ref_tensors, log_max.double(), paired, normalization, chunk_size, ref_probes)
    # the plain reference in fp32 measures the conditioning (signed trig features can cancel in
    # the denominator / rms): tests/numerics.py
    plain_out, plain_new, plain_grads = _run(
        _reference, [t.detach().clone().requires_grad_() for t in tensors], log_max, paired, normalization, chunk_size, probes
    )
    assert out.dtype == torch.float32 and new.kv.dtype == torch.float32
    kls = trig_feature_map_reference(ref_tensors[1].detach(), ref_tensors[3].detach(), ref_tensors[4].detach(), paired=paired)[1]
    # attention over n tokens (+ state) and feat features; the map's head_dim-term projections and
    # log-scales ||k||^2 inv_t; omega / inv_t gradients sum over every (batch, token) position
    steps = attention_steps(n, feat, VALUE_DIM, log_scale_spread(kls, log_max), HEAD_DIM) + 2 * batch * n
    for name, got, plain, want in (("out", out, plain_out, ref_out), ("kv", new.kv, plain_new.kv, ref_new.kv),
                                   ("k_sum", new.k_sum, plain_new.k_sum, ref_new.k_sum),
                                   ("log_max", new.log_max, plain_new.log_max, ref_new.log_max)):
        assert_close_to_reference(got, plain, want, steps=steps, name=name)
    names = ("q", "k", "v", "omega", "inv_temperature", "kv0", "k_sum0")
    # a gradient's rounding scales with its terms, not its size: with keys x100 one can be pure
    # rounding noise (e.g. dq when one new key outweighs everything), so all are compared on the
    # largest gradient's scale (at least 1)
    terms = max(1.0, *(normwise_scale(g) for g in ref_grads))
    for name, got, plain, want in zip(names, grads, plain_grads, ref_grads):
        assert_close_to_reference(got, plain, want, steps=steps, floor=terms, name=f"grad of {name}")


def test_long_case_takes_the_fused_path(monkeypatch):
    """The N=1100 case (and B*H=1) really run _ChunkedTrigAttention; short multi-head N does not."""
    calls = []
    original = chunked_trig._ChunkedTrigAttention.apply
    monkeypatch.setattr(chunked_trig._ChunkedTrigAttention, "apply", lambda *a: calls.append(1) or original(*a))
    for batch, heads, n, p in CASES:
        x = _inputs(batch, heads, n, p, 1.0, seed=0)
        trig_linear_attention_chunked(*x, paired=True, chunk_size=64)
    assert len(calls) == 4  # all but (2, 2, 65)


@pytest.mark.parametrize("kind", ["flexformer_n", "flexformer_s"])
def test_core_routes_trig_maps_to_fused_path(kind, monkeypatch):
    """AttentionCore (torch backend, CPU) takes the fused path for trig maps, with the same output
    and gradients (inputs and map parameters) as the plain feature map + chunked form."""
    calls = []
    original = chunked_trig._ChunkedTrigAttention.apply
    monkeypatch.setattr(chunked_trig._ChunkedTrigAttention, "apply", lambda *a: calls.append(1) or original(*a))
    results = []
    for enabled in (True, False):
        torch.manual_seed(0)
        core = AttentionCore(kind, 1, HEAD_DIM, feature_dim=32, chunk_size=16, backend="torch")
        q, k, v = (t.requires_grad_() for t in _inputs(1, 1, 300, 16, 1.0, seed=3)[:3])
        monkeypatch.setattr(chunked_trig, "FUSED_TRIG_ENABLED", enabled)
        out, state = core(q, k, v, return_state=True)
        (out.square().sum() + state.kv.sum()).backward()
        results.append([out.detach(), state.kv.detach(), q.grad, k.grad, v.grad, *(p.grad for p in core.parameters())])
    assert len(calls) == 1
    q, k, v = _inputs(1, 1, 300, 16, 1.0, seed=3)[:3]
    steps = form_steps(core.feature_map, q, k, v) + 2 * 300 * HEAD_DIM  # map parameters: every position
    for got, want in zip(*results):
        assert_close(got, want, steps=steps)


def test_bad_inputs_name_the_argument():
    q, k, v, omega, inv_t = _inputs(1, 2, 10, 16, 1.0, seed=0)
    with pytest.raises(ValueError, match="omega"):
        trig_linear_attention_chunked(q, k, v, omega[:1], inv_t, paired=True)
    with pytest.raises(ValueError, match="inv_temperature"):
        trig_linear_attention_chunked(q, k, v, omega, inv_t[:1], paired=True)
    with pytest.raises(ValueError, match="chunk_size"):
        trig_linear_attention_chunked(q, k, v, omega, inv_t, paired=True, chunk_size=0)
