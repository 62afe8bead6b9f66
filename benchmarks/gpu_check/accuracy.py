"""The Triton kernels (core and fused trig path), compiled (or interpreted on a dry run), against
the quadratic form in fp64 on the same inputs: normwise max error of the output, the final state
and every gradient; pass when within the dtype's tolerance plus 10x the error of the quadratic form
run in that dtype (what the dtype's rounding alone costs).

The cases are what the stage must show, not a full matrix (each new dtype, normalisation kind (RMS
or not), pairing or path is a set of ~6-10 cold compiles of 5-18 s on a GPU): the production path
first (fused trig, paired, bf16, capped_denominator, at the 247M head shape: d = 64, F = 128,
Dv = 64; compiled afresh, not reused from the trainer's: its 16 heads and batch specialise
differently, and the scan block sizes depend on B x H, so the stage's estimate counts its compiles), then the given-features kernels in bf16 (every
normalisation, with and without a carried state), fp32 (trig and features), fp16 and the unpaired
map. N = 1008: a partial last chunk, and the same int specialisation (N % 16 = 0) as the trainer's
N = 1024. One case per compile set starts first, each in its own process (compiles are CPU-bound);
every case is emitted as it finishes. The dry run keeps the small CPU matrix (fp32, fp16; N = 65)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Callable

import torch

from megaflex.attention import LinearAttentionState
from megaflex.attention.normalize import NORMALIZATIONS
from megaflex.attention.feature_maps.trig import trig_feature_map_reference
from megaflex.attention.linear.naive import quadratic_linear_attention
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


def judge(got: dict[str, float], same: dict[str, float], tolerance: float) -> dict[str, Any]:
    """``passed`` when every quantity's error is within ``tolerance`` plus 10x the same-dtype
    reference's. A quantity that overflows in the reference too (an fp16 gradient past 65504) is
    the dtype's own limit: listed in ``overflows_in_dtype``, not judged; one that overflows only in
    the kernel fails. (A plain max over the excesses would drop a NaN from inf - inf.)"""
    overflow = [k for k in got if not math.isfinite(got[k]) and not math.isfinite(same[k])]
    excess = [got[k] - 10 * same[k] if math.isfinite(same[k]) else -math.inf for k in got if k not in overflow]
    passed = all(math.isfinite(got[k]) for k in got if k not in overflow) and all(e <= tolerance for e in excess)
    return {"passed": passed, **({"overflows_in_dtype": overflow} if overflow else {})}


def _errors(got: dict, exact: dict) -> dict[str, float]:
    return {
        name: (got[name].double() - ref).abs().max().item() / max(ref.abs().max().item(), 1.0) for name, ref in exact.items()
    }


@dataclass(frozen=True)
class Case:
    """One accuracy case: ``path`` "features" (given features) or "trig" (the fused trig map)."""

    path: str
    dtype: str
    n: int
    normalization: str
    state: bool = False  # features only: a carried initial state (with key log-scales x100)
    paired: bool = True  # trig only
    small: bool = False
    device: str = "cuda"


_DTYPES = {name: dtype for dtype, name in DTYPE_NAMES.items()}


def plan(small: bool, device: str) -> list[Case]:
    """The cases in submission order: one of each compile set first (most valuable first), then the rest."""
    if small:  # the CPU interpreter: no compiles, every normalisation and state, fp32 and fp16
        features = [Case("features", dt, 65, norm, state, small=True, device=device)
                    for dt in ("fp32", "fp16") for norm in NORMALIZATIONS for state in (False, True)]  # fmt: skip
        return features + [Case("trig", "fp32", 65, "rms", paired=p, small=True, device=device) for p in (True, False)]
    n, capped = 1008, "capped_denominator"
    sets = [
        [Case("trig", "bf16", n, capped, device=device)],
        [Case("features", "bf16", n, capped, True, device=device), Case("features", "bf16", n, capped, False, device=device),
         Case("features", "bf16", n, "denominator", True, device=device)],
        [Case("features", "bf16", n, "rms", True, device=device), Case("features", "bf16", n, "rms", False, device=device)],
        [Case("trig", "fp32", n, capped, device=device)],
        [Case("features", "fp32", n, capped, True, device=device)],
        [Case("features", "fp16", n, capped, True, device=device)],
        [Case("trig", "bf16", n, capped, paired=False, device=device)],
    ]  # fmt: skip
    return [s[0] for s in sets] + [c for s in sets for c in s[1:]]


def run_case(case: Case) -> dict[str, Any]:
    """One case's row (``passed``, errors), or its error; never raises."""
    row: dict[str, Any] = {k: v for k, v in asdict(case).items() if k not in ("small", "device")}
    if case.path == "trig":
        row.pop("state")
    else:
        row.pop("paired")
    try:
        row.update((_trig_case if case.path == "trig" else _features_case)(case))
    except Exception as err:  # noqa: BLE001  (recorded, the run goes on)
        row.update(passed=False, error=repr(err)[:500])
    return row


def _features_case(case: Case) -> dict[str, Any]:
    dtype = _DTYPES[case.dtype]
    feat, dv, heads = (16, 16, 2) if case.small else (128, 64, 4)
    key_scale = 100.0 if case.state else 1.0
    master = _case_inputs(case.n, feat, dv, heads, key_scale, case.state, case.device, seed=case.n)
    exact = _evaluate(quadratic_linear_attention, master, dtype, torch.float64, case.normalization)
    same = _errors(_evaluate(quadratic_linear_attention, master, dtype, dtype, case.normalization), exact)
    triton = _errors(_evaluate(triton_linear_attention, master, dtype, dtype, case.normalization), exact)
    scale = 1 + key_scale / 5  # exp arguments carry |kls| x eps rounding
    return {"key_scale": key_scale, "max_error": max(triton.values()), "reference_error": max(same.values()),
            **judge(triton, same, TOLERANCE[dtype] * scale), "errors": {k: float(f"{e:.3g}") for k, e in triton.items()}}  # fmt: skip


def _trig_case(case: Case) -> dict[str, Any]:
    """Fused trig path vs (reference map + quadratic form) in fp64, gradients of q, k, v, omega, 1/T.
    Omega [H, P, d]: paired maps give F = P features, unpaired F = 2P; both at F = 128 on a GPU."""
    dtype, device, paired = _DTYPES[case.dtype], case.device, case.paired
    n, d, feat, heads = (case.n, 8, 16, 2) if case.small else (case.n, 64, 128, 4)
    rows = feat if paired else feat // 2
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
            out, _ = trig_linear_attention(*leaves, paired=paired, normalization=case.normalization)
        else:
            qf, _ = trig_feature_map_reference(leaves[0], leaves[3], leaves[4], paired=paired)
            kf, kls = trig_feature_map_reference(leaves[1], leaves[3], leaves[4], paired=paired)
            out, _ = quadratic_linear_attention(qf, kf, kls, leaves[2], normalization=case.normalization)
        weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64).to(device)
        grads = torch.autograd.grad((out.double() * weight).sum(), leaves)
        return dict(zip(("out", "dq", "dk", "dv", "domega", "dinv_temperature"), (out, *grads)))

    exact = run(False, torch.float64)
    same, got = _errors(run(False, dtype), exact), _errors(run(True, dtype), exact)
    return {"F": feat, "max_error": max(got.values()), "reference_error": max(same.values()),
            **judge(got, same, TOLERANCE[dtype]), "errors": {k: float(f"{e:.3g}") for k, e in got.items()}}  # fmt: skip


def check_kernels(small: bool, device: str, emit: Callable[[dict[str, Any]], None] = lambda _: None,
                  workers: int = 1) -> dict[str, Any]:  # fmt: skip
    """Every planned case (``plan``), in ``workers`` processes; ``emit`` gets the partial result
    after each case. ``passed``: every case ran and passed."""
    from benchmarks.gpu_check.common import map_in_workers

    cases = plan(small, device)
    done: dict[int, dict[str, Any]] = {}
    result: dict[str, Any] = {"planned": len(cases), "cases": []}
    for i, row in map_in_workers(run_case, cases, workers):
        done[i] = row if "path" in row else {**asdict(cases[i]), "passed": False, **row}
        result["cases"] = [done[j] for j in sorted(done)]
        result["passed"] = len(done) == len(cases) and all(r["passed"] for r in done.values())
        emit(result)
    return result
