"""The trainer with kernel LR groups: kernel statistics in metrics.jsonl, group checks on resume."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

from megaflex.training.metrics import read_metrics
from training_harness import TINY, launch, write_config

pytestmark = pytest.mark.slow


def test_kernel_records_and_resume_with_other_groups_is_a_clear_error(tmp_path: Path) -> None:
    data = copy.deepcopy(TINY)
    data["train"]["train_iters"] = 10
    cfg = write_config(tmp_path / "cfg.yaml", data)
    run_dir = tmp_path / "run"
    fast = ["optimizer.kernel_frequency_lr_multiplier=30", "optimizer.kernel_temperature_lr_multiplier=30",
            "parallel.zero_stage=0", f"logging.run_dir={run_dir}"]
    first = launch(cfg, fast)
    assert first.returncodes == [0], first.output
    assert "kernel_frequencies 4 at lr x 30" in first.outputs[0]  # 2 layers x (omega1, omega2)
    kernel = read_metrics(run_dir / "metrics.jsonl", "kernel")
    assert sorted(kernel) == [5, 10]  # logging.kernel_stats_interval = 5
    last = kernel[10]
    assert last["layer01/omega1_rel_change"] > kernel[5]["layer01/omega1_rel_change"] > 0
    assert 1.0 <= last["layer00/effective_keys"] <= 64 and 0.0 <= last["layer00/negative_fraction"] <= 1.0
    assert (run_dir / "kernel_init_tp0.pt").is_file()

    data["train"]["train_iters"] = 12
    write_config(cfg, data)
    plain = launch(cfg, ["parallel.zero_stage=0", f"logging.run_dir={run_dir}", "checkpoint.resume=auto",
                         "optimizer.kernel_frequency_lr_multiplier=1", "optimizer.kernel_temperature_lr_multiplier=1"])
    assert plain.returncodes != [0]
    assert "optimizer param groups" in plain.outputs[0] and "kernel_frequency" in plain.outputs[0], plain.output
