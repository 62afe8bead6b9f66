"""Training with context parallelism under the real launcher (separate ``megaflex.train`` processes).

CP=2 on 2 gloo ranks: a kill -9 mid-run and ``checkpoint.resume=auto`` continue the loss curve bit
for bit (ZeRO 0 and 1); the same checkpoint resumed with CP=1 x DP=2 on 2 ranks (the same DP x CP
count, so ZeRO shards load as saved) and with CP=1 on one rank continues with equal losses (CP
holds no state of its own; only the reduction order differs). At ZeRO 1 the one-rank resume
changes the DP x CP count: it is refused with ``checkpoint.zero_universal_resume=false`` and
otherwise goes through DeepSpeed's universal checkpoint (converted once, repartitioned).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from megaflex.training.checkpoint import complete_tags
from megaflex.training.metrics import read_metrics
from training_harness import launch, write_config

pytestmark = pytest.mark.slow


def _losses(run_dir: Path, steps: range) -> dict[int, float]:
    records = read_metrics(run_dir / "metrics.jsonl")
    return {s: records[s]["loss"] for s in steps}


def _ok(result) -> None:
    assert all(rc == 0 for rc in result.returncodes), result.output


@pytest.mark.parametrize("zero", [0, 1])
def test_cp2_kill_resume_is_bit_exact_and_cp1_resume_matches(tmp_path: Path, zero: int) -> None:
    cfg = write_config(tmp_path / "cfg.yaml")
    cp2 = [f"parallel.zero_stage={zero}", "parallel.context_parallel_size=2"]

    straight = launch(cfg, cp2 + [f"logging.run_dir={tmp_path / 'straight'}"], world_size=2)
    _ok(straight)
    assert "TP 1 x CP 2 x DP 1" in straight.outputs[0]

    crashed = tmp_path / "crashed"
    killed = launch(cfg, cp2 + [f"logging.run_dir={crashed}", "fault.sigkill_after_step=13"], world_size=2)
    assert all(rc == -9 for rc in killed.returncodes), killed.output
    assert complete_tags(crashed / "checkpoints") == ["step_00000010"]
    other, same_count = tmp_path / "resumed_cp1", tmp_path / "resumed_cp1_dp2"
    shutil.copytree(crashed, other)
    shutil.copytree(crashed, same_count)

    resumed = launch(cfg, cp2 + [f"logging.run_dir={crashed}", "checkpoint.resume=auto"], world_size=2)
    _ok(resumed)
    assert "at step 10" in resumed.outputs[0]
    want = _losses(tmp_path / "straight", range(11, 21))
    assert _losses(crashed, range(11, 21)) == want  # bit for bit
    assert len(set(want.values())) > 1

    # CP=2 x DP=1 -> CP=1 x DP=2: the same DP x CP count, so the ZeRO shards load as saved.
    cp1 = [f"parallel.zero_stage={zero}", "parallel.context_parallel_size=1"]
    dp2 = launch(cfg, cp1 + [f"logging.run_dir={same_count}", "checkpoint.resume=auto"], world_size=2)
    _ok(dp2)
    assert "at step 10" in dp2.outputs[0] and "TP 1 x CP 1 x DP 2" in dp2.outputs[0]
    got = _losses(same_count, range(11, 21))
    for step, loss in want.items():
        assert abs(got[step] - loss) <= 1e-5, (step, got[step], loss)

    if zero > 0:  # DP x CP 2 -> 1: ZeRO shards must be repartitioned (through the universal copy) or refused
        refused = launch(cfg, cp1 + [f"logging.run_dir={other}", "checkpoint.resume=auto",
                                     "checkpoint.zero_universal_resume=false"], world_size=1)
        assert refused.returncodes == [2], refused.output
        assert "partitioned over DP 1 x CP 2 = 2 ranks, this run has DP 1 x CP 1 = 1" in refused.outputs[0]
        assert not (other / "checkpoints" / "universal").exists()
    single = launch(cfg, cp1 + [f"logging.run_dir={other}", "checkpoint.resume=auto"], world_size=1)
    _ok(single)
    assert "at step 10" in single.outputs[0] and "TP 1 x CP 1 x DP 1" in single.outputs[0]
    assert ("through its universal copy" in single.outputs[0]) == (zero > 0)
    got = _losses(other, range(11, 21))
    for step, loss in want.items():
        assert abs(got[step] - loss) <= 1e-5, (step, got[step], loss)
