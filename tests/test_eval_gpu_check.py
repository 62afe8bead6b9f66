"""``python -m evaluation.gpu_check --dry-run``: every section of the GPU acceptance script runs at
tiny sizes on CPU (kernels under Triton's interpreter, the trainer as a subprocess) and writes JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="triton is not installed (pip install 'megaflex[dev]' installs it)")

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_gpu_check_dry_run_writes_every_section(tmp_path, shared_data):
    out = tmp_path / "gpu_check.json"
    env = dict(os.environ, PYTHONPATH=str(REPO), MEGAFLEX_DATA=str(shared_data))
    proc = subprocess.run(
        [sys.executable, "-W", "ignore", "-m", "evaluation.gpu_check", "--dry-run", "--json", str(out)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["dry_run"] is True
    kernels = report["kernels"]
    assert kernels["passed"], kernels
    assert {case["dtype"] for case in kernels["cases"]} == {"fp32", "fp16"}
    assert all(set(case["errors"]) >= {"out", "dqf", "dkf", "dkls", "dv"} for case in kernels["cases"])
    layer = {(row["impl"], row["seq_len"]): row for row in report["layer"]["rows"]}
    assert layer[("flexformer_n_triton", 128)]["status"] == "ok" and layer[("flexformer_n_triton", 128)]["fwd_bwd_ms"] > 0
    assert layer[("sdpa", 128)]["status"] == "ok"
    assert layer[("fla_chunk_simple_gla", 128)]["status"] in ("not installed", "needs CUDA")
    steps = {row["model"]: row for row in report["train_step"]["rows"]}
    assert set(steps) == {"flexformer_n", "softmax"}
    for row in steps.values():
        assert "error" not in row, row
        assert row["tokens_per_s"] > 0 and row["peak_memory_mb"] > 0
    real = report["train_real"]
    assert real["passed"] and len(real["losses"]) == 20 and real["last5_mean"] < real["first5_mean"]


def test_gpu_check_refuses_to_run_without_cuda_unless_dry_run():
    if __import__("torch").cuda.is_available():
        pytest.skip("this machine has CUDA: the real run is the one to use")
    proc = subprocess.run(
        [sys.executable, "-m", "evaluation.gpu_check", "--sections", "kernels"],
        cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 2 and "no CUDA device" in proc.stderr
