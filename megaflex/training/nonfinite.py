"""Skipping non-finite steps: why a step was skipped, and the count that aborts a run after too
many in a row (``train.max_nonfinite_in_a_row``)."""

from __future__ import annotations

from typing import Any

import torch

from megaflex.parallel import comm


class NonFiniteAbort(RuntimeError):
    """Too many consecutive steps with a non-finite loss or gradient norm."""


def engine_skipped_steps(engine: Any) -> int:
    """DeepSpeed's count of optimizer steps it discarded (fp16 loss-scale or bf16 overflow)."""
    return int(getattr(engine, "skipped_steps", 0))


def skip_reason(nonfinite_loss: bool, engine_skipped: bool, nonfinite_grad: bool) -> str | None:
    """Why a step was skipped (None: it was applied), most telling cause first."""
    if nonfinite_loss:
        return "non-finite loss"
    if engine_skipped:
        return "gradient overflow (DeepSpeed skipped the update)"
    if nonfinite_grad:
        return "non-finite gradient norm"
    return None


class NonFiniteGuard:
    """Counts skipped steps: ``limit`` in a row abort the run (``NonFiniteAbort``)."""

    def __init__(self, limit: int, total: int = 0, checkpoint_dir: str = "") -> None:
        self.limit, self.total, self.in_a_row, self.checkpoint_dir = limit, total, 0, checkpoint_dir

    def record(self, iteration: int, reason: str | None) -> str:
        """Account step ``iteration`` (skipped when ``reason``); returns the line to log."""
        if reason is None:
            self.in_a_row = 0
            return ""
        self.in_a_row += 1
        self.total += 1
        if self.in_a_row >= self.limit:
            raise NonFiniteAbort(
                f"aborting at step {iteration}: {self.in_a_row} consecutive steps had a non-finite loss or gradient "
                f"(last: {reason}; train.max_nonfinite_in_a_row={self.limit}); lower train.lr, raise "
                f"schedule.warmup_iters or check the data; resume from the last checkpoint in {self.checkpoint_dir}"
            )
        return f"step {iteration}: {reason}; step skipped ({self.in_a_row} in a row, {self.total} in total)"


def unclipped_grad_norm(engine: Any) -> torch.Tensor:
    """Global L2 norm (a device scalar) of the (data-parallel averaged) gradients before
    clipping, counted as DeepSpeed's ``clip_grad_norm_`` counts it: TP-sharded parameters on
    every TP rank, replicated ones on TP rank 0 only. Collective over the model-parallel group."""
    from deepspeed.runtime.utils import is_model_parallel_parameter

    mpu = engine.mpu
    first_tp_rank = mpu is None or mpu.get_model_parallel_rank() == 0
    squares = [
        p.grad.detach().double().pow(2).sum() for p in engine.module.parameters()
        if p.grad is not None and (first_tp_rank or is_model_parallel_parameter(p))
    ]
    total = torch.stack(squares).sum() if squares else torch.zeros((), dtype=torch.float64)
    if mpu is not None:
        total = comm.all_reduce(total, "sum", mpu.get_model_parallel_group())
    return total.sqrt()
