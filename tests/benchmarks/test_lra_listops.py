"""``python -m benchmarks.lra_listops`` at a tiny shape: one run per (kind, seed) stored as it
finishes, a stopped benchmark resumes without retraining, and the report holds every run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from benchmarks.lra_listops import LRA_ANCHORS, main

REPO = Path(__file__).resolve().parents[2]
TINY = ["--num-layers", "1", "--hidden-size", "16", "--num-heads", "2", "--ffn-hidden-size", "32", "--feature-dim",
        "8", "--steps", "4", "--batch-size", "8", "--warmup", "1", "--eval-every", "2", "--eval-examples", "8"]  # fmt: skip


def test_runs_are_stored_resumed_and_reported(tmp_path):
    data = tmp_path / "listops"
    subprocess.run([sys.executable, "-m", "data_prep.listops", "--out", str(data), "--train", "32", "--valid", "8",
                    "--test", "8", "--min-length", "10", "--max-length", "30", "--no-progress"],
                   cwd=REPO, check=True, capture_output=True, timeout=120)  # fmt: skip
    out = tmp_path / "out"
    args = ["--data", str(data), "--out", str(out), "--kinds", "softmax,cosformer", "--seeds", "1,2", *TINY]
    assert main(args) == 0
    runs = sorted(p.name for p in (out / "runs").iterdir())
    assert runs == ["cosformer_s1.json", "cosformer_s2.json", "softmax_s1.json", "softmax_s2.json"]
    report = json.loads((out / "results.json").read_text())
    assert report["lra_anchors"] == LRA_ANCHORS and len(report["runs"]) == 4
    softmax = report["summary"]["softmax"]
    assert softmax["seeds"] == 2 and softmax["test_accuracy"] == [100 * r["test_accuracy"] for r in report["runs"]
                                                                   if r["config"]["attention"] == "softmax"]  # fmt: skip
    (out / "runs" / "softmax_s2.json").unlink()  # a stopped benchmark: only this run is trained again
    before = {p.name: p.stat().st_mtime_ns for p in (out / "runs").iterdir()}
    assert main(args) == 0
    after = {p.name: p.stat().st_mtime_ns for p in (out / "runs").iterdir()}
    assert {k: v for k, v in after.items() if k in before} == before and "softmax_s2.json" in after
    assert "| softmax | 2 |" in (out / "results.md").read_text()
