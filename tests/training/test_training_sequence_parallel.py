"""Training with sequence parallelism under the real deepspeed launcher (``deepspeed --num_gpus 2``;
the reference run without it on the test's own launcher of 2 ranks).

TP=2 on 2 CPU ranks with 4 micro-batches accumulated per step: ``parallel.sequence_parallel=true``
follows the loss curve of the same run without it within rounding (tests/numerics.py), at ZeRO 1 and ZeRO 2 (the norms'
gradients, summed over the sequence shards in backward, reach ZeRO's accumulation already whole)
and at ZeRO 3 with activation checkpointing.
The data is learnable, so a wrong gradient shows within a few steps.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from megaflex.training.metrics import read_metrics
from training_harness import (
    REPO, assert_train_losses_close, deepspeed_launcher, launch, launcher_env, write_config, write_pattern_data,
)

pytestmark = [pytest.mark.slow, pytest.mark.numerics]

STEPS = 4


def _train(tmp_path: Path, name: str, overrides: list[str], deepspeed: bool = True) -> dict[int, float]:
    """Train on 2 ranks started by the deepspeed launcher (or, without ``deepspeed``, by the test's
    own ``launch``: no launcher process to start)."""
    run = tmp_path / name
    cfg, overrides = write_config(tmp_path / "cfg.yaml"), [f"logging.run_dir={run}", *overrides]
    if deepspeed:
        env = launcher_env(2)
        cmd = [deepspeed_launcher(), "--num_gpus", "2", "--master_port", env["MASTER_PORT"], "--module",
               "megaflex.train", "--config", str(cfg), *overrides]
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
        output = proc.stdout
    else:
        result = launch(cfg, overrides, world_size=2)
        assert result.returncodes == [0, 0], result.output
        output = result.outputs[0]
    assert "world 2 = TP 2 x CP 1 x PP 1 x DP 1" in output
    sp = any(arg == "parallel.sequence_parallel=true" for arg in overrides)
    assert f"sequence_parallel: {str(sp).lower()}" in output  # the resolved config the ranks ran
    records = read_metrics(run / "metrics.jsonl")
    return {s: records[s]["loss"] for s in range(1, STEPS + 1)}


def test_sequence_parallel_follows_tensor_parallel_losses(tmp_path: Path) -> None:
    common = write_pattern_data(tmp_path) + [
        "parallel.tensor_parallel_size=2", f"train.train_iters={STEPS}", "checkpoint.save_interval=0", "checkpoint.save_at_end=false",
        "model.norm=layernorm", "model.bias=true",  # norm biases and row-parallel biases too
    ]
    want = _train(tmp_path, "tp", common + ["parallel.zero_stage=1"], deepspeed=False)  # the SP runs: the launcher
    assert want[STEPS] < want[1] - 0.1  # the model learns: not a comparison of two flat curves
    # ZeRO 3 with activation checkpointing: partitioned weights re-fetched for the column-parallel
    # backward, which gathers its input shard again, inside the recompute
    for zero, extra in ((1, []), (2, []), (3, ["model.activation_checkpointing=true"])):
        sp = [f"parallel.zero_stage={zero}", "parallel.sequence_parallel=true", *extra]
        assert_train_losses_close(_train(tmp_path, f"sp_zero{zero}", common + sp), want, ranks=2, name=f"ZeRO {zero}")
