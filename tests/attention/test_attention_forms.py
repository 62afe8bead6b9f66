"""The causal linear-attention forms agree: recurrent == quadratic (outputs and every gradient),
segmented runs with a carried state == one-shot runs, and AttentionCore keeps state across calls."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from attention_helpers import AVAILABLE_FORMS, LINEAR_KINDS, attend, form_steps, make_map, make_qkv
from megaflex.attention import AttentionCore, KVCache, LinearAttentionState, NORMALIZATIONS
from numerics import assert_close, fp32_steps_in, normwise_scale

pytestmark = pytest.mark.numerics


def _prefix_state(fmap, heads: int, head_dim: int, value_dim: int, n: int, seed: int) -> LinearAttentionState:
    """A genuine state (from a prefix), with kv / k_sum as leaves so their gradients can be compared."""
    q, k, v = make_qkv(2, heads, n, head_dim, value_dim, seed=seed)
    with torch.no_grad():
        _, state = attend(fmap, q, k, v, form="quadratic")
    return LinearAttentionState(
        state.kv.clone().requires_grad_(), state.k_sum.clone().requires_grad_(), state.log_max, state.offset
    )


def _outputs_and_grads(kind, form, normalization, n, with_state, *, head_dim=8, feature_dim=32):
    heads = 2
    fmap = make_map(kind, heads, head_dim, feature_dim)
    state = _prefix_state(fmap, heads, head_dim, 6, 5, seed=1) if with_state else None
    q, k, v = make_qkv(2, heads, n, head_dim, value_dim=6, seed=2)
    for t in (q, k, v):
        t.requires_grad_()
    out, new_state = attend(fmap, q, k, v, form=form, normalization=normalization, state=state)
    probe = torch.randn(out.shape, generator=torch.Generator().manual_seed(3))
    loss = (out * probe).sum() + new_state.kv.sum() * 1e-3 + new_state.k_sum.sum() * 1e-3
    leaves = {"q": q, "k": k, "v": v, **{f"map.{n}": p for n, p in fmap.named_parameters()}}
    if state is not None:
        leaves.update({"state.kv": state.kv, "state.k_sum": state.k_sum})
    grads = torch.autograd.grad(loss, list(leaves.values()))
    # the loss sums out x probe over the batch and the state's entries: their counts join the sums
    steps = form_steps(fmap, q, k, v, extra_tokens=5 if with_state else 0) + 2 * (out[0, 0].numel() + v.shape[-1] * feature_dim)
    return out, new_state, dict(zip(leaves, grads)), steps


def _assert_forms_agree(kind, normalization, n, with_state, form="recurrent", **sizes):
    ref_out, ref_state, ref_grads, steps = _outputs_and_grads(kind, "quadratic", normalization, n, with_state, **sizes)
    out, state, grads, _ = _outputs_and_grads(kind, form, normalization, n, with_state, **sizes)
    assert torch.isfinite(ref_out).all()
    assert_close(out, ref_out, steps=steps, name="out")
    assert_close(state.kv, ref_state.kv, steps=steps, name="kv")
    assert_close(state.k_sum, ref_state.k_sum, steps=steps, name="k_sum")
    assert torch.equal(state.log_max, ref_state.log_max) and state.offset == ref_state.offset
    # Gradients' rounding scales with their terms, not with their size: on the scale of the largest
    # gradient (e.g. d out / d q at N = 1 under "rms" is O(eps): the output is scale-invariant).
    terms = max(normwise_scale(g) for g in ref_grads.values())
    for name, ref in ref_grads.items():
        assert_close(grads[name], ref, steps=steps, floor=terms, name=f"grad of {name}")


@pytest.mark.parametrize("kind", ["flexformer_n", "flexformer_s"])
@pytest.mark.parametrize("normalization", NORMALIZATIONS)
@pytest.mark.parametrize("n", [1, 7, 65])
@pytest.mark.parametrize("with_state", [False, True])
def test_recurrent_matches_quadratic_flexformer(kind, normalization, n, with_state):
    _assert_forms_agree(kind, normalization, n, with_state)


@pytest.mark.parametrize("kind", [k for k in LINEAR_KINDS if not k.startswith("flexformer")])
@pytest.mark.parametrize("normalization", NORMALIZATIONS)
def test_recurrent_matches_quadratic_other_kinds(kind, normalization):
    _assert_forms_agree(kind, normalization, n=9, with_state=True, head_dim=4, feature_dim=8)


@pytest.mark.parametrize("form", AVAILABLE_FORMS)
@pytest.mark.parametrize("kind", LINEAR_KINDS)
@pytest.mark.parametrize("normalization", NORMALIZATIONS)
def test_segments_with_carried_state_equal_one_shot(form, kind, normalization):
    heads, head_dim = 2, 8
    fmap = make_map(kind, heads, head_dim, 32)
    q, k, v = make_qkv(2, heads, 40, head_dim, seed=4)
    full, full_state = attend(fmap, q, k, v, form="quadratic", normalization=normalization)
    pieces, state, start = [], None, 0
    for length in (1, 13, 2, 17, 7):  # arbitrary, not aligned to the chunk size
        sl = slice(start, start + length)
        out, state = attend(fmap, q[:, :, sl], k[:, :, sl], v[:, :, sl], form=form, normalization=normalization, state=state)
        pieces.append(out)
        start += length
    assert start == 40 and state.offset == 40
    steps = form_steps(fmap, q, k, v)
    assert_close(torch.cat(pieces, dim=2), full, steps=steps, name="out")
    assert_close(state.kv, full_state.kv, steps=steps, name="kv")
    assert torch.equal(state.log_max, full_state.log_max)


def test_states_are_interchangeable_between_forms():
    fmap = make_map("flexformer_n", 2, 8, 32)
    q, k, v = make_qkv(1, 2, 30, 8, seed=5)
    full, _ = attend(fmap, q, k, v, form="quadratic")
    out_a, state = attend(fmap, q[:, :, :11], k[:, :, :11], v[:, :, :11], form="recurrent")
    out_b, _ = attend(fmap, q[:, :, 11:], k[:, :, 11:], v[:, :, 11:], form=AVAILABLE_FORMS[-1], state=state)
    assert_close(torch.cat([out_a, out_b], dim=2), full, steps=form_steps(fmap, q, k, v))


def test_gradients_flow_through_the_carried_state():
    """Backprop across segments equals backprop through the one-shot computation."""
    fmap = make_map("flexformer_n", 2, 8, 32)
    q, k, v = make_qkv(1, 2, 20, 8, seed=6)
    probe = torch.randn(1, 2, 20, 8, generator=torch.Generator().manual_seed(7))

    def grads(split: bool):
        fmap.zero_grad()
        if split:
            a, state = attend(fmap, q[:, :, :9], k[:, :, :9], v[:, :, :9], form="recurrent")
            b, _ = attend(fmap, q[:, :, 9:], k[:, :, 9:], v[:, :, 9:], form="quadratic", state=state)
            out = torch.cat([a, b], dim=2)
        else:
            out, _ = attend(fmap, q, k, v, form="quadratic")
        (out * probe).sum().backward()
        return [p.grad.clone() for p in fmap.parameters()]

    steps = form_steps(fmap, q, k, v) + 2 * probe[0, 0].numel()  # the loss sums over the outputs
    for g_split, g_full in zip(grads(True), grads(False)):
        assert_close(g_split, g_full, steps=steps)


def test_bf16_inputs_accumulate_in_fp32():
    fmap = make_map("flexformer_n", 2, 8, 32)
    q, k, v = make_qkv(1, 2, 24, 8, seed=8)
    ref, _ = attend(fmap, q, k, v, form="quadratic")
    for form in AVAILABLE_FORMS:
        out, state = attend(fmap, q.bfloat16(), k.bfloat16(), v.bfloat16(), form=form)
        assert out.dtype == torch.bfloat16 and state.kv.dtype == torch.float32
        # bf16 rounding of q, k, v and of the output (each 1 u_bf16 relative; the map's exp turns
        # q's and k's into |exponent| x u) on top of fp32 accumulation
        steps = 3 + 2 * fp32_steps_in(torch.bfloat16, form_steps(fmap, q, k, v))
        assert_close(out, ref, steps=steps, dtype=torch.bfloat16)


# ----------------------------------------------------------------------------- AttentionCore
def _softmax_steps(q: torch.Tensor, k: torch.Tensor) -> float:
    """Error growth of softmax attention (forward and backward): d-term scores, exp of scores up
    to max |score| (times 2: the max subtracted), n-term sums of weights and of weighted values."""
    scores = (q.double() @ k.double().transpose(-1, -2)).abs().max().item() / q.shape[-1] ** 0.5
    return 2 * (k.shape[2] + q.shape[-1] + 2 * scores + 4)


def test_attention_core_softmax_matches_full_sdpa_when_decoding_with_kv_cache():
    torch.manual_seed(0)
    core = AttentionCore("softmax", 3, 8)
    assert core.feature_map is None
    q, k, v = make_qkv(2, 3, 12, 8, scale=1.0, seed=9)
    full = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    one_call, cache = core(q, k, v, return_state=True)
    steps = _softmax_steps(q, k)
    assert_close(one_call, full, steps=steps) and isinstance(cache, KVCache) and cache.offset == 12
    # prompt of 5 tokens, then token-by-token, then a 3-token block (masked within the cache)
    out, state = core(q[:, :, :5], k[:, :, :5], v[:, :, :5], return_state=True)
    pieces = [out]
    for t in range(5, 9):
        out, state = core(q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1], state=state, return_state=True)
        pieces.append(out)
    out, state = core(q[:, :, 9:], k[:, :, 9:], v[:, :, 9:], state=state, return_state=True)
    pieces.append(out)
    assert state.offset == 12 and state.k.shape[2] == 12
    assert_close(torch.cat(pieces, dim=2), full, steps=steps)


def test_kv_cache_appends_in_place_grows_geometrically_and_forks_safely():
    core = AttentionCore("softmax", 2, 8)
    q, k, v = make_qkv(1, 2, 700, 8, seed=3)
    full = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    out, cache = core(q[:, :, :4], k[:, :, :4], v[:, :, :4], return_state=True)
    prefix, outs, capacities = cache, [out], set()
    with torch.no_grad():
        for t in range(4, 700):
            out, cache = core(q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1], state=cache, return_state=True)
            outs.append(out)
            capacities.add(cache.capacity)
    assert_close(torch.cat(outs, dim=2), full, steps=_softmax_steps(q, k))
    assert sorted(capacities) == [256, 514, 1030]  # doubled when full: 3 reallocations for 696 appends
    assert torch.equal(cache.k, k) and torch.equal(cache.v, v) and cache.offset == 700
    # Two continuations of one 4-token prefix: the second must not see the first's token.
    other_q, other_k, other_v = make_qkv(1, 2, 1, 8, seed=4)
    with torch.no_grad():
        forked, forked_cache = core(other_q, other_k, other_v, state=prefix, return_state=True)
    expected = F.scaled_dot_product_attention(
        other_q, torch.cat([k[:, :, :4], other_k], 2), torch.cat([v[:, :, :4], other_v], 2)
    )
    assert forked_cache.offset == 5
    assert_close(forked, expected, steps=_softmax_steps(other_q, torch.cat([k[:, :, :4], other_k], 2)))
    assert torch.equal(cache.k, k)  # the first continuation is untouched by the fork


def test_kv_cache_under_autograd_matches_full_attention_gradients():
    core = AttentionCore("softmax", 2, 8)
    q, k, v = (t.requires_grad_() for t in make_qkv(1, 2, 6, 8, seed=5))
    out, cache = core(q[:, :, :3], k[:, :, :3], v[:, :, :3], return_state=True)
    pieces = [out]
    for t in range(3, 6):
        out, cache = core(q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1], state=cache, return_state=True)
        pieces.append(out)
    grads = torch.autograd.grad(torch.cat(pieces, 2).square().sum(), (q, k, v))
    full = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    expected = torch.autograd.grad(full.square().sum(), (q, k, v))
    steps = _softmax_steps(q, k) + 2 * full[0, 0].numel()  # the loss sums over the outputs
    for g, e in zip(grads, expected):
        assert_close(g, e, steps=steps)


@pytest.mark.parametrize("kind", LINEAR_KINDS)
def test_attention_core_state_across_calls_equals_one_call(kind):
    torch.manual_seed(0)
    form = AVAILABLE_FORMS[-1]  # chunked once available
    core = AttentionCore(kind, 2, 8, feature_dim=32, max_seq_len=64, form=form, chunk_size=8)
    q, k, v = make_qkv(2, 2, 50, 8, seed=10)
    full, full_state = core(q, k, v, return_state=True)
    assert core(q, k, v)[1] is None  # no state unless asked
    state, pieces = None, []
    # prefix, decode steps and a short block (recurrent path), then a long block (form + initial state)
    for start, stop in ((0, 20), (20, 21), (21, 22), (22, 27), (27, 50)):
        out, state = core(q[:, :, start:stop], k[:, :, start:stop], v[:, :, start:stop], state=state, return_state=True)
        pieces.append(out)
    assert state.offset == 50
    steps = form_steps(core.feature_map, q, k, v)
    assert_close(torch.cat(pieces, dim=2), full, steps=steps, name="out")
    assert_close(state.kv, full_state.kv, steps=steps, name="kv")


@pytest.mark.parametrize("kind", LINEAR_KINDS)
@pytest.mark.parametrize("normalization", NORMALIZATIONS)
def test_inference_decoding_fast_path_equals_the_autograd_path(kind, normalization):
    """Under no_grad a continuing call takes AttentionCore._decode (q and k mapped as one batch,
    recurrent_step for single tokens); with grad it takes the plain recurrent form."""
    core = AttentionCore(kind, 3, 8, feature_dim=24, max_seq_len=64, normalization=normalization, chunk_size=8)
    q, k, v = make_qkv(2, 3, 30, 8, seed=11)
    _, prefix = core(q[:, :, :9], k[:, :, :9], v[:, :, :9], return_state=True)

    def continue_from_prefix(grad: bool) -> tuple[torch.Tensor, LinearAttentionState]:
        state, pieces = prefix, []
        with torch.set_grad_enabled(grad):
            for start, stop in ((9, 10), (10, 11), (11, 14), (14, 15), (15, 30)):
                out, state = core(q[:, :, start:stop], k[:, :, start:stop], v[:, :, start:stop], state=state, return_state=True)
                pieces.append(out.detach())
        return torch.cat(pieces, dim=2), state.detach()

    fast_out, fast_state = continue_from_prefix(grad=False)
    slow_out, slow_state = continue_from_prefix(grad=True)
    steps = form_steps(core.feature_map, q, k, v)
    assert_close(fast_out, slow_out, steps=steps, name="out")
    for field in ("kv", "k_sum", "log_max"):
        assert_close(getattr(fast_state, field), getattr(slow_state, field), steps=steps, name=field)
    assert fast_state.offset == slow_state.offset == 30


@pytest.mark.parametrize("batch,heads,feat,value_dim", [(1, 1, 7, 5), (3, 5, 64, 33), (2, 2, 16, 1)])
@pytest.mark.parametrize("normalization", NORMALIZATIONS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_recurrent_step_matches_the_recurrent_loop(batch, heads, feat, value_dim, normalization, dtype):
    from megaflex.attention.linear.recurrent import recurrent_linear_attention, recurrent_step

    g = torch.Generator().manual_seed(feat)
    qf = torch.randn(batch, heads, 6, feat, generator=g).to(dtype)
    kf = torch.randn(batch, heads, 6, feat, generator=g).to(dtype)
    v = torch.randn(batch, heads, 6, value_dim, generator=g).to(dtype)
    if normalization == "denominator":  # signed features make d_t ill-conditioned: compare where it is not
        qf, kf = qf.abs(), kf.abs()
    # key log-scales spanning +-1e4: a later key 1e4 above the running max rescales the whole state
    kls = (torch.tensor([0.0, 3.0, -1e4, 1e4, 2.0, 1e4 + 5.0]) + torch.randn(batch, heads, 6, generator=g)).double()
    kls = kls.to(torch.float64 if dtype == torch.float64 else torch.float32)
    for log_scale in (kls, None):
        expected, expected_state = recurrent_linear_attention(qf, kf, log_scale, v, normalization=normalization)
        state = LinearAttentionState.empty(batch, heads, feat, value_dim, dtype=torch.float64 if dtype == torch.float64 else torch.float32)
        outs = []
        for t in range(6):
            ls_t = None if log_scale is None else log_scale[..., t : t + 1]
            out, state = recurrent_step(qf[:, :, t : t + 1], kf[:, :, t : t + 1], ls_t, v[:, :, t : t + 1], state,
                                        normalization=normalization)
            assert out.dtype == dtype and out.shape == (batch, heads, 1, value_dim)
            outs.append(out)
        # same recurrence, one token at a time: 6-token sums, feat features, value_dim values (rms);
        # the exp arguments |kls_s - m_t| reach 2e4 but the state rescale is exact when it is 0 or
        # underflows, and bf16 outputs round once (1 u_bf16) on top of the fp32 steps
        steps = 2 * (6 + feat + value_dim) + 8
        out_steps = steps if dtype != torch.bfloat16 else 1 + fp32_steps_in(dtype, steps)
        assert_close(torch.cat(outs, dim=2), expected, steps=out_steps, dtype=dtype, name="out")
        accumulation = torch.float64 if dtype == torch.float64 else torch.float32
        assert_close(state.kv, expected_state.kv, steps=steps, dtype=accumulation, name="kv")
        assert torch.equal(state.log_max, expected_state.log_max)
        assert torch.isfinite(state.kv).all() and state.offset == 6
