"""``window_kernels`` stage: the one-normaliser hybrid's Triton form (``megaflex/attention/triton/window.py``).

* accuracy: ``TritonWindowNumerator`` compiled, in fp32 (tf32 dots), bf16 and fp16, against the torch
  Function (``ChunkedWindowNumerator``) in fp64 on the same inputs: numerator and every gradient
  (q, k, features, log-scales, v with its ones column, the carried state), normwise (floor 1);
  passes within ``accuracy.TOLERANCE`` plus 10x the torch Function's own error in that dtype.
* speed: forward + backward of both Functions in bf16 at the 247M and 1.3B attention shapes
  (B = 8 / 4, 16 heads, N = 1024, W = 64; the torch Function in fp32, as it runs): ms and peak MB.

Cases (each dtype and window kind is a set of cold compiles): bf16 (what trains) at both accuracy
shapes, fp32 and fp16 at the first one only; one case per compile set starts first, each in its own process,
and every case is emitted as it finishes; then the speed rows, one at a time.

Under ``--dry-run``: tiny shapes, fp32 and fp16, the Triton interpreter on CPU tensors.
"""

from __future__ import annotations

from typing import Any, Callable

from benchmarks.gpu_check.common import Stage, timed

# (BH, T, head dim, F, Dv, W): the shipped shapes at N = 1024 (247M: B = 8; 1.3B: B = 4), W = 64
GPU_SHAPES = ((128, 1024, 64, 128, 64, 64), (64, 1024, 128, 256, 128, 64))
ACCURACY_SHAPES = ((4, 256, 64, 64, 64, 64), (4, 256, 64, 64, 64, 20))  # W > C (L = 2) and W = 2C
DRY_SHAPES = ((2, 64, 16, 16, 16, 20),)
CHUNK = 32  # ``window_chunk`` at the shipped chunk_size 64


def _inputs(shape: tuple[int, ...], device: str, seed: int) -> tuple[list, Any]:
    """fp64 Function inputs (q, qf, qls, k, kf, kls, v_aug, s0) and m0, key-aligned, the last keys padded."""
    import torch

    bh, t, d, f, dv, _ = shape
    g = torch.Generator().manual_seed(seed)
    q, k = 0.5 * torch.randn(bh, t, d, generator=g, dtype=torch.float64), 0.5 * torch.randn(bh, t, d, generator=g, dtype=torch.float64)
    qf, kf = torch.randn(bh, t, f, generator=g, dtype=torch.float64), torch.randn(bh, t, f, generator=g, dtype=torch.float64)
    qls, kls = torch.randn(bh, t, generator=g, dtype=torch.float64), torch.randn(bh, t, generator=g, dtype=torch.float64)
    v_aug = torch.cat([torch.randn(bh, t, dv, generator=g, dtype=torch.float64), torch.ones(bh, t, 1, dtype=torch.float64)], -1)
    pad = 3
    k[:, -pad:], kf[:, -pad:], v_aug[:, -pad:], kls[:, -pad:] = 0.0, 0.0, 0.0, float("-inf")
    s0, m0 = torch.randn(bh, f, dv + 1, generator=g, dtype=torch.float64).abs(), torch.randn(bh, generator=g, dtype=torch.float64)
    return [x.to(device) for x in (q, qf, qls, k, kf, kls, v_aug, s0)], m0.to(device)


def _leaves(master: list, m0, dtype, compute, side=None) -> tuple[list, Any]:
    """Leaves: operands rounded to ``dtype``, held in ``compute``; log-scales, state and m0 in
    ``side`` (default: fp32, fp64 for an fp64 run)."""
    import torch

    side = side or (torch.float64 if compute == torch.float64 else torch.float32)
    leaves = [x.to(dtype).to(compute) if i in (0, 1, 3, 4, 6) else x.to(side) for i, x in enumerate(master)]
    return [x.requires_grad_() for x in leaves], m0.to(side)


def _apply(fn, leaves: list, m0, window: int) -> list:
    """Numerator and gradients of a fixed random functional."""
    import torch

    numer = fn.apply(*leaves, m0, window, CHUNK)
    weight = torch.randn(numer.shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64).to(numer.device)
    return [numer, *torch.autograd.grad((numer.double() * weight).sum(), leaves)]


def _run(fn, master: list, m0, window: int, dtype, compute, side=None) -> list:
    return _apply(fn, *_leaves(master, m0, dtype, compute, side), window)


def _plan(dry_run: bool, device: str) -> list[tuple[tuple[int, ...], str, str]]:
    """(shape, dtype name, device) per case: one per compile set first, bf16 first."""
    if dry_run:
        return [(shape, dt, device) for shape in DRY_SHAPES for dt in ("fp32", "fp16")]
    first, second = ACCURACY_SHAPES
    return [(first, "bf16", device), (second, "bf16", device), (first, "fp32", device), (first, "fp16", device)]


def accuracy_case(spec: tuple[tuple[int, ...], str, str]) -> dict[str, Any]:
    """One (shape, dtype) case against the torch Function in fp64; never raises."""
    from benchmarks.gpu_check.accuracy import TOLERANCE, judge
    from megaflex.attention.window.chunk import ChunkedWindowNumerator
    from megaflex.attention.triton import TritonWindowNumerator

    shape, dtype_name, device = spec
    names = ("numer", "dq", "dqf", "dqls", "dk", "dkf", "dkls", "dv_aug", "ds0")
    case: dict[str, Any] = {"dtype": dtype_name, "shape": list(shape)}
    try:
        import torch

        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype_name]
        master, m0 = _inputs(shape, device, seed=shape[-1])
        exact = _run(ChunkedWindowNumerator, master, m0, shape[-1], *(2 * [master[0].dtype]))
        errors = {}
        # the torch Function in the dtype throughout (its matmuls take one dtype); the kernels
        # take fp32 log-scales and state
        for label, fn, side in (("same", ChunkedWindowNumerator, dtype), ("triton", TritonWindowNumerator, None)):
            got = _run(fn, master, m0, shape[-1], dtype, dtype, side)
            errors[label] = {n: (a.double() - b).abs().max().item() / max(b.abs().max().item(), 1.0) for n, a, b in zip(names, got, exact)}
        case.update(**judge(errors["triton"], errors["same"], TOLERANCE[dtype]), max_error=max(errors["triton"].values()),
                    reference_error=max(errors["same"].values()), errors={n: float(f"{e:.3g}") for n, e in errors["triton"].items()})  # fmt: skip
    except Exception as err:  # noqa: BLE001  (recorded, the run goes on)
        case.update(passed=False, error=repr(err)[:500])
    return case


def _speed(stage: Stage, rows: list[dict[str, Any]], emit: Callable[[], None]) -> None:
    import torch

    from megaflex.attention.window.chunk import ChunkedWindowNumerator
    from megaflex.attention.triton import TritonWindowNumerator

    device = stage.device
    half = torch.float32 if stage.dry_run else torch.bfloat16  # the interpreter computes bf16 wrongly
    for shape in DRY_SHAPES if stage.dry_run else GPU_SHAPES:
        master, m0 = _inputs(shape, device, seed=1)
        for name, fn, dtype in (("triton", TritonWindowNumerator, half), ("torch", ChunkedWindowNumerator, torch.float32)):
            row: dict[str, Any] = {"impl": name, "dtype": str(dtype).removeprefix("torch."), "shape": list(shape)}
            try:
                leaves, m = _leaves(master, m0, dtype, dtype)
                # the output gradient is made once, on the device, outside the timed step: drawing it
                # inside (as _apply does for the accuracy cases) timed a CPU fp64 randn of 8.5M values
                grad = torch.randn_like(fn.apply(*leaves, m, shape[-1], CHUNK).detach())

                def step() -> None:
                    fn.apply(*leaves, m, shape[-1], CHUNK).backward(grad)  # noqa: B023  (run now)

                ms, peak = timed(step, device, repeats=1 if stage.dry_run else 5)
                row.update(status="ok", fwd_bwd_ms=round(ms, 3), peak_mb=None if peak is None else round(peak, 1))
            except Exception as err:  # noqa: BLE001  (a launch failure or out of memory is a result)
                row.update(status="error", error=repr(err)[:400])
            rows.append(row)
            emit()
        master = leaves = None
        if device == "cuda":
            torch.cuda.empty_cache()


def window_kernels(stage: Stage) -> dict[str, Any]:
    import os

    from benchmarks.gpu_check.common import map_in_workers

    specs = _plan(stage.dry_run, stage.device)
    workers = 1 if stage.dry_run else min(len(specs), max(1, (os.cpu_count() or 2) // 2))
    done: dict[int, dict[str, Any]] = {}
    result: dict[str, Any] = {"planned": len(specs), "cases": []}
    for i, case in map_in_workers(accuracy_case, specs, workers):
        done[i] = case if "dtype" in case else {"dtype": specs[i][1], "shape": list(specs[i][0]), "passed": False, **case}
        result["cases"] = [done[j] for j in sorted(done)]
        result["passed"] = len(done) == len(specs) and all(c["passed"] for c in done.values())
        stage.emit(result)
    result["speed"] = []
    _speed(stage, result["speed"], lambda: stage.emit(result))
    return result
