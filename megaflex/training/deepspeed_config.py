"""Generate the DeepSpeed JSON config from the run config (the one source of truth).

Nothing DeepSpeed-specific is written by hand: batch sizes, gradient accumulation, clipping,
precision and ZeRO settings all derive from ``Config`` and the data-parallel size. The
optimizer and the LR schedule are *not* DeepSpeed's: the trainer passes a torch AdamW and sets
the learning rate itself each step, so the DeepSpeed config has no "optimizer"/"scheduler".
"""

from __future__ import annotations

from datetime import timedelta

from typing import Any

from megaflex.training.config import Config, global_batch_size


def gradient_accumulation_steps(cfg: Config, dp_size: int) -> int:
    """Micro-batches per optimizer step on each rank."""
    return global_batch_size(cfg, dp_size) // (cfg.train.micro_batch_size * dp_size)


def deepspeed_config(cfg: Config, dp_size: int, cp_size: int = 1, on_cuda: bool = False) -> dict[str, Any]:
    """The ``config`` dict for ``deepspeed.initialize`` for a data-parallel size ``dp_size``.

    DeepSpeed's data-parallel group is DP x CP (``DeepSpeedMPU``) and it checks
    train_batch_size = micro x accumulation x its group size, so it counts each sample once per
    CP rank (the CP ranks of a replica hold slices of the same samples)."""
    t, p = cfg.train, cfg.parallel
    zero: dict[str, Any] = {"stage": p.zero_stage}
    if p.zero_stage >= 1:
        zero.update(
            reduce_bucket_size=p.zero_reduce_bucket_size,
            overlap_comm=p.zero_overlap_comm,
            contiguous_gradients=True,
        )
    if p.zero_stage in (1, 2):
        zero.update(allgather_bucket_size=p.zero_allgather_bucket_size, reduce_scatter=True)
    if p.zero_stage == 3:
        zero.update(
            stage3_prefetch_bucket_size=p.zero3_prefetch_bucket_size,
            stage3_param_persistence_threshold=p.zero3_param_persistence_threshold,
            # Full (gathered) 16-bit weights are not needed: our checkpoints are sharded.
            stage3_gather_16bit_weights_on_model_save=False,
        )
    if p.zero_offload_optimizer:
        # Pinned host buffers make the offloaded optimizer's copies asynchronous (CUDA only).
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": on_cuda}
    config: dict[str, Any] = {
        "train_batch_size": global_batch_size(cfg, dp_size) * cp_size,
        "train_micro_batch_size_per_gpu": t.micro_batch_size,
        "gradient_accumulation_steps": gradient_accumulation_steps(cfg, dp_size),
        "gradient_clipping": t.grad_clip,
        "zero_optimization": zero,
        "bf16": {"enabled": t.precision == "bf16"},
        "fp16": {
            "enabled": t.precision == "fp16",
            "loss_scale": 0,  # 0 = dynamic
            "initial_scale_power": t.fp16_initial_scale_power,
            "loss_scale_window": t.fp16_loss_scale_window,
            "hysteresis": t.fp16_hysteresis,
            "min_loss_scale": t.fp16_min_loss_scale,
        },
        # The optimizer is a torch AdamW built by the trainer (weight-decay groups, fused); a subclass,
        # which DeepSpeed's exact-type check calls untested (optim.declare_zero_supported says otherwise).
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
        # Logging is ours; keep DeepSpeed's periodic prints out of the console.
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }
    if p.pipeline_parallel_size > 1 and p.sequence_parallel:
        # DeepSpeed's pipeline engine sends each TP rank's 1/TP of an activation it assumes whole on
        # every TP rank, and all-gathers it on the next stage; under SP the TP ranks hold different
        # sequence shards already, which must travel as they are.
        config["pipeline"] = {"pipe_partitioned": False, "grad_partitioned": False}
    if t.precision == "bf16":
        # Skip (do not apply) steps whose gradients are inf/NaN, as fp16 does.
        config["bf16"]["check_grad_overflow"] = True
        # Reduce gradients in fp32, and accumulate the micro-batches in fp32 (bf16 keeps 8 bits:
        # 32 micro-batch sums lose the small ones). DeepSpeed 0.19 takes fp32 accumulation with
        # ZeRO 1-3 only (ZeRO 1 then runs its BF16_Optimizer); at ZeRO 0 it rejects the mix, so
        # there gradients accumulate in bf16 (and are reduced in fp32).
        # train.grad_accum_dtype=bf16 keeps DeepSpeed's plain bf16 behaviour (gpu_check's ablation arm).
        config["communication_data_type"] = t.grad_accum_dtype
        if p.zero_stage >= 1:
            config["data_types"] = {"grad_accum_dtype": t.grad_accum_dtype}
    return config


def init_deepspeed_distributed(backend: str, timeout: "timedelta | None" = None) -> None:
    """``deepspeed.init_distributed`` without DeepSpeed's CPU shared-memory all-reduce op.

    On a CPU accelerator DeepSpeed compiles ``deepspeed_shm_comm`` (about 30 s of C++ on first
    use) and maps a ~66 MiB ``/dev/shm`` buffer per rank that it never unlinks, so every run
    leaks RAM-backed files and a small ``/dev/shm`` (containers default to 64 MiB) makes ranks
    fault or hang. The op only serves ``inference_all_reduce``, which megaflex never calls;
    training collectives go through torch.distributed either way. ``MEGAFLEX_DS_SHM_COMM=1``
    keeps DeepSpeed's default. Adopts an existing process group like DeepSpeed does.
    """
    import os

    import deepspeed
    import deepspeed.ops

    if os.environ.get("MEGAFLEX_DS_SHM_COMM") != "1":
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # cached dict; see deepspeed.ops
    if timeout is None:
        deepspeed.init_distributed(dist_backend=backend)
    else:  # the start-up (rendezvous) timeout; collectives get theirs from collective_timeout.apply_timeout
        deepspeed.init_distributed(dist_backend=backend, timeout=timeout)
