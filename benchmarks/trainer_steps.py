"""A few steps of the real trainer on one CPU rank and synthetic tokens, each step timed: what the
benchmarks comparing two settings of a training step run (``memory_plan``, ``chunked_ce``, ``compile``).

    steps = trainer_steps(Path("configs/tiny.yaml"), ["train.loss_chunk_tokens=0"], steps=4)
    steps[0]["wall_s"], steps[0]["cpu_s"], steps[-1]["memory_mb"]   # per step; peak RSS so far

Each run is a fresh interpreter (``python -m benchmarks.trainer_steps``: ``Trainer`` with a hook that
clocks every optimizer step), so its peak RSS is that of a rank as users start it. ``cpu_s`` is the
process's CPU time of the step: with one thread per rank it is what the step costs whatever else the
machine runs (wall times on a shared machine measure the neighbours too). ``study_shape`` gives the kernel
study's model and batch (``studies/kernel_study_config.py``) as overrides of configs/tiny.yaml.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "helpers"))

from training_harness import launch  # noqa: E402  (tests/helpers: local multi-process launch)

from benchmarks.common import worker_env  # noqa: E402
from megaflex.training.hooks import BaseHook  # noqa: E402
from studies.kernel_study_config import PRESETS, StudyConfig  # noqa: E402

TINY_CONFIG = REPO / "configs" / "tiny.yaml"
BENCH_DEFAULTS = [  # synthetic tokens on one CPU rank, ZeRO 0, nothing but the steps (no validation, saves)
    "data.source=synthetic", "data.tokenizer=null", "data.valid_path=[]", "schedule.warmup_iters=0",
    "parallel.zero_stage=0", "train.eval_interval=0", "train.eval_iters=0", "train.device=cpu",
    "checkpoint.save_interval=0", "checkpoint.save_at_end=false", "checkpoint.resume=none", "logging.tensorboard=false",
    "logging.kernel_stats_interval=0", "logging.log_interval=1", "logging.progress_bar=false",
]


def trainer_steps(config: Path, overrides: list[str], steps: int, timeout: float = 3600) -> list[dict[str, Any]]:
    """Per optimizer step of ``config`` + ``overrides`` (later keys win over ``BENCH_DEFAULTS``): its train
    record (loss, tokens_per_s, memory_mb: peak RSS so far) with ``wall_s`` and ``cpu_s`` added. The rank
    runs under ``MALLOC_TUNING``, as launch/setup_env.sh sets up CPU nodes."""
    with tempfile.TemporaryDirectory() as tmp, _environment(worker_env(malloc_tuning=True)):
        cfg_path, clock = Path(tmp) / "bench.yaml", Path(tmp) / "clock.json"
        cfg_path.write_text(config.read_text())
        args = ["--clock", str(clock), *BENCH_DEFAULTS, f"train.train_iters={steps}", *overrides,
                f"logging.run_dir={tmp}/run"]
        result = launch(cfg_path, args, 1, timeout=timeout, module="benchmarks.trainer_steps", fresh=True)
        if result.returncodes != [0]:
            raise RuntimeError(f"training run of {config} {overrides} failed:\n{result.output}")
        lines = (Path(tmp) / "run" / "metrics.jsonl").read_text().splitlines()
        records = {r["step"]: r for r in map(json.loads, lines) if r.get("kind", "train") == "train"}
        return [{**records[c["step"]], **c} for c in json.loads(clock.read_text())]


@contextlib.contextmanager
def _environment(env: dict[str, str]) -> Iterator[None]:
    """``os.environ`` replaced by ``env`` inside (``launch`` hands the ranks this process's environment)."""
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def steady(steps: list[dict[str, Any]], key: str, skip: int = 1) -> float:
    """Median of ``key`` over the steps after the first ``skip`` (warm-up: allocations, compiles)."""
    return statistics.median(s[key] for s in steps[skip:])


def study_shape(preset: str = "cpu") -> list[str]:
    """Overrides of configs/tiny.yaml that give the kernel study's model and batch at ``preset``
    (Flexformer-N, as the study's runner builds it: ``studies.runner.train_overrides``)."""
    cfg = StudyConfig(preset=preset, **{k: v for k, v in PRESETS[preset].items() if k in StudyConfig.__dataclass_fields__})
    return [
        f"model.vocab_size={cfg.vocab_size}", f"model.num_layers={cfg.num_layers}", f"model.hidden_size={cfg.hidden_size}",
        f"model.num_heads={cfg.num_heads}", f"model.ffn_hidden_size={4 * cfg.hidden_size}",
        f"model.feature_dim={cfg.feature_dim}", f"model.max_seq_len={cfg.seq_len}", f"data.seq_len={cfg.seq_len}",
        f"train.micro_batch_size={cfg.micro_batch_size}", f"train.global_batch_size={cfg.global_batch_size}",
        f"model.normalization={cfg.normalization}", "train.precision=fp32",
    ]


class StepClock(BaseHook):
    """Wall and CPU seconds of every optimizer step (forward, backward, update)."""

    def __init__(self) -> None:
        self.steps: list[dict[str, Any]] = []
        self._start = (0.0, 0.0)

    def on_step_start(self, trainer: Any, step: int) -> None:
        self._start = (time.perf_counter(), time.process_time())

    def on_step_applied(self, trainer: Any, step: int) -> None:
        wall, cpu = time.perf_counter() - self._start[0], time.process_time() - self._start[1]
        self.steps.append({"step": step, "wall_s": round(wall, 4), "cpu_s": round(cpu, 4)})


def main(argv: list[str] | None = None) -> None:
    """``python -m benchmarks.trainer_steps --clock OUT.json --config ... overrides``: train, clocking each step."""
    from megaflex.training.config import load_config
    from megaflex.training.train import build_parser, finish_args
    from megaflex.training.trainer import Trainer, shutdown

    parser = build_parser("benchmarks.trainer_steps", main.__doc__ or "")
    parser.add_argument("--clock", type=Path, required=True, help="where the per-step times go (JSON)")
    args = finish_args(parser.parse_args(argv))
    trainer = Trainer(load_config(args.config, args.overrides))
    clock = StepClock()
    trainer.hooks.append(clock)
    try:
        trainer.build()
        trainer.train()
    finally:
        shutdown(clean=True)
    args.clock.write_text(json.dumps(clock.steps))


if __name__ == "__main__":
    main()
