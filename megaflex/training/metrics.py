"""Rank-0 logging: metrics.jsonl, scalar sinks (TensorBoard, W&B), console progress, FLOP estimates.

``metrics.jsonl`` gets one JSON object per logged step (``kind`` "train": ``step``, ``loss``,
``lr``, ``tokens_per_s``, ...; "valid": ``loss``, ``ppl``; "kernel": the per-layer kernel
statistics of ``megaflex.model.kernel_stats``, TensorBoard tags ``kernel/layerXX/...``). Floats are written with ``json``'s shortest round-trip repr, so a loss
read back is bit-identical to the one logged; every line is flushed and fsynced so a run killed
with ``kill -9`` leaves a readable log. Resumed runs append; readers take the last entry of a
step (``read_metrics``).
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import resource
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from megaflex.attention import feature_dim_of
from megaflex.model.config import ModelConfig

# For MFU when logging.peak_tflops is unset: dense bf16 tensor-core peaks per GPU (NVIDIA
# datasheets, without sparsity), matched against torch.cuda.get_device_name() in order: the PCIe
# and NVL variants (lower clocks and power) before their family name. "H100 80GB HBM3" is SXM.
PEAK_TFLOPS = (
    ("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H200 NVL", 835.0), ("GH200", 989.0), ("H200", 989.0),
    ("H100", 989.0), ("A100", 312.0), ("A10G", 125.0), ("L4", 121.0), ("V100", 125.0),
)


def read_metrics(path: str | Path, kind: str = "train") -> dict[int, dict[str, Any]]:
    """step -> the last logged record of that step (``kind``: "train", "valid" or "kernel")."""
    records: dict[int, dict[str, Any]] = {}
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue  # a torn last line of a killed run
            if rec.get("kind", "train") == kind:
                records[rec["step"]] = rec
    return records


def flops_per_token(cfg: ModelConfig, seq_len: int, num_params: int) -> float:
    """Estimated training FLOPs per token (forward + backward = 3 x forward).

    Matmuls: 6 per parameter (the tied embedding counts once, as the logits matmul).
    Attention per layer and token, forward: softmax 4*N*h (QK^T and AV over the full window,
    Megatron's convention); linear attention 4*h*F (feature projections of q and k) +
    4*h*F (state update and readout per head dim) + 2*C*(F + d)*H (intra-chunk quadratic part),
    with F the map's real feature count (``feature_dim_of``: elu d, cosformer 2d, else feature_dim).
    """
    L, h, H = cfg.num_layers, cfg.hidden_size, cfg.num_heads
    if cfg.attention == "softmax":
        attn_fwd = 4.0 * seq_len * h
    else:
        d, C = cfg.head_dim, min(cfg.chunk_size, seq_len)
        F = feature_dim_of(cfg.attention, d, cfg.feature_dim)
        attn_fwd = 4.0 * h * F + 4.0 * h * F + 2.0 * C * (F + d) * H
    return 6.0 * num_params + 3.0 * L * attn_fwd


def peak_memory_mb(device: str) -> float:
    """Peak memory of this process: CUDA allocator peak on GPU, peak RSS on CPU."""
    if device == "cuda" and torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**20
    return peak_rss_kib() / 1024.0


def peak_rss_kib() -> int:
    """This process's own peak resident set (KiB): Linux's VmHWM. ``getrusage``'s ru_maxrss is
    not it: Linux carries the peak of the process that forked this one across exec, so a
    launcher (or a test runner) that had grown large sets every child's floor."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:  # no procfs (not Linux)
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS


def device_peak_tflops(configured: float | None, device: str) -> float | None:
    if configured is not None:
        return configured
    if device == "cuda" and torch.cuda.is_available():
        return peak_tflops_of(torch.cuda.get_device_name())
    return None


def peak_tflops_of(device_name: str) -> float | None:
    """The known dense bf16 peak of a GPU named like ``torch.cuda.get_device_name()``, else None."""
    return next((value for key, value in PEAK_TFLOPS if key in device_name), None)


@dataclass
class Rate:
    """Throughput over the steps since the last measure: tokens/s, model TFLOP/s per device, MFU."""

    tokens_per_s: float
    tflops_per_device: float
    mfu: float | None  # None when the device's peak is unknown


class Throughput:
    """The throughput arithmetic of the train records: tokens and FLOPs over the wall time between
    logged steps (time spent outside training, e.g. writing a profiler trace, excluded)."""

    def __init__(self, tokens_per_step: int, flops_per_token: float, world_size: int, peak_tflops: float | None) -> None:
        self.tokens_per_step, self.flops_per_token = tokens_per_step, flops_per_token
        self.world_size, self.peak_tflops = world_size, peak_tflops
        self.last = time.time()

    def exclude(self, seconds: float) -> None:
        """Leave ``seconds`` just spent outside training out of the next measure."""
        self.last += seconds

    def measure(self, steps: int) -> Rate:
        """The rate of the ``steps`` optimizer steps since the last measure (or the start)."""
        now = time.time()
        elapsed = max(now - self.last, 1e-9)
        self.last = now
        tokens_per_s = self.tokens_per_step * steps / elapsed
        tflops = self.flops_per_token * tokens_per_s / self.world_size / 1e12
        return Rate(tokens_per_s, tflops, tflops / self.peak_tflops if self.peak_tflops else None)


class ScalarSink(Protocol):
    """Where the logged scalars go besides metrics.jsonl: TensorBoard, W&B (``wandb_logger``)."""

    def write(self, scalars: dict[str, float], step: int) -> None:
        """Finite scalars named ``train/loss``, ``valid/ppl``, ``kernel/layer00/tau_mean``, ... of ``step``."""

    def close(self) -> None: ...


TENSORBOARD_MISSING = (
    "logging.tensorboard: the tensorboard package is not installed, so no TensorBoard event files are written "
    "(metrics.jsonl holds every scalar); pip install 'megaflex[tensorboard]', or set logging.tensorboard=false"
)


def tensorboard_installed() -> bool:
    """Whether TensorBoard's package is importable; warns (``TENSORBOARD_MISSING``) when not. It is an
    extra (``megaflex[tensorboard]``): a GPU node's offline install leaves it out (launch/wheelhouse.sh)."""
    if importlib.util.find_spec("tensorboard") is not None:
        return True
    warnings.warn(TENSORBOARD_MISSING, stacklevel=3)
    return False


class TensorBoardSink:
    """TensorBoard event files in ``directory``."""

    def __init__(self, directory: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(str(directory))

    def write(self, scalars: dict[str, float], step: int) -> None:
        for key, value in scalars.items():
            self._writer.add_scalar(key, value, step)

    def close(self) -> None:
        self._writer.close()


class MetricsLogger:
    """Writes metrics on rank 0; a no-op object on other ranks."""

    def __init__(self, run_dir: str | Path, *, enabled: bool, tensorboard: bool, progress_bar: bool, total_steps: int) -> None:
        self.enabled = enabled
        self.total_steps = total_steps
        self._file = None
        self._sinks: list[ScalarSink] = []
        self._bar = None
        if not enabled:
            return
        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        self.path = run_dir / "metrics.jsonl"
        self._file = open(self.path, "a")
        if tensorboard and tensorboard_installed():
            self._sinks.append(TensorBoardSink(run_dir / "tensorboard"))
        if progress_bar and sys.stdout.isatty():
            from tqdm import tqdm

            self._bar = tqdm(total=total_steps, dynamic_ncols=True, desc="train")
        self._start_time = time.time()
        self._start_step: int | None = None

    def add_sink(self, sink: ScalarSink) -> None:
        """Send every later record's scalars to ``sink`` too (closed with the logger)."""
        self._sinks.append(sink)

    def log(self, record: dict[str, Any], scalars: dict[str, float] | None = None) -> None:
        """One JSONL line (``record``), its scalars to every sink and a console update."""
        if not self.enabled:
            return
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())
        step = record["step"]
        if self._sinks:
            finite = {k: v for k, v in {**_numeric(record), **(scalars or {})}.items() if math.isfinite(v)}
            for sink in self._sinks:
                sink.write(finite, step)
        kind = record.get("kind", "train")
        if kind == "train":
            self._console(record)
        elif kind == "valid":
            self.print(f"[valid] step {step}: loss {record['loss']:.4f} ppl {record['ppl']:.2f}")

    def _console(self, rec: dict[str, Any]) -> None:
        step = rec["step"]
        if self._start_step is None:
            self._start_step, self._start_time = step, time.time()
        done = step - self._start_step
        rate = done / max(1e-9, time.time() - self._start_time)
        eta = (self.total_steps - step) / rate if rate > 0 else float("nan")
        text = (
            f"loss {rec['loss']:.4f} | ppl {rec['ppl']:.2f} | lr {rec['lr']:.2e} | "
            f"{rec['tokens_per_s']:,.0f} tok/s | ETA {hms(eta)}"
            + (" | SKIPPED (non-finite)" if rec.get("skipped") else "")
        )
        if self._bar is not None:
            self._bar.n = step
            self._bar.set_postfix_str(text, refresh=True)
        else:
            print(f"step {step}/{self.total_steps} | {text}", flush=True)

    def print(self, text: str) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.write(text)
        else:
            print(text, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        for sink in self._sinks:
            sink.close()
        if self._file is not None:
            self._file.close()


def _numeric(record: dict[str, Any]) -> dict[str, float]:
    prefix = record.get("kind", "train") + "/"  # train/, valid/, kernel/
    return {
        prefix + k: float(v)
        for k, v in record.items()
        if isinstance(v, (int, float)) and not isinstance(v, bool) and k not in ("step", "kind")
    }


def hms(seconds: float) -> str:
    """``H:MM:SS`` of a duration (the console's ETA), ``?`` when it is not finite."""
    if not math.isfinite(seconds):
        return "?"
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"
