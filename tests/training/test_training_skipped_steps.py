"""Steps DeepSpeed discards (bf16/fp16 gradient overflow) are seen and counted (issue 20, finding 4).

DeepSpeed leaves ``get_global_grad_norm()`` stale when it skips, so the trainer reads
``engine.skipped_steps`` before and after the step; a skip counts toward
``train.max_nonfinite_in_a_row`` like a non-finite loss.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from megaflex.training.metrics import read_metrics
from megaflex.training.trainer import NonFiniteAbort, NonFiniteGuard, engine_skipped_steps, skip_reason
from training_harness import launch, write_config


class FakeEngine:
    """DeepSpeed's counter without DeepSpeed: ``step(overflow)`` discards the update on overflow."""

    def __init__(self) -> None:
        self.skipped_steps = 0

    def step(self, overflow: bool) -> None:
        self.skipped_steps += int(overflow)


def test_engine_skips_count_toward_the_limit() -> None:
    engine, guard, lines = FakeEngine(), NonFiniteGuard(limit=3), []
    for iteration, overflow in enumerate([False, True, False, True, True], start=1):
        before = engine_skipped_steps(engine)
        engine.step(overflow)
        reason = skip_reason(False, engine_skipped_steps(engine) > before, False)
        lines.append(guard.record(iteration, reason))
    assert lines[1] == "step 2: gradient overflow (DeepSpeed skipped the update); step skipped (1 in a row, 1 in total)"
    assert lines[2] == "" and guard.total == 3 and guard.in_a_row == 2
    before = engine_skipped_steps(engine)
    engine.step(True)
    with pytest.raises(NonFiniteAbort, match="aborting at step 6: 3 consecutive steps"):
        guard.record(6, skip_reason(False, engine_skipped_steps(engine) > before, False))


def test_skip_reason_names_the_cause() -> None:
    assert skip_reason(False, False, False) is None
    assert skip_reason(True, True, True) == "non-finite loss"  # the loss is the most telling
    assert skip_reason(False, False, True) == "non-finite gradient norm"
    assert engine_skipped_steps(object()) == 0  # an engine without the counter never skips


@pytest.mark.slow
def test_bf16_overflow_is_skipped_counted_and_aborts(tmp_path: Path) -> None:
    cfg = write_config(tmp_path / "cfg.yaml")
    run = tmp_path / "run"
    result = launch(cfg, [
        f"logging.run_dir={run}", "train.train_iters=8", "train.precision=bf16", "parallel.zero_stage=1",
        "fault.inf_grad_at_steps=[3,5,6,7]", "train.max_nonfinite_in_a_row=3", "checkpoint.save_interval=0",
        "logging.kernel_stats_interval=0",
    ], world_size=1)
    assert result.returncodes == [3], result.output  # EXIT_NONFINITE
    out = result.outputs[0]
    assert "step 3: gradient overflow (DeepSpeed skipped the update); step skipped (1 in a row, 1 in total)" in out
    assert "aborting at step 7: 3 consecutive steps had a non-finite loss or gradient" in out
    records = read_metrics(run / "metrics.jsonl")
    assert records[3]["skipped"] and records[3]["nonfinite_total"] == 1 and records[3]["loss"] < 10  # finite loss
    assert not records[4]["skipped"] and records[6]["nonfinite_total"] == 3
