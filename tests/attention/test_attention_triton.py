"""Triton kernels of the chunked form and the fused trig path, against the quadratic reference,
run on CPU tensors under Triton's interpreter (the GPU compiles the same kernels; see
benchmarks/gpu_check (kernel_accuracy) for the compiled run in fp32/bf16/fp16).

Every case compares the output, the final state and the gradients of q/k features, key
log-scales, v and the incoming state (trig path: q, k, v, omega, inv_temperature, state).
Full grid for the core kernel in fp32; reduced grids for fp16 and for the trig path.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are first imported (CPU tensors need it)

import pytest  # noqa: E402
import torch  # noqa: E402

triton = pytest.importorskip("triton", reason="triton is not installed (pip install 'megaflex[dev]' installs it)")
import triton.language as tl  # noqa: E402

import megaflex.attention.linear.naive as quadratic_module  # noqa: E402
from megaflex.attention import LinearAttentionState  # noqa: E402
from megaflex.attention.normalize import NORMALIZATIONS, OUTPUT_RMS_CAP, normalize_output, output_rms  # noqa: E402
from megaflex.attention.feature_maps.trig import trig_feature_map_reference  # noqa: E402
from megaflex.attention.linear.naive import quadratic_linear_attention  # noqa: E402
from megaflex.attention.triton import kernel_chunk, trig_linear_attention, triton_linear_attention  # noqa: E402
from megaflex.attention.triton.linear_kernels import _cos_shifted, _sin_cos  # noqa: E402
from attention_helpers import attention_steps, log_scale_spread  # noqa: E402
from numerics import assert_close, assert_close_to_reference, fp32_steps_in  # noqa: E402

pytestmark = pytest.mark.numerics

LENGTHS = (1, 31, 64, 65, 200)
CHUNKS = (16, 64)
# Rounding steps per fp16 value on the way (see tests/numerics.py): fp16 inputs are exact in the
# fp64 reference. The kernels' tl.dot operands are fp16, as on the GPU (fp32 accumulation, whose
# steps are negligible next to one u16): every fp32 intermediate that enters a product (C x C
# weights, their gradients, output gradients, the carried state's two half parts) is rounded to
# fp16 first, one u16 per operand. dq's chain is the longest: two operands x (2 forward + 4
# backward product levels) x 2 (the state's two halves enter their own products) = 24.
FP16_STEPS = 24



def _inputs(n, feat, dv, *, normalization, with_state, key_scale, dtype, values=None, seed=0):
    """q/k features (positive for the denominator, so it stays away from 0; signed for rms),
    key log-scales ~ N(0, key_scale^2), v, an incoming state; all leaves requiring grad. ``values``:
    round q/k features and v through this dtype first (so an fp64 reference sees fp16 inputs)."""
    g = torch.Generator().manual_seed(seed)
    batch, heads = 1, 2
    if normalization == "denominator":
        qf = torch.exp(0.5 * torch.randn(batch, heads, n, feat, generator=g)) / feat
        kf = torch.exp(0.5 * torch.randn(batch, heads, n, feat, generator=g))
    else:
        qf = torch.randn(batch, heads, n, feat, generator=g)
        kf = torch.randn(batch, heads, n, feat, generator=g)
    kls = key_scale * torch.randn(batch, heads, n, generator=g)
    v = torch.randn(batch, heads, n, dv, generator=g)
    leaves = {"qf": qf, "kf": kf, "kls": kls, "v": v}
    state = None
    if with_state:
        leaves["kv0"] = torch.randn(batch, heads, feat, dv, generator=g).abs()
        leaves["k_sum0"] = torch.rand(batch, heads, feat, generator=g) * n
        log_max = key_scale * torch.randn(batch, heads, generator=g)
    side = torch.float64 if dtype == torch.float64 else torch.float32  # log-scales and state
    values = values or dtype
    leaves = {
        name: (t.to(values).to(dtype) if name in ("qf", "kf", "v") else t.to(side)).requires_grad_() for name, t in leaves.items()
    }
    if with_state:
        state = LinearAttentionState(leaves["kv0"], leaves["k_sum0"], log_max.to(side), offset=3)
    return leaves, state


def _loss_and_grads(out, state, leaves, seed=1):
    """Random linear functional of (out, final kv, final k_sum) and its gradients."""
    g = torch.Generator().manual_seed(seed)
    loss = (out.double() * torch.randn(out.shape, generator=g, dtype=torch.float64)).sum()
    loss = loss + (state.kv.double() * torch.randn(state.kv.shape, generator=g, dtype=torch.float64)).sum()
    loss = loss + (state.k_sum.double() * torch.randn(state.k_sum.shape, generator=g, dtype=torch.float64)).sum()
    return dict(zip(leaves, torch.autograd.grad(loss, list(leaves.values()))))


def _flatten(result):
    out, state, grads = result[:3]
    return {"out": out, "state.kv": state.kv, "state.k_sum": state.k_sum, **{f"d{k}": g for k, g in grads.items()}}


def _compare(got, want, exact, *, steps, dtype=torch.float32):
    """``got`` (Triton) vs ``exact`` (the quadratic form in fp64), conditioning measured by ``want``
    (the quadratic form at the same precision): tests/numerics.py. Gradients that are exactly 0 in
    exact arithmetic (e.g. dq at N = 1 under rms) are compared on the scale of 1 (their terms')."""
    # log_max: a max of fp32 log-scales (given, or computed by the trig map: exact[3] fp32 steps)
    assert_close_to_reference(got[1].log_max, want[1].log_max, exact[1].log_max, steps=exact[3], floor=1.0, name="log_max")
    assert got[1].offset == exact[1].offset
    got, want, exact = _flatten(got), _flatten(want), _flatten(exact)
    for name, ref in exact.items():
        assert got[name].dtype == want[name].dtype, (name, got[name].dtype, want[name].dtype)
        assert_close_to_reference(got[name], want[name], ref, steps=steps, dtype=dtype, floor=1.0, name=name)


def _run_core(fn, n, chunk, normalization, with_state, key_scale, dtype, values=None):
    leaves, state = _inputs(
        n, 16, 16, normalization=normalization, with_state=with_state, key_scale=key_scale, dtype=dtype, values=values
    )
    kwargs = dict(normalization=normalization, initial_state=state)
    if fn is triton_linear_attention:
        kwargs["chunk_size"] = chunk
    out, new_state = fn(leaves["qf"], leaves["kf"], leaves["kls"], leaves["v"], **kwargs)
    steps = attention_steps(n, 16, 16, log_scale_spread(leaves["kls"], None if state is None else state.log_max))
    return out, new_state, _loss_and_grads(out, new_state, leaves), steps


# key scales x100 run with a carried state (its log_max then matters too); 54 cases in all. Every
# length at both chunk sizes but 200 at 16 (13 interpreted chunks; 65 at 16 already runs 5, the
# last partial, and 200 at 64 four).
@pytest.mark.parametrize("with_state,key_scale", [(False, 1.0), (True, 1.0), (True, 100.0)])
@pytest.mark.parametrize("normalization", NORMALIZATIONS)
@pytest.mark.parametrize("n,chunk", [(n, c) for n in LENGTHS for c in CHUNKS if (n, c) != (200, 16)])
def test_core_kernels_match_quadratic_fp32(n, chunk, normalization, with_state, key_scale):
    args = (n, chunk, normalization, with_state, key_scale)
    exact = _run_core(quadratic_linear_attention, *args, torch.float64)
    _compare(
        _run_core(triton_linear_attention, *args, torch.float32),
        _run_core(quadratic_linear_attention, *args, torch.float32),
        exact,
        steps=exact[3],
    )


# Not capped at N = 200: one query there has a numerator of RMS 5e-3 and a negative d_t, so the
# floor (like the rms norm) scales its fp16-rounded numerator up ~370x; rms makes the same error
# there (0.18 in dqf) but its other rows' gradients set a 7x larger normwise scale. The fp32 grid
# and the crossing-zero test cover that regime.
@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize(
    "n,chunk,normalization",
    [(n, c, norm) for n, c in [(1, 16), (65, 16), (200, 64)] for norm in NORMALIZATIONS
     if (n, norm) != (200, "capped_denominator")],
)
def test_core_kernels_match_quadratic_fp16(n, chunk, normalization, with_state):
    args = (n, chunk, normalization, with_state, 100.0)
    got = _run_core(triton_linear_attention, *args, torch.float16)
    assert got[0].dtype == torch.float16 and got[1].kv.dtype == torch.float32  # fp32 state whatever the input
    exact = _run_core(quadratic_linear_attention, *args, torch.float64, values=torch.float16)
    # fp32 accumulation: its steps (exact[3]) x u32, in units of u16
    steps = FP16_STEPS + fp32_steps_in(torch.float16, exact[3])
    _compare(got, _run_core(quadratic_linear_attention, *args, torch.float16), exact, steps=steps, dtype=torch.float16)


def _capped_switch_margins(monkeypatch, runs) -> tuple[float, float]:
    """Run each fp64 reference of ``runs`` (callables) with "capped_denominator" and return (the
    smallest |d_t - r_t / CAP| / (r_t / CAP) over every query, the fraction of queries where d_t wins):
    how far the inputs keep every query from the switch between the ratio and the RMS floor."""
    seen = []

    def capture(numerator, denominator, normalization, eps):
        floor = output_rms(numerator, eps) / OUTPUT_RMS_CAP
        seen.append((((denominator - floor).abs() / floor).flatten(), (denominator >= floor).flatten()))
        return normalize_output(numerator, denominator, normalization, eps)

    monkeypatch.setattr(quadratic_module, "normalize_output", capture)
    for run in runs:
        run()
    margins, ratio = (torch.cat(parts) for parts in zip(*seen))
    return margins.min().item(), ratio.double().mean().item()


def test_capped_grid_inputs_keep_every_query_clear_of_the_switch(monkeypatch):
    """The capped cases of the grids compare branch-wise gradients (dd = 0 under the RMS floor): a
    query within rounding of d_t = r_t / CAP could take the other branch on another CPU's BLAS.
    Their inputs keep every query >= 1e-3 (relative, fp64) from it in the fp32 cases and >= 3e-2 in
    the fp16 ones (> twice FP16_STEPS x u16), and both branches occur. (A d_t that is itself the
    cancellation of much larger terms has a larger relative rounding: hence no capped trig case at
    temperature x100.)"""
    capped = "capped_denominator"
    fp32 = [lambda a=(n, c, capped, ws, ks): _run_core(quadratic_linear_attention, *a, torch.float64)
            for ws, ks in [(False, 1.0), (True, 1.0), (True, 100.0)] for n in LENGTHS for c in CHUNKS if (n, c) != (200, 16)]
    fp32 += [lambda a=(n, c, paired, capped, ws, ts): _run_trig(False, *a, torch.float64)
             for n, c, ws, ts in TRIG_CASES if ts == 1.0 for paired in (True, False)]
    fp16 = [lambda a=(n, c, capped, ws, 100.0): _run_core(quadratic_linear_attention, *a, torch.float64, values=torch.float16)
            for n, c in [(1, 16), (65, 16)] for ws in (False, True)]
    margin, ratio_share = _capped_switch_margins(monkeypatch, fp32)
    assert margin >= 1e-3 and 0.1 < ratio_share < 0.9, (margin, ratio_share)
    margin, ratio_share = _capped_switch_margins(monkeypatch, fp16)
    assert margin >= 3e-2 and 0.1 < ratio_share < 0.9, (margin, ratio_share)


def test_capped_denominator_kernels_where_d_crosses_zero(monkeypatch):
    """qf = e1 against keys +-e1: d_t = sum_s qf_t . kf_s is a walk through 0 and negative values (the
    RMS floor) and large positive ones (the ratio), over three chunks (the last partial) and a carried
    state; the kernels' output, state and gradients equal the quadratic form's (fp64)."""
    g = torch.Generator().manual_seed(7)
    n, feat, dv = 40, 16, 8
    signs = torch.where(torch.rand(1, 2, n, generator=g) < 0.4, -1.0, 1.0)

    def run(dtype, fn):
        qf = torch.zeros(1, 2, n, feat, dtype=dtype)
        qf[..., 0] = 1.0
        kf = torch.zeros(1, 2, n, feat, dtype=dtype)
        kf[..., 0] = signs.to(dtype)
        leaves = {"qf": qf.requires_grad_(), "kf": kf.requires_grad_(),
                  "v": torch.randn(1, 2, n, dv, generator=torch.Generator().manual_seed(8)).to(dtype).requires_grad_()}
        state = LinearAttentionState(torch.zeros(1, 2, feat, dv, dtype=dtype), torch.zeros(1, 2, feat, dtype=dtype),
                                     torch.zeros(1, 2, dtype=dtype), offset=0)
        state.k_sum[..., 0] = -2.0  # the walk starts below zero
        kwargs = dict(normalization="capped_denominator", initial_state=state)
        if fn is triton_linear_attention:
            kwargs["chunk_size"] = 16
        out, new_state = fn(leaves["qf"], leaves["kf"], None, leaves["v"], **kwargs)
        return out, new_state, _loss_and_grads(out, new_state, leaves), attention_steps(n, feat, dv)

    margin, ratio_share = _capped_switch_margins(monkeypatch, [lambda: run(torch.float64, quadratic_linear_attention)])
    assert margin >= 1e-3 and 0.1 < ratio_share < 0.9, (margin, ratio_share)  # both regimes, clear of the switch
    exact = run(torch.float64, quadratic_linear_attention)
    _compare(run(torch.float32, triton_linear_attention), run(torch.float32, quadratic_linear_attention), exact, steps=exact[3])


def _run_trig(
    use_triton, n, chunk, paired, normalization, with_state, temperature_scale, dtype, values=None, fused=False, head_dim=8
):  # fmt: skip
    g = torch.Generator().manual_seed(2)
    heads, d, rows = 2, head_dim, 16  # F = 16 paired, 32 unpaired
    values = values or dtype
    leaves, state = _inputs(
        n, rows if paired else 2 * rows, 8, normalization="rms", with_state=with_state, key_scale=1.0, dtype=dtype, values=values
    )
    q = (0.5 * torch.randn(1, heads, n, d, generator=g)).to(values).to(dtype).requires_grad_()
    k = (0.5 * torch.randn(1, heads, n, d, generator=g)).to(values).to(dtype).requires_grad_()
    side = torch.float64 if dtype == torch.float64 else torch.float32
    omega = torch.randn(heads, rows, d, generator=g).to(side).requires_grad_()
    inv_t = (temperature_scale * (0.2 + torch.rand(heads, generator=g))).to(side).requires_grad_()
    grads_of = {"q": q, "k": k, "v": leaves["v"], "omega": omega, "inv_temperature": inv_t}
    grads_of.update({name: leaves[name] for name in ("kv0", "k_sum0") if name in leaves})
    options = dict(normalization=normalization, initial_state=state)
    if use_triton:
        out, new_state = trig_linear_attention(
            q, k, leaves["v"], omega, inv_t, paired=paired, chunk_size=chunk, fused_map=fused, **options
        )
    else:
        qf, _ = trig_feature_map_reference(q, omega, inv_t, paired=paired)
        kf, kls = trig_feature_map_reference(k, omega, inv_t, paired=paired)
        out, new_state = quadratic_linear_attention(qf, kf, kls, leaves["v"], **options)
    # the map adds d-term projections (omega . q) whose cos/sin arguments, and the log-scales
    # ||k||^2 inv_t, carry their own size x u
    with torch.no_grad():
        projections = torch.einsum("bhnd,hrd->bhnr", torch.cat([q, k], dim=2).double(), omega.double()).abs().max().item()
        log_scales = (k.double().pow(2).sum(-1) * inv_t.double()[:, None]).abs().max().item()
    spread = 2 * max(log_scales, 0.0 if state is None else state.log_max.detach().abs().max().item())
    steps = attention_steps(n, rows if paired else 2 * rows, 8, spread) + 2 * (d + projections)
    return out, new_state, _loss_and_grads(out, new_state, grads_of), steps


TRIG_CASES = [(1, 16, False, 1.0), (31, 64, True, 1.0), (65, 16, False, 100.0), (200, 64, True, 100.0)]


# Not capped at temperature x100: there the signed trig weights of some queries cancel to a
# d_t ~ 1e-4 out of O(1) terms and the ratio branch divides by it, so each form's own rounding
# of d_t (the kernels' in-register log-scales against torch's) is amplified ~1e4 and the fp32
# reference does not measure the kernels' share (failed under OPENBLAS_CORETYPE=Sandybridge
# ATEN_CPU_CAPABILITY=default); the denominator cases use positive features for the same reason.
@pytest.mark.parametrize("paired", [True, False])
@pytest.mark.parametrize(
    "n,chunk,with_state,temperature_scale,normalization",
    [(*case, norm) for case in TRIG_CASES for norm in NORMALIZATIONS
     if not (norm == "capped_denominator" and case[3] > 1.0)],
)
def test_trig_path_matches_reference_fp32(n, chunk, with_state, temperature_scale, paired, normalization):
    # temperature_scale 100: key log-scales ||k||^2 inv_t ~ 100 x larger (the stabiliser keeps every exp <= 1)
    args = (n, chunk, paired, normalization, with_state, temperature_scale)
    exact = _run_trig(False, *args, torch.float64)
    _compare(_run_trig(True, *args, torch.float32), _run_trig(False, *args, torch.float32), exact, steps=exact[3])


@pytest.mark.parametrize("paired", [True, False])
@pytest.mark.parametrize("n,chunk", [(31, 16), (65, 64)])
def test_trig_path_matches_reference_fp16(n, chunk, paired):
    args = (n, chunk, paired, "rms", True, 100.0)
    exact = _run_trig(False, *args, torch.float64, values=torch.float16)
    steps = FP16_STEPS + fp32_steps_in(torch.float16, exact[3])
    _compare(_run_trig(True, *args, torch.float16), _run_trig(False, *args, torch.float16), exact, steps=steps, dtype=torch.float16)


@pytest.mark.parametrize("paired", [True, False])
@pytest.mark.parametrize(
    "n,chunk,with_state,temperature_scale,normalization",
    [(31, 64, True, 1.0, "rms"), (65, 16, False, 100.0, "denominator"), (31, 64, True, 1.0, "capped_denominator"),
     (200, 64, True, 100.0, "rms")],
)
def test_fused_trig_map_matches_reference_fp32(n, chunk, with_state, temperature_scale, normalization, paired):
    """fused_map=True: the kernels compute the features (and trig_grads their backward) from q, k
    and omega; out, state and the gradients of q, k, v, omega, inv_temperature and the initial
    state equal the reference (head dim 8 in a 16-wide block, odd lengths, partial chunks)."""
    args = (n, chunk, paired, normalization, with_state, temperature_scale)
    exact = _run_trig(False, *args, torch.float64)
    _compare(_run_trig(True, *args, torch.float32, fused=True), _run_trig(False, *args, torch.float32), exact, steps=exact[3])


def test_fused_trig_map_matches_reference_fp16():
    args = (41, 16, True, "rms", True, 100.0)  # three chunks, the last partial
    exact = _run_trig(False, *args, torch.float64, values=torch.float16)
    steps = FP16_STEPS + fp32_steps_in(torch.float16, exact[3])
    got = _run_trig(True, *args, torch.float16, fused=True)
    _compare(got, _run_trig(False, *args, torch.float16), exact, steps=steps, dtype=torch.float16)


def test_fused_trig_map_over_several_head_dim_blocks():
    """Head dim 40: the kernels project over two 32-wide head-dim blocks (the second partial),
    trig_grads over one 64-wide block."""
    args = (65, 16, True, "rms", True, 1.0)
    exact = _run_trig(False, *args, torch.float64, head_dim=40)
    got = _run_trig(True, *args, torch.float32, fused=True, head_dim=40)
    _compare(got, _run_trig(False, *args, torch.float32, head_dim=40), exact, steps=exact[3])


@triton.jit
def _sin_cos_probe(P, SIN, COS, COS_SHIFTED, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = i < n
    p = tl.load(P + i, mask=mask, other=0.0)
    sin_p, cos_p = _sin_cos(p)
    tl.store(SIN + i, sin_p, mask=mask)
    tl.store(COS + i, cos_p, mask=mask)
    tl.store(COS_SHIFTED + i, _cos_shifted(p, i % 2), mask=mask)  # odd i: cos(p - pi/2) = sin p


def test_kernel_sin_cos_are_accurate_over_the_reduction_range():
    """The kernels' range reduction + polynomials (not libdevice) against fp64 sin/cos of the same
    fp32 arguments: within 1e-6 absolute for |p| up to 2e4 (projections are far smaller)."""
    g = torch.Generator().manual_seed(5)
    p = torch.cat(
        [torch.linspace(-8, 8, 1001), 100 * torch.randn(1000, generator=g), 2e4 * (2 * torch.rand(1000, generator=g) - 1)]
    ).float()
    p[:4] = torch.tensor([0.0, torch.pi / 4, -torch.pi / 2, 3 * torch.pi])
    sin_p, cos_p, shifted = torch.empty_like(p), torch.empty_like(p), torch.empty_like(p)
    _sin_cos_probe[(triton.cdiv(p.numel(), 512),)](p, sin_p, cos_p, shifted, p.numel(), BLOCK=512)
    exact_sin, exact_cos = torch.sin(p.double()), torch.cos(p.double())
    assert (sin_p.double() - exact_sin).abs().max() < 1e-6
    assert (cos_p.double() - exact_cos).abs().max() < 1e-6
    odd = torch.arange(p.numel()) % 2 == 1
    assert torch.equal(shifted[odd], sin_p[odd]) and torch.equal(shifted[~odd], cos_p[~odd])


def test_chunk_lengths_round_to_powers_of_two_within_dot_limits():
    assert [kernel_chunk(c) for c in (1, 16, 17, 48, 64, 100, 1000)] == [16, 16, 32, 64, 64, 128, 128]


def test_segments_with_carried_state_equal_one_shot():
    leaves, _ = _inputs(70, 16, 16, normalization="rms", with_state=False, key_scale=30.0, dtype=torch.float32)
    qf, kf, kls, v = (leaves[name].detach() for name in ("qf", "kf", "kls", "v"))
    whole, whole_state = triton_linear_attention(qf, kf, kls, v, chunk_size=16)
    first, state = triton_linear_attention(qf[:, :, :37], kf[:, :, :37], kls[:, :, :37], v[:, :, :37], chunk_size=16)
    second, last_state = triton_linear_attention(
        qf[:, :, 37:], kf[:, :, 37:], kls[:, :, 37:], v[:, :, 37:], chunk_size=16, initial_state=state
    )
    # both within the rounding bound of the exact result (tests/numerics.py); key scales x30 make the
    # exp arguments' rounding (their spread x u) the largest part
    steps = attention_steps(70, 16, 16, log_scale_spread(kls))
    assert_close(torch.cat([first, second], dim=2), whole, steps=steps, floor=1.0, name="segments")
    assert_close(last_state.kv, whole_state.kv, steps=steps, floor=1.0, name="state.kv")
    assert last_state.offset == whole_state.offset == 70


@pytest.mark.parametrize(
    "change, error",
    [
        (dict(v=torch.zeros(2, 2, 5, 4, dtype=torch.float64)), "the triton backend takes fp16, bf16 or fp32"),
        (dict(normalization="l2"), "normalization: expected one of"),
        (dict(chunk_size=0), "chunk_size: expected a positive int"),
    ],
)
def test_bad_input_raises_value_error(change, error):
    args = dict(qf=torch.rand(2, 2, 5, 4), kf=torch.rand(2, 2, 5, 4), kls=None, v=torch.rand(2, 2, 5, 4))
    options = {key: change.pop(key) for key in list(change) if key not in args}
    args.update(change)
    if "qf" in args and args["v"].dtype == torch.float64:
        args = {key: (t.double() if isinstance(t, torch.Tensor) else t) for key, t in args.items()}
    with pytest.raises(ValueError, match=error):
        triton_linear_attention(args["qf"], args["kf"], args["kls"], args["v"], **options)
