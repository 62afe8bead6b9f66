"""gpu_check's trainer stage, option ``compile``: the compiled run's numbers against the eager run's
(the trainer run itself stubbed: this checks what is made of its records)."""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from benchmarks.gpu_check import stages_train  # noqa: E402
from benchmarks.gpu_check.common import Stage  # noqa: E402


def test_compiled_run_reports_speed_against_eager_and_the_compile_time_apart(monkeypatch, tmp_path) -> None:
    tokens = 32 * 1024  # per step
    seconds = {1: 40.0, 2: 7.0, 3: 2.0, 4: 2.0, 5: 2.5}  # steps 1-2 compile (forward, then a recompile)
    train, total = {}, 0
    for step, s in seconds.items():
        total += tokens
        train[step] = {"loss": 10.0, "tokens_per_s": tokens / s, "tokens": total, "memory_mb": 1.0}
    calls = []

    def fake_run_trainer(args, run_dir, stage, timeout):
        calls.append(args)
        return {"train": train, "wall_s": 60.0}

    monkeypatch.setattr(stages_train, "run_trainer", fake_run_trainer)
    stage = Stage(dry_run=True, work_dir=tmp_path, result_path=tmp_path / "r.json", options={"compile": True})
    result = stages_train.compiled_against_eager(stage, "c.yaml", [], ["train.train_iters=5"], tokens / 4.0)
    assert "train.compile=true" in calls[0]
    assert result["tokens_per_s"] == tokens / 2.0  # the median of steps 3-5
    assert result["compiled_over_eager_tokens_per_s"] == 2.0
    assert result["compile_s"] == 43.0  # 40 + 7 - 2 x 2
