"""The Triton kernels' F / Dv tiling under the interpreter: widths that span several blocks, with
partial last blocks (F = 80: three 32-wide blocks, two 64-wide ones in the scans; Dv = 72), few heads (the
scans then halve their blocks for occupancy) and partial last chunks, against the quadratic
form in fp64. Outputs, final state and every gradient, both normalisations."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are first imported (CPU tensors need it)

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton", reason="triton is not installed (pip install 'megaflex[dev]' installs it)")

from megaflex.attention import LinearAttentionState  # noqa: E402
from megaflex.attention.linear.naive import quadratic_linear_attention  # noqa: E402
from megaflex.attention.triton import triton_linear_attention  # noqa: E402
from megaflex.attention.triton.linear import ChunkPlan  # noqa: E402


def _case(feat: int, dv: int, n: int, heads: int, normalization: str, dtype: torch.dtype):
    g = torch.Generator().manual_seed(feat + dv + n)
    qf = torch.randn(1, heads, n, feat, generator=g)
    kf = torch.randn(1, heads, n, feat, generator=g)
    if normalization == "denominator":  # positive features keep the denominator away from 0
        qf, kf = qf.exp() / feat, kf.exp()
    leaves = {
        "qf": qf, "kf": kf, "kls": 3.0 * torch.randn(1, heads, n, generator=g), "v": torch.randn(1, heads, n, dv, generator=g),
        "kv0": torch.randn(1, heads, feat, dv, generator=g).abs(), "k_sum0": torch.rand(1, heads, feat, generator=g) * n,
    }  # fmt: skip
    leaves = {name: t.to(dtype).requires_grad_() for name, t in leaves.items()}
    state = LinearAttentionState(leaves["kv0"], leaves["k_sum0"], torch.randn(1, heads, generator=g).to(dtype), offset=0)
    return leaves, state


def _run(fn, leaves, state, normalization, **kwargs):
    out, final = fn(leaves["qf"], leaves["kf"], leaves["kls"], leaves["v"], normalization=normalization, initial_state=state, **kwargs)
    g = torch.Generator().manual_seed(7)
    loss = (out.double() * torch.randn(out.shape, generator=g, dtype=torch.float64)).sum()
    for t in (final.kv, final.k_sum):
        loss = loss + (t.double() * torch.randn(t.shape, generator=g, dtype=torch.float64)).sum()
    grads = torch.autograd.grad(loss, list(leaves.values()))
    return {"out": out, "kv": final.kv, "k_sum": final.k_sum, **{f"d{name}": gr for name, gr in zip(leaves, grads)}}


@pytest.mark.parametrize("normalization", ["rms", "denominator"])
@pytest.mark.parametrize("feat,dv,n,heads", [(80, 72, 37, 1), (128, 40, 20, 2)])
def test_kernels_tiled_over_f_and_dv_match_quadratic(feat, dv, n, heads, normalization):
    leaves, state = _case(feat, dv, n, heads, normalization, torch.float32)
    got = _run(triton_linear_attention, leaves, state, normalization, chunk_size=16)
    leaves64, state64 = _case(feat, dv, n, heads, normalization, torch.float64)
    want = _run(quadratic_linear_attention, leaves64, state64, normalization)
    for name, ref in want.items():
        scale = max(ref.abs().max().item(), 1.0)
        err = (got[name].double() - ref).abs().max().item()
        assert err <= 1e-4 * scale, f"{name}: max error {err:.3e} vs scale {scale:.3e}"


def _plan(bh: int, feat: int, dv: int) -> ChunkPlan:
    return ChunkPlan(bh, 256, feat, dv, 64, 4, torch.empty(0), torch.empty(0))


def test_blocks_cap_at_64_and_scans_split_further_when_few_programs_run():
    wide = _plan(128, 256, 128)  # 1.3B shape, B = 8
    assert (wide.loop_block, wide.dv_block) == (32, 64) and wide.scan_blocks() == (64, 64)
    assert wide.grads_qk_blocks() == (32, 32)
    single = _plan(16, 128, 64)  # 247M shape, B = 1: 16 heads, 2 programs per head at 64 x 64
    bf, bv = single.scan_blocks()
    assert (bf, bv) == (32, 32) and 16 * (128 // bf) * (64 // bv) == 128
    narrow = _plan(2, 16, 8)  # blocks never below tl.dot's 16 nor above the padded width
    assert (narrow.loop_block, narrow.dv_block) == (16, 16) and narrow.scan_blocks() == (16, 16)
