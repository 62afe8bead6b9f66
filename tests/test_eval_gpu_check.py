"""``python -m evaluation.gpu_check --dry-run``: every stage of the one-call GPU acceptance runs at tiny
shapes on CPU (kernels under Triton's interpreter, the real trainer as subprocesses) and writes its
fields into the JSON report."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="triton is not installed (pip install 'megaflex[dev]' installs it)")

from evaluation.gpu_check.__main__ import STAGES  # noqa: E402
from evaluation.gpu_check.profile_summary import category  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.timeout(1500)  # seven stages in subprocesses, about 5 minutes on 2 loaded cores
@pytest.mark.usefixtures("forked_python")  # its stages and their training runs: forked, not fresh interpreters
def test_gpu_check_dry_run_runs_every_stage(tmp_path):
    from evaluation.gpu_check.__main__ import main

    status = main(["--dry-run", "--out", str(tmp_path)])
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert status == 0, {name: stage.get("log_tail", stage.get("error")) for name, stage in report["stages"].items()}
    stages = report["stages"]
    assert report["dry_run"] is True and list(stages) == list(STAGES)  # every stage, most telling first
    assert all(s["stage_status"] == "ok" and s["seconds"] > 0 for s in stages.values()), stages

    env_stage = stages["environment"]
    assert env_stage["versions"]["torch"] and env_stage["triton_imported"]["version"]
    assert Path(env_stage["triton_imported"]["path"]).exists()
    assert "passed" in env_stage["pip_check"] and "cuda_available" in env_stage

    flex = stages["trainer_247m"]
    assert flex["tokens_per_s"] > 0 and flex["peak_memory_mb"] > 0 and flex["skipped_steps"] == 0
    assert sorted(int(s) for s in flex["losses"]) == list(range(1, 13))
    assert flex["checkpoints"] == ["step_00000010"]
    assert flex["resume"]["steps_run"] == [11, 12] and flex["resume"]["passed"], flex["resume"]
    profile = flex["profile_steps_6_8"]
    assert profile["steps"] == 3 and profile["ms_per_step"]["gemm"] > 0 and profile["ms_per_step"]["attention"] > 0
    assert profile["attention_kernels_ms_per_step"] and "dtoh_copies_per_step" in profile
    assert profile["item_reads_per_step"] >= 0

    softmax = stages["softmax_247m"]
    assert softmax["tokens_per_s"] > 0
    assert softmax["flexformer_over_softmax_tokens_per_s"] == pytest.approx(flex["tokens_per_s"] / softmax["tokens_per_s"], rel=1e-3)

    sweep = stages["kernel_sweep"]
    rows = {(r["impl"], r["N"]): r for r in sweep["rows"]}
    for impl in ("flexformer_kernel", "flexformer_trig", "sdpa"):
        assert rows[(impl, 64)]["status"] == "ok" and rows[(impl, 64)]["fwd_bwd_ms"] > 0, rows
    assert rows[("fla_chunk_simple_gla", 64)]["status"] in ("not installed", "needs CUDA")
    probe = sweep["int32_probe"]
    assert probe["passed"] and probe["elements"] == probe["B"] * probe["H"] * probe["N"] * probe["F"]
    assert "status" in sweep["aot_report"]

    precision = stages["precision_41m"]
    for name in ("fp32", "bf16"):
        run = precision["runs"][name]
        assert run["final_loss"] < run["first_loss"], run  # learnable tokens: the loss falls
        assert len(run["tau_mean_by_step"]) >= 2
    assert "final_loss_gap_bf16_minus_fp32" in precision
    accum = precision["runs"]["bf16_fp32_accum"]
    assert accum == {"skipped": "dry run: config checked, not trained"}  # the GPU run trains it

    accuracy = stages["kernel_accuracy"]
    assert accuracy["passed"] and {c["dtype"] for c in accuracy["cases"]} == {"fp32", "fp16"}

    window = stages["window_kernels"]
    assert window["passed"] and {c["dtype"] for c in window["cases"]} == {"fp32", "fp16"}
    assert {r["impl"] for r in window["speed"] if r["status"] == "ok"} == {"triton", "torch"}


def test_profile_categories():
    assert category("sm90_xmma_gemm_bf16bf16_bf16f32") == "gemm" and category("aten::baddbmm_") == "gemm"
    assert category("chunk_grads") == "attention" and category("flash_fwd_kernel") == "attention"
    assert category("_TrigFeatureMapBackward") == "feature_maps" and category("aten::cos") == "feature_maps"
    assert category("aten::copy_") == "other"


def test_gpu_check_refuses_to_run_without_cuda_unless_dry_run():
    if __import__("torch").cuda.is_available():
        pytest.skip("this machine has CUDA: the real run is the one to use")
    proc = subprocess.run(
        [sys.executable, "-m", "evaluation.gpu_check", "--stages", "environment"],
        cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 2 and "no usable CUDA device" in proc.stderr
