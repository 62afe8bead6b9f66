"""The Triton kernels (core and fused trig path), compiled (or interpreted on a dry run), in fp32,
bf16 and fp16, against the quadratic form in fp64 on the same inputs: normwise max error of the
output, the final state and every gradient; pass when within the dtype's tolerance plus 10x the error
of the quadratic form run in that dtype (what the dtype's rounding alone costs)."""

from __future__ import annotations

from typing import Any, Callable

import torch

from megaflex.attention import LinearAttentionState
from megaflex.attention.base import NORMALIZATIONS
from megaflex.attention.feature_maps._trig import trig_feature_map_reference
from megaflex.attention.quadratic import quadratic_linear_attention
from megaflex.attention.triton import trig_linear_attention, triton_linear_attention

# normwise tolerance per dtype on top of 10x the quadratic form's own error in that dtype
# The kernels' dot operands are in the inputs' dtype (fp32 inputs: tf32 on CUDA, 10 mantissa bits),
# so fp32 intermediates are rounded to it before their products.
TOLERANCE = {torch.float32: 2e-3, torch.bfloat16: 2e-2, torch.float16: 4e-3}
DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def _case_inputs(n: int, feat: int, dv: int, heads: int, key_scale: float, with_state: bool, device: str, seed: int):
    """fp64 master copies of one case's inputs: features (signed), key log-scales, v, state."""
    g = torch.Generator().manual_seed(seed)
    x = {
        "qf": torch.randn(1, heads, n, feat, generator=g, dtype=torch.float64),
        "kf": torch.randn(1, heads, n, feat, generator=g, dtype=torch.float64),
        "kls": key_scale * torch.randn(1, heads, n, generator=g, dtype=torch.float64),
        "v": torch.randn(1, heads, n, dv, generator=g, dtype=torch.float64),
    }
    if with_state:
        x["kv0"] = torch.randn(1, heads, feat, dv, generator=g, dtype=torch.float64)
        x["k_sum0"] = torch.randn(1, heads, feat, generator=g, dtype=torch.float64)
        x["log_max0"] = key_scale * torch.randn(1, heads, generator=g, dtype=torch.float64)
    return {name: t.to(device) for name, t in x.items()}


def _evaluate(fn: Callable, master: dict[str, torch.Tensor], dtype: torch.dtype, compute: torch.dtype, normalization: str):
    """Run ``fn`` on ``master`` rounded to ``dtype`` (features, v) and held in ``compute``;
    returns {name: tensor} of the output, final state and gradients of a fixed random loss."""
    leaves = {
        name: t.to(dtype).to(compute).requires_grad_() if name in ("qf", "kf", "v") else t.to(compute if compute == torch.float64 else torch.float32).requires_grad_()
        for name, t in master.items()
        if name != "log_max0"
    }
    state = None
    if "kv0" in leaves:
        state = LinearAttentionState(leaves["kv0"], leaves["k_sum0"], master["log_max0"].to(leaves["kv0"].dtype), 0)
    out, final = fn(leaves["qf"], leaves["kf"], leaves["kls"], leaves["v"], normalization=normalization, initial_state=state)
    g = torch.Generator().manual_seed(7)
    loss = sum(
        (t.double() * torch.randn(t.shape, generator=g, dtype=torch.float64).to(t.device)).sum()
        for t in (out, final.kv, final.k_sum)
    )
    grads = torch.autograd.grad(loss, list(leaves.values()))
    return {"out": out, "kv": final.kv, "k_sum": final.k_sum, **{f"d{k}": gr for k, gr in zip(leaves, grads)}}


def _errors(got: dict, exact: dict) -> dict[str, float]:
    return {
        name: (got[name].double() - ref).abs().max().item() / max(ref.abs().max().item(), 1.0) for name, ref in exact.items()
    }


def check_kernels(small: bool, device: str) -> dict[str, Any]:
    """Compiled (or interpreted) kernels vs the fp64 quadratic form, every dtype and gradient."""
    dtypes = [torch.float32, torch.float16] if device == "cpu" else [torch.float32, torch.bfloat16, torch.float16]
    lengths = (65,) if small else (1, 65, 200, 1000)
    feat, dv, heads = (16, 16, 2) if small else (128, 64, 4)
    cases = []
    for dtype in dtypes:
        for n in lengths:
            for normalization in NORMALIZATIONS:
                for with_state, key_scale in ((False, 1.0), (True, 100.0)):
                    master = _case_inputs(n, feat, dv, heads, key_scale, with_state, device, seed=n)
                    case = {"dtype": DTYPE_NAMES[dtype], "n": n, "normalization": normalization, "state": with_state, "key_scale": key_scale}
                    try:
                        exact = _evaluate(quadratic_linear_attention, master, dtype, torch.float64, normalization)
                        same = _errors(_evaluate(quadratic_linear_attention, master, dtype, dtype, normalization), exact)
                        triton = _errors(_evaluate(triton_linear_attention, master, dtype, dtype, normalization), exact)
                        scale = 1 + key_scale / 5  # exp arguments carry |kls| x eps rounding
                        worst = max(triton[k] - 10 * same[k] for k in triton)
                        case.update(max_error=max(triton.values()), reference_error=max(same.values()))
                        case["passed"] = worst <= TOLERANCE[dtype] * scale
                        case["errors"] = {k: float(f"{e:.3g}") for k, e in triton.items()}
                    except Exception as err:  # noqa: BLE001  (recorded, the run goes on)
                        case.update(passed=False, error=repr(err)[:500])
                    cases.append(case)
    trig = check_trig(small, device)
    return {"passed": all(c["passed"] for c in cases) and trig["passed"], "cases": cases, "trig": trig}


def check_trig(small: bool, device: str) -> dict[str, Any]:
    """Fused trig path vs (reference map + quadratic form) in fp64, gradients of q, k, v, omega, 1/T."""
    n, d, rows, heads = (65, 8, 16, 2) if small else (1000, 64, 64, 4)
    results = []
    for dtype in [torch.float32] if device == "cpu" else [torch.float32, torch.bfloat16]:
        for paired in (True, False):
            g = torch.Generator().manual_seed(3)
            q, k, v = (torch.randn(1, heads, n, d, generator=g, dtype=torch.float64) for _ in range(3))
            q, k = 0.5 * q, 0.5 * k
            omega = torch.randn(heads, rows, d, generator=g, dtype=torch.float64) * d**-0.25
            inv_t = torch.full((heads,), 1.0 / (2 * d**0.5), dtype=torch.float64)
            master = [t.to(device).to(dtype) for t in (q, k, v)] + [omega.to(device), inv_t.to(device)]

            def run(use_triton: bool, compute: torch.dtype):
                leaves = [t.to(compute).requires_grad_() for t in master[:3]] + [
                    t.to(compute if compute == torch.float64 else torch.float32).requires_grad_() for t in master[3:]
                ]
                if use_triton:
                    out, _ = trig_linear_attention(*leaves, paired=paired)
                else:
                    qf, _ = trig_feature_map_reference(leaves[0], leaves[3], leaves[4], paired=paired)
                    kf, kls = trig_feature_map_reference(leaves[1], leaves[3], leaves[4], paired=paired)
                    out, _ = quadratic_linear_attention(qf, kf, kls, leaves[2])
                weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64).to(device)
                grads = torch.autograd.grad((out.double() * weight).sum(), leaves)
                return dict(zip(("out", "dq", "dk", "dv", "domega", "dinv_temperature"), (out, *grads)))

            try:
                exact = run(False, torch.float64)
                same, got = _errors(run(False, dtype), exact), _errors(run(True, dtype), exact)
                worst = max(got[k] - 10 * same[k] for k in got)
                results.append({"dtype": DTYPE_NAMES[dtype], "paired": paired, "max_error": max(got.values()),
                                "passed": worst <= TOLERANCE[dtype]})  # fmt: skip
            except Exception as err:  # noqa: BLE001
                results.append({"dtype": DTYPE_NAMES[dtype], "paired": paired, "passed": False, "error": repr(err)[:500]})
    return {"passed": all(r["passed"] for r in results), "cases": results}
