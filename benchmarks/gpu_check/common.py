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
from typing import Any, Callable, Iterator

REPO = Path(__file__).resolve().parents[2]


@dataclass
class Stage:
    """One stage's run: tiny CPU shapes under ``dry_run``; ``emit`` rewrites the partial result (so a
    timed-out stage still reports what it finished). ``options``: ``deadline`` (epoch seconds at
    which the parent kills this stage), ``timeout_scale``, ``previous`` (earlier stages' results)."""

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

    def inner_timeout(self, nominal: float) -> float:
        """``nominal`` x ``--timeout-scale``, cut to end 10 s before the stage's own deadline (so a
        trainer that overruns is stopped here and its log tail recorded, before the stage is killed)."""
        timeout = nominal * float(self.options.get("timeout_scale", 1.0))
        if "deadline" in self.options:
            timeout = min(timeout, float(self.options["deadline"]) - time.time() - 10)
        return max(timeout, 1.0)


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


@dataclass
class TrainerRun:
    """A started ``python -m megaflex.train`` (``start_trainer``); ``finish_trainer`` waits for it."""

    proc: Any
    cmd: list[str]
    run_dir: Path
    log_path: Path
    started: float


def start_trainer(args: list[str], run_dir: Path, dry_run: bool, env: dict[str, str] | None = None) -> TrainerRun:
    """``python -m megaflex.train --config ... logging.run_dir=run_dir`` (``env`` added to its
    environment), output to ``<run_dir>.log`` (in the stage's process group: the stage's kill
    takes it too)."""
    cmd = [sys.executable, "-m", "megaflex.train", *args, f"logging.run_dir={run_dir}"]
    log_path = run_dir.parent / f"{run_dir.name}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env={**trainer_env(dry_run), **(env or {})}, stdout=log,
                                stderr=subprocess.STDOUT)
    return TrainerRun(proc, cmd, run_dir, log_path, time.perf_counter())


def finish_trainer(run: TrainerRun, timeout: float) -> dict[str, Any]:
    """The train and kernel records of the run's metrics.jsonl and its wall time, or its error with
    the tail of its log (also after a timeout, which kills it)."""
    from megaflex.training.metrics import read_metrics

    command = " ".join(run.cmd[2:])
    try:
        returncode = run.proc.wait(timeout=max(timeout - (time.perf_counter() - run.started), 0.1))
    except subprocess.TimeoutExpired:
        run.proc.kill()
        run.proc.wait()
        return {"error": f"timed out after {timeout:.0f} s", "command": command, "log_tail": log_tail(run.log_path)}
    wall = round(time.perf_counter() - run.started, 1)
    if returncode != 0:
        return {"error": f"exit {returncode}", "command": command, "log_tail": log_tail(run.log_path)}
    metrics = run.run_dir / "metrics.jsonl"
    return {"train": read_metrics(metrics), "kernel": read_metrics(metrics, kind="kernel"), "wall_s": wall}


def run_trainer(args: list[str], run_dir: Path, stage: Stage, nominal_timeout: float) -> dict[str, Any]:
    """``start_trainer`` then ``finish_trainer`` under ``stage.inner_timeout(nominal_timeout)``."""
    timeout = stage.inner_timeout(nominal_timeout)
    return finish_trainer(start_trainer(args, run_dir, stage.dry_run), timeout)


def log_tail(path: Path, chars: int = 2500) -> str:
    """The last ``chars`` characters of a log ("" when it is missing)."""
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return ""


def base_overrides(seq_len: int, micro: int, global_batch: int, steps: int, precision: str, dry_run: bool) -> list[str]:
    """Synthetic tokens, no validation (``train.eval_iters=0``) or TensorBoard, one log record per step."""
    return [
        "data.source=synthetic", "data.tokenizer=null", "data.valid_path=[]", f"data.seq_len={seq_len}",
        f"model.max_seq_len={seq_len}", f"train.micro_batch_size={micro}", f"train.global_batch_size={global_batch}",
        f"train.train_iters={steps}", "schedule.warmup_iters=0", f"train.precision={precision}",
        "train.eval_interval=0", "train.eval_iters=0", "checkpoint.save_interval=0", "checkpoint.save_at_end=false",
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


def map_in_workers(fn: Callable[[Any], dict[str, Any]], items: list[Any], workers: int) -> Iterator[tuple[int, dict[str, Any]]]:
    """(index, ``fn(item)``) as each finishes: in this process when ``workers`` <= 1, else in that
    many spawned processes (cold Triton compiles are CPU-bound: items of different compile sets
    compile in parallel, and share the on-disk cache). ``fn`` must be a module-level function that
    catches its own errors; an item whose worker died comes back as ``{"error": ...}``."""
    if workers <= 1:
        for i, item in enumerate(items):
            yield i, fn(item)
        return
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor, as_completed

    with ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = {pool.submit(fn, item): i for i, item in enumerate(items)}
        for future in as_completed(futures):
            try:
                yield futures[future], future.result()
            except Exception as err:  # noqa: BLE001  (a worker that died: BrokenProcessPool)
                yield futures[future], {"error": f"worker failed: {err!r}"[:500]}
