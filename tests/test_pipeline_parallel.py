"""Pipeline parallelism (DeepSpeed's pipeline engine) trains exactly what one device trains.

Real ``megaflex.train`` runs under the deepspeed launcher on CPU gloo ranks, fp32, ZeRO-1, tied
embeddings (the tiny config's default): the per-step losses, gradient norms (clipping is active:
the norms are about 1) and the validation loss of PP=2 (with activation checkpointing) and of
TP=2 x PP=2 equal the 1 x 1 run's. The stage split itself is tested in test_model.py.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from megaflex.parallel.pipeline import stage_bounds
from training_harness import REPO, deepspeed_launcher, launcher_env, write_config

STEPS = 5
COMMON = [
    f"train.train_iters={STEPS}", "logging.log_interval=1", "logging.kernel_stats_interval=0",
    "checkpoint.save_interval=0", "checkpoint.save_at_end=false", f"train.eval_interval={STEPS}", "train.eval_iters=2",
]


def _train(tmp_path: Path, name: str, ranks: int, overrides: list[str]) -> list[dict]:
    cfg, run = write_config(tmp_path / "cfg.yaml"), tmp_path / name
    env = launcher_env(ranks)
    cmd = [deepspeed_launcher(), "--num_gpus", str(ranks), "--master_port", env["MASTER_PORT"], "--module",
           "megaflex.train", "--config", str(cfg), f"logging.run_dir={run}", *COMMON, *overrides]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=800)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["kind"] == "train"] == list(range(1, STEPS + 1))
    return records


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return _train(tmp_path_factory.mktemp("ref"), "ref", 1, [])


def _assert_same_run(records: list[dict], reference: list[dict]) -> None:
    assert len(records) == len(reference)
    for got, want in zip(records, reference):
        assert got["kind"] == want["kind"] and got["step"] == want["step"]
        assert got["loss"] == pytest.approx(want["loss"], abs=1e-5, rel=0), (got, want)
        if want.get("grad_norm") is not None:
            assert got["grad_norm"] == pytest.approx(want["grad_norm"], abs=1e-5, rel=0), (got, want)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("ranks", "overrides"),
    [
        (2, ["parallel.pipeline_parallel_size=2", "model.activation_checkpointing=true"]),
        (4, ["parallel.pipeline_parallel_size=2", "parallel.tensor_parallel_size=2"]),
    ],
    ids=["pp2", "tp2xpp2"],
)
def test_pipeline_parallel_run_equals_one_device(tmp_path: Path, reference: list[dict], ranks: int,
                                                 overrides: list[str]) -> None:
    records = _train(tmp_path, "run", ranks, overrides)
    _assert_same_run(records, reference)
    assert any(r["kind"] == "valid" for r in records)  # eval_batch through the pipeline


def test_stage_bounds_put_embedding_first_and_head_last() -> None:
    # items: embedding, blocks 0..4, final norm, logits; stages of 3 + 2 blocks
    assert stage_bounds(5, 2) == [0, 4, 8]
    assert stage_bounds(2, 2) == [0, 2, 5]
    assert stage_bounds(3, 3) == [0, 2, 3, 6]
