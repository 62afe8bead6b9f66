"""What the gpu_check stages share: the stage context, the real trainer as a subprocess, timing, and
learnable synthetic token files."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parents[2]


@dataclass
class Stage:
    """One stage's run: tiny CPU shapes under ``dry_run``; ``emit`` rewrites the partial result (so a
    timed-out stage still reports what it finished)."""

    dry_run: bool
    work_dir: Path
    result_path: Path
    options: dict[str, Any] = field(default_factory=dict)

    @property
    def device(self) -> str:
        return "cpu" if self.dry_run else "cuda"

    def emit(self, result: dict[str, Any]) -> None:
        tmp = self.result_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(result, indent=1, default=str))
        tmp.replace(self.result_path)


def trainer_env(dry_run: bool) -> dict[str, str]:
    """One-rank environment for ``python -m megaflex.train`` (this checkout first on the path)."""
    from megaflex.parallel.rendezvous import free_port

    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "OMPI_"))}
    env.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", LOCAL_SIZE="1",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), PYTHONUNBUFFERED="1")  # fmt: skip
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    if dry_run:
        env["DS_ACCELERATOR"] = "cpu"
        env.pop("TRITON_INTERPRET", None)  # the trainer's attention_backend=auto: torch on CPU
    return env


def run_trainer(args: list[str], run_dir: Path, dry_run: bool, timeout: float) -> dict[str, Any]:
    """``python -m megaflex.train --config ... logging.run_dir=run_dir``: the train and kernel
    records of its metrics.jsonl, its wall time, or its error (the output's tail)."""
    from megaflex.training.metrics import read_metrics

    cmd = [sys.executable, "-m", "megaflex.train", *args, f"logging.run_dir={run_dir}"]
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=trainer_env(dry_run), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s", "command": " ".join(cmd[2:])}
    wall = round(time.perf_counter() - start, 1)
    if proc.returncode != 0:
        return {"error": f"exit {proc.returncode}: " + (proc.stdout + proc.stderr)[-2000:], "command": " ".join(cmd[2:])}
    metrics = run_dir / "metrics.jsonl"
    return {"train": read_metrics(metrics), "kernel": read_metrics(metrics, kind="kernel"), "wall_s": wall}


def base_overrides(seq_len: int, micro: int, global_batch: int, steps: int, precision: str, dry_run: bool) -> list[str]:
    """Synthetic tokens, no evaluation or TensorBoard, one log record per step."""
    return [
        "data.source=synthetic", "data.tokenizer=null", "data.valid_path=[]", f"data.seq_len={seq_len}",
        f"model.max_seq_len={seq_len}", f"train.micro_batch_size={micro}", f"train.global_batch_size={global_batch}",
        f"train.train_iters={steps}", "schedule.warmup_iters=0", f"train.precision={precision}",
        "train.eval_interval=0", "checkpoint.save_interval=0", "checkpoint.save_at_end=false",
        "logging.tensorboard=false", "logging.kernel_stats_interval=0", "logging.log_interval=1",
        "logging.progress_bar=false", f"train.device={'cpu' if dry_run else 'cuda'}",
    ]  # fmt: skip


def throughput(train: dict[int, dict[str, Any]], skip: set[int]) -> dict[str, Any]:
    """Median tokens/s and MFU over the steps not in ``skip`` (warm-up, profiled), peak memory and
    skipped steps over all of them."""
    steady = [r for s, r in sorted(train.items()) if s not in skip] or list(train.values())

    def median(key: str) -> float | None:
        values = sorted(r[key] for r in steady if r.get(key) is not None)
        return values[len(values) // 2] if values else None

    return {
        "tokens_per_s": median("tokens_per_s"),
        "mfu": median("mfu"),
        "tflops_per_device": median("tflops_per_device"),
        "peak_memory_mb": max((r.get("memory_mb") or 0.0) for r in train.values()) if train else None,
        "skipped_steps": sum(1 for r in train.values() if r.get("skipped")),
        "nonfinite_total": max((r.get("nonfinite_total", 0) for r in train.values()), default=0),
        "losses": {s: round(r["loss"], 5) for s, r in sorted(train.items())},
    }


def timed(fn: Callable[[], None], device: str, repeats: int) -> tuple[float, float | None]:
    """(median ms, peak MB above what was held before; None on CPU) of ``fn``, after one warm-up call."""
    import torch

    fn()  # warm-up: compilation, autotuning
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() if device == "cuda" else 0
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(1000 * (time.perf_counter() - start))
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20 if device == "cuda" else None
    return sorted(times)[len(times) // 2], peak


def learnable_tokens(prefix: Path, vocab: int, documents: int, length: int, seed: int = 0) -> Path:
    """Indexed .bin/.idx whose documents walk a fixed random successor table (4 successors per token
    over the first min(vocab, 1024) ids): a model can learn it (uniform tokens stay at ln(vocab)), so
    precision differences show in the loss."""
    import numpy as np

    from megaflex.data.indexed import IndexedDatasetBuilder

    rng = np.random.default_rng(seed)
    used = min(vocab, 1024)
    successors = rng.integers(0, used, size=(used, 4))
    choices = rng.integers(0, 4, size=(documents, length))
    prefix.parent.mkdir(parents=True, exist_ok=True)
    docs = np.empty((documents, length), dtype=np.int64)
    docs[:, 0] = rng.integers(0, used, size=documents)
    for t in range(1, length):
        docs[:, t] = successors[docs[:, t - 1], choices[:, t]]
    with IndexedDatasetBuilder(prefix, dtype=np.uint16 if vocab < 65500 else np.int32, vocab_size=vocab) as builder:
        for doc in docs:
            builder.add_document(doc)
    return prefix
