"""What attaches to the training loop without being part of it: ``TrainerHook`` and the hooks
``Trainer`` installs from the config (fault injection, kernel statistics, the profiler) or from
its caller (an ``Objective``, e.g. distillation).

Events, in the order a run emits them (every method is optional; ``BaseHook`` has no-ops):
``on_model_built`` (after the warm start, before the optimizer) -> ``on_start`` (engine built,
resumed, data ready) -> per step ``on_step_start`` -> ``on_loss`` (per micro-batch, may replace
the loss) -> ``on_step_applied`` (after the update, before the step is logged) -> ``on_step_end``
(after validation and the save) -> ``on_loop_end`` (before the final save) -> ``on_train_end``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path
from typing import Any, ContextManager, Protocol

import torch
import torch.distributed as dist

from megaflex.model.gpt import GPT
from megaflex.model.kernel_stats import kernel_snapshot
from megaflex.parallel.comm import all_gather_objects, is_distributed
from megaflex.training.config import Config, ConfigError
from megaflex.training.batches import BatchLayout, batch_stream
from megaflex.training.profiling import StepProfiler


class Objective(Protocol):
    """What a run optimises, when not the plain LM loss (e.g. ``megaflex.training.distill``)."""

    def prepare(self, model: GPT, cfg: Config) -> None:
        """After the warm start, before the optimizer: freeze parameters, add adapters, build a teacher."""

    def loss(self, engine: Any, ids: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """One micro-batch: (loss to differentiate, named scalars averaged over the step and logged)."""

    def finish(self, engine: Any, iteration: int) -> None:
        """Collective, after the last save: e.g. export merged weights."""


class TrainerView(Protocol):
    """What a hook sees of ``megaflex.training.trainer.Trainer`` (a protocol, so that this module,
    which the trainer imports, needs nothing from it)."""

    cfg: Config
    device: torch.device
    rank: int
    run_dir: Path
    state: Any  # megaflex.parallel.state.ParallelState
    model: Any  # the GPT, or its pipeline module
    engine: Any  # DeepSpeed's engine
    manager: Any  # megaflex.checkpoint.CheckpointManager
    logger: Any  # megaflex.training.metrics.MetricsLogger
    progress: Any  # megaflex.training.run_state.RunProgress
    throughput: Any  # megaflex.training.metrics.Throughput
    resume: Any  # megaflex.training.run_state.ResumePlan
    data: Any  # megaflex.training.data.Datasets


class TrainerHook(Protocol):
    """Something that attaches to ``Trainer`` (see the module docstring for when each event runs)."""

    def on_model_built(self, trainer: TrainerView) -> None: ...
    def on_start(self, trainer: TrainerView) -> None: ...
    def on_step_start(self, trainer: TrainerView, step: int) -> None: ...
    def on_loss(self, trainer: TrainerView, step: int, loss: torch.Tensor) -> torch.Tensor: ...
    def on_step_applied(self, trainer: TrainerView, step: int) -> None: ...
    def on_step_end(self, trainer: TrainerView, step: int) -> None: ...
    def on_loop_end(self, trainer: TrainerView) -> None: ...
    def on_train_end(self, trainer: TrainerView, stop_reason: str) -> None: ...


class BaseHook:
    """No-op implementations of every ``TrainerHook`` event."""

    def on_model_built(self, trainer: TrainerView) -> None:
        pass

    def on_start(self, trainer: TrainerView) -> None:
        pass

    def on_step_start(self, trainer: TrainerView, step: int) -> None:
        pass

    def on_loss(self, trainer: TrainerView, step: int, loss: torch.Tensor) -> torch.Tensor:
        return loss

    def on_step_applied(self, trainer: TrainerView, step: int) -> None:
        pass

    def on_step_end(self, trainer: TrainerView, step: int) -> None:
        pass

    def on_loop_end(self, trainer: TrainerView) -> None:
        pass

    def on_train_end(self, trainer: TrainerView, stop_reason: str) -> None:
        pass


class ObjectiveHook(BaseHook):
    """An ``Objective``'s set-up and finish; its loss replaces the LM loss (``training.step.objective_loss``)."""

    def __init__(self, objective: Objective) -> None:
        self.objective = objective

    def on_model_built(self, trainer: TrainerView) -> None:
        if trainer.cfg.data.document_boundaries != "none":  # the objectives' losses take no document structure yet
            raise ConfigError(
                f"data.document_boundaries: expected 'none' with {type(self.objective).__name__}, got 'reset'"
            )
        self.objective.prepare(trainer.model, trainer.cfg)

    def on_train_end(self, trainer: TrainerView, stop_reason: str) -> None:
        if stop_reason == "done":
            self.objective.finish(trainer.engine, trainer.progress.iteration)


class FaultInjectionHook(BaseHook):
    """The ``fault.*`` settings (tests of the failure paths): a NaN loss or an infinite gradient at
    given steps (rank 0), SIGKILL after a step or inside a save, SIGSTOP of the last rank."""

    def __init__(self, cfg: Config) -> None:
        self.fault = cfg.fault
        self.nan_loss = self.inf_grad = False

    def on_model_built(self, trainer: TrainerView) -> None:
        kill_step, term_step = self.fault.sigkill_during_save_at_step, self.fault.sigterm_during_save_at_step
        # A background save's faults strike its writer thread mid-write, while training goes on.
        moment = "during_write" if trainer.cfg.checkpoint.background else "before_commit"
        if kill_step is not None:
            # The first rank to get there kills every rank of its node at once: ranks that died one by one
            # would let a survivor see its peer gone in a collective and exit with an error first.
            node_ranks = _node_rank_pids()
            setattr(trainer.manager, moment, lambda it: _sigkill(node_ranks) if it == kill_step else None)
        elif term_step is not None:
            setattr(trainer.manager, moment, lambda it: os.kill(os.getpid(), signal.SIGTERM) if it == term_step else None)
        if self.fault.sigterm_during_startup:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(60)  # the start-up guard ends the process meanwhile; after this, start-up would go on

    def on_step_start(self, trainer: TrainerView, step: int) -> None:
        self.nan_loss = step in self.fault.nan_loss_at_steps and trainer.rank == 0
        self.inf_grad = step in self.fault.inf_grad_at_steps and trainer.rank == 0

    def on_loss(self, trainer: TrainerView, step: int, loss: torch.Tensor) -> torch.Tensor:
        if self.nan_loss:
            loss = loss + float("nan")
        if self.inf_grad:
            loss = _InfiniteGradient.apply(loss)
        return loss

    def on_step_end(self, trainer: TrainerView, step: int) -> None:
        if self.fault.sigkill_after_step == step:
            dist.barrier()  # rank 0 has logged the step
            _sigkill()
        if self.fault.sigstop_last_rank_after_step == step and trainer.rank == dist.get_world_size() - 1:
            os.kill(os.getpid(), signal.SIGSTOP)  # a frozen peer: the others' next collective times out


class KernelStatsHook(BaseHook):
    """``logging.kernel_stats_interval``: per-layer kernel statistics, change since the initial kernel."""

    def __init__(self, interval: int) -> None:
        self.interval = interval
        self.reference: dict[str, torch.Tensor] = {}
        self.probe: torch.Tensor | None = None

    def on_model_built(self, trainer: TrainerView) -> None:
        with _kernel_parameters_whole(trainer.model):  # a deferred (ZeRO-3) build is partitioned already
            self.reference = kernel_snapshot(trainer.model)  # the init; replaced on resume

    def on_start(self, trainer: TrainerView) -> None:
        cfg = trainer.cfg
        self.reference = _kernel_reference(self.reference, trainer.run_dir, trainer.state,
                                           fresh=not trainer.resume.resuming)
        data = trainer.data.valid or trainer.data.train
        with batch_stream(data, BatchLayout(min(2, cfg.train.micro_batch_size)), trainer.device, count=1) as batches:
            self.probe = next(batches).input_ids

    def on_step_applied(self, trainer: TrainerView, step: int) -> None:
        if step % self.interval == 0:
            with _kernel_parameters_whole(trainer.engine.module):
                kernel = trainer.engine.module.kernel_statistics(self.probe, self.reference)
            trainer.logger.log({"kind": "kernel", "step": step, **kernel})


class ProfilerHook(BaseHook):
    """``logging.profile``: a torch profiler window over the configured steps (``StepProfiler``)."""

    def __init__(self) -> None:
        self.profiler: StepProfiler | None = None

    def on_start(self, trainer: TrainerView) -> None:
        settings = trainer.cfg.logging.profile
        iteration = trainer.progress.iteration
        if settings is not None and iteration >= settings.start:  # the window opens at its first step only
            trainer.logger.print(
                f"WARNING: logging.profile: steps {settings.start}-{settings.start + settings.steps - 1} are not "
                f"profiled, this run resumed at step {iteration}; "
                f"set logging.profile.start above {iteration} to profile"
            )
        self.profiler = StepProfiler(trainer.cfg.logging.profile, trainer.engine.module, trainer.run_dir / "profile",
                                     trainer.rank, trainer.device, trainer.logger.print)

    def on_step_start(self, trainer: TrainerView, step: int) -> None:
        self.profiler.step_starts(step)

    def on_step_end(self, trainer: TrainerView, step: int) -> None:
        trainer.throughput.exclude(self.profiler.step_ended(step))  # writing the trace is not training time

    def on_loop_end(self, trainer: TrainerView) -> None:
        self.profiler.close()


def default_hooks(cfg: Config, objective: Objective | None) -> list[TrainerHook]:
    """The hooks a run's config asks for, in the order their events run."""
    hooks: list[TrainerHook] = [] if objective is None else [ObjectiveHook(objective)]
    # Under pipeline parallelism each stage holds only some blocks: no statistics (the trainer says so).
    if cfg.logging.kernel_stats_interval and cfg.parallel.pipeline_parallel_size == 1:
        hooks.append(KernelStatsHook(cfg.logging.kernel_stats_interval))
    hooks += [ProfilerHook(), FaultInjectionHook(cfg)]
    return hooks


class _InfiniteGradient(torch.autograd.Function):
    """Fault injection: identity forward, infinite gradient backward (a finite loss that overflows)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return grad * float("inf")


def _node_rank_pids() -> list[int]:
    """The process ids of this node's ranks (a collective: every rank calls it), this process's last."""
    me = (os.uname().nodename, os.getpid())
    ranks = all_gather_objects(me) if is_distributed() else [me]
    return [pid for node, pid in ranks if node == me[0] and pid != me[1]] + [me[1]]


def _sigkill(pids: list[int] | None = None) -> None:
    for pid in pids or [os.getpid()]:  # this process last
        with contextlib.suppress(ProcessLookupError):  # a peer that got there first
            os.kill(pid, signal.SIGKILL)


def _kernel_reference(
    snapshot: dict[str, torch.Tensor], run_dir: Path, state: Any, fresh: bool
) -> dict[str, torch.Tensor]:
    """Kernel parameters at step 0, kept in ``run_dir/kernel_init_tp{rank}.pt`` so a resumed run
    still reports the change since the real init (a resume without the file: since the resume)."""
    path = run_dir / f"kernel_init_tp{state.tp_rank}.pt"
    if not fresh and path.is_file():
        return torch.load(path, map_location="cpu")
    if state.dp_rank == 0 and snapshot:
        run_dir.mkdir(parents=True, exist_ok=True)
        torch.save(snapshot, path)
    return snapshot


def _kernel_parameters_whole(module: torch.nn.Module) -> ContextManager[Any]:
    """Context in which the kernel parameters are whole on every rank: gathered (collective) when
    ZeRO 3 has partitioned them, else as they are."""
    from megaflex.attention import named_kernel_parameters

    params = [kp.param for _, kp in named_kernel_parameters(module)]
    if not any(hasattr(p, "ds_id") for p in params):  # DeepSpeed tags the parameters it partitions
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(params, modifier_rank=None)
