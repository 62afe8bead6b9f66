"""Exact resume, crash safety and non-finite skipping of the real trainer (multi-process, CPU).

Each test launches ``python -m megaflex.train`` processes (gloo ranks) on the tiny config of
``training_harness`` and reads the run's metrics.jsonl and checkpoint folder.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from megaflex.checkpoint import complete_tags
from megaflex.training.metrics import read_metrics
from training_harness import TINY, assert_train_losses_close, launch, logged_train_steps, write_config

pytestmark = pytest.mark.slow

# Every pair of (ZeRO stage, precision, TP-vs-DP layout) values appears in one of four runs (an
# L4 orthogonal array over the 2 x 2 x 2 grid): half the launches of the full grid, and an
# interaction between any two of the three settings still has its run.
GRID = [
    (1, "fp32", 1, 2),
    (1, "bf16", 2, 1),
    (3, "fp32", 2, 1),
    (3, "bf16", 1, 2),
]


def _losses(run_dir: Path, steps: range) -> dict[int, float]:
    records = read_metrics(run_dir / "metrics.jsonl")
    return {s: records[s]["loss"] for s in steps}


def _ok(result) -> None:
    assert all(rc == 0 for rc in result.returncodes), result.output


@pytest.mark.parametrize("zero,precision,tp,dp", GRID, ids=[f"zero{z}-{p}-tp{t}dp{d}" for z, p, t, d in GRID])
def test_bit_exact_resume_after_kill(tmp_path: Path, zero: int, precision: str, tp: int, dp: int) -> None:
    cfg = write_config(tmp_path / "cfg.yaml")
    common = [f"parallel.zero_stage={zero}", f"train.precision={precision}", f"parallel.tensor_parallel_size={tp}"]
    world = tp * dp

    # The killed run is the uninterrupted reference up to its kill: its logged steps 11-13 are
    # what the resumed run must reproduce bit for bit (a separate straight run adds a launch).
    crashed_dir = tmp_path / "crashed"
    killed = launch(cfg, common + [f"logging.run_dir={crashed_dir}", "fault.sigkill_after_step=13"], world)
    assert all(rc == -9 for rc in killed.returncodes), killed.output  # kill -9 of every rank
    assert "step 13/20" in killed.outputs[0], killed.output  # killed by the fault injection, not a timeout
    assert complete_tags(crashed_dir / "checkpoints") == ["step_00000010"]
    assert max(read_metrics(crashed_dir / "metrics.jsonl")) == 13  # the killed run's log is readable

    want = _losses(crashed_dir, range(11, 14))
    resumed = launch(cfg, common + [f"logging.run_dir={crashed_dir}", "checkpoint.resume=step_00000010"], world)
    _ok(resumed)
    assert "resumed from" in resumed.outputs[0] and "at step 10" in resumed.outputs[0]

    got = _losses(crashed_dir, range(11, 14))  # the resumed run's records (the latest per step)
    logged = logged_train_steps(crashed_dir)
    assert all(logged.count(s) == 2 for s in range(11, 14)) and max(logged) == 20  # both runs logged them
    assert got == want  # bit for bit: floats round-trip exactly through metrics.jsonl
    assert len(set(want.values())) > 1  # the comparison covers changing losses


@pytest.mark.parametrize("background", [False, True], ids=["synchronous", "background"])
def test_kill_during_save_keeps_previous_checkpoint(tmp_path: Path, background: bool) -> None:
    """kill -9 of every rank in the save of step 10: before its commit, or (checkpoint.background) from
    the writer thread once its first file is written, while training goes on. Nothing older is lost,
    auto resumes from step 5 bit for bit; the resumed background run's final save is waited for."""
    cfg = write_config(tmp_path / "cfg.yaml")
    run = tmp_path / "run"
    common = [f"logging.run_dir={run}", "checkpoint.save_interval=5", "train.train_iters=12", "parallel.zero_stage=1",
              f"checkpoint.background={str(background).lower()}"]
    killed = launch(cfg, common + ["fault.sigkill_during_save_at_step=10"], world_size=2)
    assert all(rc == -9 for rc in killed.returncodes), killed.output
    ckpt = run / "checkpoints"
    assert (ckpt / ".tmp-step_00000010").is_dir()  # the interrupted save's shards
    assert not (ckpt / "step_00000010").exists()
    assert (ckpt / "latest").read_text().strip() == "step_00000005"
    first = read_metrics(run / "metrics.jsonl")

    resumed = launch(cfg, common + ["checkpoint.resume=auto"], world_size=2)
    _ok(resumed)
    assert "at step 5" in resumed.outputs[0]
    again = read_metrics(run / "metrics.jsonl")
    assert [again[s]["loss"] for s in range(6, 11)] == [first[s]["loss"] for s in range(6, 11)]
    assert complete_tags(ckpt) == ["step_00000005", "step_00000010", "step_00000012"]
    assert not list(ckpt.glob(".tmp-*"))  # the next successful save cleaned up


def test_nan_loss_is_skipped_and_reported(tmp_path: Path) -> None:
    cfg = write_config(tmp_path / "cfg.yaml")
    run = tmp_path / "run"
    result = launch(cfg, [f"logging.run_dir={run}", "train.train_iters=8", "fault.nan_loss_at_steps=[4]", "parallel.zero_stage=1"], 2)
    _ok(result)
    records = read_metrics(run / "metrics.jsonl")
    assert records[4]["skipped"] is True and records[4]["nonfinite_total"] == 1
    assert "step 4: non-finite loss; step skipped" in result.outputs[0]
    assert all(not records[s]["skipped"] for s in (1, 2, 3, 5, 6, 7, 8))
    assert records[8]["nonfinite_total"] == 1
    # The skipped step left the parameters untouched: the Adam step count is 7, not 8.
    import torch

    states = torch.load(run / "checkpoints" / "step_00000008" / "zero_pp_rank_0_mp_rank_00_optim_states.pt", weights_only=False)
    base = states["optimizer_state_dict"]["base_optimizer_state"]
    steps = {float(v["step"]) for v in base["state"].values()} if isinstance(base, dict) else {float(base[0]["step"])}
    assert steps == {7.0}


def test_consecutive_nan_losses_abort(tmp_path: Path) -> None:
    cfg = write_config(tmp_path / "cfg.yaml")
    result = launch(
        cfg,
        [f"logging.run_dir={tmp_path / 'run'}", "fault.nan_loss_at_steps=[3,4,5]", "train.max_nonfinite_in_a_row=3"],
        world_size=1,
    )
    assert result.returncodes == [3], result.output
    assert "aborting at step 5: 3 consecutive steps had a non-finite loss" in result.outputs[0]


def test_an_abort_keeps_the_background_save_in_flight(tmp_path: Path) -> None:
    """The save of step 4 is still in flight when step 5 aborts the run (3 non-finite steps in a row):
    the abort is decided alike on every rank, so the run commits it before exiting 3."""
    cfg = write_config(tmp_path / "cfg.yaml")
    run = tmp_path / "run"
    result = launch(cfg, [f"logging.run_dir={run}", "fault.nan_loss_at_steps=[3,4,5]", "train.max_nonfinite_in_a_row=3",
                          "checkpoint.save_interval=4", "checkpoint.background=true"], world_size=1)
    assert result.returncodes == [3], result.output
    assert complete_tags(run / "checkpoints") == ["step_00000004"]
    assert result.outputs[0].count("saved checkpoint") == 1


@pytest.mark.numerics
def test_resume_with_different_data_parallel_size(tmp_path: Path) -> None:
    cfg = write_config(tmp_path / "cfg.yaml")
    run = tmp_path / "run"
    common = [f"logging.run_dir={run}", "parallel.zero_stage=0"]
    first = launch(cfg, common + ["fault.sigkill_after_step=10"], world_size=2)  # DP=2
    assert all(rc == -9 for rc in first.returncodes), first.output
    second = launch(cfg, common + ["checkpoint.resume=auto"], world_size=1)  # DP=1, accumulation 4
    _ok(second)
    assert "data parallel 2 -> 1" in second.outputs[0]
    records = read_metrics(run / "metrics.jsonl")
    assert [records[s]["consumed_samples"] for s in (10, 11, 20)] == [80, 88, 160]
    straight = launch(cfg, [f"logging.run_dir={tmp_path / 'straight'}", "parallel.zero_stage=0"], world_size=2)
    _ok(straight)
    want = read_metrics(tmp_path / "straight" / "metrics.jsonl")
    # Same samples in the same steps; only the reduction order differs.
    assert_train_losses_close({s: records[s]["loss"] for s in range(11, 21)}, {s: want[s]["loss"] for s in range(11, 21)},
                              ranks=2, name="DP 2 -> 1")


def test_checkpoint_with_other_model_shape_is_refused(tmp_path: Path) -> None:
    cfg = write_config(tmp_path / "cfg.yaml")
    run = tmp_path / "run"
    _ok(launch(cfg, [f"logging.run_dir={run}", "train.train_iters=4"], world_size=1))
    bigger = copy.deepcopy(TINY)
    bigger["model"]["hidden_size"] = 128
    cfg2 = write_config(tmp_path / "cfg2.yaml", bigger)
    result = launch(cfg2, [f"logging.run_dir={run}", "train.train_iters=6"], world_size=1)
    assert result.returncodes == [2], result.output
    out = result.outputs[0]
    assert "was trained with model.hidden_size=64, this run has model.hidden_size=128; its parameters do not fit (" in out
    assert "[256, 64]" in out and "[256, 128]" in out  # embedding shard shapes of both
    meta = json.loads((run / "checkpoints" / "step_00000004" / "megaflex.json").read_text())
    assert meta["config"]["model"]["hidden_size"] == 64


def test_sigterm_saves_and_stops(tmp_path: Path) -> None:
    import os
    import signal
    import subprocess
    import sys
    import time

    from training_harness import REPO, base_env

    cfg = write_config(tmp_path / "cfg.yaml")
    run = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "megaflex.train", "--config", str(cfg), f"logging.run_dir={run}",
         "train.train_iters=100000", "schedule.warmup_iters=0", "checkpoint.save_interval=0"],
        cwd=REPO, env=base_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    metrics = run / "metrics.jsonl"
    deadline = time.time() + 600
    while time.time() < deadline and proc.poll() is None:
        if metrics.is_file() and len(read_metrics(metrics)) >= 3:
            break
        time.sleep(0.2)
    os.kill(proc.pid, signal.SIGTERM)  # preemption notice
    out, _ = proc.communicate(timeout=600)
    from megaflex.training.train import EXIT_PREEMPTED

    assert proc.returncode == EXIT_PREEMPTED, out[-4000:]  # a preempted run is told apart from a finished one
    stopped = max(read_metrics(metrics))
    assert f"training stopped (signal SIGTERM) at step {stopped}" in out
    assert complete_tags(run / "checkpoints") == [f"step_{stopped:08d}"]
