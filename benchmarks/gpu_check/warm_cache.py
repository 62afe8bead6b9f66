"""Warm a Triton cache for an H100/H200 (sm_90) on a machine without a GPU, for gpu_check's call to carry.

    python -m benchmarks.gpu_check.warm_cache --out DIR --triton-python /opt/torch/.venv/bin/python
    python benchmarks/gpu_check/warm_cache.py --relocate DIR      # on the device, where DIR now lies

Triton finds a compiled kernel under sha256(triton_key, source hash, backend hash, options hash,
cache-invalidating TRITON_* variables) (triton 3.6 ``compiler.compile``): triton_key hashes triton's
own files and ``libtriton`` (so the same wheel, Python minor version included); the source hash the
kernel's source, its callees, the constexprs and the specialisation (int == 1, int % 16 == 0,
16-byte aligned pointers); the backend hash ptxas's version (the wheel's own) and the arch; the
options hash the options and libdevice's *contents* (not its path). Nothing of the GPU enters it,
so the keys can be made here. Two steps:

1. Here (torch and megaflex, any triton): gpu_check's launches (``LAUNCH_SETS``) are recorded by
   running the real entry points (``trig_linear_attention``, ``triton_linear_attention``,
   ``TritonWindowNumerator``, forward and backward) on meta tensors with a recorder in place of the
   kernels: each launch at its real shape (ints, dtypes, constexprs); nothing is computed.
2. In ``--triton-python`` (the device's triton, e.g. 3.6.0 under Python 3.12, numpy; no torch): each
   launch goes through Triton's own binder and autotuner (``Autotuner.warmup``: every config it may
   pick, specialised by Triton itself, pointers as 16-byte aligned) with a stand-in driver that
   reports sm_90, and is compiled into DIR.

The cache must be built from the same commit as the run (kernel source and line numbers are in
the key). Triton's group files (``__grp__*.json``) name their files by absolute path: a cache moved
elsewhere misses (silently recompiles) until ``--relocate`` rewrites them for where it lies (stdlib
only). The autotuner still benchmarks each config on the device: the cache saves compiles only.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class LaunchSet:
    """One forward + backward that a gpu_check stage runs: ``kind`` "trig" (the fused map; Omega
    [H, F, d] when paired, [H, F / 2, d] not), "features" (given; the unfused trig path launches the
    same kernels), "probe" (forward only) or "window" (the window hybrid's Function, BH = B x H)."""

    name: str
    kind: str
    dtype: str
    b: int
    h: int
    n: int
    d: int
    f: int
    dv: int
    normalization: str = "capped_denominator"  # the configs' default
    state: bool = False  # features: a carried initial state
    paired: bool = True  # trig
    window: int = 64  # window


_CAP = "capped_denominator"
# what the stages launch (stages_train.py, accuracy.py, stages_kernels.py, stages_window.py)
LAUNCH_SETS: tuple[LaunchSet, ...] = (
    LaunchSet("trainer_247m", "trig", "bfloat16", 8, 16, 1024, 64, 128, 64),
    *(LaunchSet("accuracy", "features", dt, 1, 4, 1008, 64, 128, 64, norm, state)
      for dt, norm, state in (("bfloat16", _CAP, True), ("bfloat16", _CAP, False), ("bfloat16", "denominator", True),
                              ("bfloat16", "rms", True), ("bfloat16", "rms", False), ("float32", _CAP, True), ("float16", _CAP, True))),
    *(LaunchSet("accuracy", "trig", dt, 1, 4, 1008, 64, 128, 64, paired=p) for dt, p in (("bfloat16", True), ("float32", True), ("bfloat16", False))),
    *(LaunchSet(f"sweep_{n}_{f}", kind, "bfloat16", b, 16, n, dv, f, dv)
      for b, n, f, dv in ((8, 1024, 128, 64), (1, 32768, 128, 64), (4, 1024, 256, 128)) for kind in ("trig", "features")),
    LaunchSet("int32_probe", "probe", "bfloat16", 33, 16, 32768, 64, 128, 64),
    *(LaunchSet("precision_41m", "trig", dt, 8, 8, 1024, 64, 128, 64) for dt in ("float32", "bfloat16")),
    *(LaunchSet("window", "window", dt, 4, 1, 256, 64, 64, 64, window=w)
      for dt, w in (("bfloat16", 64), ("bfloat16", 20), ("float32", 64), ("float16", 64))),
    *(LaunchSet("window", "window", "bfloat16", bh, 1, 1024, d, f, dv) for bh, d, f, dv in ((128, 64, 128, 64), (64, 128, 256, 128))),
)  # fmt: skip


# ---- step 1: record (torch + megaflex) ----


def _record_set(spec: LaunchSet) -> list[dict[str, Any]]:
    """The launches of one forward + backward of ``spec``, on meta tensors."""
    from unittest import mock

    import torch

    from megaflex.attention.base import LinearAttentionState
    from megaflex.attention.triton import TritonWindowNumerator, linear, trig_linear_attention, triton_linear_attention, window
    from megaflex.attention.triton.window import window_chunk

    b, h, n, d, f, dv = spec.b, spec.h, spec.n, spec.d, spec.f, spec.dv
    dtype, f32 = getattr(torch, spec.dtype), torch.float32
    calls: list[dict[str, Any]] = []

    class Recorder:
        def __getattr__(self, kernel: str):
            class Grid:
                def __getitem__(self, grid):
                    def launch(*args, **constexprs):
                        values = [{"tensor": str(a.dtype).removeprefix("torch.")} if isinstance(a, torch.Tensor) else a for a in args]
                        calls.append({"set": spec.name, "kernel": kernel, "grid": list(grid), "args": values, "constexprs": constexprs})

                    return launch

            return Grid()

    def tensor(*shape: int, dt=dtype, grad: bool = True) -> torch.Tensor:
        return torch.empty(*shape, device="meta", dtype=dt).requires_grad_(grad)

    recorder = Recorder()
    with mock.patch.object(linear, "kernels_for", lambda _device: recorder), \
            mock.patch.object(window, "kernels_for", lambda _device: recorder), \
            mock.patch.object(window, "window_kernels_for", lambda _device: recorder):  # fmt: skip
        if spec.kind == "trig":
            omega = tensor(h, f if spec.paired else f // 2, d, dt=f32)
            out = trig_linear_attention(tensor(b, h, n, d), tensor(b, h, n, d), tensor(b, h, n, dv), omega, tensor(h, dt=f32),
                                        paired=spec.paired, normalization=spec.normalization)[0]  # fmt: skip
        elif spec.kind in ("features", "probe"):
            grad = spec.kind == "features"
            state = None
            if spec.state:
                state = LinearAttentionState(tensor(b, h, f, dv, dt=f32), tensor(b, h, f, dt=f32), tensor(b, h, dt=f32, grad=False), 0)
            qf, kf, v = tensor(b, h, n, f, grad=grad), tensor(b, h, n, f, grad=grad), tensor(b, h, n, dv, grad=grad)
            out = triton_linear_attention(qf, kf, tensor(b, h, n, dt=f32, grad=grad), v, normalization=spec.normalization,
                                          initial_state=state)[0]  # fmt: skip
        elif spec.kind == "window":
            bh = b * h
            leaves = [tensor(bh, n, d), tensor(bh, n, f), tensor(bh, n, dt=f32), tensor(bh, n, d), tensor(bh, n, f),
                      tensor(bh, n, dt=f32), tensor(bh, n, dv + 1), tensor(bh, f, dv + 1, dt=f32)]  # fmt: skip
            out = TritonWindowNumerator.apply(*leaves, tensor(bh, dt=f32, grad=False), spec.window, window_chunk(64))
        else:
            raise ValueError(f"unknown launch set kind {spec.kind!r}")
        if out.requires_grad:
            out.backward(torch.empty_like(out))
    return calls


def record(sets: tuple[LaunchSet, ...] = LAUNCH_SETS) -> list[dict[str, Any]]:
    """Every distinct launch of ``sets`` (a launch's grid is not part of its compile)."""
    seen, launches = set(), []
    for spec in sets:
        for call in _record_set(spec):
            key = json.dumps([call["kernel"], call["args"], call["constexprs"]], sort_keys=True)
            if key not in seen:
                seen.add(key)
                launches.append(call)
    return launches


# ---- step 2: compile (the device's triton; no torch) ----


class _Dtype:
    """A dtype named like torch's. Triton's binder caches dtype -> type name by the object's hash:
    one live instance per name (``_DTYPES``), or a freed one's address could come back as another dtype."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __str__(self) -> str:
        return f"torch.{self.name}"


_DTYPES: dict[str, _Dtype] = {}


class _Tensor:
    """A tensor as Triton's binder reads it: its dtype and a 16-byte aligned address (torch's
    allocations and the ``.contiguous()`` copies the glue passes are)."""

    def __init__(self, dtype: str) -> None:
        self.dtype = _DTYPES.setdefault(dtype, _Dtype(dtype))

    @staticmethod
    def data_ptr() -> int:
        return 0


class _Sm90Driver:
    """Stands in for ``triton.runtime.driver.active`` on a machine without a GPU: it names the
    target; nothing is launched (``warmup`` only compiles)."""

    def __init__(self, arch: int) -> None:
        from triton.backends.compiler import GPUTarget

        self.target = GPUTarget("cuda", arch, 32)

    def get_current_target(self):
        return self.target

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0


def _kernel_modules(repo: Path) -> list[types.ModuleType]:
    """linear_kernels and window_kernels of ``repo``, imported without megaflex's package
    (which imports torch): the kernels import only triton and ``tuning``."""
    import importlib

    base = repo / "megaflex" / "attention" / "triton"
    for name, path in (("megaflex", None), ("megaflex.attention", None), ("megaflex.attention.triton", base)):
        if name not in sys.modules:
            module = types.ModuleType(name)
            module.__path__ = [str(path)] if path else []
            sys.modules[name] = module
    return [importlib.import_module(f"megaflex.attention.triton.{m}") for m in ("linear_kernels", "window_kernels")]


def compile_launches(launches: list[dict[str, Any]], cache_dir: Path, arch: int = 90, repo: Path = REPO) -> list[dict[str, Any]]:
    """Compile ``launches`` (``record``'s) for sm_``arch`` into ``cache_dir`` through Triton's own
    JIT path; returns (kernel, num_warps, num_stages, cache entry) per compile."""
    os.environ["TRITON_CACHE_DIR"] = str(cache_dir)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise SystemExit("warm_cache: TRITON_INTERPRET is set: the kernels would not be compiled")
    import base64

    from triton.runtime.driver import driver

    modules = _kernel_modules(repo)
    driver.set_active(_Sm90Driver(arch))
    done = []
    try:
        for launch in launches:
            tuner = next(getattr(m, launch["kernel"]) for m in modules if hasattr(m, launch["kernel"]))
            args = [_Tensor(a["tensor"]) if isinstance(a, dict) else a for a in launch["args"]]
            for compiled in tuner.warmup(*args, grid=tuple(launch["grid"]), **launch["constexprs"]):
                entry = base64.b32encode(bytes.fromhex(compiled.hash)).decode().rstrip("=")
                done.append({"set": launch["set"], "kernel": launch["kernel"], "num_warps": compiled.metadata.num_warps,
                             "num_stages": compiled.metadata.num_stages, "entry": entry})  # fmt: skip
    finally:
        driver.set_active(None)  # back to the lazily made default (reset_active would make it now: no GPU here)
    return done


# ---- on the device ----


def relocate(cache_dir: Path) -> int:
    """Rewrite the absolute paths in ``cache_dir``'s group files for where it lies now (naming only
    the files still there); the count of files rewritten."""
    count = 0
    for group in sorted(cache_dir.glob("*/__grp__*.json")):
        data = json.loads(group.read_text())
        paths = data.get("child_paths", {})
        moved = {name: str(group.parent / name) for name in paths if (group.parent / name).exists()}
        if moved != paths:
            group.write_text(json.dumps({**data, "child_paths": moved}))
            count += 1
    return count


def keep_binaries(cache_dir: Path) -> None:
    """Drop the IR a launch never reads (a cache hit loads the metadata JSON and the cubin; Triton
    keeps TTIR, TTGIR, LLIR, PTX and the source beside them, ~5x their size), then ``relocate``."""
    for path in cache_dir.glob("*/*"):
        if not path.name.startswith("__grp__") and path.suffix not in (".json", ".cubin"):
            path.unlink()
    relocate(cache_dir)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, help="the Triton cache folder to fill (created)")
    ap.add_argument("--triton-python", default=sys.executable,
                    help="interpreter holding the device's triton (same version, Python minor version) for step 2")  # fmt: skip
    ap.add_argument("--arch", type=int, default=90, help="compute capability to compile for (default 90: H100/H200)")
    ap.add_argument("--sets", nargs="+", metavar="NAME", help="only these launch sets (default: all of LAUNCH_SETS)")
    ap.add_argument("--keep-ir", action="store_true", help="keep Triton's IR files beside the cubins (~5x the size)")
    ap.add_argument("--relocate", type=Path, metavar="DIR", help="only rewrite DIR's group files for where it lies (on the device)")
    ap.add_argument("--compile", type=Path, metavar="LAUNCHES", help=argparse.SUPPRESS)  # step 2, run in --triton-python
    args = ap.parse_args(argv)
    if args.relocate:
        if not args.relocate.is_dir():
            ap.exit(2, f"warm_cache: --relocate: no folder {args.relocate}\n")
        print(f"[warm_cache] {relocate(args.relocate.resolve())} group file(s) rewritten under {args.relocate}")
        return
    if args.out is None:
        ap.exit(2, "warm_cache: --out DIR (or --relocate DIR) is required\n")
    out = args.out.resolve()
    if args.compile:
        report = compile_launches(json.loads(args.compile.read_text()), out, args.arch)
        print(json.dumps(report))
        return
    names = sorted({spec.name for spec in LAUNCH_SETS})
    unknown = sorted(set(args.sets or ()) - set(names))
    if unknown:
        ap.exit(2, f"warm_cache: --sets: unknown {', '.join(unknown)} (known: {', '.join(names)})\n")
    launches = record(tuple(spec for spec in LAUNCH_SETS if not args.sets or spec.name in args.sets))
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(launches, f)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [args.triton_python, str(Path(__file__).resolve()), "--out", str(out), "--arch", str(args.arch), "--compile", f.name]
    try:
        done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    finally:
        os.unlink(f.name)
    if done.returncode:
        sys.stderr.write(done.stdout[-2000:] + done.stderr[-4000:])
        ap.exit(1, f"warm_cache: compiling in {args.triton_python} failed (exit {done.returncode})\n")
    report = json.loads(done.stdout.strip().splitlines()[-1])
    if not args.keep_ir:
        keep_binaries(out)
    size = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    version = subprocess.run([args.triton_python, "-c", "import triton; print(triton.__version__)"], capture_output=True, text=True).stdout.strip()
    print(f"[warm_cache] {len(launches)} launches, {len(report)} compiles for sm_{args.arch} with triton {version} "
          f"in {out} ({size / 2**20:.1f} MiB)")


if __name__ == "__main__":
    main()
