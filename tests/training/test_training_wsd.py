"""The warmup-stable-decay (WSD) LR schedule: its curve, its config checks and a resume mid-decay."""

from __future__ import annotations

import copy
import math
import subprocess
import sys
from pathlib import Path

import pytest

from megaflex.training.config import ConfigError, load_config
from megaflex.training.metrics import read_metrics
from megaflex.training.optim import lr_at
from training_harness import REPO, TINY, launch, write_config

SHAPES = {
    "linear": lambda p: 1.0 - p,
    "cosine": lambda p: 0.5 * (1.0 + math.cos(math.pi * p)),
    "1-sqrt": lambda p: 1.0 - math.sqrt(p),
}


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_wsd_warms_up_holds_then_decays_by_its_shape(tmp_path: Path, shape: str) -> None:
    peak, floor, warmup, total, fraction = 2.0, 0.2, 4, 40, 0.25
    cfg = load_config([write_config(tmp_path / "cfg.yaml")], [
        f"train.lr={peak}", f"train.train_iters={total}", f"schedule.warmup_iters={warmup}", f"schedule.min_lr={floor}",
        "schedule.decay_style=wsd", f"schedule.wsd_decay_fraction={fraction}", f"schedule.wsd_decay_shape={shape}",
    ])
    decay_len = round(fraction * total)
    first = total - decay_len
    assert [lr_at(cfg, i) for i in range(warmup)] == [peak * (i + 1) / warmup for i in range(warmup)]
    assert {lr_at(cfg, i) for i in range(warmup, first)} == {peak}  # the stable phase
    for i in (first, first + 3, first + decay_len // 2, total - 1):
        assert lr_at(cfg, i) == pytest.approx(floor + SHAPES[shape]((i - first) / decay_len) * (peak - floor), rel=1e-12)
    assert lr_at(cfg, total) == floor and lr_at(cfg, total + 5) == floor
    middle = [lr_at(cfg, i) for i in range(first, total)]
    assert middle == sorted(middle, reverse=True) and len(set(middle)) == decay_len  # strictly falling


@pytest.mark.parametrize("overrides,needle", [
    (["schedule.decay_style=wsd", "schedule.wsd_decay_fraction=0"], "expected a finite float in (0, 1]"),
    (["schedule.decay_style=wsd", "schedule.wsd_decay_fraction=1.5"], "expected a finite float in (0, 1]"),
    (["schedule.decay_style=wsd", "schedule.wsd_decay_fraction=0.01"], "rounds to no decay step"),
    (["schedule.decay_style=wsd", "schedule.wsd_decay_fraction=0.9"], "overlaps the warmup (schedule.warmup_iters=3)"),
    (["schedule.decay_style=wsd", "schedule.wsd_decay_shape=exp"], "expected one of 'cosine', 'linear', '1-sqrt'"),
    (["schedule.wsd_decay_fraction=0.5"], "only used with schedule.decay_style=wsd, got decay_style='cosine'"),
])
def test_wsd_config_errors_name_the_key(tmp_path: Path, overrides: list[str], needle: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config([write_config(tmp_path / "cfg.yaml")], overrides)
    assert needle in str(err.value) and "schedule.wsd_decay_" in str(err.value)


@pytest.mark.usefixtures("forked_python")
def test_wsd_config_error_is_one_line_and_exit_2(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "megaflex.train", "--config", str(write_config(tmp_path / "cfg.yaml")),
         "schedule.decay_style=wsd", "schedule.wsd_decay_fraction=0.9", f"logging.run_dir={tmp_path / 'run'}"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr[-3000:]
    assert "config error: schedule.wsd_decay_fraction (from command line): the decay" in out.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_wsd_resume_mid_decay_is_bit_exact(tmp_path: Path) -> None:
    """A run resumed from a checkpoint inside the decay repeats the uninterrupted run's LRs and losses."""
    data = copy.deepcopy(TINY)
    data["train"]["train_iters"] = 16
    data["schedule"] = {"warmup_iters": 2, "decay_style": "wsd", "wsd_decay_fraction": 0.5, "min_lr": 1e-4}
    data["checkpoint"] = {"save_interval": 10, "keep_last": 5}  # step 10: 2 steps into the decay (8..16)
    data["logging"]["kernel_stats_interval"] = 0
    cfg, run_dir = write_config(tmp_path / "cfg.yaml", data), tmp_path / "run"
    straight = launch(cfg, [f"logging.run_dir={run_dir}"])
    assert straight.returncodes == [0], straight.output
    want = read_metrics(run_dir / "metrics.jsonl")
    resumed = launch(cfg, [f"logging.run_dir={run_dir}", "checkpoint.resume=step_00000010"])
    assert resumed.returncodes == [0] and "at step 10" in resumed.outputs[0], resumed.output
    got = read_metrics(run_dir / "metrics.jsonl")  # the resumed run appended steps 11..16: the last records win
    steps = range(11, 17)
    assert [(got[s]["lr"], got[s]["loss"]) for s in steps] == [(want[s]["lr"], want[s]["loss"]) for s in steps]
    # step s logs the LR of iteration s - 1: the decay runs over iterations 8..15, i.e. steps 9..16
    lrs = [want[s]["lr"] for s in range(9, 17)]
    assert lrs == sorted(lrs, reverse=True) and len(set(lrs)) == len(lrs)  # the compared steps are in the decay
    assert {want[s]["lr"] for s in range(2, 10)} == {TINY["train"]["lr"]}  # stable before it
