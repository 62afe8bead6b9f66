"""The training loop on a DeepSpeed engine.

    run(cfg)  # every rank; torch.distributed env vars set by deepspeed/torchrun/Slurm

Order of set-up: distributed init (gloo on CPU, nccl on GPU) -> ``ParallelState`` (TP x CP x DP)
-> seeds (same default RNG on every rank, per-TP-rank tracker stream) -> model through the
layer factory -> warm start (``checkpoint.init_from``, fresh runs only) -> the objective's
set-up (``Objective.prepare``, e.g. distillation) -> AdamW with weight-decay groups ->
``deepspeed.initialize(..., mpu=...)`` with the generated config -> resume -> loop.

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
from pathlib import Path
from typing import Any, Protocol

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
from megaflex.model.kernel_stats import kernel_snapshot
from megaflex.model.layers import LocalLayers
from megaflex.parallel import comm
from megaflex.parallel.rendezvous import free_port
from megaflex.training.collective_timeout import (
    apply_timeout, every_process_group, parallel_groups, progress, rendezvous_timeout,
)
from megaflex.training.config import (
    Config, ConfigError, check_device, global_batch_size, parallel_dims, resolve_device, validate_runtime,
)
from megaflex.data.card import check_same_tokenizer
from megaflex.training.data import batch_documents, build_datasets, check_data_tokenizer, document_eod_id, micro_batches
from megaflex.training.deepspeed_config import (
    deepspeed_config, gradient_accumulation_steps, init_deepspeed_distributed,
)
from megaflex.training.metrics import MetricsLogger, device_peak_tflops, flops_per_token, peak_memory_mb
from megaflex.training.optim import build_optimizer, group_summary, lr_at, set_lr
from megaflex.training.profiling import StepProfiler
from megaflex.training.run_lock import hold_run_lock
from megaflex.training.stop_signals import SignalFlag
from megaflex.training.wandb_logger import WandbSink, import_wandb


class NonFiniteAbort(RuntimeError):
    """Too many consecutive steps with a non-finite loss or gradient norm."""


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
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    init_deepspeed_distributed(backend, rendezvous_timeout(cfg.parallel.timeout_minutes))
    validate_runtime(cfg, dist.get_world_size(), has_cuda)
    return device


class Objective(Protocol):
    """What a run optimises, when not the plain LM loss (e.g. ``megaflex.training.distill``)."""

    def prepare(self, model: GPT, cfg: Config) -> None:
        """After the warm start, before the optimizer: freeze parameters, add adapters, build a teacher."""

    def loss(self, engine: Any, ids: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """One micro-batch: (loss to differentiate, named scalars averaged over the step and logged)."""

    def finish(self, engine: Any, iteration: int) -> None:
        """Collective, after the last save: e.g. export merged weights."""


def run(cfg: Config, objective: Objective | None = None) -> dict[str, Any]:
    """Train as configured (``objective``: the loss and its set-up, default the LM loss);
    returns a summary (rank 0's numbers) when training ends."""
    import deepspeed

    from megaflex.attention import redraw_random_features
    from megaflex.parallel import (
        ParallelState, TensorParallelLayers, deepspeed_mpu, mark_head_sharded_params, model_parallel_seed,
    )

    device = init_distributed(cfg)
    if cfg.logging.wandb is not None:
        import_wandb()  # every rank, before anything is set up: a missing package stops all alike
    tokenizer = check_data_tokenizer(cfg)  # recorded with checkpoints; raises DataError at start
    state = ParallelState.create(parallel_dims(cfg, dist.get_world_size()))
    apply_timeout(cfg.parallel.timeout_minutes, parallel_groups(state))
    hold_run_lock(Path(cfg.logging.run_dir))  # before anything is written to the run directory
    rank, dp_size, cp_size = dist.get_rank(), state.dp_size, state.cp_size
    is_main = rank == 0
    run_dir = Path(cfg.logging.run_dir)
    if cfg.train.precision == "bf16" and device == "cpu":
        torch.set_default_dtype(torch.float32)  # DeepSpeed casts the module itself

    # Same default-RNG seed on every rank: replicas start identical and TP shards are cut from
    # identically initialised full matrices; the tracker gives each TP rank its own stream.
    tracker = model_parallel_seed(cfg.train.seed, state.tp_rank, device=device)
    layers = LocalLayers() if state.tp_size == 1 and cp_size == 1 else TensorParallelLayers(state, tracker)
    model = GPT(cfg.model, layers=layers)
    if state.tp_size > 1:
        # Feature-map params (Omega, tau) are head-sharded: tag them so grad norms count every shard.
        mark_head_sharded_params(model)
    # The one resume decision (checksums verified; warnings printed once the logger exists).
    manager = CheckpointManager(Path(cfg.checkpoint_dir), cfg.checkpoint.keep_last, rank)
    resume_warnings: list[str] = []
    resume_path, meta = manager.select_resume(cfg.checkpoint.resume, warn=resume_warnings.append)
    init_record = _warm_start(cfg, model, resuming=resume_path is not None)  # before the optimizer and DeepSpeed
    if objective is not None:
        if cfg.data.document_boundaries != "none":  # the objectives' losses take no document structure yet
            raise ConfigError(f"data.document_boundaries: expected 'none' with {type(objective).__name__}, got 'reset'")
        objective.prepare(model, cfg)
    shapes = parameter_shapes(model)
    num_params = _full_parameter_count(model, state.tp_size)
    space_warning = preflight(Path(cfg.checkpoint_dir), num_params)  # every rank: its own mount
    optimizer = build_optimizer(cfg, model, device)
    if cfg.parallel.zero_stage == 0 and cfg.train.precision == "fp32" and hasattr(optimizer, "skip"):
        optimizer.check_finite = True  # no ZeRO/bf16 wrapper checks the gradients here
    ds_config = deepspeed_config(cfg, dp_size, cp_size, on_cuda=device == "cuda")
    grad_accum = gradient_accumulation_steps(cfg, dp_size)
    gbs = global_batch_size(cfg, dp_size)

    logger = MetricsLogger(
        run_dir, enabled=is_main, tensorboard=cfg.logging.tensorboard,
        progress_bar=cfg.logging.progress_bar, total_steps=cfg.train.train_iters,
    )
    if is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(cfg.to_yaml())
        import json

        (run_dir / "ds_config.json").write_text(json.dumps(ds_config, indent=1))
        logger.print("resolved config:\n" + cfg.to_yaml())
        logger.print(
            f"world {state.world_size} = TP {state.tp_size} x CP {cp_size} x DP {dp_size} | device {device} | "
            f"ZeRO {cfg.parallel.zero_stage} | {cfg.train.precision} | {num_params / 1e6:.2f}M parameters | "
            f"global batch {gbs} = micro {cfg.train.micro_batch_size} x DP {dp_size} x accum {grad_accum}"
        )
        logger.print(group_summary(model, cfg))
        if space_warning:
            logger.print(space_warning)

    if init_record is not None:
        logger.print(f"initialised {init_record['copied']} parameter tensors ({init_record['parameters']}) from "
                     f"{init_record['path']}; the others keep their init")
    kernel_init = kernel_snapshot(model)  # before ZeRO 3 partitions anything; replaced on resume
    if cfg.parallel.zero_stage == 3:
        _register_zero3_external_parameters(model)

    # ---------------------------------------------------------------- resume checks (before the engine)
    if cfg.fault.sigkill_during_save_at_step is not None:
        kill_step = cfg.fault.sigkill_during_save_at_step
        manager.before_commit = lambda it: _sigkill() if it == kill_step else None
    for warning in resume_warnings:
        logger.print(warning)
    universal, engine_config = None, ds_config
    if resume_path is not None:
        check_compatible(meta, cfg.to_dict()["model"], shapes, state.tp_size)
        check_same_tokenizer(meta.tokenizer, tokenizer, f"checkpoint {resume_path}", "this run's tokenizer/data")
        check_resume_layout(meta, resume_path, cfg.parallel.zero_stage, cfg.train.precision)
        check_optimizer_groups(meta, [g["name"] for g in optimizer.param_groups], resume_path)
        if needs_repartition(meta, resume_path, cfg.parallel.zero_stage, dp_size, cp_size, state.tp_size,
                             cfg.checkpoint.zero_universal_resume):
            universal = manager.universal_copy(resume_path)
            logger.print(f"ZeRO states of {resume_path} repartitioned from {meta.zero_partitions} to "
                         f"{dp_size * cp_size} DP x CP ranks through its universal copy {universal}")
            # Only the engine reads it; the recorded ds_config stays the run's own.
            engine_config = dict(ds_config, checkpoint={"load_universal": True})

    if is_main and cfg.logging.wandb is not None:
        logger.add_sink(WandbSink.open(cfg.logging.wandb, run_dir, cfg.to_dict(), resuming=resume_path is not None))

    engine, _, _, _ = deepspeed.initialize(
        model=model, optimizer=optimizer, config=engine_config, mpu=deepspeed_mpu(state), dist_init_required=False
    )
    # DeepSpeed builds groups of its own (e.g. its data-parallel group without an mpu): same timeout.
    apply_timeout(cfg.parallel.timeout_minutes, every_process_group())

    # ---------------------------------------------------------------- data and resume
    train_samples = cfg.train.train_iters * gbs
    valid_samples = cfg.train.eval_iters * cfg.train.micro_batch_size * dp_size
    train_data, valid_data = build_datasets(cfg, train_samples, valid_samples, rank)

    iteration, consumed, nonfinite_total = 0, 0, 0
    skipped_loss = False
    if resume_path is not None:
        same_world = meta.world_size == state.world_size
        manager.load(engine, resume_path, tracker, load_rng=same_world, universal=universal)
        iteration, consumed = meta.iteration, meta.consumed_samples
        nonfinite_total = meta.nonfinite_total or 0
        init_record = meta.init_from
        logger.print(
            f"resumed from {resume_path} at step {iteration} ({consumed} samples consumed"
            + ("" if meta.data_parallel_size == dp_size else f"; data parallel {meta.data_parallel_size} -> {dp_size}")
            + ")"
        )

    kernel_probe = None
    if cfg.logging.kernel_stats_interval:
        kernel_init = _kernel_reference(kernel_init, run_dir, state, fresh=resume_path is None)
        kernel_probe = next(micro_batches(valid_data or train_data, 0, min(2, cfg.train.micro_batch_size), 1, 0, 1, device))[0]

    def save(step: int) -> None:
        progress.at(step, "checkpoint save")
        meta = CheckpointMeta(
            iteration=step, consumed_samples=consumed, nonfinite_total=nonfinite_total,
            world_size=state.world_size, tensor_parallel_size=state.tp_size, data_parallel_size=dp_size,
            context_parallel_size=cp_size, zero_stage=cfg.parallel.zero_stage, precision=cfg.train.precision,
            parameter_shapes=shapes, num_parameters=num_params, config=cfg.to_dict(), deepspeed_config=ds_config,
            optimizer_groups=[g["name"] for g in optimizer.param_groups],
            sampler={"consumed_samples": consumed, "global_batch_size": gbs}, tokenizer=tokenizer, init_from=init_record,
        )
        path = manager.save(engine, step, meta, tracker)
        logger.print(f"saved checkpoint {path}")

    # ---------------------------------------------------------------- loop
    # Host reads of device values (each one waits for the GPU): one per step in this loop, the
    # step's agreed flags (any rank's non-finite loss, a caught signal) before the update; the
    # losses, sums and the gradient norm stay on the device until a step is logged (and fp32
    # runs read the gradient norm per step: nothing else there notices a non-finite one).
    signals = SignalFlag(cfg.checkpoint.save_on_signal)
    fpt = flops_per_token(cfg.model, cfg.data.seq_len, num_params)
    peak_tflops = device_peak_tflops(cfg.logging.peak_tflops, device)
    tokens_per_step = gbs * cfg.data.seq_len
    last_saved = iteration
    guard = NonFiniteGuard(cfg.train.max_nonfinite_in_a_row, nonfinite_total, cfg.checkpoint_dir)
    dp_group, everyone = state.dp_group, comm.world_group()
    # ZeRO 0 in fp32 has no DeepSpeed optimizer wrapper that records the gradient norm.
    plain_fp32 = cfg.parallel.zero_stage == 0 and cfg.train.precision == "fp32"
    own_grad_norm = None
    stop_reason = "done"
    t_last = time.time()
    train_batches = micro_batches(
        train_data, consumed, cfg.train.micro_batch_size, grad_accum * (cfg.train.train_iters - iteration),
        state.dp_rank, dp_size, device, state.cp_rank, cp_size, document_eod_id(cfg),
    )
    zero = torch.zeros((), dtype=torch.float64, device=device)
    profiler = StepProfiler(cfg.logging.profile, engine.module, run_dir / "profile", rank, device, logger.print)
    while iteration < cfg.train.train_iters:
        profiler.step_starts(iteration + 1)
        engine.train()
        lr = lr_at(cfg, iteration)
        set_lr(engine.optimizer, lr)
        loss_sum, bad = zero.clone(), zero.clone()
        extra_sums: dict[str, torch.Tensor] = {}
        inject_nan = (iteration + 1) in cfg.fault.nan_loss_at_steps and rank == 0
        inject_inf_grad = (iteration + 1) in cfg.fault.inf_grad_at_steps and rank == 0
        skipped_before, stop_signal = engine_skipped_steps(engine), 0
        progress.at(iteration + 1, "forward/backward (ZeRO gradient reduction) and optimizer step")
        for _ in range(grad_accum):
            batch = next(train_batches)
            ids, labels = batch[:2]
            if objective is None:
                loss = engine(ids, labels, documents=batch_documents(batch, cfg.data.reset_positions)).loss
            else:
                loss, extras = objective.loss(engine, ids, labels)
                for key, value in extras.items():
                    extra_sums[key] = extra_sums.get(key, zero) + value.detach().double()
            if inject_nan:
                loss = loss + float("nan")
            if inject_inf_grad:
                loss = _InfiniteGradient.apply(loss)
            finite = torch.isfinite(loss.detach())
            bad += (~finite).double()
            loss_sum += torch.where(finite, loss.detach(), 0.0).double()
            # Masked, not dropped: every rank must run the same backward/step sequence. The loss is the
            # whole sequence's but each CP rank differentiates its own slice's share; DeepSpeed averages
            # gradients over DP x CP, so x CP turns that average into the sum over the slices.
            engine.backward(torch.where(finite, loss, torch.zeros_like(loss)) * cp_size)
            if engine.is_gradient_accumulation_boundary():
                # Decided on every rank alike before the update (the last micro-batch is the boundary);
                # a caught signal travels in the same read and stops the run after this step.
                progress.at(iteration + 1, "the step's flag all_reduce (non-finite loss, stop signal)")
                flags = torch.stack([bad, torch.tensor(float(signals.signum or 0), dtype=torch.float64, device=device)])
                skipped_loss, stop_signal = (int(v) for v in comm.all_reduce(flags, "max", everyone).tolist())
                skipped_loss = skipped_loss > 0
                progress.at(iteration + 1, "optimizer step (ZeRO gradient reduction)")
                if hasattr(optimizer, "skip"):
                    optimizer.skip = skipped_loss
                if plain_fp32:  # DeepSpeed clips here without keeping the norm: measure it before the step
                    own_grad_norm = _unclipped_grad_norm(engine)
            engine.step()
        if hasattr(optimizer, "skip"):
            optimizer.skip = False
        grad_norm = own_grad_norm if plain_fp32 else engine.get_global_grad_norm()
        engine_skipped = engine_skipped_steps(engine) > skipped_before  # overflow: DeepSpeed discarded the step
        # DeepSpeed checks bf16/fp16 gradients itself (a skip above); in fp32 only the norm tells.
        grad_bad = cfg.train.precision == "fp32" and grad_norm is not None and not math.isfinite(float(grad_norm))
        reason = skip_reason(skipped_loss, engine_skipped, grad_bad or getattr(optimizer, "skipped_nonfinite_grad", False))
        iteration += 1
        consumed += gbs
        redraw_random_features(engine.module, iteration)  # Performer redraws (deterministic in the step)
        skipped = reason is not None
        if skipped:
            logger.print(guard.record(iteration, reason))  # raises NonFiniteAbort after too many in a row
        else:
            guard.record(iteration, None)
        nonfinite_total = guard.total

        if cfg.logging.kernel_stats_interval and iteration % cfg.logging.kernel_stats_interval == 0:
            kernel = _kernel_statistics(engine, cfg.parallel.zero_stage, kernel_probe, kernel_init)
            logger.log({"kind": "kernel", "step": iteration, **kernel})
        if iteration % cfg.logging.log_interval == 0 or skipped or iteration == cfg.train.train_iters:
            now = time.time()
            elapsed = max(now - t_last, 1e-9)
            t_last = now
            steps = cfg.logging.log_interval if iteration % cfg.logging.log_interval == 0 else 1
            tok_s = tokens_per_step * steps / elapsed
            tflops = fpt * tok_s / state.world_size / 1e12
            # One read for every logged value: the step's loss and named sums, summed over DP.
            names = sorted(extra_sums)
            progress.at(iteration, "the loss all_reduce")
            sums = comm.all_reduce(torch.stack([loss_sum, *(extra_sums[k] for k in names)]), "sum", dp_group)
            loss_avg, *extra_values = (v / (grad_accum * dp_size) for v in sums.tolist())
            record = {
                "kind": "train", "step": iteration, "loss": loss_avg if not skipped_loss else float("nan"),
                "ppl": math.exp(min(loss_avg, 50.0)) if not skipped_loss else float("nan"), "lr": lr,
                "grad_norm": None if grad_norm is None else float(grad_norm), "tokens_per_s": tok_s,
                "tflops_per_device": tflops, "consumed_samples": consumed, "tokens": consumed * cfg.data.seq_len,
                "skipped": skipped, "nonfinite_total": nonfinite_total,
                "memory_mb": peak_memory_mb(device), **dict(zip(names, extra_values)),
            }
            if peak_tflops:
                record["mfu"] = tflops / peak_tflops
            logger.log(record)

        if cfg.train.eval_interval and iteration % cfg.train.eval_interval == 0 and valid_data is not None:
            if _log_validation(cfg, engine, valid_data, state, device, iteration, logger, signals) is None:
                # Preempted mid-validation (every rank agreed there): stop after saving this step.
                signum = torch.tensor(float(signals.signum or 0), device=device)
                stop_signal = stop_signal or int(comm.all_reduce(signum, "max", comm.world_group()).item())
        if cfg.checkpoint.save_interval and iteration % cfg.checkpoint.save_interval == 0:
            save(iteration)
            last_saved = iteration
        t_last += profiler.step_ended(iteration)  # writing the trace is not training time
        if cfg.fault.sigkill_after_step == iteration:
            dist.barrier()  # rank 0 has logged the step
            _sigkill()
        if cfg.fault.sigstop_last_rank_after_step == iteration and rank == dist.get_world_size() - 1:
            os.kill(os.getpid(), signal.SIGSTOP)  # a frozen peer: the others' next collective times out
        if stop_signal > 0:
            stop_reason = f"signal {signal.Signals(stop_signal).name}"
            break
    train_batches.close()
    profiler.close()

    if (stop_reason != "done" or cfg.checkpoint.save_at_end) and last_saved != iteration:
        save(iteration)
    if objective is not None and stop_reason == "done":
        objective.finish(engine, iteration)
    valid_loss = None
    evaluated_last = bool(cfg.train.eval_interval) and iteration % cfg.train.eval_interval == 0
    if stop_reason == "done" and valid_data is not None and not evaluated_last:
        valid_loss = _log_validation(cfg, engine, valid_data, state, device, iteration, logger, signals)
    logger.print(
        f"training stopped ({stop_reason}) at step {iteration}; metrics {run_dir / 'metrics.jsonl'}, "
        f"TensorBoard {run_dir / 'tensorboard'}, checkpoints {cfg.checkpoint_dir}"
    )
    logger.close()
    return {"iteration": iteration, "stop_reason": stop_reason, "valid_loss": valid_loss, "nonfinite_total": nonfinite_total}


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


class _InfiniteGradient(torch.autograd.Function):
    """Fault injection: identity forward, infinite gradient backward (a finite loss that overflows)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return grad * float("inf")


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


def _unclipped_grad_norm(engine: Any) -> torch.Tensor:
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


def _sigkill() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _full_parameter_count(model: torch.nn.Module, tp_size: int) -> int:
    """Parameters of the whole model (TP shards counted once per shard, replicated ones once)."""
    from megaflex.parallel import is_tensor_parallel

    return sum(p.numel() * (tp_size if tp_size > 1 and is_tensor_parallel(p) else 1) for p in model.parameters())


def _register_zero3_external_parameters(model: GPT) -> None:
    """Tell ZeRO 3 about parameters used outside their own module's forward.

    ZeRO 3 gathers a module's parameters around its forward/backward, hooking the *tensors* it
    returns. The feature maps return a ``FeatureMapOutput`` dataclass (not hooked), so their
    kernel parameters are registered with the attention module that calls them (through the core,
    or the context-parallel stand-in that bypasses the core's forward); the tied embedding is
    used again by the logits in the model's own forward.
    """
    from deepspeed.runtime.zero.partition_parameters import register_external_parameter

    from megaflex.attention import named_kernel_parameters

    for block in model.blocks:
        for _, kp in named_kernel_parameters(block.attn.core):
            register_external_parameter(block.attn, kp.param)
    register_external_parameter(model, model.output_weight)


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


def _kernel_statistics(
    engine: Any, zero_stage: int, probe: torch.Tensor | None, reference: dict[str, torch.Tensor]
) -> dict[str, float]:
    """Per-layer kernel statistics (collective under ZeRO 3: kernel parameters are gathered)."""
    from megaflex.attention import named_kernel_parameters

    module = engine.module
    if zero_stage == 3:
        import deepspeed

        params = [kp.param for _, kp in named_kernel_parameters(module)]
        with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
            return module.kernel_statistics(probe, reference)
    return module.kernel_statistics(probe, reference)


@torch.no_grad()
def evaluate(cfg: Config, engine: Any, dataset: Any, state: Any, device: str, signals: Any = None) -> float | None:
    """Mean validation loss over ``train.eval_iters`` micro-batches per data-parallel rank; None
    when a stop signal (``signals.signum``, agreed over all ranks per batch) cuts it short."""
    engine.eval()
    progress.at(progress.step, "validation")
    total = torch.zeros((), dtype=torch.float64, device=device)
    batches = micro_batches(
        dataset, 0, cfg.train.micro_batch_size, cfg.train.eval_iters, state.dp_rank, state.dp_size, device,
        state.cp_rank, state.cp_size, document_eod_id(cfg),
    )
    for ids, labels, *positions in batches:
        if signals is not None:  # preempted: save promptly instead of finishing the pass
            signum = torch.tensor(float(signals.signum or 0), device=device)
            if comm.all_reduce(signum, "max", comm.world_group()).item() > 0:
                engine.train()
                return None
        documents = batch_documents((ids, labels, *positions), cfg.data.reset_positions)
        total += engine(ids, labels, documents=documents).loss.double()
    engine.train()
    total = comm.all_reduce(total, "sum", state.dp_group)
    return total.item() / (cfg.train.eval_iters * state.dp_size)


def _log_validation(cfg: Config, engine: Any, dataset: Any, state: Any, device: str, step: int, logger: MetricsLogger,
                    signals: Any = None) -> float | None:
    loss = evaluate(cfg, engine, dataset, state, device, signals)
    if loss is None:
        logger.print(f"validation at step {step} stopped by a signal (not logged)")
        return None
    logger.log({"kind": "valid", "step": step, "loss": loss, "ppl": math.exp(min(loss, 50.0))})
    return loss


def shutdown(clean: bool) -> None:
    """End a distributed program cleanly (a missing destroy aborts ~1 in 4 gloo runs at exit).

    After an error (``clean`` False) peers may be gone, so no barrier then: destroy only."""
    if dist.is_available() and dist.is_initialized():
        if clean:
            dist.barrier()
        dist.destroy_process_group()
