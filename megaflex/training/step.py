"""One optimizer step's forward and backward on the DeepSpeed engine, and validation.

    runner = StepRunner(engine, optimizer, state, device, grad_accum, batches, loss, on_loss, agreed_flags)
    sums = runner.run(step)        # grad_accum x forward_backward_step, the update; sums stay on the device

One optimizer step = ``grad_accum`` micro-batches, each ``engine.backward`` + ``engine.step``
(DeepSpeed applies the update at the accumulation boundary). A non-finite micro-batch loss is
masked to zero before backward (every rank runs the same backward/step sequence) and the whole
step is skipped (``SkippableAdamW.skip``), decided identically on every rank from the flags
agreed once per step, at the boundary.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from megaflex.parallel import comm
from megaflex.training.batches import Batch, BatchLayout, batch_stream
from megaflex.training.collective_timeout import progress
from megaflex.training.config import Config
from megaflex.training.nonfinite import unclipped_grad_norm

# One micro-batch's (loss to differentiate, named scalars summed over the step and logged).
LossFn = Callable[[Any, Batch], tuple[torch.Tensor, dict[str, torch.Tensor]]]


@dataclass
class StepResult:
    """One optimizer step's numbers; the sums stay on the device until the step is logged."""

    lr: float
    loss_sum: torch.Tensor
    extra_sums: dict[str, torch.Tensor]
    grad_norm: Any
    skipped: bool
    skipped_loss: bool
    stop_signal: int
    checkpoint_write: int  # the background save's status, agreed (CheckpointManager.writer_status)


@dataclass
class StepSums:
    """What a step's micro-batches add up (on the device) and what every rank agreed on."""

    loss_sum: torch.Tensor
    bad: torch.Tensor  # non-finite losses seen
    extra_sums: dict[str, torch.Tensor] = field(default_factory=dict)
    skipped_loss: bool = False
    stop_signal: int = 0
    checkpoint_write: int = 0
    own_grad_norm: Any = None  # plain fp32: measured before DeepSpeed clips


def lm_loss(engine: Any, batch: Batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The language-model loss of ``batch`` (no extra scalars)."""
    return engine(batch.input_ids, batch.labels, documents=batch.documents).loss, {}


def objective_loss(objective: Any) -> LossFn:
    """The loss of an ``Objective`` (``megaflex.training.hooks``), e.g. distillation."""
    return lambda engine, batch: objective.loss(engine, batch.input_ids, batch.labels)


class StepRunner:
    """The micro-batches of each optimizer step, forward and backward, then the update.

    ``on_loss(step, loss)`` may replace a micro-batch's loss (the hooks); ``stop_signal()`` (the caught
    signal, 0 for none) and ``save_status()`` (``CheckpointManager.writer_status``) travel in the
    step's one agreed read (``agreed_flags``)."""

    def __init__(
        self, engine: Any, optimizer: Any, state: Any, device: str, grad_accum: int, batches: Any, loss: LossFn,
        on_loss: Callable[[int, torch.Tensor], torch.Tensor], stop_signal: Callable[[], int],
        save_status: Callable[[], int], plain_fp32: bool,
    ) -> None:
        self.engine, self.optimizer, self.state, self.grad_accum = engine, optimizer, state, grad_accum
        self.batches, self.loss, self.on_loss = batches, loss, on_loss
        self.device, self.stop_signal, self.save_status = device, stop_signal, save_status
        # ZeRO 0 in fp32 has no DeepSpeed optimizer wrapper that records the gradient norm.
        self.plain_fp32 = plain_fp32
        self.zero = torch.zeros((), dtype=torch.float64, device=device)
        # The pipeline engine takes (inputs, labels) pairs and runs the micro-batches itself.
        self.pipeline_batches = ((b.input_ids, b.labels) for b in batches) if state.pp_size > 1 else None

    def run(self, step: int) -> StepSums:
        return self._pipeline_step(step) if self.pipeline_batches is not None else self._step(step)

    def forward_backward_step(self, batch: Batch, step: int, sums: StepSums) -> None:
        """One micro-batch: the loss (added to ``sums``, masked when non-finite) and its backward."""
        loss, extras = self.loss(self.engine, batch)
        for key, value in extras.items():
            sums.extra_sums[key] = sums.extra_sums.get(key, self.zero) + value.detach().double()
        loss = self.on_loss(step, loss)
        finite = torch.isfinite(loss.detach())
        sums.bad += (~finite).double()
        sums.loss_sum += torch.where(finite, loss.detach(), 0.0).double()
        # Masked, not dropped: every rank must run the same backward/step sequence. The loss is the
        # whole sequence's but each CP rank differentiates its own slice's share; DeepSpeed averages
        # gradients over DP x CP, so x CP turns that average into the sum over the slices.
        self.engine.backward(torch.where(finite, loss, torch.zeros_like(loss)) * self.state.cp_size)

    def _step(self, step: int) -> StepSums:
        """The grad_accum micro-batches' forward and backward, then the update (one device's engine)."""
        engine, optimizer = self.engine, self.optimizer
        sums = StepSums(self.zero.clone(), self.zero.clone())
        for _ in range(self.grad_accum):
            self.forward_backward_step(next(self.batches), step, sums)
            if engine.is_gradient_accumulation_boundary():
                # Decided on every rank alike before the update (the last micro-batch is the boundary);
                # a caught signal travels in the same read and stops the run after this step.
                sums.skipped_loss, sums.stop_signal, sums.checkpoint_write = self.agreed_flags(step, sums.bad)
                progress.at(step, "optimizer step (ZeRO gradient reduction)")
                if hasattr(optimizer, "skip"):
                    optimizer.skip = sums.skipped_loss
                if self.plain_fp32:  # DeepSpeed clips here without keeping the norm: measure it before the step
                    sums.own_grad_norm = unclipped_grad_norm(engine)
            engine.step()
        return sums

    def agreed_flags(self, step: int, bad: torch.Tensor) -> tuple[bool, int, int]:
        """(any rank's loss non-finite, the caught signal, the background save's status), agreed over
        every rank in one read."""
        progress.at(step, "the step's flag all_reduce (non-finite loss, stop signal, checkpoint write)")
        skipped, signal_number, write = agreed_max(self.device, bad, self.stop_signal(), self.save_status())
        return skipped > 0, signal_number, write

    def _pipeline_step(self, step: int) -> StepSums:
        """DeepSpeed's pipeline engine runs the grad_accum micro-batches (1F1B), the reductions and
        the update; its loss is the step's mean, averaged over DP, on every stage."""
        sums = StepSums(self.zero.clone(), self.zero.clone())
        loss = self.engine.train_batch(self.pipeline_batches).detach()
        finite = torch.isfinite(loss)
        sums.bad += (~finite).double()
        sums.loss_sum += torch.where(finite, loss, 0.0).double() * self.grad_accum
        sums.skipped_loss, sums.stop_signal, sums.checkpoint_write = self.agreed_flags(step, sums.bad)
        return sums


@torch.no_grad()
def evaluate(cfg: Config, engine: Any, dataset: Any, state: Any, device: str, signals: Any = None) -> float | None:
    """Mean validation loss over ``train.eval_iters`` micro-batches per data-parallel rank; None
    when a stop signal (``signals.signum``, agreed over all ranks per batch) cuts it short."""
    engine.eval()
    progress.at(progress.step, "validation")
    total = torch.zeros((), dtype=torch.float64, device=device)
    with batch_stream(dataset, BatchLayout.of(cfg, state), device, cfg.train.eval_iters) as batches:
        if state.pp_size > 1:  # the pipeline engine's mean over the micro-batches and DP (no stop check inside)
            pairs = ((b.input_ids, b.labels) for b in batches)
            loss = engine.eval_batch(pairs, num_micro_batches=cfg.train.eval_iters)
            engine.train()
            return float(loss)
        for batch in batches:
            if signals is not None:  # preempted: save promptly instead of finishing the pass
                if agreed_max(device, signals.signum or 0)[0] > 0:
                    engine.train()
                    return None
            total += lm_loss(engine, batch)[0].double()
    engine.train()
    total = comm.all_reduce(total, "sum", state.dp_group)
    return total.item() / (cfg.train.eval_iters * state.dp_size)


def agreed_max(device: torch.device | str, *values: float | torch.Tensor) -> list[int]:
    """The largest of each value over every rank, in one all_reduce (collective): a flag or the
    caught stop signal, which every rank must act on alike."""
    stacked = torch.stack([torch.as_tensor(v, dtype=torch.float64, device=device).reshape(()) for v in values])
    return [int(v) for v in comm.all_reduce(stacked, "max", comm.world_group()).tolist()]
