"""``python -m benchmarks.lra_listops`` at a tiny shape: one run per (kind, seed) stored as it
finishes, a stopped benchmark resumes without retraining, the report holds every run, a stored run
is reused only when its settings and data match (fingerprint), and the default output is outside
the repository."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.lra_listops import LRA_ANCHORS, main
from data_prep.listops import ListOpsConfig, generate

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


def test_a_stored_run_is_reused_only_for_the_same_settings_and_data(tmp_path, capsys):
    """Other steps, other data at the same path, or a row without a fingerprint: retrained, and the
    report's header and its numbers come from the same runs."""
    data = tmp_path / "listops"
    _generate(data, seed=0)
    out = tmp_path / "out"
    args = ["--data", str(data), "--out", str(out), "--kinds", "softmax", "--seeds", "1", *TINY]
    assert main(args) == 0
    run = out / "runs" / "softmax_s1.json"

    def stamp() -> int:
        return run.stat().st_mtime_ns

    first = stamp()
    assert main(args) == 0 and stamp() == first  # the same settings and data: reused
    assert main(args[:-1] + ["2"]) == 0 and stamp() != first  # --eval-examples 2: retrained
    stored = json.loads(run.read_text())
    assert stored["fingerprint"]["settings"]["eval_examples"] == 2 and stored["row"]["config"]["eval_examples"] == 2
    report = json.loads((out / "results.json").read_text())
    assert report["config"]["eval_examples"] == 2 and [r["config"]["eval_examples"] for r in report["runs"]] == [2]
    second = stamp()
    _generate(data, seed=1, overwrite=True)  # other data at the same path
    assert main(args[:-1] + ["2"]) == 0 and stamp() != second
    assert "stored with other settings or data; it will be retrained" in capsys.readouterr().out
    run.write_text(json.dumps(json.loads(run.read_text())["row"]))  # the format before fingerprints
    third = stamp()
    assert main(args[:-1] + ["2"]) == 0 and stamp() != third and "no fingerprint" in capsys.readouterr().out


def test_the_default_out_is_outside_the_repository(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    data = tmp_path / "listops"
    _generate(data, seed=0)
    assert main(["--data", str(data), "--kinds", "cosformer", "--seeds", "3", *TINY]) == 0
    out = tmp_path / "cache" / "megaflex" / "lra_listops"
    assert (out / "runs" / "cosformer_s3.json").is_file() and (out / "results.md").is_file()


def test_arguments_that_cannot_work_are_refused_while_parsing(tmp_path, capsys):
    for flag, value in (("--steps", "0"), ("--lr", "nan"), ("--kinds", "softmax,nope"), ("--seeds", "a"),
                        ("--out", str(Path(__file__)))):  # fmt: skip
        with pytest.raises(SystemExit) as stop:
            main(["--data", str(tmp_path), flag, value])
        assert stop.value.code == 2 and f"argument {flag}" in capsys.readouterr().err
    assert main(["--data", str(tmp_path), "--out", str(tmp_path / "out")]) == 2
    assert "missing" in capsys.readouterr().err


def _generate(data: Path, seed: int, overwrite: bool = False) -> None:
    generate(ListOpsConfig(out=str(data), train=32, valid=8, test=8, min_length=10, max_length=30, seed=seed,
                           progress=False, overwrite=overwrite))  # fmt: skip
