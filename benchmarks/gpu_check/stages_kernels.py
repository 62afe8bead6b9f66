"""Kernel stages (issue 21, point 4):

* ``kernel_sweep``: forward + backward in bf16 at (B, H, N, F, Dv) = (8, 16, 1k, 128, 64) (247M),
  (1, 16, 32k, 128, 64) (the same kernels' compiles), then (4, 16, 1k, 256, 128) (1.3B: compiles of
  its own, so last, after the probe): megaflex's Triton kernel on given features, the
  whole Triton trig path (features computed in the kernels from q, k; ``_unfused``: its reference
  path, features computed in torch), SDPA restricted to FlashAttention (head dim Dv) and
  fla's ``chunk_simple_gla`` on the same features when fla is importable: ms and peak MB. Every row
  has F features: the trig map is paired with Omega [H, F, Dv] (F = P for a paired map); every
  linear form normalises with capped_denominator (the configs' default). Then an
  int32-boundary probe: a batch with B*H*N*F > 2^31 elements, its last batch element compared with
  that element run alone (int32 offsets wrap past 2^31: a silent wrong output). Registers, spills
  and shared memory come from the AOT report (docs/results/triton_aot.json) when it exists.
* ``kernel_accuracy``: the compiled kernels against the fp64 quadratic form (``accuracy.py``).

Under ``--dry-run``: tiny shapes, fp32, the Triton interpreter on CPU tensors.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any, Callable

from benchmarks.gpu_check.common import REPO, Stage, timed

GPU_SHAPES = ((8, 16, 1024, 128, 64), (1, 16, 32768, 128, 64))
GPU_LAST_SHAPES = ((4, 16, 1024, 256, 128),)  # after the int32 probe
DRY_SHAPES = ((2, 2, 64, 16, 16),)  # every impl once (longer sequences, against fp64: kernel_accuracy)
AOT_REPORT = REPO / "docs" / "results" / "triton_aot.json"
# the configs' default: what trains, and the compiles the trainer and kernel_accuracy left in the cache
NORMALIZATION = "capped_denominator"


def _impls(heads: int, feat: int, dv: int, device: str, dtype: Any) -> dict[str, Callable[..., Any] | str]:
    """name -> fn(q, k, v, qf, kf, kls) of one attention forward, or why it is unavailable."""
    import torch
    import torch.nn.functional as F

    from megaflex.attention.triton import trig_linear_attention, triton_linear_attention

    g = torch.Generator().manual_seed(0)
    # paired trig map: Omega [H, P, d] gives F = P features (pair sums of cos and of sin, P / 2 each)
    omega = (torch.randn(heads, feat, dv, generator=g) * dv**-0.25).to(device).requires_grad_()
    inv_t = torch.full((heads,), 1.0 / (2 * dv**0.5), device=device).requires_grad_()

    def sdpa(q, k, v, qf, kf, kls):
        if device != "cuda":
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    norm = NORMALIZATION
    impls: dict[str, Any] = {
        "flexformer_kernel": lambda q, k, v, qf, kf, kls: triton_linear_attention(qf, kf, kls, v, normalization=norm)[0],
        "flexformer_trig": lambda q, k, v, qf, kf, kls: trig_linear_attention(
            q, k, v, omega, inv_t, paired=True, normalization=norm
        )[0],
        "flexformer_trig_unfused": lambda q, k, v, qf, kf, kls: trig_linear_attention(
            q, k, v, omega, inv_t, paired=True, fused_map=False, normalization=norm
        )[0],
        "sdpa_flash" if device == "cuda" else "sdpa": sdpa,
    }
    try:
        import fla  # noqa: F401

        from megaflex.attention.linear.chunk_fla import gla_linear_attention

        impls["fla_chunk_simple_gla"] = (
            (lambda q, k, v, qf, kf, kls: gla_linear_attention(qf, kf, kls, v, normalization=norm)[0])
            if device == "cuda"
            else "needs CUDA"
        )
    except ImportError:
        impls["fla_chunk_simple_gla"] = "not installed"
    return impls


def _inputs(shape: tuple[int, ...], device: str, dtype: Any, seed: int) -> dict[str, Any]:
    import torch

    b, h, n, f, dv = shape
    g = torch.Generator().manual_seed(seed)

    def make(*size: int, scale: float = 1.0) -> torch.Tensor:
        return (scale * torch.randn(*size, generator=g)).to(device, dtype).requires_grad_()

    return {"q": make(b, h, n, dv), "k": make(b, h, n, dv), "v": make(b, h, n, dv),
            "qf": make(b, h, n, f, scale=0.3), "kf": make(b, h, n, f, scale=0.3),
            "kls": (0.1 * torch.randn(b, h, n, generator=g)).to(device).requires_grad_()}  # fmt: skip


def kernel_sweep(stage: Stage) -> dict[str, Any]:
    import torch

    device = stage.device
    dtype = torch.float32 if stage.dry_run else torch.bfloat16  # the interpreter computes bf16 wrongly
    result: dict[str, Any] = {"dtype": str(dtype).removeprefix("torch."), "rows": []}
    _sweep(stage, DRY_SHAPES if stage.dry_run else GPU_SHAPES, dtype, result)
    result["int32_probe"] = int32_probe(stage)
    result["aot_report"] = aot_report()
    stage.emit(result)
    if not stage.dry_run:
        _sweep(stage, GPU_LAST_SHAPES, dtype, result)
    return result


def _sweep(stage: Stage, shapes: tuple[tuple[int, ...], ...], dtype: Any, result: dict[str, Any]) -> None:
    """Forward + backward of every impl at each shape: one row each, emitted as it is measured."""
    import torch

    device = stage.device
    for shape in shapes:
        b, h, n, f, dv = shape
        x = _inputs(shape, device, dtype, seed=n)
        grad = torch.randn(b, h, n, dv, generator=torch.Generator().manual_seed(1)).to(device, dtype)
        for name, impl in _impls(h, f, dv, device, dtype).items():
            row: dict[str, Any] = {"impl": name, "B": b, "H": h, "N": n, "F": f, "Dv": dv}
            if isinstance(impl, str):
                result["rows"].append({**row, "status": impl})
                continue

            def step() -> None:
                impl(**x).backward(grad)  # noqa: B023  (run now, in this iteration)

            try:
                ms, peak = timed(step, device, repeats=1 if stage.dry_run else 5)
                row.update(status="ok", fwd_bwd_ms=round(ms, 3), peak_mb=None if peak is None else round(peak, 1))
            except Exception as err:  # noqa: BLE001  (a launch failure or out of memory is a result)
                if raised_inside_package(err, "fla"):  # the optional comparator refused this platform
                    row.update(status="unavailable", refused_by_fla=repr(err)[:400])
                else:
                    row.update(status="error", error=repr(err)[:400])
            result["rows"].append(row)
            stage.emit(result)
        x = grad = None  # free this shape's tensors before the next one
        if device == "cuda":
            torch.cuda.empty_cache()


def raised_inside_package(err: BaseException, package: str) -> bool:
    """Whether ``err`` was raised by ``package``'s own code (its innermost frame is in it): fla 0.6
    refuses Hopper with triton < 3.7.1 itself, which is a fact about the platform, not a failure
    of megaflex's kernels (a megaflex error inside an fla call is raised in megaflex's frames)."""
    import traceback

    frames = traceback.extract_tb(err.__traceback__)
    return bool(frames) and f"{os.sep}{package}{os.sep}" in frames[-1].filename


def int32_probe(stage: Stage) -> dict[str, Any]:
    """The last batch element of a batch past 2^31 feature elements against that element alone.

    Both runs take the same tiles: the autotuner's key holds the shapes and blocks, not B or N, so
    the second call reuses the first one's config, and each (batch, head) row is computed alone. So
    they agree to the bit unless offsets wrap; the bound, 2 ulps of the output dtype at max|o| (one
    bf16 ulp is 2^-8..2^-7 relative), leaves room only for rounding, and a wrapped offset reads
    another row's data (errors of the order of |o|)."""
    import torch

    from megaflex.attention.triton import triton_linear_attention

    shape = (3, 2, 64, 16, 16) if stage.dry_run else (33, 16, 32768, 128, 64)  # 33*16*32768*128 > 2^31
    b, h, n, f, dv = shape
    device, dtype = stage.device, torch.float32 if stage.dry_run else torch.bfloat16
    elements = b * h * n * f
    out: dict[str, Any] = {"B": b, "H": h, "N": n, "F": f, "Dv": dv, "elements": elements,
                           "crosses_int32": elements > 2**31}  # fmt: skip
    try:
        with torch.no_grad():
            g = torch.Generator(device=device).manual_seed(0)
            qf = 0.3 * torch.randn(b, h, n, f, generator=g, device=device, dtype=dtype)
            kf = 0.3 * torch.randn(b, h, n, f, generator=g, device=device, dtype=dtype)
            kls = 0.1 * torch.randn(b, h, n, generator=g, device=device)
            v = torch.randn(b, h, n, dv, generator=g, device=device, dtype=dtype)
            last_in_batch = triton_linear_attention(qf, kf, kls, v, normalization=NORMALIZATION)[0][-1].float()
            alone = triton_linear_attention(qf[-1:], kf[-1:], kls[-1:], v[-1:], normalization=NORMALIZATION)[0][0].float()
        diff = (last_in_batch - alone).abs().max().item()
        top = alone.abs().max().item()
        bound = 2 * torch.finfo(dtype).eps * 2.0 ** math.floor(math.log2(top)) if top > 0 else 0.0  # 2 ulps at max|o|
        out.update(max_abs_diff=diff, max_abs_out=top, bound=bound, passed=diff <= bound)
    except Exception as err:  # noqa: BLE001
        out.update(passed=False, error=repr(err)[:400])
    return out


def aot_report() -> dict[str, Any]:
    """Registers, spills and shared memory per kernel and target from the AOT compile report."""
    if not AOT_REPORT.exists():
        return {"status": f"not found ({AOT_REPORT.relative_to(REPO)} is written by the AOT compile script)"}
    text = AOT_REPORT.read_text()
    if len(text) > 400_000:
        return {"status": "too large to embed", "path": str(AOT_REPORT.relative_to(REPO)), "bytes": len(text)}
    return {"status": "ok", "path": str(AOT_REPORT.relative_to(REPO)), "report": json.loads(text)}


def kernel_accuracy(stage: Stage) -> dict[str, Any]:
    import os

    from benchmarks.gpu_check.accuracy import check_kernels

    workers = 1 if stage.dry_run else min(7, max(1, (os.cpu_count() or 2) // 2))  # 7: the compile sets
    return check_kernels(stage.dry_run, stage.device, stage.emit, workers)
