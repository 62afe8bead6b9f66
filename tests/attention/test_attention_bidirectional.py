"""Bidirectional (non-causal) attention (issue 41): the global-sum linear form against its quadratic
reference, the banded one-normaliser window against its reference, non-causal softmax against a direct
masked softmax, padding, non-causality, the refusals, the model, and the stabilisers."""

from __future__ import annotations

import math

import pytest
import torch

from attention_helpers import LINEAR_KINDS, attention_steps, form_steps, log_scale_spread, make_map, make_qkv
from megaflex.attention import NORMALIZATIONS, AttentionCore, LinearAttentionState
from megaflex.attention.normalize import OUTPUT_RMS_CAP
from megaflex.attention.dispatch import REFUSALS, RefusedAttention, Request, select
from megaflex.attention.hybrid import LocalMixingCore, build_attention
from megaflex.attention.linear.bidirectional import bidirectional_linear_attention
from megaflex.attention.linear.naive import quadratic_bidirectional_linear_attention
from megaflex.attention.softmax import bidirectional_softmax_attention
from megaflex.model import GPT, ModelConfig
from numerics import assert_close, normwise_scale

pytestmark = pytest.mark.numerics

B, H, N, D, F, DV = 2, 2, 13, 8, 8, 6
MASKS = ("none", "right", "left", "random")


def key_mask(kind: str, n: int = N) -> torch.Tensor | None:
    """[B, n] bool (False: padding): row 1 right- or left-padded, or random keys of both rows padded."""
    if kind == "none":
        return None
    mask = torch.ones(B, n, dtype=torch.bool)
    if kind == "right":
        mask[1, n - 4 :] = False
    elif kind == "left":
        mask[1, :3] = False
    else:
        mask = torch.rand(B, n, generator=torch.Generator().manual_seed(5)) > 0.4
        mask[:, 0] = True
    return mask


def leaves_and_grads(out: torch.Tensor, leaves: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    probe = torch.randn(out.shape, generator=torch.Generator().manual_seed(3), dtype=out.dtype)
    return dict(zip(leaves, torch.autograd.grad((out * probe).sum(), list(leaves.values()))))


def assert_grads_close(got: dict, want: dict, steps: float) -> None:
    terms = max(normwise_scale(g) for g in want.values())  # gradients' rounding scales with their terms
    for name in want:
        assert_close(got[name], want[name], steps=steps, floor=terms, name=f"grad of {name}")


# ----------------------------------------------------------------------------- linear kinds
def _linear(kind: str, normalization: str, mask: torch.Tensor | None, quadratic: bool):
    fmap = make_map(kind, H, D, F)
    q, k, v = make_qkv(B, H, N, D, DV, seed=2)
    for t in (q, k, v):
        t.requires_grad_()
    fq, fk = fmap(q), fmap(k)
    fn = quadratic_bidirectional_linear_attention if quadratic else bidirectional_linear_attention
    out = fn(fq.features, fk.features, fk.log_scale, v, normalization=normalization, key_mask=mask)
    leaves = {"q": q, "k": k, "v": v, **{f"map.{n}": p for n, p in fmap.named_parameters()}}
    steps = form_steps(fmap, q, k, v) + 2 * (out[0, 0].numel() + DV * F)  # + the probe loss's sums
    return out, leaves_and_grads(out, leaves), steps


@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("normalization", NORMALIZATIONS)
@pytest.mark.parametrize("kind", LINEAR_KINDS)
def test_global_form_matches_the_quadratic_reference(kind, normalization, mask):
    """Outputs and the gradients of q, k, v and every feature-map parameter (Omega, tau, ...)."""
    m = key_mask(mask)
    ref, ref_grads, steps = _linear(kind, normalization, m, quadratic=True)
    out, grads, _ = _linear(kind, normalization, m, quadratic=False)
    assert_close(out, ref, steps=steps, name="out")
    assert_grads_close(grads, ref_grads, steps)
    if m is not None:  # a padded key gets no gradient: it is in no sum
        for name in ("k", "v"):
            assert torch.equal(grads[name].abs().sum((1, 3))[~m], torch.zeros(int((~m).sum())))


@pytest.mark.parametrize("form", ["chunked", "quadratic"])
@pytest.mark.parametrize("kind", [k for k in LINEAR_KINDS if k != "cosformer"] + ["softmax", "hybrid"])
def test_padded_keys_change_nothing_and_the_first_query_sees_the_last_key(kind, form):
    module = _module(kind, form)
    q, k, v = make_qkv(B, H, N, D, seed=4)
    mask = key_mask("left")
    mask[0, -1] = False  # row 0 right-padded by one: its last real key is N - 2
    out, _ = module(q, k, v, key_mask=mask)
    k2, v2 = k.clone(), v.clone()
    k2[~mask[:, None, :].expand(B, H, N)] += 3.0
    v2[~mask[:, None, :].expand(B, H, N)] -= 5.0
    again, _ = module(q, k2, v2, key_mask=mask)
    real = mask[:, None, :, None].expand_as(out)
    assert torch.isfinite(again).all()
    assert torch.equal(out[real], again[real])
    # non-causal: the first query reads the last real key (row 1's is N - 1)
    k3, v3 = k.clone(), v.clone()
    k3[1, :, -1] += 1.0
    v3[1, :, -1] += 1.0
    moved, _ = module(q, k3, v3, key_mask=mask)
    assert not torch.equal(moved[1, :, 0], out[1, :, 0])


@pytest.mark.parametrize("form", ["chunked", "quadratic"])
def test_cosformer_takes_right_padding_in_the_bidirectional_form_only(form):
    """Right padding leaves the real tokens' positions (hence cosformer's features) as they are: each
    row computes what it computes alone. Padding before real tokens would shift them: refused, and
    so is any padding in the causal form (a later call would continue the padded row)."""
    module = _module("cosformer", form)
    q, k, v = make_qkv(B, H, N, D, seed=8)
    mask = key_mask("right")
    out, _ = module(q, k, v, key_mask=mask)
    n = int(mask[1].sum())
    alone, _ = module(q[1:, :, :n], k[1:, :, :n], v[1:, :, :n])
    assert_close(out[1:, :, :n], alone, steps=attention_steps(N, F, D, head_dim=D), name="right-padded row")
    for refused, causal in ((key_mask("left"), False), (mask, True)):
        with pytest.raises(ValueError, match="padding is not supported by the position-dependent 'cosformer' map"):
            _module("cosformer", form, causal=causal)(q, k, v, key_mask=refused)


def _module(kind: str, form: str, causal: bool = False, window: int = 3, normalization: str = "capped_denominator"):
    torch.manual_seed(0)
    feature = {} if kind == "softmax" else dict(feature_dim=F)
    core_kind = "flexformer_n" if kind == "hybrid" else kind
    core = AttentionCore(core_kind, H, D, form=form, chunk_size=4, causal=causal, normalization=normalization, **feature)
    return LocalMixingCore(core, window=window) if kind == "hybrid" else core


@pytest.mark.parametrize("kind", LINEAR_KINDS + ("softmax", "hybrid"))
def test_only_the_bidirectional_module_reads_later_tokens(kind):
    q, k, v = make_qkv(B, H, N, D, seed=6)
    k2, v2 = k.clone(), v.clone()
    k2[:, :, -1] += 1.0
    v2[:, :, -1] += 1.0
    for causal in (False, True):
        module = _module(kind, "chunked", causal=causal)
        first, moved = module(q, k, v)[0][:, :, 0], module(q, k2, v2)[0][:, :, 0]
        assert torch.equal(first, moved) == causal, causal


# ----------------------------------------------------------------------------- softmax
@pytest.mark.parametrize("mask", MASKS)
def test_softmax_matches_a_direct_masked_softmax(mask):
    q, k, v = make_qkv(B, H, N, D, seed=7)
    for t in (q, k, v):
        t.requires_grad_()
    m = key_mask(mask)
    core = AttentionCore("softmax", H, D, causal=False)
    out, state = core(q, k, v, key_mask=m)
    assert state is None
    scores = q @ k.transpose(-1, -2) / math.sqrt(D)
    if m is not None:
        scores = scores.masked_fill(~m[:, None, None, :], float("-inf"))
    want = torch.softmax(scores, dim=-1) @ v
    scale = (q.double() @ k.double().transpose(-1, -2)).abs().max().item() / math.sqrt(D)
    steps = 2 * (N + D + 2 * scale + 4)  # d-term scores, exp up to 2 max |score|, N-term sums
    assert_close(out, want, steps=steps, name="out")
    leaves = {"q": q, "k": k, "v": v}
    assert_grads_close(leaves_and_grads(out, leaves), leaves_and_grads(want, leaves), steps + 2 * N * D)


def test_softmax_row_without_real_keys_is_finite():
    q, k, v = make_qkv(B, H, N, D, seed=8)
    mask = torch.ones(B, N, dtype=torch.bool)
    mask[1] = False
    out = bidirectional_softmax_attention(q, k, v, key_mask=mask)
    assert torch.isfinite(out).all()


# ----------------------------------------------------------------------------- the hybrid
def _hybrid_steps(module, q, k, v) -> float:
    """The plain kernel's error growth plus the window logits' exp arguments (as the causal window's)."""
    with torch.no_grad():
        qls, kls = module.feature_map(q).log_scale, module.feature_map(k).log_scale
        logits = (q.double() @ k.double().transpose(-1, -2)).abs().max().item() / math.sqrt(D)
    return attention_steps(N, F, DV, log_scale_spread(qls, kls) + 2 * logits, D) + 8 + 2 * (N * DV + DV * F)


@pytest.mark.parametrize("mask", ["none", "left", "random"])
@pytest.mark.parametrize("normalization", NORMALIZATIONS)
@pytest.mark.parametrize("window", [1, 3, 5, 20])
@pytest.mark.parametrize("kind", ["flexformer_n", "elu", "softmax"])
def test_banded_window_matches_its_quadratic_reference(kind, window, normalization, mask):
    torch.manual_seed(0)
    feature = {} if kind == "softmax" else dict(feature_dim=F)
    core = AttentionCore(kind, H, D, chunk_size=4, causal=False, normalization=normalization, **feature)
    module = LocalMixingCore(core, window=window)
    q, k, v = make_qkv(B, H, N, D, DV, seed=9)
    for t in (q, k, v):
        t.requires_grad_()
    leaves = {"q": q, "k": k, "v": v, **dict(module.named_parameters())}
    results = {}
    for form in ("quadratic", "chunked"):
        core.form = form
        out, _ = module(q, k, v, key_mask=key_mask(mask))
        results[form] = out, leaves_and_grads(out, leaves)
    steps = 0.0 if kind == "softmax" else _hybrid_steps(module, q, k, v)
    steps = max(steps, 2 * (N + D + 8)) + 2 * N * DV
    assert_close(results["chunked"][0], results["quadratic"][0], steps=steps, name="out")
    assert_grads_close(results["chunked"][1], results["quadratic"][1], 2 * steps)


# padding between real tokens: row 0 pads after its first two tokens and near the end, row 1 before,
# between and after (9 real tokens of N = 13 each)
BETWEEN = torch.tensor([[i not in (2, 5, 6, 10) for i in range(N)], [i not in (0, 4, 8, 12) for i in range(N)]])


@pytest.mark.parametrize("form", ["chunked", "quadratic"])
@pytest.mark.parametrize("window", [0, 3])
@pytest.mark.parametrize("kind", [k for k in LINEAR_KINDS if k != "cosformer"] + ["softmax"])
def test_padding_between_real_tokens_changes_no_real_output(kind, window, form):
    """Each row's real tokens give what they give without the padding (the reference: the row alone),
    for every kind that takes padding there (cosformer refuses it: its positions would move) and with
    the softmax window, whose |i - j| < W counts real tokens, not the padding between them."""
    torch.manual_seed(0)
    feature = {} if kind == "softmax" else dict(feature_dim=F)
    core = AttentionCore(kind, H, D, form=form, chunk_size=4, causal=False, normalization="capped_denominator", **feature)
    module = LocalMixingCore(core, window=window) if window else core
    q, k, v = make_qkv(B, H, N, D, DV, seed=14)
    with torch.no_grad():
        out, _ = module(q, k, v, key_mask=BETWEEN)
        alone = [module(*(x[b : b + 1, :, BETWEEN[b]] for x in (q, k, v)))[0][0] for b in range(B)]
    steps = 2 * (N + D + 8) + 2 * N * DV
    if kind != "softmax":
        steps = max(steps, _hybrid_steps(core, q, k, v))
    for b in range(B):
        assert_close(out[b, :, BETWEEN[b]], alone[b], steps=steps, name=f"row {b}")


def test_window_reference_is_the_definition_in_fp64():
    """|i - j| < W: exact softmax weights exp(q.k / sqrt d); every other key phi~(q).phi~(k); one denominator."""
    window = 3
    torch.manual_seed(0)
    core = AttentionCore("performer", H, D, feature_dim=F, causal=False, normalization="denominator", form="quadratic").double()
    module = LocalMixingCore(core, window=window)
    q, k, v = (x.double() for x in make_qkv(B, H, N, D, DV, seed=10))
    got, _ = module(q, k, v)
    fq, fk = core.feature_map(q), core.feature_map(k)
    kernel = (fq.features @ fk.features.transpose(-1, -2)) * torch.exp(fq.log_scale[..., None] + fk.log_scale[..., None, :])
    near = (torch.arange(N)[:, None] - torch.arange(N)[None, :]).abs() < window
    weights = torch.where(near, torch.exp(q @ k.transpose(-1, -2) / math.sqrt(D)), kernel)
    want = (weights @ v) / weights.sum(-1, keepdim=True)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def test_a_window_covering_every_key_is_exact_bidirectional_softmax():
    core = AttentionCore("flexformer_n", H, D, feature_dim=F, causal=False, normalization="denominator", chunk_size=4)
    q, k, v = make_qkv(B, H, N, D, seed=11)
    mask = key_mask("random")
    got, _ = LocalMixingCore(core, window=N)(q, k, v, key_mask=mask)
    want = bidirectional_softmax_attention(q, k, v, key_mask=mask)
    scale = (q.double() @ k.double().transpose(-1, -2)).abs().max().item() / math.sqrt(D)
    assert_close(got, want, steps=2 * (N + D + 2 * scale + 8))


# ----------------------------------------------------------------------------- refusals
@pytest.mark.parametrize("case", ["state_in", "state_out", "documents", "recurrent", "gated", "conv_build", "conv_direct"])
def test_what_has_no_bidirectional_meaning_is_refused_naming_the_fix(case):
    q, k, v = make_qkv(B, H, N, D, seed=12)
    core = _module("elu", "chunked")
    calls = {
        "state_in": (lambda: core(q, k, v, state=LinearAttentionState.empty(B, H, F, D)), "state: .*state=None"),
        "state_out": (lambda: core(q, k, v, return_state=True), "return_state: .*return_state=False"),
        "documents": (lambda: core(q, k, v, document_starts=torch.arange(N).expand(B, N) % 5 == 0), "document_starts: .*one document per row"),
        "recurrent": (lambda: _module("elu", "recurrent")(q, k, v), "form: 'recurrent' .*'chunked'"),
        "gated": (lambda: LocalMixingCore(core, window=3, mixing="gated")(q, k, v), "window_mixing: .*'shared_normaliser'"),
        "conv_build": (lambda: build_attention(core, conv_size=2), "qkv_conv_size: .*qkv_conv_size=0"),
        "conv_direct": (lambda: LocalMixingCore(core, window=3, conv_size=2)(q, k, v), "qkv_conv_size: .*qkv_conv_size=0"),
    }
    call, message = calls[case]
    with pytest.raises(RefusedAttention, match=message) as err:
        call()
    assert "causal=True" in str(err.value)  # the other way out


def test_every_refusal_is_a_value_error_that_names_a_setting():
    assert issubclass(RefusedAttention, ValueError)
    for refusal in REFUSALS:
        assert refusal.message.split(":")[0] in {"state", "return_state", "document_starts", "qkv_conv_size",
                                                 "window_mixing", "form", "context_parallel_size", "kernel_decay"}, refusal.name
    with pytest.raises(RefusedAttention):  # a causal request with the same settings is served
        select(Request("linear", form="bidirectional", continues_state=True))
    assert select(Request("linear", continues_state=True)).name == "linear.chunk.torch"


# ----------------------------------------------------------------------------- the model
MODEL = dict(vocab_size=37, num_layers=2, hidden_size=16, num_heads=2, feature_dim=8, chunk_size=4, max_seq_len=32)


@pytest.mark.parametrize("extra", [{}, {"attention": "softmax"}, {"softmax_window": 3}, {"attention": "elu"}])
def test_gpt_bidirectional_forward_backward_with_padding(extra):
    torch.manual_seed(0)
    model = GPT(ModelConfig(**MODEL, causal=False, **extra))
    ids = torch.randint(0, 37, (B, 11), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(B, 11, dtype=torch.long)
    mask[1, :3] = 0  # left padding
    labels = ids.masked_fill(mask == 0, -100)
    out = model(ids, labels=labels, attention_mask=mask)
    assert torch.isfinite(out.logits).all() and torch.isfinite(out.loss)
    out.loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    with torch.no_grad():
        other = ids.clone()
        other[1, :3] = (other[1, :3] + 1) % 37  # other pad tokens: the real tokens' logits do not move
        assert torch.equal(model(other, attention_mask=mask).logits[1, 3:], out.logits[1, 3:].detach())
        later = ids.clone()
        later[:, -1] = (later[:, -1] + 1) % 37  # the first real token reads the last one
        assert not torch.equal(model(later, attention_mask=mask).logits[:, 3], out.logits[:, 3].detach())


def test_gpt_bidirectional_refusals_and_config():
    with pytest.raises(ValueError, match="causal must be a bool"):
        ModelConfig(**MODEL, causal="no")
    with pytest.raises(RefusedAttention, match="qkv_conv_size"):  # by the config, before any module is built
        ModelConfig(**MODEL, causal=False, qkv_conv_size=2)
    model = GPT(ModelConfig(**MODEL, causal=False))
    with pytest.raises(RefusedAttention, match="return_state"):
        model(torch.zeros(1, 4, dtype=torch.long), return_state=True)


def test_gpt_bidirectional_under_context_parallelism_is_refused_by_the_table():
    """The context-parallel stand-in of a layer's core (a causal prefix state from the ranks before)
    is refused by ``dispatch.REFUSALS``, as the config check refuses parallel.context_parallel_size > 1."""
    from megaflex.model.layers import LocalLayers

    class ContextParallelStandIn(LocalLayers):
        def attention(self, core):
            return lambda *args, **kwargs: core(*args, **kwargs)  # not the core itself: what CP > 1 gives

    for causal in (True, False):
        model = GPT(ModelConfig(**MODEL, causal=causal))
        for block in model.blocks:
            block.attn.layer_factory = ContextParallelStandIn()
        ids = torch.zeros(1, 4, dtype=torch.long)
        if causal:
            model(ids)  # served
            continue
        with pytest.raises(RefusedAttention, match="context_parallel_size: context parallelism passes .*causal=True"):
            model(ids)


# ----------------------------------------------------------------------------- stabilisers
@pytest.mark.parametrize("normalization", NORMALIZATIONS)
@pytest.mark.parametrize("kind", ["flexformer_n", "hybrid"])
def test_huge_norms_stay_finite(kind, normalization):
    """||k||^2 / e^tau ~ 1e3-1e4: exp of the log-scales would overflow fp32; the stabiliser keeps every
    exp argument <= 0, forward and backward, and both forms agree where the problem is well conditioned."""
    q, k, v = make_qkv(1, H, N, D, seed=13)
    q, k = (x.mul(30.0).requires_grad_() for x in (q, k))
    with torch.no_grad():
        k[:, :, 5] *= 3  # one dominant key
    results = {}
    for form in ("quadratic", "chunked"):
        module = _module(kind, form, normalization=normalization)
        kls = module.feature_map(k).log_scale
        assert kls.abs().max() > 1e3
        out, _ = module(q, k, v)
        grads = torch.autograd.grad(out.sum(), [q, k])
        assert torch.isfinite(out).all() and all(torch.isfinite(g).all() for g in grads)
        results[form] = out
    if kind != "hybrid" and normalization == "rms":
        steps = attention_steps(N, F, D, log_scale_spread(kls))
        assert_close(results["chunked"], results["quadratic"], steps=steps)


@pytest.mark.parametrize("normalization", ["denominator", "capped_denominator"])
def test_signed_denominators_crossing_zero_are_guarded_as_in_the_causal_forms(normalization):
    """Trig-like signed features: keys +-e1, +-e2 give z = (1, -1), queries (cos a, sin a) give
    d_i = cos a - sin a: positive, zero and negative, while the numerators do not vanish."""
    from megaflex.attention.normalize import capped_denominator, guard_denominator

    angles = torch.tensor([0.0, math.pi / 4, math.pi / 2, math.pi, 5 * math.pi / 4, 3 * math.pi / 2, 0.3, 2.0])
    qf = torch.stack([angles.cos(), angles.sin()], -1)[None, None]  # [1, 1, 8, 2]
    kf = torch.tensor([[1.0, 0.0], [-1.0, 0.0], [1.0, 0.0], [0.0, -1.0], [0.0, 1.0], [0.0, -1.0]])[None, None]
    v = torch.randn(1, 1, 6, 3, generator=torch.Generator().manual_seed(3))
    qf, kf, v = (x.double().requires_grad_() for x in (qf, kf, v))
    # queries and keys of different lengths are not a form's input: pad the keys' call to 8 tokens
    kf8 = torch.cat([kf, kf.new_zeros(1, 1, 2, 2)], 2)
    v8 = torch.cat([v, v.new_zeros(1, 1, 2, 3)], 2)
    mask = torch.tensor([[True] * 6 + [False] * 2])
    out = bidirectional_linear_attention(qf, kf8, None, v8, normalization=normalization, key_mask=mask)
    numerators = qf[0, 0] @ (kf[0, 0].T @ v[0, 0])
    d = qf[0, 0] @ kf[0, 0].sum(0)
    assert (d.abs() < 1e-12).any() and (d < -0.1).any() and (d > 0.1).any()
    eps = 1e-6
    guard = guard_denominator(d, eps) if normalization == "denominator" else capped_denominator(numerators, d, eps)
    torch.testing.assert_close(out[0, 0], numerators / guard[:, None], rtol=1e-12, atol=1e-12)
    if normalization == "capped_denominator":
        assert (out[0, 0].pow(2).mean(-1).sqrt() <= OUTPUT_RMS_CAP * (1 + 1e-9)).all()
    grads = torch.autograd.grad(out.sum(), [qf, kf, v])
    assert all(torch.isfinite(g).all() for g in grads)
