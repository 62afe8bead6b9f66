"""The window hybrid's learned far-field gain (``LocalMixingCore(far_gain=True)``, ``model.window_far_gain``):
e^b_h on every far weight, against the naive definition in every form, its gradient, today's
hybrid at init, and the settings it refuses."""

from __future__ import annotations

import math

import pytest
import torch

from megaflex.attention import AttentionCore
from megaflex.attention.hybrid import LocalMixingCore, build_attention
from attention_helpers import make_qkv
from numerics import assert_close, normwise_scale
from test_attention_shared_window import steps_of

pytestmark = pytest.mark.numerics

HEADS, D, FEAT = 3, 8, 16
GAINS = torch.tensor([-1.5, 0.0, 0.8], dtype=torch.float64)  # log-gains b_h: e^b = 0.22, 1, 2.2


def hybrid(window: int, form: str = "chunked", causal: bool = True, seed: int = 1, **kwargs) -> LocalMixingCore:
    torch.manual_seed(seed)
    core = AttentionCore("flexformer_n", HEADS, D, feature_dim=FEAT, chunk_size=4, normalization="denominator",
                         form=form, causal=causal)
    return LocalMixingCore(core, window=window, **kwargs).double()


def naive(mixer: LocalMixingCore, q, k, v, window: int, log_gain: torch.Tensor, causal: bool = True) -> torch.Tensor:
    """fp64, unstabilised: exp(q.k / sqrt d) for keys with lag in [0, W) (|lag| < W bidirectional),
    e^b_h phi~(q).phi~(k) for every other key it may see, one normaliser."""
    fmap = mixer.core.feature_map
    qm, km = fmap(q), fmap(k)
    phi_q, phi_k = qm.features * qm.log_scale.exp().unsqueeze(-1), km.features * km.log_scale.exp().unsqueeze(-1)
    n = q.shape[2]
    near = torch.exp(q @ k.transpose(-1, -2) / math.sqrt(D))
    far = (phi_q @ phi_k.transpose(-1, -2)) * log_gain.exp().view(1, HEADS, 1, 1)
    lag = torch.arange(n).unsqueeze(1) - torch.arange(n)
    w = torch.where(lag.abs() < window if not causal else (lag >= 0) & (lag < window), near, far)
    if causal:
        w = w * (lag >= 0)
    return (w @ v) / w.sum(-1, keepdim=True)


@pytest.mark.parametrize("form", ["quadratic", "chunked", "recurrent"])
def test_every_form_scales_the_far_field_by_the_learned_gain(form: str) -> None:
    window = 5
    mixer = hybrid(window, form, far_gain=True)
    with torch.no_grad():
        mixer.far_log_gain.copy_(GAINS)
    q, k, v = make_qkv(2, HEADS, 19, D, seed=2, dtype=torch.float64)
    got, _ = mixer(q, k, v)
    want = naive(mixer, q, k, v, window, GAINS)
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9 * want.abs().max().item())
    # its gradient is the definition's (fp64 autograd through the naive sums)
    weights = torch.linspace(-1, 1, got.numel(), dtype=torch.float64).view_as(got)
    (got * weights).sum().backward()
    gains = GAINS.clone().requires_grad_()
    (naive(mixer, q, k, v, window, gains) * weights).sum().backward()
    torch.testing.assert_close(mixer.far_log_gain.grad, gains.grad, rtol=1e-8, atol=1e-10)
    assert (gains.grad.abs() > 1e-6).all()


def test_the_bidirectional_window_scales_its_far_field_too() -> None:
    window = 4
    q, k, v = make_qkv(2, HEADS, 17, D, seed=3, dtype=torch.float64)
    outs = []
    for form in ("quadratic", "chunked"):
        mixer = hybrid(window, form, causal=False, far_gain=True)
        with torch.no_grad():
            mixer.far_log_gain.copy_(GAINS)
        outs.append(mixer(q, k, v)[0])
    want = naive(mixer, q, k, v, window, GAINS, causal=False)
    for got in outs:
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9 * want.abs().max().item())


def test_decoding_and_segments_continue_the_full_sequence_with_the_gain() -> None:
    q0, k0, v0 = make_qkv(1, HEADS, 61, D, seed=4)
    results = []
    for segment in (1 << 20, 16):  # one call; segments of 16 tokens recomputed in the backward
        torch.manual_seed(0)
        core = AttentionCore("flexformer_n", HEADS, D, feature_dim=FEAT, chunk_size=8)
        mixer = LocalMixingCore(core, window=12, far_gain=True)
        mixer.segment_tokens = segment
        with torch.no_grad():
            mixer.far_log_gain.copy_(GAINS.float())
        q, k, v = (t.clone().requires_grad_() for t in (q0, k0, v0))
        out, _ = mixer(q, k, v)
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        results.append([out.detach(), q.grad, mixer.far_log_gain.grad, *(p.grad for p in core.parameters())])
        with torch.no_grad():  # token by token from a state: the recurrent form after a prefix
            first, state = mixer(q0[:, :, :30], k0[:, :, :30], v0[:, :, :30], return_state=True)
            steps = [first]
            for t in range(30, 61):
                o, state = mixer(q0[:, :, t : t + 1], k0[:, :, t : t + 1], v0[:, :, t : t + 1], state=state, return_state=True)
                steps.append(o)
        bound = steps_of(core.feature_map, q0, k0, v0) + 2 * 61 * HEADS  # as the plain hybrid's segment test
        assert_close(torch.cat(steps, dim=2), out.detach(), steps=bound, name="decoded")
    assert results[0][2].abs().min() > 0  # the gain learns
    floor = max(normwise_scale(g) for g in results[0][1:])
    for a, b in zip(*results):  # the segments return the gain's gradient too
        assert a is not None and b is not None
        assert_close(a, b, steps=bound, floor=floor)


def test_at_init_it_is_todays_hybrid_bit_for_bit() -> None:
    q, k, v = make_qkv(2, HEADS, 23, D, seed=5)
    plain, gained = hybrid(6), hybrid(6, far_gain=True)
    plain, gained = plain.float(), gained.float()
    assert torch.equal(gained.far_log_gain, torch.zeros(HEADS))
    assert torch.equal(plain(q, k, v)[0], gained(q, k, v)[0])
    assert [kp.name for kp in gained.kernel_parameters()] == ["far_log_gain"]
    assert gained.kernel_parameters()[0].role == "temperature"


def test_settings_without_a_far_field_to_scale_are_refused() -> None:
    from megaflex.model import ModelConfig

    core = AttentionCore("flexformer_n", HEADS, D, feature_dim=FEAT)
    with pytest.raises(ValueError, match="window_far_gain: expected softmax_window > 0 with window_mixing 'shared_norm"):
        build_attention(core, far_gain=True)  # no window: it would be dropped silently
    with pytest.raises(ValueError, match="window_mixing='gated'; set window_far_gain=false"):
        LocalMixingCore(core, window=4, mixing="gated", far_gain=True)
    with pytest.raises(ValueError, match="expected a linear attention kind"):
        build_attention(AttentionCore("softmax", HEADS, D), window=4, far_gain=True)
    base = dict(vocab_size=64, num_layers=1, hidden_size=24, num_heads=3, feature_dim=8)
    with pytest.raises(ValueError, match="window_far_gain: expected softmax_window > 0"):
        ModelConfig(**base, window_far_gain=True)
    assert ModelConfig(**base, softmax_window=4, window_far_gain=True).window_far_gain


def test_the_diagnostic_weights_carry_the_gain() -> None:
    """kernel_stats' far share and effective keys read the weights the forward uses, gain included."""
    from megaflex.attention.diagnostics import far_share, window_causal_weights

    mixer = hybrid(5, "quadratic", far_gain=True).float()
    with torch.no_grad():
        mixer.far_log_gain.copy_(GAINS.float())
        q, k, v = make_qkv(2, HEADS, 21, D, seed=6)
        out, _ = mixer(q, k, v)
        weights = window_causal_weights(q, k, mixer.core.feature_map, 5, mixer.far_log_gain)
        plain = window_causal_weights(q, k, mixer.core.feature_map, 5)
    assert_close((weights @ v) / weights.sum(-1, keepdim=True), out, steps=steps_of(mixer.core.feature_map, q, k, v))
    shares = [far_share(w[:, h : h + 1], 5) for w in (weights, plain) for h in range(HEADS)]
    assert shares[0] < shares[3] and shares[1] == pytest.approx(shares[4]) and shares[2] > shares[5]  # e^b: 0.22, 1, 2.2
