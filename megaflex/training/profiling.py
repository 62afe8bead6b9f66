"""torch.profiler inside the trainer (``logging.profile: {start: N, steps: K}``).

    profiler = StepProfiler(cfg.logging.profile, model, run_dir / "profile", rank, device, log)
    # in the loop:  profiler.step_starts(step) ... profiler.step_ended(step);  after it: profiler.close()

Optimizer steps N .. N+K-1 (1-based, as logged) are recorded with the CPU activity, plus CUDA on a
GPU. Every rank writes ``rank<r>.steps<N>-<M>.pt.trace.json`` (Chrome trace format: chrome://tracing,
Perfetto, or TensorBoard's profiler plugin pointed at the folder) and ``rank<r>.steps<N>-<M>.ops.json``
(every operator and kernel with its call count and self CPU/device microseconds, for scripts:
``read_ops``); ``log`` (rank 0's console) gets the top operators by self time. While recording, each attention sublayer's forward is labelled
``megaflex.attention`` and its core (feature maps + attention) ``megaflex.attention.<kind>``
(``record_function`` ranges opened by module hooks, removed afterwards: no cost outside the window).
A run stopped inside the window (signal) still writes the steps it recorded.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn
from torch.profiler import ProfilerAction, ProfilerActivity, profile, record_function

from megaflex.training.config import ProfileConfig

TOP_OPS = 12


class StepProfiler:
    """Profiles the configured window of optimizer steps; does nothing when ``settings`` is None."""

    def __init__(
        self, settings: ProfileConfig | None, model: nn.Module, out_dir: Path, rank: int, device: str,
        log: Callable[[str], None],
    ) -> None:
        self.settings, self.model, self.out_dir, self.rank, self.device, self.log = settings, model, out_dir, rank, device, log
        self.trace_path: Path | None = None
        self.ops_path: Path | None = None
        self._prof: profile | None = None
        self._hooks: list[Any] = []
        self._last_step = 0

    def step_starts(self, step: int) -> None:
        """Call before optimizer step ``step`` (1-based) runs."""
        if self.settings is None or step != self.settings.start:
            return
        on_cuda = self.device == "cuda"
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
        self._label_attention()
        if on_cuda:
            torch.cuda.synchronize()
        # A schedule (always recording) makes the profiler mark each step as ProfilerStep#<step>,
        # which trace viewers and TensorBoard's step view use; the window itself is ours.
        self._prof = profile(activities=activities, schedule=lambda _: ProfilerAction.RECORD)
        self._prof.step_num = step
        self._prof.start()

    def step_ended(self, step: int) -> float:
        """Call after optimizer step ``step`` and its logging; returns the seconds spent writing
        the trace (when this step ends the window), to keep them out of the next tokens/s."""
        if self._prof is None:
            return 0.0
        self._last_step = step
        if step < self.settings.start + self.settings.steps - 1:
            self._prof.step()
            return 0.0
        began = time.perf_counter()
        self._finish()
        return time.perf_counter() - began

    def close(self) -> None:
        """End of training: write a window cut short by a stop."""
        if self._prof is not None and self._last_step >= self.settings.start:
            self._finish()
        elif self._prof is not None:  # stopped inside its first step: nothing complete to show
            self._prof.stop()
            self._prof = None
            self._unlabel()

    def _finish(self) -> None:
        prof, self._prof = self._prof, None
        if self.device == "cuda":
            torch.cuda.synchronize()
        prof.stop()
        self._unlabel()
        first, last = self.settings.start, self._last_step
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.trace_path = self.out_dir / f"rank{self.rank}.steps{first}-{last}.pt.trace.json"
        prof.export_chrome_trace(str(self.trace_path))
        averages = prof.key_averages()
        self.ops_path = self.out_dir / f"rank{self.rank}.steps{first}-{last}.ops.json"
        self.ops_path.write_text(json.dumps({"steps": last - first + 1, "device": self.device, "ops": [
            {"name": evt.key, "count": evt.count, "self_cpu_us": evt.self_cpu_time_total,
             "self_device_us": getattr(evt, "self_device_time_total", 0.0) or 0.0,
             "device_type": str(getattr(evt, "device_type", ""))} for evt in averages]}))  # fmt: skip
        by = "self_device_time_total" if self.device == "cuda" else "self_cpu_time_total"
        table = averages.table(sort_by=by, row_limit=TOP_OPS, max_name_column_width=60)
        self.log(f"profile of steps {first}-{last} (rank {self.rank}, top {TOP_OPS} ops by {by}); trace "
                 f"{self.trace_path}\n{table}")

    # ---------------------------------------------------------------- attention labels
    def _label_attention(self) -> None:
        from megaflex.model.gpt import Attention

        for module in self.model.modules():
            if isinstance(module, Attention):
                kind = getattr(module.core, "kind", type(module.core).__name__)
                self._label(module, "megaflex.attention")
                self._label(module.core, f"megaflex.attention.{kind}")

    def _label(self, module: nn.Module, name: str) -> None:
        ranges: list[record_function] = []  # open ranges of this module (re-entered by activation recompute)

        def enter(_module: nn.Module, _args: Any) -> None:
            ranges.append(record_function(name).__enter__())

        def leave(_module: nn.Module, _args: Any, _output: Any) -> None:
            if ranges:
                ranges.pop().__exit__(None, None, None)

        self._hooks.append(module.register_forward_pre_hook(enter))
        self._hooks.append(module.register_forward_hook(leave, always_call=True))

    def _unlabel(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()


def read_ops(path: Path) -> dict[str, Any]:
    """A ``rank<r>.steps<N>-<M>.ops.json``: {"steps", "device", "ops": [{"name", "count", "self_cpu_us",
    "self_device_us", "device_type"}]}."""
    return json.loads(Path(path).read_text())
