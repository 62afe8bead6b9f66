"""The one-normaliser hybrid's Triton form (``megaflex.attention.triton.window``) against the torch
chunked Function (``ChunkedWindowNumerator``), on CPU tensors under Triton's interpreter (fp32: the
interpreter computes bf16 wrongly, so bf16 is only run; fp16 against fp64). Outputs, the returned state and every
gradient: q, k, the features and log-scales of both, v, and the carried state (far kv / k_sum and
the window cache's k, features, log-scale, v). Bounds: tests/numerics.py.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are first imported (CPU tensors need it)

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton", reason="triton is not installed (pip install 'megaflex[dev]' installs it)")

from megaflex.attention import AttentionCore, LinearAttentionState  # noqa: E402
from megaflex.attention.hybrid import LocalMixingCore  # noqa: E402
from megaflex.attention.window import WindowCache, windowed_linear_attention  # noqa: E402
from megaflex.attention.window.chunk import ChunkedWindowNumerator  # noqa: E402
from megaflex.attention.triton import TritonWindowNumerator  # noqa: E402
from attention_helpers import attention_steps, log_scale_spread, make_map, make_qkv  # noqa: E402
from numerics import assert_close, assert_close_to_reference, fp32_steps_in  # noqa: E402

pytestmark = pytest.mark.numerics

HEADS, D, FEAT, CHUNK, PREFIX = 2, 8, 16, 16, 20
# the case grid runs one head (the interpreter runs every program in turn); the other tests run
# two heads or a BH of 2, so head offsets are covered there
GRID_HEADS = 1


def _case_grid():
    """N in {1, W - 1, W, W + 1, 3 chunks + 5} for W in {1, 16, 64} (W = 64 > C = 16: four lookback
    chunks); a carried state or none, rms, denominator or capped_denominator normalisation, rotating
    over the cases (the normalisation is torch's, after the kernels: all reach the numerator and its
    ones column)."""
    cases = []
    for window in (1, 16, 64):
        for n in sorted({1, window - 1, window, window + 1, 3 * CHUNK + 5} - {0}):
            for carried in (False, True):
                normalization = ("rms", "denominator", "capped_denominator")[(len(cases) // 2 + carried) % 3]
                cases.append((window, n, carried, normalization))
    return cases


def _leaves(window: int, n: int, carried: bool, seed: int):
    """q, k, v, features and log-scales of a flexformer_n map (detached leaves), and a carried state
    (far kv / k_sum and cache tensors as leaves) from PREFIX earlier tokens."""
    fmap = make_map("flexformer_n", GRID_HEADS, D, FEAT, seed=seed)
    q, k, v = make_qkv(1, GRID_HEADS, n, D, seed=seed + 1)
    with torch.no_grad():
        (qm, km) = fmap(q, 0), fmap(k, 0)
        leaves = dict(q=q, k=k, v=v, qf=qm.features, qls=qm.log_scale, kf=km.features, kls=km.log_scale)
        far = cache = None
        if carried:
            pq, pk, pv = make_qkv(1, GRID_HEADS, PREFIX, D, seed=seed + 2)
            pqm, pkm = fmap(pq, 0), fmap(pk, 0)
            _, far, cache = windowed_linear_attention(pq, pqm.features, pqm.log_scale, pk, pkm.features, pkm.log_scale, pv,
                                                      window=window, form="quadratic")  # fmt: skip
            leaves |= dict(kv0=far.kv, k_sum0=far.k_sum)
            if cache.length:
                leaves |= dict(cache_k=cache.k, cache_kf=cache.kf, cache_kls=cache.kls, cache_v=cache.v)
    return {name: t.clone().requires_grad_() for name, t in leaves.items()}, far


def _run(leaves: dict, far: LinearAttentionState | None, window: int, normalization: str, backend: str):
    far_state = cache = None
    if far is not None:
        far_state = LinearAttentionState(leaves["kv0"], leaves["k_sum0"], far.log_max, far.offset)
        if "cache_k" in leaves:
            cache = WindowCache(leaves["cache_k"], leaves["cache_kf"], leaves["cache_kls"], leaves["cache_v"])
    x = leaves
    out, state, kept = windowed_linear_attention(
        x["q"], x["qf"], x["qls"], x["k"], x["kf"], x["kls"], x["v"], window=window, form="chunked",
        normalization=normalization, chunk_size=CHUNK, far_state=far_state, cache=cache, backend=backend,
    )  # fmt: skip
    g = torch.Generator().manual_seed(5)
    loss = (out * torch.randn(out.shape, generator=g)).sum() + (state.kv * torch.randn(state.kv.shape, generator=g)).sum()
    loss = loss + (kept.v * torch.randn(kept.v.shape, generator=g)).sum()
    grads = torch.autograd.grad(loss, list(leaves.values()))
    return out, state, dict(zip(leaves, grads))


@pytest.mark.parametrize("window,n,carried,normalization", _case_grid())
def test_triton_window_matches_the_torch_function_in_fp32(window, n, carried, normalization, monkeypatch):
    used = []
    monkeypatch.setattr(TritonWindowNumerator, "forward", _spy(TritonWindowNumerator.forward, used))
    leaves, far = _leaves(window, n, carried, seed=3 * n + window)
    want = _run(leaves, far, window, normalization, "torch")
    assert not used
    got = _run(leaves, far, window, normalization, "triton")
    assert used, "the triton backend did not run the Triton Function"
    extra = PREFIX if carried else 0
    spread = log_scale_spread(leaves["qls"], leaves["kls"]) + 2 * _max_logit(leaves)
    steps = attention_steps(n + extra, FEAT, D, spread, D) + 8
    assert_close(got[0], want[0], steps=steps, name="out")
    assert_close(got[1].kv, want[1].kv, steps=steps, name="state.kv")
    assert torch.equal(got[1].log_max, want[1].log_max)
    for name, ref in want[2].items():
        # gradients: forward and backward (recomputed) steps; on the scale of their terms (floor 1)
        assert_close(got[2][name], ref, steps=2 * steps, floor=1.0, name=f"d{name}")


def _spy(forward, used: list):
    def wrapped(ctx, *args):
        used.append(args[9:])  # (window, C)
        return forward(ctx, *args)

    return staticmethod(wrapped)


def _max_logit(leaves: dict) -> float:
    q, k = leaves["q"].detach().double(), leaves["k"].detach().double()
    if "cache_k" in leaves:
        k = torch.cat([leaves["cache_k"].detach().double(), k], dim=2)
    return (q @ k.transpose(-1, -2)).abs().max().item() / D**0.5


@pytest.mark.parametrize("attention", ["flexformer_n", "softmax", "flexformer_n+far_gain"])
def test_local_mixing_core_dispatches_to_triton_and_agrees(attention, monkeypatch):
    """``LocalMixingCore`` with backend "triton" (what "auto" is on CUDA) runs the Triton Function;
    a softmax core (zero-width features, no far field: sliding-window softmax) too, and the learned
    far-field gain (model.window_far_gain) reaches it through the query log-scales, with its gradient."""
    attention, far_gain = attention.split("+")[0], attention.endswith("+far_gain")
    used = []
    monkeypatch.setattr(TritonWindowNumerator, "forward", _spy(TritonWindowNumerator.forward, used))
    q0, k0, v0 = make_qkv(1, HEADS, 2 * CHUNK + 3, D, seed=11)
    results = {}
    for backend in ("torch", "triton"):
        torch.manual_seed(12)
        kwargs = {} if attention == "softmax" else dict(feature_dim=FEAT)
        mixer = LocalMixingCore(AttentionCore(attention, HEADS, D, chunk_size=CHUNK, backend=backend, **kwargs), window=20,
                                far_gain=far_gain)  # fmt: skip
        if far_gain:
            with torch.no_grad():
                mixer.far_log_gain.copy_(torch.tensor([-1.0, 0.7]))
        q, k, v = (t.clone().requires_grad_() for t in (q0, k0, v0))
        out, _ = mixer(q, k, v)
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        results[backend] = (out.detach(), q.grad, k.grad, v.grad) + ((mixer.far_log_gain.grad,) if far_gain else ())
        with torch.no_grad():
            _, qls, _, kls = mixer.window_features(q0, k0, 0)
    assert used == [(20, CHUNK)]
    logits = (q0.double() @ k0.double().transpose(-1, -2)).abs().max().item() / D**0.5
    kls = None if attention == "softmax" else kls
    steps = attention_steps(q0.shape[2], FEAT, D, log_scale_spread(qls, kls) + 2 * logits, D) + 8
    for name, a, b in zip(("out", "dq", "dk", "dv", "d_far_log_gain"), results["triton"], results["torch"]):
        assert_close(a, b, steps=steps if name == "out" else 2 * steps, floor=0.0 if name == "out" else 1.0, name=name)


def _function_inputs(dtype: torch.dtype, t: int = 2 * CHUNK, bh: int = 2, feat: int = FEAT, dv: int = D, head_dim: int = D):
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(bh, t, head_dim, generator=g), torch.randn(bh, t, head_dim, generator=g)
    qf, kf = torch.randn(bh, t, feat, generator=g), torch.randn(bh, t, feat, generator=g)
    qls, kls = 0.3 * torch.randn(bh, t, generator=g), 0.3 * torch.randn(bh, t, generator=g)
    v_aug = torch.cat([torch.randn(bh, t, dv, generator=g), torch.ones(bh, t, 1)], dim=-1)
    s0, m0 = torch.randn(bh, feat, dv + 1, generator=g).abs(), torch.zeros(bh)
    return [*(x.to(dtype) for x in (q, qf)), qls, *(x.to(dtype) for x in (k, kf)), kls, v_aug.to(dtype), s0], m0


def test_bf16_inputs_run_and_return_gradients_in_their_dtypes():
    """bf16 operands, fp32 accumulation (the interpreter computes bf16 dots wrongly: this only runs
    them; the compiled kernels' bf16 accuracy is a GPU check)."""
    inputs, m0 = _function_inputs(torch.bfloat16)
    leaves = [x.clone().requires_grad_() for x in inputs]
    numer = TritonWindowNumerator.apply(*leaves, m0, 16, CHUNK)
    assert numer.dtype == torch.float32 and numer.shape == (2, 2 * CHUNK, D + 1)
    grads = torch.autograd.grad(numer.sum(), leaves)
    for leaf, grad in zip(leaves, grads):
        assert grad.dtype == leaf.dtype and grad.shape == leaf.shape
        assert torch.isfinite(grad.float()).all()


@pytest.mark.parametrize("head_dim,feat,dv", [(D, FEAT, D), (40, 48, 40)], ids=["one-block", "several-blocks"])
def test_function_contract_matches_the_torch_function_directly(head_dim, feat, dv):
    """The Function itself (no dispatcher): numerator, and the gradient of the carried state s0;
    head dim, F and Dv over one loop block, or several with a partial last one (32-wide blocks)."""
    # 5 chunks, W = 20 > C: L = 2, chunks 2 .. 4 read S_0 .. S_2 (key chunks 0 and 1 reach the state)
    bh = 2 if head_dim == D else 1  # one (batch x head) row is enough for the block loops (interpreter time)
    inputs, m0 = _function_inputs(torch.float32, t=5 * CHUNK, bh=bh, feat=feat, dv=dv, head_dim=head_dim)
    m0 = torch.tensor([0.5, -0.25])[:bh]
    results = []
    for fn in (ChunkedWindowNumerator, TritonWindowNumerator):
        leaves = [x.clone().requires_grad_() for x in inputs]
        numer = fn.apply(*leaves, m0, 20, CHUNK)
        weight = torch.linspace(-1, 1, numer.numel()).view_as(numer)
        results.append((numer, *torch.autograd.grad((numer * weight).sum(), leaves)))
    q, qf, qls, k, kf, kls = inputs[:6]
    spread = log_scale_spread(qls, kls, m0) + 2 * (q.double() @ k.double().transpose(-1, -2)).abs().max().item() / head_dim**0.5
    steps = attention_steps(5 * CHUNK, feat, dv, spread, head_dim) + 8
    names = ("numer", "dq", "dqf", "dqls", "dk", "dkf", "dkls", "dv_aug", "ds0")
    for name, a, b in zip(names, *results):
        assert_close(a, b, steps=steps if name == "numer" else 2 * steps, floor=1.0, name=name)


# Rounding steps per fp16 value (tests/numerics.py): the inputs are exact in fp16 and fp64; every fp32
# intermediate that enters a dot is rounded to fp16 first (one u16 per operand, fp32 accumulation),
# carried states split into two halves. Longest chain: the weights w (forward, 1 product level), then
# dn and dw * w (dq, dk) or q e^(...) and dn, then v e^(...) with dS (the keys' state share): 2
# backward levels; 2 operands x 3 levels x 2 (a state's halves enter their own products) = 12.
WINDOW_FP16_STEPS = 12


def test_fp16_operands_match_fp64_within_the_half_precision_bound():
    """fp16 dot operands (the GPU's half path; the interpreter computes fp16 correctly) against the
    torch Function in fp64 on the same fp16 values, the torch Function in fp16 measuring the
    conditioning (``assert_close_to_reference``): numerator and every gradient, s0's included."""
    inputs, _ = _function_inputs(torch.float16, t=5 * CHUNK, bh=1)
    m0 = torch.tensor([0.5])

    def run(fn, xs, m):
        leaves = [x.clone().requires_grad_() for x in xs]
        numer = fn.apply(*leaves, m, 20, CHUNK)
        weight = torch.linspace(-1, 1, numer.numel(), dtype=torch.float64).view_as(numer)
        return [numer, *torch.autograd.grad((numer.double() * weight).sum(), leaves)]

    got = run(TritonWindowNumerator, inputs, m0)
    exact = run(ChunkedWindowNumerator, [x.double() for x in inputs], m0.double())
    plain = run(ChunkedWindowNumerator, [x.half() for x in inputs], m0.half())
    q, qf, qls, k, kf, kls = (x.double() for x in inputs[:6])
    spread = log_scale_spread(qls, kls, m0) + 2 * (q @ k.transpose(-1, -2)).abs().max().item() / D**0.5
    steps = WINDOW_FP16_STEPS + fp32_steps_in(torch.float16, 2 * (attention_steps(5 * CHUNK, FEAT, D, spread, D) + 8))
    names = ("numer", "dq", "dqf", "dqls", "dk", "dkf", "dkls", "dv_aug", "ds0")
    for name, a, b, ref in zip(names, got, plain, exact):
        assert_close_to_reference(a, b, ref, steps=steps, dtype=torch.float16, floor=1.0, name=name)


def test_bad_arguments_raise():
    inputs, m0 = _function_inputs(torch.float32)
    with pytest.raises(ValueError, match="power of two"):
        TritonWindowNumerator.apply(*inputs, m0, 4, 8)
    with pytest.raises(ValueError, match="W >= 1"):
        TritonWindowNumerator.apply(*inputs, m0, 0, CHUNK)
    mixed = list(inputs)
    mixed[0] = mixed[0].half()
    with pytest.raises(ValueError, match="dtype"):
        TritonWindowNumerator.apply(*mixed, m0, 4, CHUNK)


def test_half_inputs_reach_the_kernels_as_half_operands(monkeypatch):
    """bf16 q, k, v (and features): the dispatcher hands the Function bf16 dot operands (fp32
    log-scales and state), and the output and gradients come back finite in bf16 (only run: the
    interpreter computes bf16 wrongly)."""
    seen = []

    def forward(ctx, *args):
        seen.append([a.dtype for a in args[:8]])
        return original(ctx, *args)

    original = TritonWindowNumerator.forward
    monkeypatch.setattr(TritonWindowNumerator, "forward", staticmethod(forward))
    leaves, _ = _leaves(16, 20, False, seed=9)
    leaves = {name: t.detach().to(torch.bfloat16 if name not in ("qls", "kls") else torch.float32).requires_grad_()
              for name, t in leaves.items()}  # fmt: skip
    out, state, grads = _run(leaves, None, 16, "rms", "triton")
    bf16, f32 = torch.bfloat16, torch.float32
    assert seen == [[bf16, bf16, f32, bf16, bf16, f32, bf16, f32]]  # q, qf, qls, k, kf, kls, v_aug, s0
    assert out.dtype == bf16 and torch.isfinite(out.float()).all()
    for name, grad in grads.items():
        assert grad.dtype == leaves[name].dtype and torch.isfinite(grad.float()).all(), name


def test_backend_choice_and_fp64():
    """"torch" and "fla" (no window kernel) keep the torch Function; "triton" refuses fp64 as the
    plain Triton path does ("auto" on CUDA keeps fp64 on the torch Function)."""
    leaves, _ = _leaves(16, 20, False, seed=13)
    x = {name: t.detach().double() for name, t in leaves.items()}
    args = (x["q"], x["qf"], x["qls"], x["k"], x["kf"], x["kls"], x["v"])
    ref, _, _ = windowed_linear_attention(*args, window=16, chunk_size=CHUNK, backend="torch")
    fla, _, _ = windowed_linear_attention(*args, window=16, chunk_size=CHUNK, backend="fla")
    assert torch.equal(ref, fla)
    with pytest.raises(ValueError, match="fp16, bf16 or fp32"):
        windowed_linear_attention(*args, window=16, chunk_size=CHUNK, backend="triton")
