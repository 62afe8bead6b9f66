"""Training with context parallelism under the real launcher (separate ``megaflex.train`` processes).

CP=2 on 2 gloo ranks: a kill -9 mid-run and ``checkpoint.resume=auto`` continue the loss curve bit
for bit (ZeRO 0 and 1); the same checkpoint resumed with CP=1 x DP=2 on 2 ranks (the same DP x CP
count, so ZeRO shards load as saved) and with CP=1 on one rank continues with the same losses
within rounding (tests/numerics.py; CP holds no state of its own, only the reduction order
differs). At ZeRO 1 the one-rank resume changes the DP x CP count: it is refused with
``checkpoint.zero_universal_resume=false`` (and otherwise goes through DeepSpeed's universal
checkpoint, converted once, repartitioned: checked at ZeRO 2, which runs ZeRO 1's DeepSpeed
optimizer and conversion, below).

ZeRO 2 and 3 (fp32): CP=2 on 2 ranks equals CP=1 on one rank step by step on a learnable data
set, and their checkpoints resume at CP=1 on one rank (universal copy) with the same losses. bf16
at ZeRO 2 trains under CP=2.
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest

from megaflex.checkpoint import complete_tags
from megaflex.training.metrics import read_metrics
from training_harness import assert_train_losses_close, launch, logged_train_steps, write_config, write_pattern_data

pytestmark = pytest.mark.slow


def _losses(run_dir: Path, steps: range) -> dict[int, float]:
    records = read_metrics(run_dir / "metrics.jsonl")
    return {s: records[s]["loss"] for s in steps}


def _ok(result) -> None:
    assert all(rc == 0 for rc in result.returncodes), result.output


@pytest.mark.numerics
@pytest.mark.parametrize("zero", [0, 1])
def test_cp2_kill_resume_is_bit_exact_and_cp1_resume_matches(tmp_path: Path, zero: int) -> None:
    cfg = write_config(tmp_path / "cfg.yaml")
    # 7 steps, a checkpoint at step 4, the kill after step 6; one validation batch at the end
    steps = ["train.train_iters=7", "checkpoint.save_interval=4", "train.eval_iters=1"]
    cp2 = [f"parallel.zero_stage={zero}", "parallel.context_parallel_size=2", *steps]
    crashed = tmp_path / "crashed"
    killed = launch(cfg, cp2 + [f"logging.run_dir={crashed}", "fault.sigkill_after_step=6"], world_size=2)
    assert all(rc == -9 for rc in killed.returncodes), killed.output
    assert "TP 1 x CP 2 x PP 1 x DP 1" in killed.outputs[0]
    before_kill = _losses(crashed, range(5, 7))  # the uninterrupted trajectory up to the kill
    assert complete_tags(crashed / "checkpoints") == ["step_00000004"]
    other, same_count = tmp_path / "resumed_cp1", tmp_path / "resumed_cp1_dp2"
    shutil.copytree(crashed, other)
    shutil.copytree(crashed, same_count)

    resume = ["checkpoint.resume=auto", "checkpoint.save_at_end=false"]  # no resumed run's checkpoint is read
    resumed = launch(cfg, cp2 + resume + [f"logging.run_dir={crashed}"], world_size=2)
    _ok(resumed)
    assert "at step 4" in resumed.outputs[0]
    want = _losses(crashed, range(5, 8))  # the resumed run's records (the latest per step)
    logged = logged_train_steps(crashed)
    assert all(logged.count(s) == 2 for s in range(5, 7)) and max(logged) == 7  # both runs logged them
    assert {s: want[s] for s in range(5, 7)} == before_kill  # bit for bit
    assert len(set(want.values())) > 1

    # CP=2 x DP=1 -> CP=1 x DP=2: the same DP x CP count, so the ZeRO shards load as saved.
    cp1 = [f"parallel.zero_stage={zero}", "parallel.context_parallel_size=1", *steps, *resume]
    dp2 = launch(cfg, cp1 + [f"logging.run_dir={same_count}"], world_size=2)
    _ok(dp2)
    assert "at step 4" in dp2.outputs[0] and "TP 1 x CP 1 x PP 1 x DP 2" in dp2.outputs[0]
    assert_train_losses_close(_losses(same_count, range(5, 8)), want, ranks=2, name="CP 1 x DP 2")

    if zero > 0:  # DP x CP 2 -> 1: ZeRO shards must be repartitioned (through the universal copy) or refused
        refused = launch(cfg, cp1 + [f"logging.run_dir={other}", "checkpoint.zero_universal_resume=false"],
                         world_size=1)
        assert refused.returncodes == [2], refused.output
        assert "partitioned over DP 1 x CP 2 = 2 ranks, this run has DP 1 x CP 1 = 1" in refused.outputs[0]
        assert not (other / "checkpoints" / "universal").exists()
        # Resuming through the universal copy: test_cp2_at_zero_2_and_3_... at ZeRO 2 (ZeRO 1's optimizer,
        # DeepSpeed's stage-1/2 one, and its conversion), with one less launch here.
        return
    single = launch(cfg, cp1 + [f"logging.run_dir={other}"], world_size=1)
    _ok(single)
    assert "at step 4" in single.outputs[0] and "TP 1 x CP 1 x PP 1 x DP 1" in single.outputs[0]
    assert "through its universal copy" not in single.outputs[0]  # ZeRO 0: nothing to repartition
    assert_train_losses_close(_losses(other, range(5, 8)), want, ranks=2, name="CP 1 on one rank")


@pytest.fixture(scope="module")
def pattern_data(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    return write_pattern_data(tmp_path_factory.mktemp("pattern"))


@pytest.mark.numerics
@pytest.mark.parametrize("zero", [2, 3])
def test_cp2_at_zero_2_and_3_equals_cp1_and_resumes_on_another_world(tmp_path: Path, pattern_data: list[str],
                                                                       zero: int) -> None:
    cfg = write_config(tmp_path / "cfg.yaml")
    common = pattern_data + [f"parallel.zero_stage={zero}", "train.train_iters=8", "checkpoint.save_interval=4"]
    no_saves = ["checkpoint.save_interval=0", "checkpoint.save_at_end=false"]  # in the runs no one resumes
    cp1_dir, cp2_dir = tmp_path / "cp1", tmp_path / "cp2"
    cp1 = launch(cfg, common + no_saves + ["parallel.context_parallel_size=1", f"logging.run_dir={cp1_dir}"],
                 world_size=1)
    _ok(cp1)
    killed = launch(cfg, common + ["parallel.context_parallel_size=2", f"logging.run_dir={cp2_dir}",
                                   "fault.sigkill_after_step=5"], world_size=2)
    assert all(rc == -9 for rc in killed.returncodes), killed.output
    assert "TP 1 x CP 2 x PP 1 x DP 1" in killed.outputs[0] and f"ZeRO {zero}" in killed.outputs[0]
    want = _losses(cp1_dir, range(1, 9))
    assert want[8] < want[1] - 0.2  # the model learns: the comparison is not between two flat curves
    # the same global batches; only the reduction order differs
    assert_train_losses_close(_losses(cp2_dir, range(1, 6)), {s: want[s] for s in range(1, 6)}, ranks=2, name="CP 2")

    # Its step-4 checkpoint (ZeRO shards over DP x CP = 2) resumed with CP=1 on one rank.
    resumed = launch(cfg, common + no_saves + ["parallel.context_parallel_size=1", f"logging.run_dir={cp2_dir}"],
                     world_size=1)
    _ok(resumed)
    assert "at step 4" in resumed.outputs[0] and "through its universal copy" in resumed.outputs[0]
    assert_train_losses_close(_losses(cp2_dir, range(5, 9)), {s: want[s] for s in range(5, 9)}, ranks=2, name="resumed")


def test_bf16_at_zero_2_trains_under_cp2(tmp_path: Path, pattern_data: list[str]) -> None:
    cfg = write_config(tmp_path / "cfg.yaml")
    run = tmp_path / "bf16"
    result = launch(cfg, pattern_data + [
        "parallel.zero_stage=2", "parallel.context_parallel_size=2", "train.precision=bf16", "train.train_iters=8",
        "checkpoint.save_interval=0", "checkpoint.save_at_end=false", f"logging.run_dir={run}",
    ], world_size=2)
    _ok(result)
    assert "CP 2" in result.outputs[0] and "bf16" in result.outputs[0]
    records = read_metrics(run / "metrics.jsonl")
    losses = [records[s]["loss"] for s in range(1, 9)]
    assert all(math.isfinite(x) for x in losses) and not any(records[s]["skipped"] for s in range(1, 9))
    assert losses[-1] < losses[0] - 0.2, losses
