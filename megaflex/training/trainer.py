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

One optimizer step (``megaflex.training.step``): ``grad_accum`` micro-batches, then the update; a
non-finite gradient norm makes DeepSpeed's ZeRO/bf16/fp16 optimizers discard the step (for ZeRO 0
fp32, ``SkippableAdamW`` checks the gradients). Skipped steps still consume their data;
``train.max_nonfinite_in_a_row`` in a row abort the run.
"""

from __future__ import annotations

import math
import os
import signal
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megaflex.checkpoint import CheckpointManager, parameter_shapes, preflight
from megaflex.parallel import comm
from megaflex.parallel.deferred_init import is_partitioned, register_zero3_external_parameters
from megaflex.parallel.launcher_env import local_cuda_device
from megaflex.parallel.rendezvous import free_port
from megaflex.training.batches import BatchLayout, batch_stream
from megaflex.training.build import build_gpt, full_parameter_count
from megaflex.training.collective_timeout import (
    apply_timeout, every_process_group, parallel_groups, rendezvous_timeout,
)
from megaflex.training.collective_timeout import progress as collective_progress
from megaflex.training.config import (
    Config, ConfigError, check_device, config_warnings, global_batch_size, parallel_dims, resolve_device,
    validate_runtime,
)
from megaflex.training.data import build_datasets, check_data_tokenizer, check_document_boundaries
from megaflex.training.deepspeed_config import (
    deepspeed_config, gradient_accumulation_steps, init_deepspeed_distributed,
)
from megaflex.training.hooks import Objective, TrainerHook, default_hooks
from megaflex.training.metrics import MetricsLogger, Throughput, device_peak_tflops, flops_per_token, peak_memory_mb
from megaflex.training.nonfinite import NonFiniteAbort, NonFiniteGuard, engine_skipped_steps, skip_reason
from megaflex.training.optim import build_optimizer, declare_zero_supported, lr_at, set_lr
from megaflex.training.run_lock import hold_run_lock
from megaflex.training.run_state import RunProgress, RunRecord, plan_resume, write_run_files
from megaflex.training.stop_signals import SignalFlag
from megaflex.training.step import StepResult, StepRunner, agreed_max, evaluate, lm_loss, objective_loss
from megaflex.training.wandb_logger import WandbSink, import_wandb
from megaflex.training.weights import warm_start_from

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


class Trainer:
    """A training run, in the order it happens: ``build()`` (distributed, model, engine, resume,
    data), then ``train()``: per step ``train_step()``, logging, ``evaluate()``, ``save()``.
    Everything optional attaches through ``hooks`` (``megaflex.training.hooks``).

    Its parts: ``progress`` (``RunProgress``), ``resume`` (``ResumePlan``), ``record``
    (``RunRecord``: what checkpoints record), ``runner`` (``StepRunner``: forward/backward and the
    update), ``throughput`` (``metrics.Throughput``), ``guard`` (non-finite steps)."""

    def __init__(self, cfg: Config, objective: Objective | None = None) -> None:
        self.cfg, self.objective = cfg, objective
        self.hooks: list[TrainerHook] = default_hooks(cfg, objective)
        self.progress = RunProgress()

    @property
    def run_dir(self) -> Path:
        return Path(self.cfg.logging.run_dir)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def emit(self, event: str, *args: Any) -> None:
        """Run ``event`` on every hook, in order."""
        for hook in self.hooks:
            getattr(hook, event)(self, *args)

    # ---------------------------------------------------------------- build
    def build(self) -> None:
        """Everything before the first step; collective."""
        start_warnings, tokenizer, ds_config = self._build_model()
        self._build_optimizer(tokenizer, ds_config)
        self._build_engine(start_warnings)
        self._load_data_and_resume()
        self.emit("on_start")

    def _build_model(self) -> tuple[list[str], dict[str, Any] | None, dict[str, Any]]:
        """Distributed set-up, the model and the resume decision; returns the start-up warnings
        (printed once the logger exists), the tokenizer record and the DeepSpeed config."""
        from megaflex.parallel import ParallelState, model_parallel_seed

        cfg = self.cfg
        self.device = device = init_distributed(cfg)
        if cfg.logging.wandb is not None:
            import_wandb()  # every rank, before anything is set up: a missing package stops all alike
        tokenizer = check_data_tokenizer(cfg)  # raises DataError at start
        # settings that would have no effect; DataError for an EOD id no token has
        start_warnings = config_warnings(cfg) + check_document_boundaries(cfg)
        if self.objective is not None and cfg.parallel.pipeline_parallel_size > 1:
            raise ConfigError("parallel.pipeline_parallel_size: expected 1 with a training objective other than the "
                              f"LM loss (e.g. distillation), got {cfg.parallel.pipeline_parallel_size}")
        self.state = state = ParallelState.create(parallel_dims(cfg, dist.get_world_size()))
        apply_timeout(cfg.parallel.timeout_minutes, parallel_groups(state))
        hold_run_lock(self.run_dir)  # before anything is written to the run directory
        self.rank = dist.get_rank()
        if cfg.train.precision == "bf16" and device == "cpu":
            torch.set_default_dtype(torch.float32)  # DeepSpeed casts the module itself

        # Same default-RNG seed on every rank: replicas start identical and TP shards are cut from
        # identically initialised plain models; the tracker gives each TP rank its own stream.
        self.tracker = model_parallel_seed(cfg.train.seed, state.tp_rank, device=device)
        # Built plain, then parallelised over the grid (feature-map params tagged head-sharded).
        ds_config = deepspeed_config(cfg, state.dp_size, state.cp_size, on_cuda=device == "cuda")
        self.model = build_gpt(cfg, state, device, self.tracker, ds_config)
        self.manager = CheckpointManager(Path(cfg.checkpoint_dir), cfg.checkpoint.keep_last, self.rank,
                                         background=cfg.checkpoint.background)
        self.resume = plan_resume(cfg, self.manager)
        return start_warnings, tokenizer, ds_config

    def _build_optimizer(self, tokenizer: dict[str, Any] | None, ds_config: dict[str, Any]) -> None:
        """The warm start, the objective's set-up (hooks), the optimizer, the run's record and logger."""
        cfg, state, device, model = self.cfg, self.state, self.device, self.model
        dp_size, cp_size = state.dp_size, state.cp_size
        warm_start = warm_start_from(cfg, model, resuming=self.resume.resuming)  # before the optimizer
        self.emit("on_model_built")
        shapes, num_params = parameter_shapes(model), full_parameter_count(model, state.tp_size)
        if state.pp_size > 1:  # parallelise after build: this rank's stage of the whole GPT
            from megaflex.parallel.pipeline import build_pipeline

            self.model = model = build_pipeline(model, state)
        space_warning = preflight(Path(cfg.checkpoint_dir), num_params)  # every rank: its own mount
        self.optimizer = optimizer = build_optimizer(cfg, model, device)
        if cfg.parallel.zero_stage == 0 and cfg.train.precision == "fp32" and hasattr(optimizer, "skip"):
            optimizer.check_finite = True  # no ZeRO/bf16 wrapper checks the gradients here
        self.record = RunRecord(
            cfg, state, shapes, num_params, ds_config, [g["name"] for g in optimizer.param_groups],
            global_batch_size(cfg, dp_size), gradient_accumulation_steps(cfg, dp_size), tokenizer,
            init_from=self.resume.meta.init_from if self.resume.meta is not None else warm_start,
        )
        self.logger = logger = MetricsLogger(
            self.run_dir, enabled=self.is_main, tensorboard=cfg.logging.tensorboard,
            progress_bar=cfg.logging.progress_bar, total_steps=cfg.train.train_iters,
        )
        if self.is_main:
            write_run_files(cfg, state, self.record, self.model, self.device, logger, space_warning)
        if any(is_partitioned(p) for p in model.parameters()):
            logger.print(f"deferred init: the model was built partitioned over {dp_size * cp_size} DP x CP ranks (ZeRO-3)")
        if warm_start is not None:
            logger.print(f"initialised {warm_start['copied']} parameter tensors ({warm_start['parameters']}) "
                         f"from {warm_start['path']}; the others keep their init")
        if cfg.parallel.zero_stage == 3:
            register_zero3_external_parameters(model)

    def _build_engine(self, start_warnings: list[str]) -> None:
        """The resume checks, then DeepSpeed's engine."""
        import deepspeed

        from megaflex.parallel import deepspeed_mpu

        cfg, state, logger, optimizer = self.cfg, self.state, self.logger, self.optimizer
        for warning in start_warnings + self.resume.warnings:
            logger.print(warning)
        if repartition := self.resume.check(cfg, state, self.record, self.manager):
            logger.print(repartition)
        if self.is_main and cfg.logging.wandb is not None:
            logger.add_sink(WandbSink.open(cfg.logging.wandb, self.run_dir, cfg.to_dict(), resuming=self.resume.resuming))
        # The pipeline engine brings its own grid (PipelineModule's topology) and takes no mpu.
        mpu = deepspeed_mpu(state) if state.pp_size == 1 else None
        declare_zero_supported(optimizer)  # no "untested optimizer" warning for torch's AdamW
        engine_config = self.resume.engine_config(self.record.deepspeed_config)
        self.engine, _, _, _ = deepspeed.initialize(model=self.model, optimizer=optimizer, config=engine_config, mpu=mpu,
                                                    dist_init_required=False)
        # DeepSpeed builds groups of its own (e.g. its data-parallel group without an mpu): same timeout.
        apply_timeout(cfg.parallel.timeout_minutes, every_process_group())

    def _load_data_and_resume(self) -> None:
        cfg, state = self.cfg, self.state
        train_samples = cfg.train.train_iters * self.record.global_batch_size
        valid_samples = cfg.train.eval_iters * cfg.train.micro_batch_size * state.dp_size
        self.data = build_datasets(cfg, train_samples, valid_samples, self.rank)
        if self.resume.resuming:
            self.progress, line = self.resume.load(self.engine, self.manager, state, self.tracker)
            self.logger.print(line)

    # ---------------------------------------------------------------- the loop
    def train(self) -> dict[str, Any]:
        """The step loop, then the final save and validation; returns the run's summary."""
        cfg, progress = self.cfg, self.progress
        self._start_loop()
        try:
            stop_reason = self._run_steps()
        except NonFiniteAbort:  # decided alike on every rank: the save in flight is kept
            self._saved(self.manager.finish())
            raise
        finally:
            self.runner.batches.close()  # also when a step raises: no reader thread outlives the loop
        self.emit("on_loop_end")

        if (stop_reason != "done" or cfg.checkpoint.save_at_end) and progress.last_saved != progress.iteration:
            self.save()
        self._saved(self.manager.finish())  # the background save in flight (a stop signal waits for it too)
        self.emit("on_train_end", stop_reason)
        valid_loss = None
        evaluated_last = bool(cfg.train.eval_interval) and progress.iteration % cfg.train.eval_interval == 0
        if stop_reason == "done" and self.data.valid is not None and not evaluated_last:
            valid_loss = self.evaluate()
        tensorboard = f"TensorBoard {self.run_dir / 'tensorboard'}, " if cfg.logging.tensorboard else ""
        self.logger.print(
            f"training stopped ({stop_reason}) at step {progress.iteration}; metrics {self.run_dir / 'metrics.jsonl'}, "
            f"{tensorboard}checkpoints {cfg.checkpoint_dir}"
        )
        self.logger.close()
        return {"iteration": progress.iteration, "stop_reason": stop_reason, "valid_loss": valid_loss,
                "nonfinite_total": progress.nonfinite_total}

    def _run_steps(self) -> str:
        """Steps until ``train.train_iters`` or a stop signal; returns why the loop stopped."""
        cfg, progress = self.cfg, self.progress
        while progress.iteration < cfg.train.train_iters:
            self.emit("on_step_start", progress.iteration + 1)
            step = self.train_step()
            iteration = progress.iteration
            self._saved(self.manager.advance(step.checkpoint_write))  # a background save every rank has written
            self.emit("on_step_applied", iteration)
            if iteration % cfg.logging.log_interval == 0 or step.skipped or iteration == cfg.train.train_iters:
                self.log_step(step)
            stop_signal = step.stop_signal
            if cfg.train.eval_interval and iteration % cfg.train.eval_interval == 0 and self.data.valid is not None:
                if self.evaluate() is None:
                    # Preempted mid-validation (every rank agreed there): stop after saving this step.
                    stop_signal = stop_signal or self._agreed_signal()
            if cfg.checkpoint.save_interval and iteration % cfg.checkpoint.save_interval == 0:
                self.save()
                # A signal caught during the save (saves are long: preemption notices often land there)
                # stops the run now, with this checkpoint, not after one more step and another save.
                stop_signal = stop_signal or self._agreed_signal()
            self.emit("on_step_end", iteration)
            if stop_signal > 0:
                return f"signal {signal.Signals(stop_signal).name}"
        return "done"

    def _start_loop(self) -> None:
        # Host reads of device values (each one waits for the GPU): one per step in this loop, the
        # step's agreed flags (any rank's non-finite loss, a caught signal) before the update; the
        # losses, sums and the gradient norm stay on the device until a step is logged (and fp32
        # runs read the gradient norm per step: nothing else there notices a non-finite one).
        cfg, state, record, progress = self.cfg, self.state, self.record, self.progress
        self.signals = SignalFlag(cfg.checkpoint.save_on_signal)
        self.throughput = Throughput(
            record.global_batch_size * cfg.data.seq_len, flops_per_token(cfg.model, cfg.data.seq_len, record.num_parameters),
            state.world_size, device_peak_tflops(cfg.logging.peak_tflops, self.device),
        )
        progress.last_saved = progress.iteration
        self.guard = NonFiniteGuard(cfg.train.max_nonfinite_in_a_row, progress.nonfinite_total, cfg.checkpoint_dir)
        accum = record.gradient_accumulation_steps
        batches = batch_stream(self.data.train, BatchLayout.of(cfg, state), self.device,
                               accum * (cfg.train.train_iters - progress.iteration), progress.consumed_samples)
        self.runner = StepRunner(
            self.engine, self.optimizer, state, self.device, accum, batches,
            lm_loss if self.objective is None else objective_loss(self.objective), self._on_loss,
            lambda: self.signals.signum or 0, self.manager.writer_status,
            plain_fp32=cfg.parallel.zero_stage == 0 and cfg.train.precision == "fp32",
        )

    def _on_loss(self, step: int, loss: torch.Tensor) -> torch.Tensor:
        for hook in self.hooks:
            loss = hook.on_loss(self, step, loss)
        return loss

    def train_step(self) -> StepResult:
        """One optimizer step: ``grad_accum`` micro-batches, forward, backward, update."""
        from megaflex.attention import redraw_random_features

        cfg, engine, optimizer, runner = self.cfg, self.engine, self.optimizer, self.runner
        step = self.progress.iteration + 1
        engine.train()
        lr = lr_at(cfg, self.progress.iteration)
        set_lr(engine.optimizer, lr)
        skipped_before = engine_skipped_steps(engine)
        collective_progress.at(step, "forward/backward (ZeRO gradient reduction) and optimizer step")
        sums = runner.run(step)
        if hasattr(optimizer, "skip"):
            optimizer.skip = False
        pipelined = self.state.pp_size > 1
        grad_norm = sums.own_grad_norm if runner.plain_fp32 and not pipelined else engine.get_global_grad_norm()
        engine_skipped = engine_skipped_steps(engine) > skipped_before  # overflow: DeepSpeed discarded the step
        # DeepSpeed checks bf16/fp16 gradients itself (a skip above); in fp32 only the norm tells.
        grad_bad = cfg.train.precision == "fp32" and grad_norm is not None and not math.isfinite(float(grad_norm))
        reason = skip_reason(sums.skipped_loss, engine_skipped, grad_bad or getattr(optimizer, "skipped_nonfinite_grad", False))
        self.progress.advance(self.record.global_batch_size)
        redraw_random_features(engine.module, self.progress.iteration)  # Performer redraws (deterministic in the step)
        line = self.guard.record(self.progress.iteration, reason)  # raises NonFiniteAbort after too many in a row
        if reason is not None:
            self.logger.print(line)
        self.progress.nonfinite_total = self.guard.total
        return StepResult(lr, sums.loss_sum, sums.extra_sums, grad_norm, reason is not None, sums.skipped_loss,
                          sums.stop_signal, sums.checkpoint_write)

    def log_step(self, step: StepResult) -> None:
        """The step's train record: losses summed over data parallelism (one read), throughput, memory."""
        cfg, state, iteration, consumed = self.cfg, self.state, self.progress.iteration, self.progress.consumed_samples
        rate = self.throughput.measure(cfg.logging.log_interval if iteration % cfg.logging.log_interval == 0 else 1)
        names = sorted(step.extra_sums)
        collective_progress.at(iteration, "the loss all_reduce")
        sums = comm.all_reduce(torch.stack([step.loss_sum, *(step.extra_sums[k] for k in names)]), "sum", state.dp_group)
        loss_avg, *extra_values = (v / (self.record.gradient_accumulation_steps * state.dp_size) for v in sums.tolist())
        nan = float("nan")
        record = {
            "kind": "train", "step": iteration, "loss": loss_avg if not step.skipped_loss else nan,
            "ppl": math.exp(min(loss_avg, 50.0)) if not step.skipped_loss else nan, "lr": step.lr,
            "grad_norm": None if step.grad_norm is None else float(step.grad_norm), "tokens_per_s": rate.tokens_per_s,
            "tflops_per_device": rate.tflops_per_device, "consumed_samples": consumed,
            "tokens": consumed * cfg.data.seq_len, "skipped": step.skipped,
            "nonfinite_total": self.progress.nonfinite_total, "memory_mb": peak_memory_mb(self.device),
            **dict(zip(names, extra_values)),
        }
        if rate.mfu is not None:
            record["mfu"] = rate.mfu
        self.logger.log(record)

    def evaluate(self) -> float | None:
        """Validation loss at this step, logged; None when a stop signal cut the pass short."""
        loss = evaluate(self.cfg, self.engine, self.data.valid, self.state, self.device, self.signals)
        iteration = self.progress.iteration
        if loss is None:
            self.logger.print(f"validation at step {iteration} stopped by a signal (not logged)")
            return None
        self.logger.log({"kind": "valid", "step": iteration, "loss": loss, "ppl": math.exp(min(loss, 50.0))})
        return loss

    def _agreed_signal(self) -> int:
        return agreed_max(self.device, self.signals.signum or 0)[0]

    def save(self) -> None:
        """Collective: the checkpoint of this step, committed atomically (``checkpoint.background``:
        written in the background, committed at a later step or when ``train`` finishes it)."""
        step = self.progress.iteration
        collective_progress.at(step, "checkpoint save")
        self._saved(self.manager.finish())  # at most one save in flight: the previous one first
        start = time.time()
        path = self.manager.save(self.engine, step, self.record.checkpoint_meta(self.progress), self.tracker)
        self.progress.last_saved = step
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


def shutdown(clean: bool) -> None:
    """End a distributed program cleanly (a missing destroy aborts ~1 in 4 gloo runs at exit).

    After an error (``clean`` False) peers may be gone, so no barrier then: destroy only."""
    if dist.is_available() and dist.is_initialized():
        if clean:
            dist.barrier()
        dist.destroy_process_group()
