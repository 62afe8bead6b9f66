"""The training loop on a DeepSpeed engine.

    run(cfg)  # every rank; torch.distributed env vars set by deepspeed/torchrun/Slurm

Order of set-up: distributed init (gloo on CPU, nccl on GPU) -> ``ParallelState`` (TP x CP x DP)
-> seeds (same default RNG on every rank, per-TP-rank tracker stream) -> model through the
layer factory -> warm start (``checkpoint.init_from``, fresh runs only) -> the objective's
set-up (``Objective.prepare``, e.g. distillation) -> AdamW with weight-decay groups ->
``deepspeed.initialize(..., mpu=...)`` with the generated config -> resume -> loop. ``Trainer``
holds the run: ``build()`` does that set-up, ``train()`` is the loop (``train_step``, logging,
``evaluate``, ``save``); fault injection, kernel statistics, the profiler and an ``Objective``
attach as hooks (``megaflex.training.hooks``).

One optimizer step = ``grad_accum`` micro-batches, each ``engine.backward`` + ``engine.step``
(DeepSpeed applies the update at the accumulation boundary). A non-finite micro-batch loss is
masked to zero before backward and the whole step is skipped (``SkippableAdamW.skip``, decided
identically on every rank); a non-finite gradient norm makes DeepSpeed's ZeRO/bf16/fp16
optimizers discard the step (for ZeRO 0 fp32, ``SkippableAdamW`` checks the gradients). Skipped
steps still consume their data; ``train.max_nonfinite_in_a_row`` in a row abort the run.
"""

from __future__ import annotations

import math
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megaflex.checkpoint import (
    CheckpointManager,
    CheckpointMeta,
    check_compatible,
    check_optimizer_groups,
    check_resume_layout,
    needs_repartition,
    parameter_shapes,
    preflight,
)
from megaflex.model.gpt import GPT
from megaflex.parallel import comm
from megaflex.parallel.deferred_init import full_numel, is_partitioned, register_zero3_external_parameters
from megaflex.parallel.launcher_env import local_cuda_device
from megaflex.parallel.rendezvous import free_port
from megaflex.training.build import build_gpt
from megaflex.training.collective_timeout import (
    apply_timeout, every_process_group, parallel_groups, progress, rendezvous_timeout,
)
from megaflex.training.config import (
    Config, ConfigError, check_device, config_warnings, global_batch_size, parallel_dims, resolve_device,
    validate_runtime,
)
from megaflex.data.card import check_same_tokenizer
from megaflex.training.data import (
    batch_documents, build_datasets, check_data_tokenizer, check_document_boundaries, document_eod_id, micro_batches,
)
from megaflex.training.deepspeed_config import (
    deepspeed_config, gradient_accumulation_steps, init_deepspeed_distributed,
)
from megaflex.training.hooks import Objective, TrainerHook, default_hooks
from megaflex.training.metrics import MetricsLogger, device_peak_tflops, flops_per_token, peak_memory_mb
from megaflex.training.nonfinite import (
    NonFiniteAbort, NonFiniteGuard, engine_skipped_steps, skip_reason, unclipped_grad_norm,
)
from megaflex.training.optim import build_optimizer, declare_zero_supported, group_summary, lr_at, set_lr
from megaflex.training.run_lock import hold_run_lock
from megaflex.training.stop_signals import SignalFlag
from megaflex.training.wandb_logger import WandbSink, import_wandb


# The entry points (train.py, distill) take run, shutdown and NonFiniteAbort from here.
__all__ = ["NonFiniteAbort", "Objective", "Trainer", "TrainerHook", "evaluate", "init_distributed", "run", "shutdown"]


def init_distributed(cfg: Config) -> str:
    """Initialise torch.distributed through DeepSpeed; returns the device ("cpu"/"cuda")."""
    check_device(cfg, torch.cuda.is_available())  # before anything touches CUDA
    has_cuda = torch.cuda.is_available() and cfg.train.device != "cpu"
    device = resolve_device(cfg, has_cuda)
    backend = cfg.parallel.backend if cfg.parallel.backend != "auto" else ("nccl" if device == "cuda" else "gloo")
    if "RANK" not in os.environ:  # plain `python -m megaflex.train`: a world of one
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))  # 29500 may be taken by another job
    if device == "cuda":
        torch.cuda.set_device(local_cuda_device(int(os.environ.get("LOCAL_RANK", "0")), torch.cuda.device_count()))
    init_deepspeed_distributed(backend, rendezvous_timeout(cfg.parallel.timeout_minutes))
    validate_runtime(cfg, dist.get_world_size(), has_cuda)
    return device


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


class Trainer:
    """A training run, in the order it happens: ``build()`` (distributed, model, engine, resume,
    data), then ``train()``: per step ``train_step()``, logging, ``evaluate()``, ``save()``.
    Everything optional attaches through ``hooks`` (``megaflex.training.hooks``)."""

    def __init__(self, cfg: Config, objective: Objective | None = None) -> None:
        self.cfg, self.objective = cfg, objective
        self.hooks: list[TrainerHook] = default_hooks(cfg, objective)
        self.run_dir = Path(cfg.logging.run_dir)
        self.iteration, self.consumed, self.nonfinite_total = 0, 0, 0

    def emit(self, event: str, *args: Any) -> None:
        """Run ``event`` on every hook, in order."""
        for hook in self.hooks:
            getattr(hook, event)(self, *args)

    # ---------------------------------------------------------------- build
    def build(self) -> None:
        """Everything before the first step; collective."""
        self._build_model()
        self._build_engine()
        self._load_data_and_resume()
        self.emit("on_start")

    def _build_model(self) -> None:
        from megaflex.parallel import ParallelState, model_parallel_seed

        cfg = self.cfg
        self.device = device = init_distributed(cfg)
        if cfg.logging.wandb is not None:
            import_wandb()  # every rank, before anything is set up: a missing package stops all alike
        self.tokenizer = check_data_tokenizer(cfg)  # recorded with checkpoints; raises DataError at start
        # settings that would have no effect (printed once the logger exists); DataError for an EOD id no token has
        self.start_warnings = config_warnings(cfg) + check_document_boundaries(cfg)
        if self.objective is not None and cfg.parallel.pipeline_parallel_size > 1:
            raise ConfigError("parallel.pipeline_parallel_size: expected 1 with a training objective other than the "
                              f"LM loss (e.g. distillation), got {cfg.parallel.pipeline_parallel_size}")
        self.state = state = ParallelState.create(parallel_dims(cfg, dist.get_world_size()))
        apply_timeout(cfg.parallel.timeout_minutes, parallel_groups(state))
        hold_run_lock(self.run_dir)  # before anything is written to the run directory
        self.rank = dist.get_rank()
        self.is_main = self.rank == 0
        if cfg.train.precision == "bf16" and device == "cpu":
            torch.set_default_dtype(torch.float32)  # DeepSpeed casts the module itself

        # Same default-RNG seed on every rank: replicas start identical and TP shards are cut from
        # identically initialised plain models; the tracker gives each TP rank its own stream.
        self.tracker = model_parallel_seed(cfg.train.seed, state.tp_rank, device=device)
        # Built plain, then parallelised over the grid (feature-map params tagged head-sharded).
        self.model = model = build_gpt(cfg, state, device, self.tracker)
        # The one resume decision (checksums verified; warnings printed once the logger exists).
        self.manager = CheckpointManager(Path(cfg.checkpoint_dir), cfg.checkpoint.keep_last, self.rank,
                                         background=cfg.checkpoint.background)
        self.resume_warnings: list[str] = []
        self.resume_path, self.resume_meta = self.manager.select_resume(
            cfg.checkpoint.resume, warn=self.resume_warnings.append
        )
        # Before the optimizer and DeepSpeed.
        self.init_record = _warm_start(cfg, model, resuming=self.resume_path is not None)
        self.emit("on_model_built")
        self.shapes = parameter_shapes(model)
        self.num_params = _full_parameter_count(model, state.tp_size)
        if state.pp_size > 1:  # parallelise after build: this rank's stage of the whole GPT
            from megaflex.parallel.pipeline import build_pipeline

            self.model = build_pipeline(model, state)

    def _build_engine(self) -> None:
        import deepspeed

        from megaflex.parallel import deepspeed_mpu

        cfg, state, device, model = self.cfg, self.state, self.device, self.model
        dp_size, cp_size = state.dp_size, state.cp_size
        space_warning = preflight(Path(cfg.checkpoint_dir), self.num_params)  # every rank: its own mount
        self.optimizer = optimizer = build_optimizer(cfg, model, device)
        if cfg.parallel.zero_stage == 0 and cfg.train.precision == "fp32" and hasattr(optimizer, "skip"):
            optimizer.check_finite = True  # no ZeRO/bf16 wrapper checks the gradients here
        self.ds_config = ds_config = deepspeed_config(cfg, dp_size, cp_size, on_cuda=device == "cuda")
        self.grad_accum = gradient_accumulation_steps(cfg, dp_size)
        self.gbs = global_batch_size(cfg, dp_size)
        self.logger = logger = MetricsLogger(
            self.run_dir, enabled=self.is_main, tensorboard=cfg.logging.tensorboard,
            progress_bar=cfg.logging.progress_bar, total_steps=cfg.train.train_iters,
        )
        if self.is_main:
            self._write_run_files(space_warning)
        if any(is_partitioned(p) for p in model.parameters()):
            logger.print(f"deferred init: the model was built partitioned over {dp_size * cp_size} DP x CP ranks (ZeRO-3)")
        if self.init_record is not None:
            logger.print(f"initialised {self.init_record['copied']} parameter tensors ({self.init_record['parameters']}) "
                         f"from {self.init_record['path']}; the others keep their init")
        if cfg.parallel.zero_stage == 3:
            register_zero3_external_parameters(model)

        # Resume checks, before the engine.
        for warning in self.start_warnings + self.resume_warnings:
            logger.print(warning)
        self.universal, engine_config = None, ds_config
        path, meta = self.resume_path, self.resume_meta
        if path is not None:
            check_compatible(meta, cfg.to_dict()["model"], self.shapes, state.tp_size, path)
            check_same_tokenizer(meta.tokenizer, self.tokenizer, f"checkpoint {path}", "this run's tokenizer/data")
            check_resume_layout(meta, path, cfg.parallel.zero_stage, cfg.train.precision, state.pp_size)
            check_optimizer_groups(meta, [g["name"] for g in optimizer.param_groups], path)
            if needs_repartition(meta, path, cfg.parallel.zero_stage, dp_size, cp_size, state.tp_size,
                                 cfg.checkpoint.zero_universal_resume):
                self.universal = self.manager.universal_copy(path)
                logger.print(f"ZeRO states of {path} repartitioned from {meta.zero_partitions} to "
                             f"{dp_size * cp_size} DP x CP ranks through its universal copy {self.universal}")
                # Only the engine reads it; the recorded ds_config stays the run's own.
                engine_config = dict(ds_config, checkpoint={"load_universal": True})

        if self.is_main and cfg.logging.wandb is not None:
            logger.add_sink(WandbSink.open(cfg.logging.wandb, self.run_dir, cfg.to_dict(), resuming=path is not None))
        # The pipeline engine brings its own grid (PipelineModule's topology) and takes no mpu.
        mpu = deepspeed_mpu(state) if state.pp_size == 1 else None
        declare_zero_supported(optimizer)  # no "untested optimizer" warning for torch's AdamW
        self.engine, _, _, _ = deepspeed.initialize(
            model=model, optimizer=optimizer, config=engine_config, mpu=mpu, dist_init_required=False
        )
        # DeepSpeed builds groups of its own (e.g. its data-parallel group without an mpu): same timeout.
        apply_timeout(cfg.parallel.timeout_minutes, every_process_group())

    def _write_run_files(self, space_warning: str | None) -> None:
        """Rank 0: the resolved config and DeepSpeed config in the run directory, and the run's header lines."""
        import json

        cfg, state, logger = self.cfg, self.state, self.logger
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "config.yaml").write_text(cfg.to_yaml())
        (self.run_dir / "ds_config.json").write_text(json.dumps(self.ds_config, indent=1))
        logger.print("resolved config:\n" + cfg.to_yaml())
        logger.print(
            f"world {state.world_size} = TP {state.tp_size} x CP {state.cp_size} x PP {state.pp_size} x DP {state.dp_size} | "
            f"device {self.device} | ZeRO {cfg.parallel.zero_stage} | {cfg.train.precision} | "
            f"{self.num_params / 1e6:.2f}M parameters | global batch {self.gbs} = micro {cfg.train.micro_batch_size} "
            f"x DP {state.dp_size} x accum {self.grad_accum}"
        )
        logger.print(group_summary(self.model, cfg))
        if state.pp_size > 1 and cfg.logging.kernel_stats_interval:
            logger.print("logging.kernel_stats_interval: no kernel statistics under pipeline parallelism "
                         "(each stage holds only some blocks)")
        if space_warning:
            logger.print(space_warning)

    def _load_data_and_resume(self) -> None:
        cfg, state = self.cfg, self.state
        train_samples = cfg.train.train_iters * self.gbs
        valid_samples = cfg.train.eval_iters * cfg.train.micro_batch_size * state.dp_size
        self.train_data, self.valid_data = build_datasets(cfg, train_samples, valid_samples, self.rank)
        path, meta = self.resume_path, self.resume_meta
        if path is None:
            return
        same_world = meta.world_size == state.world_size
        self.manager.load(self.engine, path, self.tracker, load_rng=same_world, universal=self.universal)
        self.iteration, self.consumed = meta.iteration, meta.consumed_samples
        self.nonfinite_total = meta.nonfinite_total or 0
        self.init_record = meta.init_from
        self.logger.print(
            f"resumed from {path} at step {self.iteration} ({self.consumed} samples consumed"
            + ("" if meta.data_parallel_size == state.dp_size
               else f"; data parallel {meta.data_parallel_size} -> {state.dp_size}")
            + ")"
        )

    # ---------------------------------------------------------------- the loop
    def train(self) -> dict[str, Any]:
        """The step loop, then the final save and validation; returns the run's summary."""
        cfg = self.cfg
        self._start_loop()
        try:
            stop_reason = self._run_steps()
        except NonFiniteAbort:  # decided alike on every rank: the save in flight is kept
            self._saved(self.manager.finish())
            raise
        finally:
            self.train_batches.close()  # also when a step raises: no reader thread outlives the loop
        self.emit("on_loop_end")

        if (stop_reason != "done" or cfg.checkpoint.save_at_end) and self.last_saved != self.iteration:
            self.save()
        self._saved(self.manager.finish())  # the background save in flight (a stop signal waits for it too)
        self.emit("on_train_end", stop_reason)
        valid_loss = None
        evaluated_last = bool(cfg.train.eval_interval) and self.iteration % cfg.train.eval_interval == 0
        if stop_reason == "done" and self.valid_data is not None and not evaluated_last:
            valid_loss = self.evaluate()
        tensorboard = f"TensorBoard {self.run_dir / 'tensorboard'}, " if cfg.logging.tensorboard else ""
        self.logger.print(
            f"training stopped ({stop_reason}) at step {self.iteration}; metrics {self.run_dir / 'metrics.jsonl'}, "
            f"{tensorboard}checkpoints {cfg.checkpoint_dir}"
        )
        self.logger.close()
        return {"iteration": self.iteration, "stop_reason": stop_reason, "valid_loss": valid_loss,
                "nonfinite_total": self.nonfinite_total}

    def _run_steps(self) -> str:
        """Steps until ``train.train_iters`` or a stop signal; returns why the loop stopped."""
        cfg = self.cfg
        while self.iteration < cfg.train.train_iters:
            self.emit("on_step_start", self.iteration + 1)
            step = self.train_step()
            self._saved(self.manager.advance(step.checkpoint_write))  # a background save every rank has written
            self.emit("on_step_applied", self.iteration)
            if self.iteration % cfg.logging.log_interval == 0 or step.skipped or self.iteration == cfg.train.train_iters:
                self.log_step(step)
            stop_signal = step.stop_signal
            if cfg.train.eval_interval and self.iteration % cfg.train.eval_interval == 0 and self.valid_data is not None:
                if self.evaluate() is None:
                    # Preempted mid-validation (every rank agreed there): stop after saving this step.
                    stop_signal = stop_signal or self._agreed_signal()
            if cfg.checkpoint.save_interval and self.iteration % cfg.checkpoint.save_interval == 0:
                self.save()
                # A signal caught during the save (saves are long: preemption notices often land there)
                # stops the run now, with this checkpoint, not after one more step and another save.
                stop_signal = stop_signal or self._agreed_signal()
            self.emit("on_step_end", self.iteration)
            if stop_signal > 0:
                return f"signal {signal.Signals(stop_signal).name}"
        return "done"

    def _start_loop(self) -> None:
        # Host reads of device values (each one waits for the GPU): one per step in this loop, the
        # step's agreed flags (any rank's non-finite loss, a caught signal) before the update; the
        # losses, sums and the gradient norm stay on the device until a step is logged (and fp32
        # runs read the gradient norm per step: nothing else there notices a non-finite one).
        cfg, state = self.cfg, self.state
        self.signals = SignalFlag(cfg.checkpoint.save_on_signal)
        self.flops_per_token = flops_per_token(cfg.model, cfg.data.seq_len, self.num_params)
        self.peak_tflops = device_peak_tflops(cfg.logging.peak_tflops, self.device)
        self.last_saved = self.iteration
        self.guard = NonFiniteGuard(cfg.train.max_nonfinite_in_a_row, self.nonfinite_total, cfg.checkpoint_dir)
        # ZeRO 0 in fp32 has no DeepSpeed optimizer wrapper that records the gradient norm.
        self.plain_fp32 = cfg.parallel.zero_stage == 0 and cfg.train.precision == "fp32"
        self.t_last = time.time()
        self.train_batches = micro_batches(
            self.train_data, self.consumed, cfg.train.micro_batch_size,
            self.grad_accum * (cfg.train.train_iters - self.iteration), state.dp_rank, state.dp_size, self.device,
            state.cp_rank, state.cp_size, document_eod_id(cfg),
        )
        if state.pp_size > 1:
            from megaflex.parallel.pipeline import stage_batches

            self.pipeline_batches = stage_batches(self.train_batches)
        self.zero = torch.zeros((), dtype=torch.float64, device=self.device)
        self.micro_batch_loss = self._lm_loss if self.objective is None else self._objective_loss

    def _lm_loss(self, batch: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        ids, labels = batch[:2]
        return self.engine(ids, labels, documents=batch_documents(batch, self.cfg.data.reset_positions)).loss, {}

    def _objective_loss(self, batch: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return self.objective.loss(self.engine, *batch[:2])

    def train_step(self) -> StepResult:
        """One optimizer step: ``grad_accum`` micro-batches, forward, backward, update."""
        from megaflex.attention import redraw_random_features

        cfg, engine, optimizer, step = self.cfg, self.engine, self.optimizer, self.iteration + 1
        engine.train()
        lr = lr_at(cfg, self.iteration)
        set_lr(engine.optimizer, lr)
        skipped_before = engine_skipped_steps(engine)
        progress.at(step, "forward/backward (ZeRO gradient reduction) and optimizer step")
        pipelined = self.state.pp_size > 1
        sums = self._pipeline_micro_batches(step) if pipelined else self._micro_batches(step)
        if hasattr(optimizer, "skip"):
            optimizer.skip = False
        grad_norm = sums.own_grad_norm if self.plain_fp32 and not pipelined else engine.get_global_grad_norm()
        engine_skipped = engine_skipped_steps(engine) > skipped_before  # overflow: DeepSpeed discarded the step
        # DeepSpeed checks bf16/fp16 gradients itself (a skip above); in fp32 only the norm tells.
        grad_bad = cfg.train.precision == "fp32" and grad_norm is not None and not math.isfinite(float(grad_norm))
        reason = skip_reason(sums.skipped_loss, engine_skipped, grad_bad or getattr(optimizer, "skipped_nonfinite_grad", False))
        self.iteration += 1
        self.consumed += self.gbs
        redraw_random_features(engine.module, self.iteration)  # Performer redraws (deterministic in the step)
        line = self.guard.record(self.iteration, reason)  # raises NonFiniteAbort after too many in a row
        if reason is not None:
            self.logger.print(line)
        self.nonfinite_total = self.guard.total
        return StepResult(lr, sums.loss_sum, sums.extra_sums, grad_norm, reason is not None, sums.skipped_loss,
                          sums.stop_signal, sums.checkpoint_write)

    def _pipeline_micro_batches(self, step: int) -> StepSums:
        """DeepSpeed's pipeline engine runs the grad_accum micro-batches (1F1B), the reductions and
        the update; its loss is the step's mean, averaged over DP, on every stage."""
        sums = StepSums(self.zero.clone(), self.zero.clone())
        loss = self.engine.train_batch(self.pipeline_batches).detach()
        finite = torch.isfinite(loss)
        sums.bad += (~finite).double()
        sums.loss_sum += torch.where(finite, loss, 0.0).double() * self.grad_accum
        sums.skipped_loss, sums.stop_signal, sums.checkpoint_write = self._agreed_flags(step, sums.bad)
        return sums

    def _micro_batches(self, step: int) -> StepSums:
        """The grad_accum micro-batches' forward and backward, then the update (one device's engine)."""
        engine, optimizer = self.engine, self.optimizer
        sums = StepSums(self.zero.clone(), self.zero.clone())
        for _ in range(self.grad_accum):
            loss, extras = self.micro_batch_loss(next(self.train_batches))
            for key, value in extras.items():
                sums.extra_sums[key] = sums.extra_sums.get(key, self.zero) + value.detach().double()
            for hook in self.hooks:
                loss = hook.on_loss(self, step, loss)
            finite = torch.isfinite(loss.detach())
            sums.bad += (~finite).double()
            sums.loss_sum += torch.where(finite, loss.detach(), 0.0).double()
            # Masked, not dropped: every rank must run the same backward/step sequence. The loss is the
            # whole sequence's but each CP rank differentiates its own slice's share; DeepSpeed averages
            # gradients over DP x CP, so x CP turns that average into the sum over the slices.
            engine.backward(torch.where(finite, loss, torch.zeros_like(loss)) * self.state.cp_size)
            if engine.is_gradient_accumulation_boundary():
                # Decided on every rank alike before the update (the last micro-batch is the boundary);
                # a caught signal travels in the same read and stops the run after this step.
                sums.skipped_loss, sums.stop_signal, sums.checkpoint_write = self._agreed_flags(step, sums.bad)
                progress.at(step, "optimizer step (ZeRO gradient reduction)")
                if hasattr(optimizer, "skip"):
                    optimizer.skip = sums.skipped_loss
                if self.plain_fp32:  # DeepSpeed clips here without keeping the norm: measure it before the step
                    sums.own_grad_norm = unclipped_grad_norm(engine)
            engine.step()
        return sums

    def _agreed_flags(self, step: int, bad: torch.Tensor) -> tuple[bool, int, int]:
        """(any rank's loss non-finite, the caught signal, the background save's status), agreed over
        every rank in one read."""
        progress.at(step, "the step's flag all_reduce (non-finite loss, stop signal, checkpoint write)")
        skipped, signal_number, write = agreed_max(self.device, bad, self.signals.signum or 0, self.manager.writer_status())
        return skipped > 0, signal_number, write

    def log_step(self, step: StepResult) -> None:
        """The step's train record: losses summed over data parallelism (one read), throughput, memory."""
        cfg, state = self.cfg, self.state
        now = time.time()
        elapsed = max(now - self.t_last, 1e-9)
        self.t_last = now
        steps = cfg.logging.log_interval if self.iteration % cfg.logging.log_interval == 0 else 1
        tok_s = self.gbs * cfg.data.seq_len * steps / elapsed
        tflops = self.flops_per_token * tok_s / state.world_size / 1e12
        names = sorted(step.extra_sums)
        progress.at(self.iteration, "the loss all_reduce")
        sums = comm.all_reduce(torch.stack([step.loss_sum, *(step.extra_sums[k] for k in names)]), "sum", state.dp_group)
        loss_avg, *extra_values = (v / (self.grad_accum * state.dp_size) for v in sums.tolist())
        nan = float("nan")
        record = {
            "kind": "train", "step": self.iteration, "loss": loss_avg if not step.skipped_loss else nan,
            "ppl": math.exp(min(loss_avg, 50.0)) if not step.skipped_loss else nan, "lr": step.lr,
            "grad_norm": None if step.grad_norm is None else float(step.grad_norm), "tokens_per_s": tok_s,
            "tflops_per_device": tflops, "consumed_samples": self.consumed,
            "tokens": self.consumed * cfg.data.seq_len, "skipped": step.skipped,
            "nonfinite_total": self.nonfinite_total, "memory_mb": peak_memory_mb(self.device),
            **dict(zip(names, extra_values)),
        }
        if self.peak_tflops:
            record["mfu"] = tflops / self.peak_tflops
        self.logger.log(record)

    def evaluate(self) -> float | None:
        """Validation loss at this step, logged; None when a stop signal cut the pass short."""
        loss = evaluate(self.cfg, self.engine, self.valid_data, self.state, self.device, self.signals)
        if loss is None:
            self.logger.print(f"validation at step {self.iteration} stopped by a signal (not logged)")
            return None
        self.logger.log({"kind": "valid", "step": self.iteration, "loss": loss, "ppl": math.exp(min(loss, 50.0))})
        return loss

    def _agreed_signal(self) -> int:
        return agreed_max(self.device, self.signals.signum or 0)[0]

    def save(self) -> None:
        """Collective: the checkpoint of this step, committed atomically (``checkpoint.background``:
        written in the background, committed at a later step or when ``train`` finishes it)."""
        cfg, state, step = self.cfg, self.state, self.iteration
        progress.at(step, "checkpoint save")
        self._saved(self.manager.finish())  # at most one save in flight: the previous one first
        meta = CheckpointMeta(
            iteration=step, consumed_samples=self.consumed, nonfinite_total=self.nonfinite_total,
            world_size=state.world_size, tensor_parallel_size=state.tp_size, data_parallel_size=state.dp_size,
            context_parallel_size=state.cp_size, pipeline_parallel_size=state.pp_size if state.pp_size > 1 else None,
            zero_stage=cfg.parallel.zero_stage, precision=cfg.train.precision,
            parameter_shapes=self.shapes, num_parameters=self.num_params, config=cfg.to_dict(),
            deepspeed_config=self.ds_config, optimizer_groups=[g["name"] for g in self.optimizer.param_groups],
            sampler={"consumed_samples": self.consumed, "global_batch_size": self.gbs}, tokenizer=self.tokenizer,
            init_from=self.init_record,
        )
        start = time.time()
        path = self.manager.save(self.engine, step, meta, self.tracker)
        self.last_saved = step
        took = f"{time.time() - start:.2f} s"  # the time training stood still for it
        if path is None:
            self.logger.print(f"saving checkpoint of step {step} in the background (state copied in {took})")
        self._saved(path, took)

    def _saved(self, path: Path | None, took: str = "written in the background") -> None:
        if path is not None:
            self.logger.print(f"saved checkpoint {path} ({took})")


def run(cfg: Config, objective: Objective | None = None) -> dict[str, Any]:
    """Train as configured (``objective``: the loss and its set-up, default the LM loss);
    returns a summary (rank 0's numbers) when training ends."""
    trainer = Trainer(cfg, objective)
    trainer.build()
    return trainer.train()


# -------------------------------------------------------------------------------- helpers
def _warm_start(cfg: Config, model: GPT, resuming: bool) -> dict[str, Any] | None:
    """``checkpoint.init_from`` at a fresh start (not when this run resumes its own checkpoint):
    copy the selected parameters into ``model``. Returns the record kept in checkpoint metadata."""
    from megaflex.training.weights import init_from_checkpoint

    c = cfg.checkpoint
    if c.init_from is None or resuming:
        return None
    copied, source = init_from_checkpoint(model, c.init_from, c.init_parameters)
    return {"path": str(source), "parameters": c.init_parameters, "copied": len(copied)}


def _full_parameter_count(model: torch.nn.Module, tp_size: int) -> int:
    """Parameters of the whole model (TP shards counted once per shard, replicated ones once)."""
    from megaflex.parallel import is_tensor_parallel

    return sum(full_numel(p) * (tp_size if tp_size > 1 and is_tensor_parallel(p) else 1) for p in model.parameters())


@torch.no_grad()
def evaluate(cfg: Config, engine: Any, dataset: Any, state: Any, device: str, signals: Any = None) -> float | None:
    """Mean validation loss over ``train.eval_iters`` micro-batches per data-parallel rank; None
    when a stop signal (``signals.signum``, agreed over all ranks per batch) cuts it short."""
    engine.eval()
    progress.at(progress.step, "validation")
    total = torch.zeros((), dtype=torch.float64, device=device)
    with micro_batches(
        dataset, 0, cfg.train.micro_batch_size, cfg.train.eval_iters, state.dp_rank, state.dp_size, device,
        state.cp_rank, state.cp_size, document_eod_id(cfg),
    ) as batches:
        if state.pp_size > 1:  # the pipeline engine's mean over the micro-batches and DP (no stop check inside)
            from megaflex.parallel.pipeline import stage_batches

            loss = engine.eval_batch(stage_batches(batches), num_micro_batches=cfg.train.eval_iters)
            engine.train()
            return float(loss)
        for ids, labels, *positions in batches:
            if signals is not None:  # preempted: save promptly instead of finishing the pass
                if agreed_max(device, signals.signum or 0)[0] > 0:
                    engine.train()
                    return None
            documents = batch_documents((ids, labels, *positions), cfg.data.reset_positions)
            total += engine(ids, labels, documents=documents).loss.double()
    engine.train()
    total = comm.all_reduce(total, "sum", state.dp_group)
    return total.item() / (cfg.train.eval_iters * state.dp_size)


def agreed_max(device: torch.device, *values: float | torch.Tensor) -> list[int]:
    """The largest of each value over every rank, in one all_reduce (collective): a flag or the
    caught stop signal, which every rank must act on alike."""
    stacked = torch.stack([torch.as_tensor(v, dtype=torch.float64, device=device).reshape(()) for v in values])
    return [int(v) for v in comm.all_reduce(stacked, "max", comm.world_group()).tolist()]


def shutdown(clean: bool) -> None:
    """End a distributed program cleanly (a missing destroy aborts ~1 in 4 gloo runs at exit).

    After an error (``clean`` False) peers may be gone, so no barrier then: destroy only."""
    if dist.is_available() and dist.is_initialized():
        if clean:
            dist.barrier()
        dist.destroy_process_group()
