"""What a training run carries from step to step and into its checkpoints.

* ``RunProgress``: iteration, consumed samples, non-finite steps, the last saved step (what a
  checkpoint restores).
* ``ResumePlan``: which checkpoint the run continues (``plan_resume``), checked against the built
  run before DeepSpeed starts (``ResumePlan.check``), and how the engine loads it.
* ``RunRecord``: what is fixed once the run is built (grid, precision, shapes, the configs, the
  batch sizes, the tokenizer, the warm start); ``RunRecord.checkpoint_meta(progress)`` is the
  ``CheckpointMeta`` of a save; ``write_run_files`` puts it in the run directory and the log.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megaflex.checkpoint import (
    CheckpointManager,
    CheckpointMeta,
    check_compatible,
    check_optimizer_groups,
    check_resume_layout,
    needs_repartition,
)
from megaflex.data.card import check_same_tokenizer
from megaflex.training.config import Config
from megaflex.training.optim import group_summary


@dataclass
class RunProgress:
    """How far the run is: steps done, samples consumed (all ranks), skipped steps, last save."""

    iteration: int = 0
    consumed_samples: int = 0
    nonfinite_total: int = 0
    last_saved: int = 0  # the step of the last checkpoint (the resumed one counts)

    @classmethod
    def resumed(cls, meta: CheckpointMeta) -> "RunProgress":
        return cls(meta.iteration, meta.consumed_samples, meta.nonfinite_total or 0, meta.iteration)  # type: ignore[arg-type]

    def advance(self, global_batch_size: int) -> None:
        """One optimizer step done (applied or skipped: a skipped step consumes its data too)."""
        self.iteration += 1
        self.consumed_samples += global_batch_size


@dataclass(frozen=True)
class RunRecord:
    """What every checkpoint of this run records beside its progress, fixed once the run is built."""

    cfg: Config  # recorded resolved (to_dict) in every checkpoint
    state: Any  # megaflex.parallel.ParallelState: the TP x CP x PP x DP grid
    parameter_shapes: dict[str, list[int]]
    num_parameters: int
    deepspeed_config: dict[str, Any]
    optimizer_groups: list[str]
    global_batch_size: int
    gradient_accumulation_steps: int
    tokenizer: dict[str, Any] | None
    init_from: dict[str, Any] | None  # the warm start (a resumed run keeps its checkpoint's)

    def checkpoint_meta(self, progress: RunProgress) -> CheckpointMeta:
        state = self.state
        return CheckpointMeta(
            iteration=progress.iteration, consumed_samples=progress.consumed_samples,
            nonfinite_total=progress.nonfinite_total, world_size=state.world_size,
            tensor_parallel_size=state.tp_size, data_parallel_size=state.dp_size, context_parallel_size=state.cp_size,
            pipeline_parallel_size=state.pp_size if state.pp_size > 1 else None,
            zero_stage=self.cfg.parallel.zero_stage, precision=self.cfg.train.precision,
            parameter_shapes=self.parameter_shapes, num_parameters=self.num_parameters, config=self.cfg.to_dict(),
            deepspeed_config=self.deepspeed_config,
            optimizer_groups=self.optimizer_groups,
            sampler={"consumed_samples": progress.consumed_samples, "global_batch_size": self.global_batch_size},
            tokenizer=self.tokenizer, init_from=self.init_from,
        )


@dataclass
class ResumePlan:
    """The checkpoint this run continues (``path`` None: a fresh start) and how it is loaded."""

    path: Path | None = None
    meta: CheckpointMeta | None = None
    warnings: list[str] = field(default_factory=list)  # printed once the logger exists
    universal: Path | None = None  # the repartitioned (universal) copy the engine loads instead

    @property
    def resuming(self) -> bool:
        return self.path is not None

    def check(self, cfg: Config, state: Any, record: RunRecord, manager: CheckpointManager) -> str | None:
        """Refuse a checkpoint this run cannot continue (model, tokenizer, layout, optimizer groups),
        before the engine is built; a ZeRO repartition goes through its universal copy (the line to log)."""
        if self.path is None or self.meta is None:
            return None
        path, meta = self.path, self.meta
        check_compatible(meta, cfg.to_dict()["model"], record.parameter_shapes, state.tp_size, path)
        check_same_tokenizer(meta.tokenizer, record.tokenizer, f"checkpoint {path}", "this run's tokenizer/data")
        check_resume_layout(meta, path, cfg.parallel.zero_stage, cfg.train.precision, state.pp_size)
        check_optimizer_groups(meta, record.optimizer_groups, path)
        if not needs_repartition(meta, path, cfg.parallel.zero_stage, state.dp_size, state.cp_size, state.tp_size,
                                 cfg.checkpoint.zero_universal_resume):
            return None
        self.universal = manager.universal_copy(path)
        return (f"ZeRO states of {path} repartitioned from {meta.zero_partitions} to "
                f"{state.dp_size * state.cp_size} DP x CP ranks through its universal copy {self.universal}")

    def engine_config(self, ds_config: dict[str, Any]) -> dict[str, Any]:
        """The config ``deepspeed.initialize`` gets: the run's own, told to load the universal copy
        when there is one (only the engine reads that; the recorded ds_config stays the run's)."""
        return ds_config if self.universal is None else dict(ds_config, checkpoint={"load_universal": True})

    def load(self, engine: Any, manager: CheckpointManager, state: Any, tracker: Any) -> tuple[RunProgress, str]:
        """Load the checkpoint into ``engine``; (the resumed progress, the line to log)."""
        assert self.path is not None and self.meta is not None
        meta = self.meta
        same_world = meta.world_size == state.world_size
        manager.load(engine, self.path, tracker, load_rng=same_world, universal=self.universal)
        progress = RunProgress.resumed(meta)
        dp_change = "" if meta.data_parallel_size == state.dp_size else f"; data parallel {meta.data_parallel_size} -> {state.dp_size}"
        return progress, (f"resumed from {self.path} at step {progress.iteration} "
                          f"({progress.consumed_samples} samples consumed{dp_change})")


def plan_resume(cfg: Config, manager: CheckpointManager) -> ResumePlan:
    """The one resume decision (``checkpoint.resume``; checksums verified), before the model's warm start."""
    plan = ResumePlan()
    plan.path, plan.meta = manager.select_resume(cfg.checkpoint.resume, warn=plan.warnings.append)
    return plan


def write_run_files(cfg: Config, state: Any, record: RunRecord, model: Any, device: str, logger: Any,
                    space_warning: str | None) -> None:
    """Rank 0: the resolved config and DeepSpeed config in the run directory, and the run's header lines."""
    run_dir = Path(cfg.logging.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(cfg.to_yaml())
    (run_dir / "ds_config.json").write_text(json.dumps(record.deepspeed_config, indent=1))
    logger.print("resolved config:\n" + cfg.to_yaml())
    logger.print(
        f"world {state.world_size} = TP {state.tp_size} x CP {state.cp_size} x PP {state.pp_size} x DP {state.dp_size} | "
        f"device {device} | ZeRO {cfg.parallel.zero_stage} | {cfg.train.precision} | "
        f"{record.num_parameters / 1e6:.2f}M parameters | global batch {record.global_batch_size} = micro "
        f"{cfg.train.micro_batch_size} x DP {state.dp_size} x accum {record.gradient_accumulation_steps}"
    )
    logger.print(group_summary(model, cfg))
    if state.pp_size > 1 and cfg.logging.kernel_stats_interval:
        logger.print("logging.kernel_stats_interval: no kernel statistics under pipeline parallelism "
                     "(each stage holds only some blocks)")
    if space_warning:
        logger.print(space_warning)
