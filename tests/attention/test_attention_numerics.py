"""Numerical robustness: the log-space stabiliser (huge key norms, carried-state rescaling), the
guarded denominator, the Flexformer temperature floor, and gradchecks of the reference forms."""

from __future__ import annotations

import math

import pytest
import torch

from attention_helpers import AVAILABLE_FORMS, attend, attention_steps, form_steps, log_scale_spread, make_map, make_qkv, rel_err
from megaflex.attention import LinearAttentionState, NORMALIZATIONS, causal_linear_attention
from megaflex.attention.feature_maps.flexformer_n import DEFAULT_FLOOR_MARGIN
from numerics import assert_close

pytestmark = pytest.mark.numerics


@pytest.mark.parametrize("kind", ["flexformer_n", "flexformer_s", "performer"])
@pytest.mark.parametrize("key_scale", [100.0, 1000.0])
@pytest.mark.parametrize("normalization", NORMALIZATIONS)
def test_huge_key_norms_stay_finite_in_every_form(kind, key_scale, normalization):
    fmap = make_map(kind, 2, 8, 32)
    q, k, v = make_qkv(1, 2, 21, 8, seed=0)
    k = k * key_scale
    k[:, :, 5] *= 3  # one dominant key mid-sequence: later queries must still see finite sums
    fq, fk = fmap(q), fmap(k)
    qf, kls = fq.features.detach(), fk.log_scale.detach()
    assert kls.abs().max() > 1e3  # exp(log_scale) itself would overflow (or underflow) fp32
    outputs = {}
    for form in AVAILABLE_FORMS:
        kf = fk.features.detach().requires_grad_()
        vv = v.clone().requires_grad_()
        out, state = causal_linear_attention(qf, kf, kls, vv, form=form, normalization=normalization, chunk_size=8)
        assert torch.isfinite(out).all() and torch.isfinite(state.kv).all() and torch.isfinite(state.k_sum).all()
        out.sum().backward()
        assert torch.isfinite(kf.grad).all() and torch.isfinite(vv.grad).all()
        outputs[form] = out
    if normalization == "rms":  # (a signed denominator near its guard is ill-conditioned, only finite)
        steps = attention_steps(21, qf.shape[-1], v.shape[-1], log_scale_spread(kls))
        for form, out in outputs.items():
            assert_close(out, outputs["quadratic"], steps=steps, name=form)


@pytest.mark.parametrize("form", AVAILABLE_FORMS)
@pytest.mark.parametrize("kind", ["flexformer_n", "flexformer_s"])
def test_state_rescaled_when_a_later_segment_has_much_larger_keys(form, kind):
    fmap = make_map(kind, 2, 8, 32)
    q, k, v = make_qkv(1, 2, 24, 8, seed=1)
    k[:, :, 12:] *= 5  # the second segment's key log-scales exceed the carried log_max by > 10
    full, full_state = attend(fmap, q, k, v, form="quadratic")
    first, state = attend(fmap, q[:, :, :12], k[:, :, :12], v[:, :, :12], form=form, chunk_size=4)
    second, final = attend(fmap, q[:, :, 12:], k[:, :, 12:], v[:, :, 12:], form=form, state=state, chunk_size=4)
    assert (final.log_max - state.log_max).min() > 10
    steps = form_steps(fmap, q, k, v)
    assert_close(torch.cat([first, second], dim=2), full, steps=steps, name="out")
    assert_close(final.kv, full_state.kv, steps=steps, name="kv")
    assert_close(final.k_sum, full_state.k_sum, steps=steps, name="k_sum")
    # sensitivity: the carried (rescaled) state visibly matters for the second segment
    alone, _ = attend(fmap, q[:, :, 12:], k[:, :, 12:], v[:, :, 12:], form="quadratic")
    assert rel_err(alone, full[:, :, 12:]) > 1e-3


@pytest.mark.parametrize("form", AVAILABLE_FORMS)
@pytest.mark.parametrize("normalization", NORMALIZATIONS)
def test_carried_state_rescaling_with_synthetic_log_scales(form, normalization):
    """Positive features, key log-scales jumping by +30 then +300 across three segments."""
    g = torch.Generator().manual_seed(6)
    qf, kf = torch.rand(2, 1, 2, 30, 4, generator=g) + 0.05
    v = torch.randn(1, 2, 30, 3, generator=g)
    kls = torch.randn(1, 2, 30, generator=g)
    kls[..., 10:20] += 30
    kls[..., 20:] += 300  # exp(kls) alone overflows fp32 here
    full, full_state = causal_linear_attention(qf, kf, kls, v, form="quadratic", normalization=normalization)
    pieces, state = [], None
    for sl in (slice(0, 10), slice(10, 20), slice(20, 30)):
        out, state = causal_linear_attention(
            qf[:, :, sl], kf[:, :, sl], kls[..., sl], v[:, :, sl], form=form, normalization=normalization,
            initial_state=state, chunk_size=4,
        )
        pieces.append(out)
    assert torch.isfinite(full).all()
    steps = attention_steps(30, 4, 3, log_scale_spread(kls))
    assert_close(torch.cat(pieces, dim=2), full, steps=steps, name="out")
    assert torch.equal(state.log_max, full_state.log_max)
    assert_close(state.kv, full_state.kv, steps=steps, name="kv")


@pytest.mark.parametrize("form", AVAILABLE_FORMS)
def test_state_with_larger_log_max_than_new_keys(form):
    """The opposite case: new keys are tiny relative to the carried log_max (no rescale of the state)."""
    fmap = make_map("flexformer_s", 2, 8, 32)
    q, k, v = make_qkv(1, 2, 20, 8, seed=2)
    k[:, :, :8] *= 4
    full, _ = attend(fmap, q, k, v, form="quadratic")
    first, state = attend(fmap, q[:, :, :8], k[:, :, :8], v[:, :, :8], form=form, chunk_size=4)
    second, final = attend(fmap, q[:, :, 8:], k[:, :, 8:], v[:, :, 8:], form=form, state=state, chunk_size=4)
    assert torch.equal(final.log_max, state.log_max)
    assert_close(torch.cat([first, second], dim=2), full, steps=form_steps(fmap, q, k, v))


@pytest.mark.parametrize("form", AVAILABLE_FORMS)
def test_denominator_mode_is_finite_when_the_trig_denominator_crosses_zero(form):
    # Signed (trig-like) features: qf = e1 and keys +-e1, so d_t = sum_s qf_t . kf_s goes
    # 1, 0, 1, 0, -1, ... (exactly zero at even t) while the numerator does not vanish.
    n = 10
    qf = torch.zeros(1, 1, n, 2)
    qf[..., 0] = 1.0
    signs = torch.tensor([1.0, -1.0, 1.0, -1.0, -1.0, -1.0, 1.0, 1.0, 1.0, -1.0])
    kf = torch.zeros(1, 1, n, 2)
    kf[0, 0, :, 0] = signs
    kf = kf.requires_grad_()
    v = torch.randn(1, 1, n, 3, generator=torch.Generator().manual_seed(3), requires_grad=True)
    denominators = torch.cumsum(signs, 0)
    assert (denominators == 0).any() and (denominators < 0).any()
    eps = 1e-6
    out, _ = causal_linear_attention(qf, kf, None, v, form=form, normalization="denominator", chunk_size=4, eps=eps)
    assert torch.isfinite(out).all()
    numerators = torch.cumsum(signs[:, None] * v[0, 0].detach(), 0)
    guarded = torch.where(denominators >= 0, denominators.clamp(min=eps), denominators.clamp(max=-eps))
    # the sums of +-1 x v are exact in few terms but for v's own rounding: n-term sums, one division
    assert_close(out[0, 0], numerators / guarded[:, None], steps=2 * n + 2)
    out.sum().backward()
    assert torch.isfinite(kf.grad).all() and torch.isfinite(v.grad).all()


def _crossing_denominators(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """qf = e1 and keys +-e1: d_t = sum_s qf_t . kf_s goes 1, 0, 1, 0, -1, ... (zero at even t, negative
    later) while the numerator does not vanish. Returns qf, kf, v (leaves) and the exact d_t."""
    n = 10
    qf = torch.zeros(1, 1, n, 2, dtype=dtype)
    qf[..., 0] = 1.0
    signs = torch.tensor([1.0, -1.0, 1.0, -1.0, -1.0, -1.0, 1.0, 1.0, 1.0, -1.0], dtype=dtype)
    kf = torch.zeros(1, 1, n, 2, dtype=dtype)
    kf[0, 0, :, 0] = signs
    v = torch.randn(1, 1, n, 3, generator=torch.Generator().manual_seed(3)).to(dtype)
    return qf, kf.requires_grad_(), v.requires_grad_(), torch.cumsum(signs, 0)


@pytest.mark.parametrize("form", AVAILABLE_FORMS)
def test_capped_denominator_is_the_ratio_below_the_cap_and_bounded_where_d_crosses_zero(form):
    from megaflex.attention.normalize import OUTPUT_RMS_CAP

    qf, kf, v, denominators = _crossing_denominators(torch.float32)
    eps = 1e-6
    out, _ = causal_linear_attention(qf, kf, None, v, form=form, normalization="capped_denominator", chunk_size=4, eps=eps)
    numerators = torch.cumsum(kf[0, 0, :, :1].detach() * v[0, 0].detach(), 0)
    floor = torch.sqrt(numerators.pow(2).mean(-1) + eps * eps) / OUTPUT_RMS_CAP
    capped = denominators < floor
    assert capped.any() and (~capped).any()  # both regimes: zero / negative d and well-conditioned d
    assert_close(out[0, 0], numerators / torch.maximum(denominators, floor)[:, None], steps=2 * 10 + 4)
    rms = out[0, 0].pow(2).mean(-1).sqrt()
    assert (rms <= OUTPUT_RMS_CAP * (1 + 1e-5)).all()  # where d <= 0 the plain guard gives |n| / eps
    assert torch.allclose(rms[capped], torch.full_like(rms[capped], OUTPUT_RMS_CAP), rtol=1e-5)


@pytest.mark.parametrize("form", [f for f in AVAILABLE_FORMS if f != "quadratic"])
def test_capped_denominator_gradients_match_the_reference_in_both_regimes(form):
    """The chunked Function's hand-written backward (and the recurrent form's autograd) against
    autograd through the quadratic form, fp64, on denominators that cross zero."""
    grads = {}
    for name in ("quadratic", form):
        qf, kf, v, _ = _crossing_denominators(torch.float64)
        qf = qf.requires_grad_()
        out, _ = causal_linear_attention(qf, kf, None, v, form=name, normalization="capped_denominator", chunk_size=4)
        probe = torch.linspace(-1, 1, out.numel(), dtype=torch.float64).view_as(out)
        grads[name] = torch.autograd.grad((out * probe).sum(), (qf, kf, v))
    # qf's gradient is ~0 (the output is invariant to a per-query scale): compare on the scale of 1
    for want, got in zip(grads["quadratic"], grads[form]):
        assert_close(got, want, steps=40, dtype=torch.float64, floor=1.0)
    assert grads[form][1].abs().max() > 0.1 and grads[form][2].abs().max() > 0.1


@pytest.mark.parametrize("form", AVAILABLE_FORMS)
def test_rms_mode_with_zero_numerator_is_finite(form):
    qf, kf, _ = make_qkv(1, 2, 9, 4, seed=4)
    v = torch.zeros(1, 2, 9, 4, requires_grad=True)
    out, _ = causal_linear_attention(qf, kf, None, v, form=form, chunk_size=4)
    assert torch.equal(out, torch.zeros_like(out))
    out.sum().backward()
    assert torch.isfinite(v.grad).all()


def test_flexformer_temperature_cannot_collapse_below_its_floor():
    head_dim = 16
    fmap = make_map("flexformer_n", 3, head_dim, 32)
    floor = math.log(2 * math.sqrt(head_dim)) - DEFAULT_FLOOR_MARGIN
    assert fmap.min_log_temperature == pytest.approx(floor)
    with torch.no_grad():
        fmap.tau.copy_(torch.tensor([-1e4, floor, floor + 2.5]))
    tau_eff = fmap.log_temperature().detach()
    assert (tau_eff >= floor).all() and tau_eff[0] == pytest.approx(floor, abs=1e-6)
    assert tau_eff[2].item() == pytest.approx(floor + 2.5, abs=1e-6)  # identity well above the floor
    # the log-scale stays bounded by ||x||^2 / e^floor, and tau keeps a gradient (it can recover)
    x = torch.randn(1, 3, 4, head_dim)
    out = fmap(x)
    assert (out.log_scale <= (x * x).sum(-1) * math.exp(-floor) * (1 + 1e-5)).all()
    out.log_scale.sum().backward()
    assert (fmap.tau.grad[1:] != 0).all()
    # a custom floor
    custom = make_map("flexformer_n", 1, head_dim, 8, min_log_temperature=0.5)
    with torch.no_grad():
        custom.tau.fill_(-30.0)
    assert custom.log_temperature().detach().item() == pytest.approx(0.5, abs=1e-6)


def test_flexformer_temperature_ceiling_bounds_tau_and_is_the_identity_well_inside_the_band():
    head_dim = 16
    init = math.log(2 * math.sqrt(head_dim))
    ceiling = init + 0.5
    fmap = make_map("flexformer_n", 6, head_dim, 32, max_log_temperature=ceiling)
    assert torch.equal(fmap.log_temperature(), fmap.tau.detach())  # the init lies inside the band: untouched
    taus = torch.tensor([init - 1.0, ceiling - 0.45, ceiling - 0.1, ceiling, ceiling + 0.3, 1e4])
    with torch.no_grad():
        fmap.tau.copy_(taus)
    tau_eff = fmap.log_temperature()
    assert (tau_eff.detach() <= ceiling).all() and tau_eff[5].item() == pytest.approx(ceiling, abs=1e-6)
    assert torch.equal(tau_eff[:2].detach(), taus[:2])  # bit-exact well inside the band (below ceiling - 0.4)
    assert (tau_eff[2:5].detach() < taus[2:5]).all()  # saturating toward the ceiling
    # a gradient everywhere: ~1 below the ceiling, 1/2 at it, small but not 0 above (tau can come back)
    tau_eff.sum().backward()
    grad = fmap.tau.grad
    assert torch.equal(grad[:2], torch.ones(2)) and grad[3].item() == pytest.approx(0.5, abs=1e-6)
    assert 0.99 < grad[2].item() < 1 and 0 < grad[4].item() < 1e-5
    # the features use it: the log-scale ||x||^2 / e^tau_eff never falls below ||x||^2 / e^ceiling
    x = torch.randn(1, 6, 5, head_dim)
    out = fmap(x)
    assert (out.log_scale >= (x * x).sum(-1) * math.exp(-ceiling) * (1 - 1e-5)).all()
    # without the field: no ceiling, today's behaviour (tau = 1e4 stays 1e4)
    plain = make_map("flexformer_n", 6, head_dim, 32)
    assert plain.max_log_temperature is None
    with torch.no_grad():
        plain.tau.copy_(taus)
    assert torch.equal(plain.log_temperature().detach(), taus)
    # every form reads the bounded value (trig_spec): a capped core over tau above the ceiling computes
    # what an uncapped one computes at tau_eff, in the chunked (fused trig) and recurrent forms alike
    from megaflex.attention import AttentionCore

    q, k, v = (torch.randn(1, 6, 11, head_dim) for _ in range(3))
    for form in ("chunked", "recurrent"):
        capped = AttentionCore("flexformer_n", 6, head_dim, feature_dim=32, chunk_size=4, form=form,
                               max_log_temperature=ceiling)
        free = AttentionCore("flexformer_n", 6, head_dim, feature_dim=32, chunk_size=4, form=form)
        free.load_state_dict(capped.state_dict())
        with torch.no_grad():
            capped.feature_map.tau.copy_(taus)
            free.feature_map.tau.copy_(capped.feature_map.log_temperature())
        assert torch.equal(capped(q, k, v)[0], free(q, k, v)[0]), form
    for bad in (plain.min_log_temperature + 2.3, float("inf"), "3"):
        with pytest.raises(ValueError, match="max_log_temperature: expected a number >= min_log_temperature"):
            make_map("flexformer_n", 1, head_dim, 8, max_log_temperature=bad)


# ----------------------------------------------------------------------------- gradcheck


@pytest.mark.parametrize("form", ["quadratic", "recurrent"])
@pytest.mark.parametrize("normalization", NORMALIZATIONS)
def test_reference_forms_gradcheck(form, normalization):
    """Float64 gradcheck of the output w.r.t. features, key log-scales, values and the carried state.

    m_t is detached by definition; the output is invariant to it up to eps, so a tiny eps makes
    the analytic gradient exact. Positive features keep the denominator away from its guard.
    """
    g = torch.Generator().manual_seed(5)
    b, h, n, f, dv = 1, 2, 5, 3, 2
    qf = torch.rand(b, h, n, f, generator=g, dtype=torch.float64) + 0.1
    kf = torch.rand(b, h, n, f, generator=g, dtype=torch.float64) + 0.1
    kls = torch.randn(b, h, n, generator=g, dtype=torch.float64) * 2
    v = torch.randn(b, h, n, dv, generator=g, dtype=torch.float64)
    kv = torch.rand(b, h, f, dv, generator=g, dtype=torch.float64)
    k_sum = torch.rand(b, h, f, generator=g, dtype=torch.float64) + 0.1
    log_max = torch.zeros(b, h, dtype=torch.float64)

    def fn(qf, kf, kls, v, kv, k_sum):
        state = LinearAttentionState(kv, k_sum, log_max, offset=3)
        return causal_linear_attention(qf, kf, kls, v, form=form, normalization=normalization, initial_state=state, eps=1e-14)[0]

    inputs = tuple(t.requires_grad_() for t in (qf, kf, kls, v, kv, k_sum))
    assert torch.autograd.gradcheck(fn, inputs, eps=1e-6, atol=1e-6)
