"""The Triton kernels compiled ahead of time for A100 (sm_80) and H100 (sm_90) on this GPU-less
machine: every launch the dispatcher makes at every shipped config fits the target's shared
memory, the bf16 spill targets hold, and head offsets are computed in 64 bits.

Compiling needs the real (not interpreted) kernels, so it runs in subprocesses without
TRITON_INTERPRET (the test session sets it for the interpreter tests).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="triton is not installed (pip install 'megaflex[dev]' installs it)")

from megaflex.attention.triton.aot import parse_ptxas_log  # noqa: E402
from megaflex.attention.triton.tuning import SCAN_KERNELS, launch_configs  # noqa: E402

KERNELS = ("chunk_states", "chunk_outputs", "chunk_state_grads", "chunk_grads_qk", "chunk_grads_v", "trig_grads")

REPO_ROOT = Path(__file__).resolve().parents[2]
SPILL_BUDGET_BF16 = {"flexformer_n_247m": 0, "flexformer_n_41m": 0, "flexformer_n_1.3b": 1024}


def _compiler_env() -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(REPO_ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    return env


# fp16 launches are the bf16 ones with the other 2-byte type (same tiles, same shared memory, same
# mma shapes): CI compiles bf16 and fp32 only; ``python -m benchmarks.triton_aot`` (all three) writes
# the report docs/design.md cites, docs/results/triton_aot.json.
CI_DTYPES = ("bf16", "fp32")


@pytest.mark.slow
def test_every_shipped_launch_fits_shared_memory_and_meets_the_spill_targets(tmp_path):
    out = tmp_path / "aot.json"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.triton_aot", "--out", str(out), "--dtypes", *CI_DTYPES],
        cwd=REPO_ROOT, env=_compiler_env(), capture_output=True, text=True, timeout=1800,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    rows = report["kernels"]
    kernels = set(KERNELS)  # the trig maps' default path computes the features in the kernels, trig_grads their backward
    for config in ("flexformer_n_41m", "flexformer_n_247m", "flexformer_n_1.3b", "tiny"):
        for dtype in CI_DTYPES:
            for arch in (80, 90):
                used = {r["kernel"] for r in rows if f"{config}/{dtype}" in r["configs"] and r["arch"] == arch}
                assert used == kernels, (config, dtype, arch, used)
    # every config the autotuner may pick was compiled, at every (kernel, blocks, dtype, target)
    picked: dict[tuple, set] = {}
    for r in rows:
        picked.setdefault((r["kernel"], json.dumps(r["constexprs"], sort_keys=True), r["dtype"], r["arch"]), set()).add(
            (r["num_warps"], r["num_stages"])
        )
    for (kernel, constexprs, *_), configs in picked.items():
        assert json.loads(constexprs).get("TRIG", True)  # shipped configs: features computed in the kernels
        assert configs == set(launch_configs(kernel, trig=True)), (kernel, configs)
    limit = {80: 166_912, 90: 232_448}
    too_big = [(r["kernel"], r["arch"], r["configs"][0], r["shared_bytes"]) for r in rows if r["shared_bytes"] > limit[r["arch"]]]
    assert not too_big
    assert all(r["tensor_cores"] for r in rows)  # half operands (and tf32 for fp32 inputs) reach mma / wgmma
    for config, budget in SPILL_BUDGET_BF16.items():
        spills = [(r["kernel"], r["arch"], r["spill_store_bytes"]) for r in rows if f"{config}/bf16" in r["configs"]]
        assert spills and all(spilled <= budget for _, _, spilled in spills), (config, spills)


WINDOW_KERNELS = ("chunk_states", "chunk_state_grads", "window_outputs", "window_grads_q", "window_grads_k")


@pytest.mark.slow
def test_window_hybrid_launches_fit_shared_memory_without_spills(tmp_path):
    """The one-normaliser window hybrid's Triton form (``triton/window.py``) at the 247M and 1.3B
    shapes, bf16 (the training dtype; ``python -m benchmarks.triton_aot --window-only`` also compiles
    fp16 / fp32: docs/results/triton_aot_window.json): every launch, every config its autotuner may
    pick, fits sm_80 / sm_90 shared memory, reaches the tensor cores and spills nothing. Its own
    run (40 compiles), so the shipped set's checks above stay about the shipped configs."""
    out = tmp_path / "aot_window.json"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.triton_aot", "--window-only", "--out", str(out), "--dtypes", "bf16"],
        cwd=REPO_ROOT, env=_compiler_env(), capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())["kernels"]
    for config in ("flexformer_n_247m+window", "flexformer_n_1.3b+window"):
        for arch in (80, 90):
            used = {r["kernel"] for r in rows if f"{config}/bf16" in r["configs"] and r["arch"] == arch}
            assert used == set(WINDOW_KERNELS), (config, arch, used)
    picked: dict[tuple, set] = {}
    for r in rows:
        picked.setdefault((r["kernel"], json.dumps(r["constexprs"], sort_keys=True), r["arch"]), set()).add((r["num_warps"], r["num_stages"]))
    for (kernel, constexprs, _), configs in picked.items():
        assert not json.loads(constexprs).get("TRIG", False)  # features given: the map runs in torch
        assert configs == set(launch_configs(kernel, trig=False)), (kernel, configs)
    assert all(r["fits"] and r["tensor_cores"] for r in rows)
    assert [(r["kernel"], r["arch"], r["spill_store_bytes"]) for r in rows if r["spill_store_bytes"]] == []


_TTIR_PROBE = textwrap.dedent(
    """
    import json, re, sys, torch
    from megaflex.attention.triton.aot import launch_ttir, record_launches, record_window_launches
    found = {}
    for launch in record_launches(16, 16, torch.float32, 16, bh=2) + record_window_launches(16, 16, 16, torch.float32, 16, bh=2):
        ttir = launch_ttir(launch)
        pids = dict((axis, name) for name, axis in re.findall(r"(%[\\w.]+) = tt.get_program_id ([xyz]) : i32", ttir))
        found[launch.kernel] = {axis: {
            "widened": bool(re.search(re.escape(name) + r" : i32 to i64", ttir)),
            "i32_products": len(re.findall(r"arith.muli [^\\n]*" + re.escape(name) + r"\\b[^\\n]*: i32", ttir)),
        } for axis, name in pids.items()}
    json.dump(found, sys.stdout)
    """
)


@pytest.mark.slow
def test_head_offsets_are_computed_in_64_bits():
    """The batch x head program id (axis x of the scans, y of the chunk and window kernels) is sign-extended
    to i64 and never multiplied in i32: bh * N * F passes 2^31 at long context (e.g. F = 256,
    B*H = 512, N = 16k), which int32 offsets would wrap silently."""
    proc = subprocess.run(
        [sys.executable, "-c", _TTIR_PROBE], cwd=REPO_ROOT, env=_compiler_env(), capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads(proc.stdout)
    assert set(found) == {"chunk_states", "chunk_outputs", "chunk_state_grads", "chunk_grads_qk", "chunk_grads_v",
                          "window_outputs", "window_grads_q", "window_grads_k"}  # fmt: skip
    for kernel, axes in found.items():
        bh_axis = "x" if kernel in ("chunk_states", "chunk_state_grads") else "y"
        assert axes[bh_axis] == {"widened": True, "i32_products": 0}, (kernel, axes)


def test_ptxas_log_parsing_takes_registers_spills_and_stack():
    log = (
        "ptxas info    : Compiling entry function 'chunk_grads_qk' for 'sm_80'\n"
        "ptxas info    : Function properties for chunk_grads_qk\n"
        "    24 bytes stack frame, 24 bytes spill stores, 28 bytes spill loads\n"
        "ptxas info    : Used 255 registers, used 1 barriers, 412 bytes cmem[0]\n"
    )
    assert parse_ptxas_log(log) == dict(registers=255, spill_store_bytes=24, spill_load_bytes=28, stack_bytes=24)
    with pytest.raises(ValueError, match="ptxas log without"):
        parse_ptxas_log("ptxas info    : Compiling entry function 'x'\n")


_CONFIG_PROBE = textwrap.dedent(
    """
    import json, sys, torch
    from megaflex.attention.triton import linear_kernels as kernels
    from megaflex.attention.triton.aot import record_launches
    launches = record_launches(64, 32, torch.bfloat16, 64, bh=4, trig_head_dim=32)
    launches += record_launches(64, 32, torch.bfloat16, 64, bh=4)  # features given: TRIG=False
    tuners = {name: [[c.num_warps, c.num_stages] for c in getattr(kernels, name).configs] for name in sys.argv[1:]}
    json.dump({"tuners": tuners, "launches": [[l.kernel, dict(l.constexprs), l.num_warps, l.num_stages] for l in launches]}, sys.stdout)
    """
)


def test_cuda_autotunes_over_the_listed_configs_and_the_aot_records_each():
    """Compiled (not interpreted) kernels autotune over ``launch_configs``, pruned per launch to
    ``launch_configs(kernel, trig=TRIG)``; the AOT recorder turns every launch into one compile per
    config the autotuner may pick there (the trig path and the given-features path)."""
    proc = subprocess.run(
        [sys.executable, "-c", _CONFIG_PROBE, *KERNELS], cwd=REPO_ROOT, env=_compiler_env(), capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads(proc.stdout)
    for kernel in KERNELS:
        assert [tuple(c) for c in found["tuners"][kernel]] == launch_configs(kernel), kernel
    recorded: dict[tuple, set] = {}
    for kernel, constexprs, warps, stages in found["launches"]:
        recorded.setdefault((kernel, json.dumps(constexprs, sort_keys=True)), set()).add((warps, stages))
    assert {kernel for kernel, _ in recorded} == set(KERNELS)
    trig_flags = {json.loads(constexprs).get("TRIG") for kernel, constexprs in recorded if kernel != "trig_grads"}
    assert trig_flags == {True, False}
    for (kernel, constexprs), configs in recorded.items():
        assert configs == set(launch_configs(kernel, trig=json.loads(constexprs).get("TRIG")))
    assert any(len(launch_configs(kernel, trig=trig)) > 1 for kernel in KERNELS for trig in (True, False))  # tuned on CUDA
    # the TRIG subsets differ from the plain lists (else the pruning would be dead code)
    assert any(launch_configs(kernel, trig=True) != launch_configs(kernel, trig=False) for kernel in KERNELS)


def test_interpreter_runs_one_fixed_config_per_kernel():
    """Under TRITON_INTERPRET=1 (the test session's) the autotuners hold one config: the first listed."""
    from megaflex.attention.triton import interpreter_enabled, window_kernels
    from megaflex.attention.triton import linear_kernels as kernels

    if not interpreter_enabled():
        pytest.skip("the session runs without TRITON_INTERPRET=1")

    for kernel in KERNELS + WINDOW_KERNELS:
        assert launch_configs(kernel, interpreted=True) == launch_configs(kernel)[:1]
        tuner = getattr(kernels, kernel, None) or getattr(window_kernels, kernel)
        assert [(c.num_warps, c.num_stages) for c in tuner.configs] == launch_configs(kernel)[:1]
    assert set(SCAN_KERNELS) < set(KERNELS)
