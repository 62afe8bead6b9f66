"""Feature maps: shapes and layout, the kernels they estimate (Monte-Carlo), convergence to exact
attention as the number of random features grows, and each map's defining identities."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from attention_helpers import LINEAR_KINDS, make_map
from megaflex.attention import build_feature_map, causal_linear_attention, redraw_random_features
from megaflex.attention.base import FeatureMap
from numerics import assert_close, fp32_steps_in

D_HEAD = 16


def phi_tilde_kernel(fmap: FeatureMap, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Per-head phi_tilde(q) . phi_tilde(k) for single vectors q, k [d] (one value per head), fp64."""
    x = torch.stack([q, k]).expand(fmap.num_heads, 2, q.shape[-1]).unsqueeze(0)  # [1, H, 2, d]
    out = fmap(x)
    feats = out.features[0].double()  # [H, 2, F]
    log_scale = torch.zeros(fmap.num_heads, 2, dtype=torch.float64) if out.log_scale is None else out.log_scale[0].double()
    return (feats[:, 0] * feats[:, 1]).sum(-1) * torch.exp(log_scale.sum(-1))


def query_key_pair(norm: float, cos_angle: float, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k [d] of the given norm and angle, in a random orientation."""
    g = torch.Generator().manual_seed(seed)
    basis, _ = torch.linalg.qr(torch.randn(D_HEAD, D_HEAD, generator=g, dtype=torch.float64))
    q = basis[:, 0] * norm
    k = (cos_angle * basis[:, 0] + math.sqrt(1 - cos_angle**2) * basis[:, 1]) * norm
    return q.float(), k.float()


# ----------------------------------------------------------------------------- layout


@pytest.mark.parametrize("kind", LINEAR_KINDS)
def test_shapes_dtypes_and_heads_on_dim0(kind):
    heads = 3
    fmap = make_map(kind, heads, 8, 24)
    x = torch.randn(2, heads, 5, 8)
    out = fmap(x, offset=4)
    assert out.features.shape == (2, heads, 5, fmap.feature_dim)
    assert out.log_scale is None or out.log_scale.shape == (2, heads, 5)
    for name, tensor in list(fmap.named_parameters()) + list(fmap.named_buffers()):
        assert tensor.shape[0] == heads, f"{kind}.{name} must have heads on dim 0 for TP sharding"
    if fmap.positive:
        assert (out.features >= 0).all()
    # bf16 in: features in bf16 (computed in fp32), log-scale kept in fp32
    out_bf16 = fmap(x.bfloat16(), offset=4)
    assert out_bf16.features.dtype == torch.bfloat16
    assert out_bf16.log_scale is None or out_bf16.log_scale.dtype == torch.float32
    # bf16 x (1 u_bf16 relative) through the map's head_dim-term projections and exps (their
    # arguments carry |arg| u), the bf16 output's rounding, fp32 maths in between
    with torch.no_grad():
        arguments = 1.0 + (out.log_scale.abs().max().item() if out.log_scale is not None else 0.0) + x.abs().max().item() ** 2
    steps = 2 + 8 + 2 * arguments + fp32_steps_in(torch.bfloat16, 8 + 24)
    assert_close(out_bf16.features, out.features, steps=steps, dtype=torch.bfloat16)


@pytest.mark.parametrize("omega_init", ["paper", "tied", "correlated"])
def test_flexformer_init(omega_init):
    fmap = make_map("flexformer_n", 4, D_HEAD, 512, omega_init=omega_init, omega_correlation=0.8)
    expected_std = D_HEAD**-0.25
    o2_std = {"paper": 1.0, "tied": math.sqrt(1 + 0.1**2), "correlated": 1.0}[omega_init]  # O1 + 0.1 noise: wider
    for omega, std in ((fmap.omega1, 1.0), (fmap.omega2, o2_std)):
        assert omega.shape == (4, 256, D_HEAD)
        assert abs(omega.std().item() / (std * expected_std) - 1) < 0.02 and abs(omega.mean().item()) < 0.01
    # paper: independent draws; tied: O2 - O1 is independent noise of std 0.1 * d^-1/4; correlated:
    # O2 - 0.8 O1 is independent noise of std 0.6 * d^-1/4. Always O1 != O2 (equal frequencies would
    # stay equal under training: symmetry)
    other, noise_std = {"paper": (fmap.omega2, 1.0), "tied": (fmap.omega2 - fmap.omega1, 0.1),
                        "correlated": (fmap.omega2 - 0.8 * fmap.omega1, 0.6)}[omega_init]
    assert abs(torch.corrcoef(torch.stack([fmap.omega1.flatten(), other.flatten()]))[0, 1].item()) < 0.02
    assert abs(other.std().item() / (noise_std * expected_std) - 1) < 0.02
    assert torch.allclose(fmap.tau, torch.full((4,), math.log(2 * math.sqrt(D_HEAD))))
    assert torch.equal(fmap.log_temperature(), fmap.tau.detach())  # the floor is inactive at init
    s = make_map("flexformer_s", 4, D_HEAD, 512)
    assert abs(s.omega.std().item() / expected_std - 1) < 0.02
    for bad in ({"omega_correlation": 1.0}, {"omega_correlation": 0.0}, {"omega_noise": 0.0}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            make_map("flexformer_n", 4, D_HEAD, 8, **bad)


def test_flexformer_n_with_equal_frequencies_is_exactly_flexformer_s():
    torch.manual_seed(0)
    n_map = build_feature_map("flexformer_n", 2, D_HEAD, 64)
    s_map = build_feature_map("flexformer_s", 2, D_HEAD, 64)
    with torch.no_grad():
        n_map.omega2.copy_(n_map.omega1)
        s_map.omega.copy_(n_map.omega1)
    x = torch.randn(1, 2, 9, D_HEAD) * 0.7
    out_n, out_s = n_map(x), s_map(x)
    # same maths in another arrangement (pair sums of cos/sin vs one set): head_dim-term projections
    steps = 2 * (D_HEAD + 4)
    assert_close(out_n.features, out_s.features, steps=steps, name="features")
    assert_close(out_n.log_scale, out_s.log_scale, steps=steps, name="log_scale")
    # the full kernels phi_tilde(q) . phi_tilde(k) between all pairs
    def kernel(o):
        return (o.features @ o.features.transpose(-1, -2)) * torch.exp(o.log_scale[..., :, None] + o.log_scale[..., None, :])
    # plus the 64-feature dot products and the exp of two log-scales
    assert_close(kernel(out_n), kernel(out_s), steps=steps + 64 + 2 * (out_n.log_scale.abs().max().item() + 1))


# ----------------------------------------------------------------------------- Monte-Carlo kernels

# (kind, kwargs, kernel estimated as a function of s = q.k / sqrt(d)); many heads = many independent draws
ESTIMATORS = [
    ("flexformer_s", {}, lambda s: math.exp(s)),
    ("flexformer_n", {"omega_init": "paper"}, lambda s: 0.5 * (math.exp(s) + 1)),  # the uniform floor
    ("flexformer_n", {"omega_init": "tied"}, lambda s: math.exp(s)),  # no floor (noise bias < 0.5% here)
    ("performer", {"variant": "positive"}, lambda s: math.exp(s)),
    ("performer", {"variant": "trig"}, lambda s: math.exp(s)),
]


@pytest.mark.parametrize("kind, kwargs, target", ESTIMATORS, ids=[e[0] + "-" + "-".join(e[1].values()) for e in ESTIMATORS])
@pytest.mark.parametrize("cos_angle", [0.6, -0.4])
def test_random_features_are_unbiased_kernel_estimates(kind, kwargs, target, cos_angle):
    norm = 0.8 * D_HEAD**0.25  # ||q||^2 / sqrt(d) = 0.64: moderate, so the estimator's variance is too
    q, k = query_key_pair(norm, cos_angle, seed=1)
    torch.manual_seed(1)
    fmap = build_feature_map(kind, 256, D_HEAD, 1024, **kwargs)  # 256 independent draws of 512-1024 features
    estimates = phi_tilde_kernel(fmap, q, k)
    expected = target((q @ k).item() / math.sqrt(D_HEAD))
    assert abs(estimates.mean().item() / expected - 1) < 0.02
    if kwargs.get("variant") == "positive":
        assert (estimates > 0).all()


def expected_flexformer_n_kernel(q: torch.Tensor, k: torch.Tensor, omega_init: str, eta: float = 0.1, rho: float = 0.5) -> float:
    """The closed-form mean of Flexformer-N's kernel at init over the frequency draws (module docstring)."""
    q, k = q.double(), k.double()
    root = math.sqrt(D_HEAD)
    s = (q @ k).item() / root
    if omega_init == "paper":
        return 0.5 * (math.exp(s) + 1)
    if omega_init == "correlated":
        return 0.5 * (math.exp(s) + math.exp(rho * s))
    damp = [(q - k).square().sum().item(), k.square().sum().item(), q.square().sum().item()]
    return 0.25 * math.exp(s) * (1 + sum(math.exp(-eta**2 * x / (2 * root)) for x in damp))


NO_FLOOR_INITS = [({"omega_init": "tied", "omega_noise": eta}, dict(eta=eta)) for eta in (0.3, 0.5, 1.0)]
NO_FLOOR_INITS += [({"omega_init": "correlated", "omega_correlation": rho}, dict(rho=rho)) for rho in (0.5, 0.8)]


@pytest.mark.parametrize("kwargs, params", NO_FLOOR_INITS, ids=[f"{k['omega_init']}-{list(p.values())[0]}" for k, p in NO_FLOOR_INITS])
@pytest.mark.parametrize("cos_angle", [0.6, -0.4])
def test_floor_free_inits_estimate_their_closed_form_kernel(kwargs, params, cos_angle):
    norm = 0.8 * D_HEAD**0.25
    q, k = query_key_pair(norm, cos_angle, seed=1)
    torch.manual_seed(1)
    fmap = build_feature_map("flexformer_n", 256, D_HEAD, 1024, **kwargs)
    expected = expected_flexformer_n_kernel(q, k, kwargs["omega_init"], **params)
    assert abs(phi_tilde_kernel(fmap, q, k).mean().item() / expected - 1) < 0.02


@pytest.mark.parametrize("kwargs", [{"omega_init": "paper"}] + [k for k, _ in NO_FLOOR_INITS],
                         ids=["paper"] + [f"{k['omega_init']}-{list(p.values())[0]}" for k, p in NO_FLOOR_INITS])
def test_only_the_paper_init_puts_a_floor_under_an_opposed_key(kwargs):
    """At init, a key pointing away from the query (s = q.k / sqrt d = -2.25) against a neutral key of
    the same norm (s = 0): the paper's init keeps (e^-2.25 + 1) / 2 = 0.55 of the neutral weight in
    expectation, the floor-free inits at most 0.22 (their closed forms: 0.10 to 0.22)."""
    norm = 3.0  # ||q||^2 / sqrt d = 2.25
    q, opposed = query_key_pair(norm, -1.0, seed=2)
    _, neutral = query_key_pair(norm, 0.0, seed=2)
    torch.manual_seed(2)
    fmap = build_feature_map("flexformer_n", 2048, D_HEAD, 64, **kwargs)  # 2048 independent draws of 32 pairs
    ratio = phi_tilde_kernel(fmap, q, opposed).mean().item() / phi_tilde_kernel(fmap, q, neutral).mean().item()
    if kwargs["omega_init"] == "paper":
        assert ratio >= 0.5
    else:
        assert ratio < 0.3


def test_performer_positive_features_are_positive_and_stable_for_large_inputs():
    fmap = make_map("performer", 2, D_HEAD, 64)
    out = fmap(torch.randn(1, 2, 7, D_HEAD) * 100)
    assert torch.isfinite(out.features).all() and torch.isfinite(out.log_scale).all()
    # non-negative (tiny ones underflow to 0) and the per-token max feature is exactly D^-1/2
    assert (out.features >= 0).all()
    assert torch.allclose(out.features.amax(dim=-1), torch.full((1, 2, 7), 64**-0.5))


def _exact_attention(q, k, v, kernel):
    weights = kernel((q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])).tril()
    return (weights @ v) / weights.sum(-1, keepdim=True)


@pytest.mark.parametrize(
    "kind, kwargs, kernel",
    [
        ("flexformer_s", {}, torch.exp),
        ("flexformer_n", {"omega_init": "paper"}, lambda s: 0.5 * (torch.exp(s) + 1)),
        ("performer", {"variant": "positive"}, torch.exp),
    ],
    ids=["flexformer_s", "flexformer_n", "performer"],
)
def test_attention_error_vs_exact_shrinks_with_more_features(kind, kwargs, kernel):
    heads, n = 8, 32
    errors = []
    for frequencies in (16, 64, 256, 1024):
        per_seed = []
        for seed in range(3):
            g = torch.Generator().manual_seed(100 + seed)
            q, k = (torch.randn(1, heads, n, D_HEAD, generator=g) * 0.5 for _ in range(2))
            v = torch.randn(1, heads, n, 4, generator=g)
            torch.manual_seed(seed)
            feature_dim = frequencies if kind == "performer" else 2 * frequencies
            fmap = build_feature_map(kind, heads, D_HEAD, feature_dim, **kwargs)
            fq, fk = fmap(q), fmap(k)
            out, _ = causal_linear_attention(fq.features, fk.features, fk.log_scale, v, form="quadratic", normalization="denominator")
            exact = _exact_attention(q.double(), k.double(), v.double(), kernel)
            per_seed.append(((out.double() - exact).abs().mean() / exact.abs().mean()).item())
        errors.append(sum(per_seed) / len(per_seed))
    assert all(a > b for a, b in zip(errors, errors[1:])), errors
    assert errors[-1] < errors[0] / 4, errors  # Monte-Carlo rate ~ D^-1/2: /8 expected for 64x more features


# ----------------------------------------------------------------------------- specific maps


def test_elu_features():
    fmap = make_map("elu", 2, 8, 999)  # feature_dim is fixed to head_dim for elu
    x = torch.randn(1, 2, 5, 8)
    assert fmap.feature_dim == 8
    assert torch.allclose(fmap(x).features, F.elu(x) + 1)


def test_cosformer_kernel_is_relu_product_with_cosine_distance_reweighting():
    m = 64
    fmap = make_map("cosformer", 1, 8, 0, max_seq_len=m)
    q, k = torch.randn(1, 1, 6, 8), torch.randn(1, 1, 6, 8)
    fq, fk = fmap(q, offset=10).features[0, 0], fmap(k, offset=3).features[0, 0]  # positions 10.., 3..
    kernel = fq @ fk.T  # [6, 6]
    i = torch.arange(6)[:, None] + 10
    j = torch.arange(6)[None, :] + 3
    expected = (torch.relu(q[0, 0]) @ torch.relu(k[0, 0]).T) * torch.cos(math.pi * (i - j) / (2 * m))
    # 16-feature (cos/sin-weighted relu) dots vs 8-term relu dots times a cosine: a few steps each;
    # the scale is the terms' (the relu dot of the magnitudes), not the possibly cancelled result
    terms = (torch.relu(q[0, 0]) @ torch.relu(k[0, 0]).T).abs().max().item()
    assert_close(kernel, expected, steps=2 * (16 + 8 + 4), floor=terms)
    with pytest.raises(ValueError, match="offset"):
        fmap(q, offset=m - 3)


def test_hedgehog_identity_init_and_softmax_features():
    fmap = make_map("hedgehog", 2, 8, 16)
    x = torch.randn(1, 2, 5, 8)
    feats = fmap(x).features
    # a 16-term softmax (exp arguments up to 2 max |x|) through the identity-initialised projection
    steps = 16 + 8 + 2 * 2 * x.abs().max().item() + 4
    assert_close(feats, torch.softmax(torch.cat([x, -x], dim=-1), dim=-1), steps=steps, floor=1.0)
    assert_close(feats.sum(-1), torch.ones(1, 2, 5), steps=steps + 16)


def test_performer_frequencies_are_orthogonal_blocks():
    fmap = make_map("performer", 2, 8, 16)
    omega = fmap.omega[0].double()  # [16, 8]: two blocks of 8 orthogonal rows
    for block in (omega[:8], omega[8:]):
        gram = block @ block.T
        # rows orthogonalised in fp32 (a QR of 8 x 8 blocks: ~8 steps per reflection, 8 of them),
        # compared on the scale of their squared norms (the Gram's diagonal)
        off_diagonal = gram - torch.diag(torch.diagonal(gram))
        assert_close(off_diagonal, torch.zeros_like(off_diagonal), steps=8 * 8 * 2, floor=torch.diagonal(gram).max().item())


def test_performer_redraw_is_deterministic_per_step_and_shardable():
    torch.manual_seed(0)
    a = build_feature_map("performer", 4, 8, 16, redraw_interval=10)
    torch.manual_seed(0)
    b = build_feature_map("performer", 4, 8, 16, redraw_interval=10)  # "another rank"
    initial = a.omega.clone()
    assert torch.equal(a.omega, b.omega)
    assert redraw_random_features(a, 9) == 0 and torch.equal(a.omega, initial)  # same interval
    assert redraw_random_features(a, 10) == 1 and not torch.equal(a.omega, initial)
    assert a.maybe_redraw(15) is False
    b.maybe_redraw(10)
    assert torch.equal(a.omega, b.omega)
    # a TP shard holding heads 2..3 (dim-0 slices of every buffer) redraws exactly those heads
    torch.manual_seed(1)
    shard = build_feature_map("performer", 2, 8, 16, redraw_interval=10)
    shard.load_state_dict({name: t[2:] for name, t in a.state_dict().items()})
    shard.maybe_redraw(25)
    a.maybe_redraw(25)
    assert torch.equal(shard.omega, a.omega[2:])
    # the draw follows the step, not the history: a fresh map asked for step 25 agrees
    assert b.maybe_redraw(27) and torch.equal(b.omega, a.omega)
    # fixed features without an interval
    fixed = make_map("performer", 2, 8, 16)
    before = fixed.omega.clone()
    assert redraw_random_features(fixed, 1000) == 0 and torch.equal(fixed.omega, before)


# ----------------------------------------------------------------------------- gradcheck


@pytest.mark.parametrize("kind", ["flexformer_n", "flexformer_s", "hedgehog", "performer", "cosformer", "elu"])
def test_feature_map_gradcheck(kind):
    fmap = make_map(kind, 2, 4, 8).double()
    x = torch.randn(1, 2, 3, 4, dtype=torch.float64, requires_grad=True)
    names = [name for name, _ in fmap.named_parameters()]

    def fn(x, *param_values):
        out = torch.func.functional_call(fmap, dict(zip(names, param_values)), (x,), {"offset": 2})
        # phi_tilde: (features, log_scale) alone depend on Performer's detached stabiliser
        return out.features if out.log_scale is None else out.features * torch.exp(out.log_scale)[..., None]

    inputs = (x, *[p.detach().clone().requires_grad_() for p in fmap.parameters()])
    assert torch.autograd.gradcheck(fn, inputs, eps=1e-6, atol=1e-5)
