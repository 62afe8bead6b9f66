"""The chunked form (training fast path) == the recurrent and quadratic forms (both of its
weight paths), its hand-written backward passes gradcheck, it survives bf16 autocast at 64k tokens
with huge keys, its head thread pool changes nothing, the optional GPU backend's mapping onto gated
linear attention is exact, and bad input raises a clear ValueError."""

from __future__ import annotations

import functools

import pytest
import torch

from attention_helpers import attend, attention_steps, form_steps, log_scale_spread, make_map, make_qkv
from megaflex.attention import LinearAttentionState, NORMALIZATIONS, causal_linear_attention
from megaflex.attention.linear.chunk import _ChunkedLinearAttention, chunked_linear_attention
from megaflex.attention.linear.chunk import chunk_stabiliser as _stabiliser
from megaflex.attention.linear.chunk_fla import gla_linear_attention
from megaflex.attention.dispatch import Request, select
from megaflex.attention.linear.naive import quadratic_linear_attention
from numerics import assert_close, fp32_steps_in, normwise_scale

pytestmark = pytest.mark.numerics

LENGTHS = (1, 7, 63, 64, 65, 500, 1000)
CHUNKS = (16, 64, 128)
HEADS, HEAD_DIM, FEATURES, VALUE_DIM = 2, 8, 16, 6


def _prefix_state(fmap, seed: int) -> LinearAttentionState:
    """A genuine state from a 9-token prefix, with kv / k_sum / log_max as gradient leaves
    (log_max must receive none: the stabiliser is detached everywhere)."""
    q, k, v = make_qkv(1, HEADS, 9, HEAD_DIM, VALUE_DIM, seed=seed)
    with torch.no_grad():
        _, state = attend(fmap, q, k, v, form="quadratic")
    return LinearAttentionState(
        state.kv.clone().requires_grad_(),
        state.k_sum.clone().requires_grad_(),
        state.log_max.clone().requires_grad_(),
        state.offset,
    )


def _run(kind, form, normalization, n, with_state, chunk_size=64):
    """Outputs, state and gradients (inputs, every feature-map parameter, the initial state)."""
    fmap = make_map(kind, HEADS, HEAD_DIM, FEATURES, **({"max_seq_len": 2048} if kind == "cosformer" else {}))
    state = _prefix_state(fmap, seed=1) if with_state else None
    q, k, v = make_qkv(1, HEADS, n, HEAD_DIM, VALUE_DIM, seed=2)
    for t in (q, k, v):
        t.requires_grad_()
    out, new_state = attend(fmap, q, k, v, form=form, normalization=normalization, state=state, chunk_size=chunk_size)
    g = torch.Generator().manual_seed(3)
    probes = [torch.randn(t.shape, generator=g) for t in (out, new_state.kv, new_state.k_sum)]
    # the returned state carries gradient too (truncated BPTT across segments)
    loss = (out * probes[0]).sum() + 1e-2 * ((new_state.kv * probes[1]).sum() + (new_state.k_sum * probes[2]).sum())
    leaves = {"q": q, "k": k, "v": v, **{f"map.{name}": p for name, p in fmap.named_parameters()}}
    if state is not None:
        leaves.update({"state.kv": state.kv, "state.k_sum": state.k_sum, "state.log_max": state.log_max})
    grads = dict(zip(leaves, torch.autograd.grad(loss, list(leaves.values()), allow_unused=True)))
    # the carried log_max is part of the stabiliser, a constant for autograd in every form
    assert grads.pop("state.log_max", None) is None, f"{form}: gradient flowed into state.log_max"
    # map parameters' gradients also sum over every (head, token, value) position
    steps = form_steps(fmap, q, k, v, extra_tokens=9 if with_state else 0) + 2 * out[0].numel()
    return out, new_state, grads, steps


def _assert_agree(actual, reference):
    out, state, grads, steps = actual
    ref_out, ref_state, ref_grads, _ = reference
    assert torch.isfinite(out).all()
    assert_close(out, ref_out, steps=steps, name="out")
    assert_close(state.kv, ref_state.kv, steps=steps, name="kv")
    assert_close(state.k_sum, ref_state.k_sum, steps=steps, name="k_sum")
    assert torch.equal(state.log_max, ref_state.log_max) and state.offset == ref_state.offset
    assert grads.keys() == ref_grads.keys() and {"q", "k", "v"} <= grads.keys()
    # a gradient's rounding scales with its terms, so all are compared on the largest one's scale
    # (e.g. d out / d q at N = 1 under "rms" is O(eps) by scale invariance, its terms are not)
    terms = max(normwise_scale(g) for g in ref_grads.values())
    for name in grads:
        assert_close(grads[name], ref_grads[name], steps=steps, floor=terms, name=f"grad of {name}")


_QUADRATIC_CACHE: dict = {}


def _quadratic(kind, normalization, n, with_state):
    key = (kind, normalization, n, with_state)
    if key not in _QUADRATIC_CACHE:
        _QUADRATIC_CACHE[key] = _run(kind, "quadratic", normalization, n, with_state)
    return _QUADRATIC_CACHE[key]


@pytest.mark.parametrize("normalization", NORMALIZATIONS)
@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("n", LENGTHS)
def test_chunked_matches_quadratic_flexformer_n(n, with_state, normalization):
    """Full grid: every length x chunk size x state x normalisation, through flexformer_n (O1, O2, tau)."""
    reference = _quadratic("flexformer_n", normalization, n, with_state)
    for chunk_size in CHUNKS:
        _assert_agree(_run("flexformer_n", "chunked", normalization, n, with_state, chunk_size), reference)


@pytest.mark.parametrize("normalization", NORMALIZATIONS)
@pytest.mark.parametrize("n", LENGTHS)
def test_chunked_matches_recurrent(n, normalization):
    """All three forms on every length (recurrent is a Python loop: one chunk size, with a state)."""
    recurrent = _run("flexformer_n", "recurrent", normalization, n, True)
    _assert_agree(recurrent, _quadratic("flexformer_n", normalization, n, True))
    _assert_agree(_run("flexformer_n", "chunked", normalization, n, True, chunk_size=64), recurrent)


@pytest.mark.parametrize("kind", ["flexformer_s", "performer", "elu", "cosformer", "hedgehog"])
@pytest.mark.parametrize("n", [7, 65, 500])
def test_chunked_matches_quadratic_other_maps(kind, n):
    """Every other map's parameters (omega for flexformer_s, W for hedgehog) get the reference gradients."""
    for normalization in NORMALIZATIONS:
        reference = _run(kind, "quadratic", normalization, n, True)
        _assert_agree(_run(kind, "chunked", normalization, n, True, chunk_size=16), reference)


@pytest.mark.parametrize("normalization", NORMALIZATIONS)
def test_large_log_scale_jumps_take_exact_path(normalization):
    """Key log-scales spread over hundreds of nats: chunks whose running max jumps more than
    _FAST_RANGE use the exact C x C factor, the others the factorised one; both == quadratic.
    In fp64: with one key dominating each row the q/k gradients are cancellation-limited, so
    even the fp32 quadratic form is only ~1e-1 accurate there; fp64 isolates the algorithm."""
    g = torch.Generator().manual_seed(11)
    qf, kf = (torch.rand(1, 2, 300, 8, generator=g, dtype=torch.float64).requires_grad_() for _ in range(2))
    kls = torch.randn(1, 2, 300, generator=g, dtype=torch.float64) * 3
    kls[..., ::37] += 40 * torch.arange(1, 10)  # a few big, rising jumps: the running max climbs in steps
    kls.requires_grad_()
    v = torch.randn(1, 2, 300, 5, generator=g, dtype=torch.float64).requires_grad_()
    _, _, _, fast = _stabiliser(kls.detach().view(2, 300), torch.full((2,), float("-inf"), dtype=torch.float64), 16)
    flags = {f for head in fast for f in head}
    assert flags == {True, False}, "both paths must be exercised"
    results = []
    for form in ("quadratic", "chunked"):
        out, state = causal_linear_attention(qf, kf, kls, v, form=form, normalization=normalization, chunk_size=16)
        grads = torch.autograd.grad((out * torch.cos(out.detach() * 7)).sum(), (qf, kf, kls, v))
        results.append((out, state, grads))
    (ref, ref_state, ref_grads), (out, state, grads) = results
    # fp64 bounds; the loss's cos(7 out) weights add one elementwise step
    steps = attention_steps(300, 8, 5, log_scale_spread(kls)) + 1
    assert_close(out, ref, steps=steps, dtype=torch.float64, name="out")
    assert_close(state.kv, ref_state.kv, steps=steps, dtype=torch.float64, name="kv")
    assert torch.equal(state.log_max, ref_state.log_max)
    # rows dominated by one key make some gradients ~1e-17 (zero up to rounding): the terms' scale
    terms = max(normwise_scale(b) for b in ref_grads)
    for name, a, b in zip(("qf", "kf", "kls", "v"), grads, ref_grads):
        assert_close(a, b, steps=steps, dtype=torch.float64, floor=terms, name=f"grad of {name}")


def test_segments_with_carried_state_equal_one_shot():
    """Three chunked segments chained through the state (gradient flowing through it) == one call."""
    fmap = make_map("flexformer_n", HEADS, HEAD_DIM, FEATURES)
    q, k, v = make_qkv(2, HEADS, 150, HEAD_DIM, VALUE_DIM, seed=4)
    for t in (q, k, v):
        t.requires_grad_()
    full, full_state = attend(fmap, q, k, v, form="chunked", chunk_size=32)
    parts, state = [], None
    for lo, hi in ((0, 37), (37, 101), (101, 150)):
        out, state = attend(fmap, q[:, :, lo:hi], k[:, :, lo:hi], v[:, :, lo:hi], form="chunked", state=state, chunk_size=32)
        parts.append(out)
    segmented = torch.cat(parts, dim=2)
    steps = form_steps(fmap, q, k, v) + 2 * full[0].numel()  # omega1/tau sum over every position
    assert_close(segmented, full, steps=steps, name="out")
    assert_close(state.kv, full_state.kv, steps=steps, name="kv")
    probe = torch.randn(full.shape, generator=torch.Generator().manual_seed(5))
    g_full = torch.autograd.grad((full * probe).sum(), (q, k, v, fmap.omega1, fmap.tau))
    g_seg = torch.autograd.grad((segmented * probe).sum(), (q, k, v, fmap.omega1, fmap.tau))
    for name, a, b in zip(("q", "k", "v", "omega1", "tau"), g_seg, g_full):
        assert_close(a, b, steps=steps, name=f"grad of {name}")


@pytest.mark.parametrize("normalization", NORMALIZATIONS)
def test_gradcheck_autograd_function(normalization):
    """float64 gradcheck of the raw autograd.Function (all outputs incl. the final state), odd
    shapes: N = 11 with chunks of 4 (last one short), an initial state whose log_max dominates so
    the detached stabiliser is locally constant (the function is then smooth in every input)."""
    g = torch.Generator().manual_seed(6)
    bh, n, feat, dv = 3, 11, 5, 3
    q = torch.randn(bh, n, feat, dtype=torch.float64, generator=g).requires_grad_()
    k = torch.randn(bh, n, feat, dtype=torch.float64, generator=g).requires_grad_()
    lam = torch.randn(bh, n, dtype=torch.float64, generator=g).requires_grad_()
    v = torch.randn(bh, n, dv, dtype=torch.float64, generator=g).requires_grad_()
    s0 = torch.randn(bh, feat, dv + 1, dtype=torch.float64, generator=g).requires_grad_()
    m0 = lam.detach().max() + 1 + torch.rand(bh, dtype=torch.float64, generator=g)

    def fn(q, k, lam, v, s0):
        out, final, _ = _ChunkedLinearAttention.apply(q, k, lam, v, s0, m0, 4, normalization, 1e-12, torch.float64)
        return out, final

    assert torch.autograd.gradcheck(fn, (q, k, lam, v, s0))
    # the public function (normalised output) w.r.t. every input except the state's log_max (part
    # of the detached stabiliser, so it has no gradient), with a below-all log_max.
    # kls spread x30 also sends chunks whose running max jumps > _FAST_RANGE down the exact path.
    B, H = 1, 2
    qf, kf = (torch.randn(B, H, n, feat, dtype=torch.float64, generator=g).requires_grad_() for _ in range(2))
    if normalization == "denominator":  # keep denominators away from the non-smooth guard
        qf, kf = (t.detach().abs().requires_grad_() for t in (qf, kf))
    kls = (30 * torch.randn(B, H, n, dtype=torch.float64, generator=g)).requires_grad_()
    vv = torch.randn(B, H, n, dv, dtype=torch.float64, generator=g).requires_grad_()
    kv0 = torch.rand(B, H, feat, dv, dtype=torch.float64, generator=g).requires_grad_()
    ks0 = torch.rand(B, H, feat, dtype=torch.float64, generator=g).requires_grad_()
    lm0 = kls.detach().min() - 1 - torch.rand(B, H, dtype=torch.float64, generator=g)

    def public(qf, kf, kls, vv, kv0, ks0):
        state = LinearAttentionState(kv0, ks0, lm0, offset=3)
        out, _ = chunked_linear_attention(
            qf, kf, kls, vv, normalization=normalization, chunk_size=4, initial_state=state, eps=1e-12
        )
        return out

    assert torch.autograd.gradcheck(public, (qf, kf, kls, vv, kv0, ks0))


def test_bf16_autocast_64k_huge_keys_finite():
    """bf16 autocast forward + backward at 65,536 tokens with q, k scaled x100 through flexformer_n:
    log-scales ~1e4 must not overflow anything; every output and gradient is finite."""
    fmap = make_map("flexformer_n", 2, 32, 32)
    q, k, v = make_qkv(1, 2, 65_536, 32, seed=7, scale=100.0)
    for t in (q, k, v):
        t.requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, state = attend(fmap, q, k, v, form="chunked", chunk_size=64)
        loss = out.float().pow(2).mean() + state.kv.float().mean()
    loss.backward()
    assert out.shape == v.shape and torch.isfinite(out).all()
    assert state.kv.dtype == torch.float32 and torch.isfinite(state.kv).all() and torch.isfinite(state.k_sum).all()
    assert state.log_max.min() > 1e3  # the keys really were huge
    for name, t in [("q", q), ("k", k), ("v", v), *fmap.named_parameters()]:
        assert t.grad is not None and torch.isfinite(t.grad).all(), name
    assert q.grad.abs().sum() > 0 and fmap.omega1.grad.abs().sum() > 0


def test_head_thread_pool_is_bitwise_equal_and_restores_threads():
    """With >1 intra-op threads the heads run on a thread pool (1 thread each): same ops per head,
    so results are bitwise equal to the sequential run, and the thread setting is restored."""
    fmap = make_map("flexformer_n", 3, HEAD_DIM, FEATURES)
    q, k, v = make_qkv(2, 3, 150, HEAD_DIM, VALUE_DIM, seed=13)
    probe = torch.randn(2, 3, 150, VALUE_DIM, generator=torch.Generator().manual_seed(14))
    before = torch.get_num_threads()
    results = []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            out, state = attend(fmap, *leaves, form="chunked", chunk_size=32)
            grads = torch.autograd.grad((out * probe).sum() + state.kv.sum(), leaves)
            assert torch.get_num_threads() == threads
            results.append((out, state.kv, *grads))
    finally:
        torch.set_num_threads(before)
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_bf16_inputs_keep_fp32_state():
    fmap = make_map("flexformer_n", HEADS, HEAD_DIM, FEATURES)
    q, k, v = make_qkv(1, HEADS, 70, HEAD_DIM, VALUE_DIM, seed=8)
    ref, ref_state = attend(fmap, q, k, v, form="quadratic")
    out, state = attend(fmap, q.bfloat16(), k.bfloat16(), v.bfloat16(), form="chunked")
    assert out.dtype == torch.bfloat16 and state.kv.dtype == torch.float32
    # bf16 rounding of q, k, v (the map's projections and log-scales carry them, ~head_dim terms)
    # and of the output, on top of fp32 accumulation
    steps = 3 + 2 * HEAD_DIM + fp32_steps_in(torch.bfloat16, form_steps(fmap, q, k, v))
    assert_close(out, ref, steps=steps, dtype=torch.bfloat16, name="out")
    assert_close(state.kv, ref_state.kv, steps=steps, dtype=torch.bfloat16, name="kv")


def test_dispatcher_reaches_chunked():
    assert select(Request("linear", backend="auto", device="cpu")).implementation() is chunked_linear_attention
    q, k, v = make_qkv(1, 2, 20, 4, seed=9)
    a, _ = causal_linear_attention(q, k, None, v, form="chunked", chunk_size=8)
    b, _ = causal_linear_attention(q, k, None, v, form="quadratic")
    assert_close(a, b, steps=attention_steps(20, 4, 4))


def _naive_simple_gla(q, k, v, g, scale, initial_state, output_final_state):
    """Stand-in for fla's chunk_simple_gla ([B, T, H, *] layout): S_t = e^{g_t} S_{t-1} + k_t v_t^T, o_t = scale q_t S_t."""
    batch, n, heads, feat = q.shape
    s = initial_state if initial_state is not None else q.new_zeros(batch, heads, feat, v.shape[-1])
    outs = []
    for t in range(n):
        s = s * g[:, t].exp()[..., None, None] + k[:, t, :, :, None] * v[:, t, :, None, :]
        outs.append(scale * torch.einsum("bhk,bhkv->bhv", q[:, t], s))
    return torch.stack(outs, dim=1), s


@pytest.mark.parametrize("normalization", NORMALIZATIONS)
@pytest.mark.parametrize("with_state", [False, True])
def test_gpu_hook_mapping_onto_gated_linear_attention(normalization, with_state):
    """The optional fla backend's stabiliser -> GLA-gate mapping reproduces the contract (kernel
    replaced by a plain scan with fla's semantics), incl. huge log-scale jumps and the state."""
    g = torch.Generator().manual_seed(12)
    qf, kf = (torch.rand(2, 2, 40, 6, generator=g, dtype=torch.float64).requires_grad_() for _ in range(2))
    kls = torch.randn(2, 2, 40, generator=g, dtype=torch.float64) * 3
    kls[..., ::9] += 50.0
    kls.requires_grad_()
    v = torch.randn(2, 2, 40, 5, generator=g, dtype=torch.float64).requires_grad_()
    state = None
    if with_state:
        state = LinearAttentionState(
            torch.rand(2, 2, 6, 5, dtype=torch.float64, generator=g), torch.rand(2, 2, 6, dtype=torch.float64, generator=g),
            torch.full((2, 2), 4.0, dtype=torch.float64), offset=3,
        )
    results = []
    for fn in (quadratic_linear_attention, functools.partial(gla_linear_attention, gla_fn=_naive_simple_gla)):
        out, new_state = fn(qf, kf, kls, v, normalization=normalization, initial_state=state)
        grads = torch.autograd.grad((out * torch.sin(out.detach() * 5)).sum(), (qf, kf, kls, v))
        results.append((out, new_state, grads))
    (ref, ref_state, ref_grads), (out, new_state, grads) = results
    # fp64; the GLA gates exp(g) carry the log-scales' spread, the loss's sin(5 out) one more step
    steps = attention_steps(43, 6, 5, log_scale_spread(kls, None if state is None else state.log_max)) + 1
    assert_close(out, ref, steps=steps, dtype=torch.float64, name="out")
    for field in ("kv", "k_sum", "log_max"):
        assert_close(getattr(new_state, field), getattr(ref_state, field), steps=steps, dtype=torch.float64, name=field)
    assert new_state.offset == ref_state.offset
    terms = max(normwise_scale(b) for b in ref_grads)
    for name, a, b in zip(("qf", "kf", "kls", "v"), grads, ref_grads):
        assert_close(a, b, steps=steps, dtype=torch.float64, floor=terms, name=f"grad of {name}")



@pytest.mark.parametrize("normalization", ["denominator", "capped_denominator"])
def test_fla_mapping_keeps_bf16_operands_and_fp32_gates_and_state(normalization):
    """bf16 features and v reach the kernel as bf16 (no fp32 copies), the gates and initial state
    as fp32; the result (kernel replaced by a scan that accumulates in fp32, as fla's does) is
    the contract on the bf16 inputs within bf16 rounding of the keys, the output and its
    denominator column. Positive features: the denominator forms are normwise-conditioned
    (floor max|v|); the state's kv by the same sums of |v|."""
    seen = {}

    def scan_fp32(q, k, v, g, scale, initial_state, output_final_state):
        seen.update(q=q.dtype, k=k.dtype, v=v.dtype, g=g.dtype, state=initial_state.dtype)
        o, s = _naive_simple_gla(q.float(), k.float(), v.float(), g, scale, initial_state, output_final_state)
        return o.to(q.dtype), s

    g = torch.Generator().manual_seed(13)
    n, feat, dv = 40, 6, 5
    qf, kf = (torch.rand(2, 2, n, feat, generator=g).to(torch.bfloat16) for _ in range(2))
    kls = torch.randn(2, 2, n, generator=g) * 3
    v = torch.randn(2, 2, n, dv, generator=g).to(torch.bfloat16)
    state = LinearAttentionState(torch.rand(2, 2, feat, dv, generator=g), torch.rand(2, 2, feat, generator=g),
                                 torch.full((2, 2), 4.0), offset=3)  # fmt: skip
    out, new_state = gla_linear_attention(qf, kf, kls, v, normalization=normalization, initial_state=state, gla_fn=scan_fp32)
    assert seen == {"q": torch.bfloat16, "k": torch.bfloat16, "v": torch.bfloat16, "g": torch.float32, "state": torch.float32}
    assert out.dtype == torch.bfloat16 and new_state.kv.dtype == new_state.k_sum.dtype == torch.float32

    def exact(values):
        state64 = LinearAttentionState(*(t.double() for t in (state.kv, state.k_sum, state.log_max)), state.offset)
        return quadratic_linear_attention(qf.double(), kf.double(), kls.double(), values.double(),
                                          normalization=normalization, initial_state=state64)  # fmt: skip

    ref, ref_state = exact(v)
    _, abs_state = exact(v.abs())  # the state's terms, summed without cancellation
    # bf16: the scaled keys, the numerator and the denominator column (kernel output) rounded once
    # each, the division and output cast; fp32 accumulation over the sequence (and exp of the
    # log-scale spread) on top
    steps = 5 + fp32_steps_in(torch.bfloat16, attention_steps(n + 3, feat, dv, log_scale_spread(kls, state.log_max)))
    assert_close(out, ref, steps=steps, dtype=torch.bfloat16, floor=v.double().abs().max().item(), name="out")
    assert_close(new_state.k_sum, ref_state.k_sum, steps=steps, dtype=torch.bfloat16, name="k_sum")
    assert_close(new_state.kv, ref_state.kv, steps=steps, dtype=torch.bfloat16, floor=normwise_scale(abs_state.kv), name="kv")




def _good_args():
    q, k, v = make_qkv(1, 2, 10, 4, seed=10)
    return dict(qf=q, kf=k, kls=torch.zeros(1, 2, 10), v=v)


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda a: a.update(qf=a["qf"][0]), r"qf: expected a rank-4 tensor"),
        (lambda a: a.update(kf=a["kf"][..., :3]), r"kf: expected shape"),
        (lambda a: a.update(v=a["v"][:, :, :5]), r"v: expected shape"),
        (lambda a: a.update(kls=torch.zeros(1, 2, 9)), r"kls: expected shape"),
        (lambda a: a.update(qf=a["qf"].long()), r"qf: expected a floating-point tensor"),
        (lambda a: a.update(chunk_size=0), r"chunk_size: expected a positive int"),
        (lambda a: a.update(normalization="l2"), r"normalization: expected one of"),
        (
            lambda a: a.update(initial_state=LinearAttentionState(torch.zeros(1, 2, 4, 3), torch.zeros(1, 2, 4), torch.zeros(1, 2))),
            r"initial_state.kv: expected a floating tensor of shape \(1, 2, 4, 4\)",
        ),
    ],
)
def test_bad_input_raises_value_error(change, match):
    args = _good_args()
    change(args)
    with pytest.raises(ValueError, match=match):
        chunked_linear_attention(**args)
