"""Short sequences batch several heads per call: the chunked form's head blocks (tokens padded to
whole chunks) and the trig map's whole-batch-entry items give the same results as one head per
call and as the references (quadratic form, ``trig_feature_map_reference``), on odd shapes."""

from __future__ import annotations

import pytest
import torch

from attention_helpers import attention_steps, log_scale_spread, map_steps
from megaflex.attention import LinearAttentionState, NORMALIZATIONS, causal_linear_attention
from megaflex.attention.linear import chunk as chunked
from megaflex.attention.feature_maps import trig as _trig
from megaflex.attention.feature_maps.trig import trig_feature_map, trig_feature_map_reference
from numerics import assert_close, normwise_scale

pytestmark = pytest.mark.numerics

BATCH, HEADS, FEAT, DV = 3, 2, 6, 5


@pytest.fixture
def one_thread():
    """One intra-op thread, so the planners may put every head in one block."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _attention_case(n: int, seed: int, key_scale: float):
    g = torch.Generator().manual_seed(seed)
    qf, kf = (torch.rand(BATCH, HEADS, n, FEAT, generator=g).requires_grad_() for _ in range(2))
    kls = (torch.randn(BATCH, HEADS, n, generator=g) * key_scale).requires_grad_()
    v = torch.randn(BATCH, HEADS, n, DV, generator=g).requires_grad_()
    kv = torch.rand(BATCH, HEADS, FEAT, DV, generator=g).requires_grad_()
    k_sum = torch.rand(BATCH, HEADS, FEAT, generator=g).requires_grad_()
    state = LinearAttentionState(kv, k_sum, torch.randn(BATCH, HEADS, generator=g), offset=4)
    probe = torch.randn(BATCH, HEADS, n, DV, generator=g)
    return (qf, kf, kls, v, kv, k_sum), state, probe


def _attend(form: str, n: int, chunk_size: int, normalization: str, key_scale: float):
    leaves, state, probe = _attention_case(n, seed=n + chunk_size, key_scale=key_scale)
    qf, kf, kls, v, _, _ = leaves
    out, new = causal_linear_attention(
        qf, kf, kls, v, form=form, normalization=normalization, chunk_size=chunk_size, initial_state=state
    )
    loss = (out * probe).sum() + 0.1 * new.kv.sum() + 0.1 * new.k_sum.sum()
    return out, new, torch.autograd.grad(loss, leaves)


@pytest.mark.parametrize("normalization", NORMALIZATIONS)
@pytest.mark.parametrize("n, chunk_size", [(1, 16), (7, 16), (65, 16), (200, 64), (130, 64)])
@pytest.mark.parametrize("key_scale", [1.0, 100.0])
def test_chunked_head_blocks_match_quadratic(one_thread, monkeypatch, n, chunk_size, normalization, key_scale):
    """All heads in one block (padded to whole chunks) and one head per block == quadratic form:
    outputs, final state and gradients of q, k, key log-scale, v and the initial state. Key
    log-scales x100 send chunks down the exact (non-factorised) path."""
    bh = BATCH * HEADS
    reference = _attend("quadratic", n, chunk_size, normalization, key_scale)
    for budget, heads_per_block in ((1 << 30, bh), (0, 1)):
        monkeypatch.setattr(chunked, "_HEAD_BLOCK_ELEMENTS", budget)
        blocks, _, _ = chunked._plan(bh, n, min(chunk_size, n), FEAT, torch.device("cpu"))
        assert blocks[0].stop - blocks[0].start == heads_per_block
        out, state, grads = _attend("chunked", n, chunk_size, normalization, key_scale)
        ref_out, ref_state, ref_grads = reference
        leaves, initial, _ = _attention_case(n, seed=n + chunk_size, key_scale=key_scale)
        steps = attention_steps(n, FEAT, DV, log_scale_spread(leaves[2], initial.log_max))
        assert_close(out, ref_out, steps=steps, name="out")
        assert_close(state.kv, ref_state.kv, steps=steps, name="kv")
        assert_close(state.k_sum, ref_state.k_sum, steps=steps, name="k_sum")
        assert torch.equal(state.log_max, ref_state.log_max)
        terms = max(normwise_scale(g) for g in ref_grads)  # a gradient's rounding scales with its terms
        for name, a, b in zip(("q", "k", "kls", "v", "kv0", "k_sum0"), grads, ref_grads):
            assert_close(a, b, steps=steps, floor=terms, name=f"grad {name} ({heads_per_block} heads/block)")


@pytest.mark.parametrize("paired", [True, False])
@pytest.mark.parametrize("n", [1, 37, 130])
def test_trig_map_batch_items_match_reference(one_thread, monkeypatch, paired, n):
    """Whole batch entries per call and one head per call == the plain-autograd reference map."""
    g = torch.Generator().manual_seed(n)
    d, rows = 5, (14 if paired else 7)
    x = torch.randn(BATCH, HEADS, n, d, generator=g).requires_grad_()
    omega = torch.randn(HEADS, rows, d, generator=g).requires_grad_()
    inv_t = (torch.rand(HEADS, generator=g) + 0.1).requires_grad_()
    p_feat = torch.randn(BATCH, HEADS, n, 14, generator=g)
    p_ls = torch.randn(BATCH, HEADS, n, generator=g)

    def run(fn):
        features, log_scale = fn(x, omega, inv_t, paired=paired)
        loss = (features * p_feat).sum() + (log_scale * p_ls).sum()
        return (features, log_scale, *torch.autograd.grad(loss, (x, omega, inv_t)))

    reference = run(trig_feature_map_reference)
    for budget, per_item in ((1 << 30, BATCH * HEADS), (0, 1)):
        monkeypatch.setattr(_trig, "_SHORT_ELEMENTS", budget)
        items, _ = _trig._work_plan(BATCH, HEADS, n, rows, torch.device("cpu"))
        assert items[0].stop - items[0].start == per_item
        for name, a, b in zip(("features", "log_scale", "x", "omega", "inv_temperature"), run(trig_feature_map), reference):
            assert_close(a, b, steps=map_steps(x, omega), name=f"{name} ({per_item} rows per call)")
