"""The one-normaliser window hybrid (``megaflex.attention.window``): maths, forms, states, edges."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from megaflex.attention import NORMALIZATIONS, causal_linear_attention
from megaflex.attention.window import WindowCache, windowed_linear_attention
from attention_helpers import attention_steps, log_scale_spread, make_map, make_qkv, saved_bytes
from numerics import assert_close, normwise_scale

pytestmark = pytest.mark.numerics

HEADS, D, FEAT, CHUNK = 2, 8, 16, 32
FORMS = ("quadratic", "chunked", "recurrent")


def features(fmap, x: torch.Tensor, offset: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    out = fmap(x, offset)
    return out.features, out.log_scale


def attend(fmap, q, k, v, window, form, normalization="rms", far=None, cache=None, chunk_size=CHUNK):
    (qf, qls), (kf, kls) = features(fmap, q), features(fmap, k)
    return windowed_linear_attention(q, qf, qls, k, kf, kls, v, window=window, form=form, normalization=normalization,
                                     chunk_size=chunk_size, far_state=far, cache=cache)  # fmt: skip


def steps_of(fmap, q, k, v, extra: int = 0) -> float:
    """Error growth (tests/numerics.py): the plain kernel's (sums over tokens, features, values and
    head dim; exp arguments up to the log-scale spread) plus the window logits' exp arguments."""
    with torch.no_grad():
        (_, qls), (_, kls) = features(fmap, q), features(fmap, k)
        logits = (q.double() @ k.double().transpose(-1, -2)).abs().max().item() / math.sqrt(q.shape[-1])
    spread = log_scale_spread(qls, kls) + 2 * logits
    return attention_steps(q.shape[2] + extra, FEAT, v.shape[-1], spread, q.shape[-1]) + 8


def naive(fmap, q, k, v, window):
    """fp64, unstabilised, one query at a time: exp(q.k / sqrt d) for the last W keys, phi~(q).phi~(k) before."""
    (qf, qls), (kf, kls) = features(fmap, q), features(fmap, k)
    phi_q, phi_k = qf * qls.exp().unsqueeze(-1), kf * kls.exp().unsqueeze(-1)
    out = torch.zeros_like(v)
    for t in range(q.shape[2]):
        near = torch.exp(q[:, :, t : t + 1] @ k[:, :, : t + 1].transpose(-1, -2) / math.sqrt(q.shape[-1])).squeeze(2)
        kernel = (phi_q[:, :, t : t + 1] @ phi_k[:, :, : t + 1].transpose(-1, -2)).squeeze(2)
        lag = t - torch.arange(t + 1)
        w = torch.where(lag < window, near, kernel)
        out[:, :, t] = (w.unsqueeze(-1) * v[:, :, : t + 1]).sum(2) / w.sum(-1, keepdim=True)
    return out


@pytest.mark.parametrize("window", [0, 1, 3, 7])
def test_matches_the_unstabilised_definition_in_fp64(window):
    fmap = make_map("flexformer_n", HEADS, D, FEAT, seed=1).double()
    q, k, v = make_qkv(2, HEADS, 19, D, seed=2, dtype=torch.float64)
    want = naive(fmap, q, k, v, window)
    for form in FORMS:
        got, _, _ = attend(fmap, q, k, v, window, form, "denominator", chunk_size=4)
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9 * want.abs().max().item())


def prefix_state(fmap, window, batch, seed=7, n=45):
    """A carried state (linear state + window cache, no autograd history) from n earlier tokens."""
    q, k, v = make_qkv(batch, HEADS, n, D, seed=seed)
    with torch.no_grad():
        _, far, cache = attend(fmap, q, k, v, window, "quadratic")
    return far, cache


def run_cases():
    for window in (1, 16, 64):
        for n in sorted({1, window - 1, window, window + 1, 3 * CHUNK + 5} - {0}):
            yield window, n


@pytest.mark.parametrize("carried", [False, True], ids=["fresh", "carried"])
@pytest.mark.parametrize("window,n", list(run_cases()))
def test_forms_agree_in_outputs_states_and_every_gradient(window, n, carried):
    fmap = make_map("flexformer_n", HEADS, D, FEAT, seed=3)
    far = cache = None
    if carried:
        far, cache = prefix_state(fmap, window, 1)
        far.kv.requires_grad_()
        cache = WindowCache(cache.k, cache.kf, cache.kls, cache.v.clone().requires_grad_())
    q0, k0, v0 = make_qkv(1, HEADS, n, D, seed=n + window)
    weight = torch.linspace(-1, 1, n * D).view(1, 1, n, D)
    results = {}
    for form in FORMS:
        q, k, v = (t.clone().requires_grad_() for t in (q0, k0, v0))
        for p in fmap.parameters():
            p.grad = None
        leaves = [] if far is None else [far.kv, cache.v][: 1 + (cache.length > 0)]
        for t in leaves:
            t.grad = None
        out, state, kept = attend(fmap, q, k, v, window, form, far=far, cache=cache)
        (out * weight).sum().add_(state.kv.square().sum() * 1e-3).backward()
        grads = [q.grad, k.grad, v.grad, *(p.grad for p in fmap.parameters()), *(t.grad for t in leaves)]
        results[form] = (out.detach(), state.kv.detach(), state.k_sum.detach(), kept.v, grads)
        assert kept.length == min(window - 1, n + (0 if cache is None else cache.length))
    extra = 0 if cache is None else 45
    steps = steps_of(fmap, q0, k0, v0, extra)
    ref = results["quadratic"]
    for form in ("chunked", "recurrent"):
        got = results[form]
        for a, b, name in zip(got[:3], ref[:3], ("out", "kv", "k_sum")):
            assert_close(a, b, steps=steps, name=f"{form} {name}")
        assert torch.equal(got[3], ref[3])
        # parameter gradients sum over every (batch, head, token) position
        floor = max(normwise_scale(g) for g in ref[4])
        for a, b in zip(got[4], ref[4]):
            assert_close(a, b, steps=2 * steps + 2 * n * HEADS, floor=floor, name=f"{form} grad")


def assert_chunked_matches_quadratic(results, steps: float, n: int) -> None:
    """results[form] = (out, state kv, gradients): the chunked form's within the error bounds of the
    quadratic form's (the gradients sum over every (batch, head, token) position)."""
    ref, got = results["quadratic"], results["chunked"]
    assert_close(got[0], ref[0], steps=steps, name="out")
    assert_close(got[1], ref[1], steps=steps, name="kv")
    floor = max(normwise_scale(g) for g in ref[2])
    for a, b in zip(got[2], ref[2]):
        assert a is not None and b is not None
        assert_close(a, b, steps=2 * steps + 2 * n * HEADS, floor=floor, name="grad")


@pytest.mark.parametrize("grouped", [True, False], ids=["chunk-per-group", "one-group"])
@pytest.mark.parametrize("kind,window", [("flexformer_n", w) for w in (0, 5, 8, 20)] + [("softmax", 5), ("softmax", 20)])
def test_chunk_groups_agree_with_the_quadratic_form(window, kind, grouped, monkeypatch):
    """The chunked Function one chunk per group (states, and dL/dS in the backward, carried from group
    to group; blocks reaching before the first key in several groups; blocks recomputed in the
    backward, where the other tests' short sequences keep them), or in one group, after a carried
    state and window cache: outputs, states and every gradient as the quadratic form. ``softmax``:
    no far field (zero-width features, from the first token)."""
    from megaflex.attention.window import chunk as shared_window_chunked

    if grouped:
        monkeypatch.setattr(shared_window_chunked, "_GROUP_ELEMENTS", 1)
        monkeypatch.setattr(shared_window_chunked, "_KEEP_ELEMENTS", 0)  # the backward recomputes every block
    fmap = make_map("flexformer_n", HEADS, D, FEAT, seed=21)
    n, chunk = 3 * 8 + 5, 8
    far, cache = (None, None) if kind == "softmax" else prefix_state(fmap, window, 1, n=11)
    leaves = [] if far is None else [far.kv.requires_grad_()]
    q0, k0, v0 = make_qkv(1, HEADS, n, D, seed=22)
    results = {}
    for form in ("quadratic", "chunked"):
        q, k, v = (t.clone().requires_grad_() for t in (q0, k0, v0))
        for p in [*leaves, *fmap.parameters()]:
            p.grad = None
        (qf, qls), (kf, kls) = features(fmap, q), features(fmap, k)
        if kind == "softmax":  # zero-width features, key log-scales -inf: sliding-window softmax
            qf, kf, qls, kls = qf[..., :0], kf[..., :0], None, torch.full_like(kls, float("-inf"))
        out, state, _ = windowed_linear_attention(q, qf, qls, k, kf, kls, v, window=window, form=form, chunk_size=chunk,
                                                  normalization="denominator", far_state=far, cache=cache)  # fmt: skip
        loss = (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum()
        if kind != "softmax":
            loss = loss + state.kv.square().sum() * 1e-3
        loss.backward()
        grads = [q.grad, k.grad, v.grad] + ([] if kind == "softmax" else [far.kv.grad, *(p.grad for p in fmap.parameters())])
        results[form] = (out.detach(), state.kv.detach(), grads)
    steps = steps_of(fmap, q0, k0, v0, 0 if far is None else 11)
    assert_chunked_matches_quadratic(results, steps, n)


def test_the_function_runs_narrower_chunks_when_they_shrink_the_blocks():
    """``_inner_chunk``: C halved (down to 16) while the window stays within two chunks and a query's
    (L + 1) C block keys shrink; odd or small chunks are kept."""
    from megaflex.attention.window.chunk import _inner_chunk

    assert [_inner_chunk(64, w) for w in (0, 1, 16, 17, 32, 33, 64, 65, 512)] == [16, 16, 16, 16, 16, 32, 32, 64, 64]
    assert (_inner_chunk(32, 64), _inner_chunk(29, 5), _inner_chunk(8, 3), _inner_chunk(48, 4)) == (32, 29, 8, 24)


@pytest.mark.parametrize("normalization", NORMALIZATIONS)
@pytest.mark.parametrize("window,one_group", [(16, True), (64, True), (40, True), (16, False), (64, False)])
def test_narrower_inner_chunks_agree_with_the_quadratic_form(window, one_group, normalization, monkeypatch):
    """At C = 64 the Function runs chunks of 16 or 32 (``_inner_chunk``), in one group (block weights
    kept for the backward, key blocks views of the flat keys of every head) or one chunk per group
    (recomputed), after a carried state and window cache: outputs, state and every gradient as the
    quadratic form ("rms" runs without the ones column)."""
    from megaflex.attention.window import chunk as shared_window_chunked

    if not one_group:
        monkeypatch.setattr(shared_window_chunked, "_GROUP_ELEMENTS", 1)
        monkeypatch.setattr(shared_window_chunked, "_KEEP_ELEMENTS", 0)
    fmap = make_map("flexformer_n", HEADS, D, FEAT, seed=31)
    n = 2 * 64 + 13
    far, cache = prefix_state(fmap, window, 2, n=50)
    far.kv.requires_grad_()
    q0, k0, v0 = make_qkv(2, HEADS, n, D, seed=32)
    results = {}
    for form in ("quadratic", "chunked"):
        q, k, v = (t.clone().requires_grad_() for t in (q0, k0, v0))
        for p in [far.kv, *fmap.parameters()]:
            p.grad = None
        out, state, _ = attend(fmap, q, k, v, window, form, normalization, far=far, cache=cache, chunk_size=64)
        loss = (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum() + state.kv.square().sum() * 1e-3
        loss.backward()
        results[form] = (out.detach(), state.kv.detach(), [q.grad, k.grad, v.grad, far.kv.grad, *(p.grad for p in fmap.parameters())])
    steps = steps_of(fmap, q0, k0, v0, 50)
    assert_chunked_matches_quadratic(results, steps, n)


@pytest.mark.parametrize("window", [1, 16])
def test_token_by_token_and_segments_continue_the_full_sequence(window):
    fmap = make_map("flexformer_n", HEADS, D, FEAT, seed=4)
    q, k, v = make_qkv(2, HEADS, 3 * CHUNK + 5, D, seed=5)
    far, cache = prefix_state(fmap, window, 2)
    full, full_state, _ = attend(fmap, q, k, v, window, "chunked", far=far, cache=cache)
    steps = steps_of(fmap, q, k, v, 45)
    for form, cuts in (("recurrent", list(range(q.shape[2] + 1))), ("chunked", [0, 3, 40, 41, 90, q.shape[2]])):
        state, kept, outs = far, cache, []
        for lo, hi in zip(cuts[:-1], cuts[1:]):
            out, state, kept = attend(fmap, q[:, :, lo:hi], k[:, :, lo:hi], v[:, :, lo:hi], window, form, far=state,
                                      cache=kept)  # fmt: skip
            outs.append(out)
        assert_close(torch.cat(outs, dim=2), full, steps=steps, name=form)
        assert_close(state.kv, full_state.kv, steps=steps, name=f"{form} state")
        assert state.offset == full_state.offset == far.offset + q.shape[2]


@pytest.mark.parametrize("normalization", NORMALIZATIONS)
def test_a_window_covering_every_key_is_exact_softmax(normalization):
    fmap = make_map("flexformer_n", HEADS, D, FEAT, seed=6)
    q, k, v = make_qkv(2, HEADS, 37, D, seed=6, scale=1.0)
    softmax = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    if normalization == "rms":
        softmax = softmax * torch.rsqrt(softmax.pow(2).mean(-1, keepdim=True) + 1e-6)
    for form in FORMS:
        got, _, _ = attend(fmap, q, k, v, 37, form, normalization, chunk_size=8)
        assert_close(got, softmax, steps=steps_of(fmap, q, k, v), name=form)


@pytest.mark.parametrize("normalization", NORMALIZATIONS)
def test_no_window_is_plain_linear_attention(normalization):
    fmap = make_map("flexformer_n", HEADS, D, FEAT, seed=8)
    q, k, v = make_qkv(2, HEADS, 3 * CHUNK + 5, D, seed=8)
    (qf, _), (kf, kls) = features(fmap, q), features(fmap, k)
    plain, plain_state = causal_linear_attention(qf, kf, kls, v, form="chunked", normalization=normalization, chunk_size=CHUNK)
    for form in FORMS:
        got, state, kept = attend(fmap, q, k, v, 0, form, normalization)
        assert_close(got, plain, steps=steps_of(fmap, q, k, v), name=form)
        assert_close(state.kv, plain_state.kv, steps=steps_of(fmap, q, k, v), name=form)
        assert kept.length == 0


def test_chunked_form_keeps_no_quadratic_tensor():
    """Every tensor the chunked form saves for backward is O(N (L + 1) C), never N x N."""
    fmap = make_map("flexformer_n", 1, D, FEAT, seed=9)
    n, window, chunk = 512, 16, 16
    q, k, v = (t.requires_grad_() for t in make_qkv(1, 1, n, D, seed=9))
    largest = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        largest.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out, _, _ = attend(fmap, q, k, v, window, "chunked", chunk_size=chunk)
    out.sum().backward()
    assert max(largest) <= n * 2 * chunk < n * n // 8


def test_bad_arguments_raise():
    fmap = make_map("flexformer_n", HEADS, D, FEAT)
    q, k, v = make_qkv(1, HEADS, 4, D)
    with pytest.raises(ValueError, match="window"):
        attend(fmap, q, k, v, -1, "chunked")
    with pytest.raises(ValueError, match="form"):
        attend(fmap, q, k, v, 2, "dense")
    _, _, cache = attend(fmap, q, k, v, 4, "chunked")
    with pytest.raises(ValueError, match="cache"):
        attend(fmap, q, k, v, 2, "chunked", cache=cache)


def test_diagnostic_weights_are_the_forward_weights_and_far_share_is_reported():
    from megaflex.attention.diagnostics import far_share, window_causal_weights
    from megaflex.model import GPT, ModelConfig

    fmap = make_map("flexformer_n", HEADS, D, FEAT, seed=10)
    q, k, v = make_qkv(2, HEADS, 23, D, seed=10)
    window = 5
    with torch.no_grad():
        weights = window_causal_weights(q, k, fmap, window)
        out, _, _ = attend(fmap, q, k, v, window, "quadratic", "denominator")
        share = far_share(weights, window)
    assert_close(out, (weights @ v) / weights.sum(-1, keepdim=True), steps=steps_of(fmap, q, k, v))
    lag = torch.arange(23).unsqueeze(1) - torch.arange(23)
    mag = weights.abs()
    want = ((mag * (lag >= window)).sum(-1) / mag.sum(-1))[..., window:].mean().item()
    assert 0.0 < share < 1.0 and share == pytest.approx(want, rel=1e-6)
    assert far_share(window_causal_weights(q, k, fmap, 0), 0) == pytest.approx(1.0)
    assert far_share(window_causal_weights(q, k, fmap, 23), 23) != far_share(weights, window)  # nan: no far field

    config = ModelConfig(vocab_size=97, num_layers=2, hidden_size=32, num_heads=4, feature_dim=16, chunk_size=8,
                         max_seq_len=64, softmax_window=4, qkv_conv_size=2)
    torch.manual_seed(0)
    stats = GPT(config).kernel_statistics(torch.randint(0, 97, (2, 24), generator=torch.Generator().manual_seed(0)))
    for i in (0, 1):
        assert 0.0 < stats[f"layer0{i}/far_share"] < 1.0 and 1.0 <= stats[f"layer0{i}/effective_keys"] <= 24.0


@pytest.mark.parametrize("form", FORMS)
def test_sliding_window_softmax_model_matches_a_banded_softmax_and_decodes(form):
    """attention 'softmax' + softmax_window W: no far field, exact softmax over the last W tokens."""
    from megaflex.attention import AttentionCore
    from megaflex.attention.hybrid import LocalMixingCore
    from megaflex.model import GPT, ModelConfig

    window, n = 6, 3 * 8 + 5
    core = LocalMixingCore(AttentionCore("softmax", HEADS, D, form=form, chunk_size=8), window=window)
    q, k, v = make_qkv(2, HEADS, n, D, seed=11, scale=1.0)
    lag = torch.arange(n).unsqueeze(1) - torch.arange(n)
    band = (lag >= 0) & (lag < window)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=band)
    want = want * torch.rsqrt(want.pow(2).mean(-1, keepdim=True) + 1e-6)  # the core's rms normalisation
    got, _ = core(q, k, v)
    steps = attention_steps(window, 0, D, 2 * (q @ k.transpose(-1, -2)).abs().max().item() / math.sqrt(D), D) + 8
    assert_close(got, want, steps=steps, name=form)

    config = ModelConfig(vocab_size=97, num_layers=2, hidden_size=32, num_heads=4, chunk_size=8, max_seq_len=64,
                         attention="softmax", softmax_window=window, init_std=0.2)
    torch.manual_seed(0)
    model = GPT(config).eval()
    x = torch.randint(0, 97, (2, 21), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(x).logits
        prefix = model(x[:, :9], return_state=True)
        state, outs = prefix.state, [prefix.logits]
        for t in range(9, 21):
            step = model(x[:, t : t + 1], state=state, return_state=True)
            state, outs = step.state, outs + [step.logits]
        stats = model.kernel_statistics(x)
    from numerics import gpt_steps

    assert_close(torch.cat(outs, dim=1), full, steps=gpt_steps(config, 21))
    assert stats["layer00/far_share"] == 0.0 and 1.0 <= stats["layer00/effective_keys"] <= window
    with pytest.raises(ValueError, match="softmax_window"):
        ModelConfig(vocab_size=97, num_layers=1, hidden_size=32, num_heads=4, attention="softmax", softmax_window=4,
                    window_mixing="gated")


def test_a_window_beyond_the_sequence_is_cheap_and_exact():
    fmap = make_map("flexformer_n", HEADS, D, FEAT, seed=12)
    q, k, v = make_qkv(1, HEADS, 3 * CHUNK + 5, D, seed=12)
    want, _, _ = attend(fmap, q, k, v, q.shape[2], "quadratic", "denominator")
    got, _, _ = attend(fmap, q, k, v, 1 << 20, "chunked", "denominator")
    assert_close(got, want, steps=steps_of(fmap, q, k, v))


def test_long_training_sequences_run_in_checkpointed_segments_with_the_same_result():
    from megaflex.attention import AttentionCore
    from megaflex.attention.hybrid import LocalMixingCore

    q0, k0, v0 = make_qkv(1, HEADS, 77, D, seed=13)
    results = []
    for segment in (1 << 20, 16):  # one call; 5 segments of 16 tokens (the window spans segments)
        torch.manual_seed(0)
        core = LocalMixingCore(AttentionCore("flexformer_n", HEADS, D, feature_dim=FEAT, chunk_size=8), window=20,
                               conv_size=2)  # fmt: skip
        core.segment_tokens = segment
        q, k, v = (t.clone().requires_grad_() for t in (q0, k0, v0))
        prefix_out, state = core(q[:, :, :5], k[:, :, :5], v[:, :, :5], return_state=True)
        out, final = core(q[:, :, 5:], k[:, :, 5:], v[:, :, 5:], state=state, return_state=True)
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().add(final.linear.kv.sum()).backward()
        results.append([out.detach(), final.linear.kv.detach(), final.window_cache.v, q.grad, k.grad, v.grad,
                        *(p.grad for p in core.parameters())])
    steps = steps_of(core.core.feature_map, q0, k0, v0) + 2 * 77 * HEADS
    floor = max(normwise_scale(g) for g in results[0][3:])
    for a, b in zip(*results):
        assert_close(a, b, steps=steps, floor=floor)


def test_long_training_sequences_keep_less_for_backward_than_sdpa():
    """The segments keep q, k, v, the outputs and a small state each: less than SDPA (q, k, v, out, lse)."""
    from megaflex.attention import AttentionCore
    from megaflex.attention.hybrid import LocalMixingCore

    torch.manual_seed(0)
    core = LocalMixingCore(AttentionCore("flexformer_n", HEADS, 32, feature_dim=64, chunk_size=32), window=64)
    q, k, v = (t.requires_grad_() for t in make_qkv(1, HEADS, 4 * 1024, 32, seed=14))
    window = saved_bytes(lambda: core(q, k, v))
    sdpa = saved_bytes(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))
    assert window <= sdpa


def test_segments_train_the_kernel_when_q_k_v_need_no_gradient():
    """Frozen projections (distillation): q, k, v need no gradient, the feature map still learns."""
    from megaflex.attention import AttentionCore
    from megaflex.attention.hybrid import LocalMixingCore

    grads = []
    for segment in (1 << 20, 16):
        torch.manual_seed(0)
        core = LocalMixingCore(AttentionCore("flexformer_n", HEADS, D, feature_dim=FEAT, chunk_size=8), window=8)
        core.segment_tokens = segment
        q, k, v = make_qkv(1, HEADS, 50, D, seed=15)
        out, _ = core(q, k, v)
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()  # rms: out.square().sum() is constant
        grads.append([p.grad for p in core.parameters()])
    for a, b in zip(*grads):
        assert a is not None and b is not None and a.abs().max() > 0
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5 * a.abs().max().item())
