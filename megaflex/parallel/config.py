"""The ``parallel:`` section of a run config and everything that checks it: one home for a
parallel axis's settings, its combinations with the rest of the run, and the rank grid.

    check_parallel(cfg)                 # static: sizes, ZeRO stage, SP / PP / CP combinations
    dims = parallel_dims(cfg, world)    # the TP x CP x PP x DP grid, fitted to the model

``cfg`` is the whole run config (``megaflex.training.config.Config``; read by duck typing, this
package sits below training): a parallel axis is often refused with another section's setting
(CP with softmax attention, PP with document resets). Refusals are ``ParallelConfigError`` naming
the key; the training config adds where the key came from. A new parallel axis adds its size
here, its grid axis in ``state.ParallelDims``, its groups in ``state.ParallelState``, its model
transformation in ``parallelize`` and its per-rank bytes in ``memory_plan``: all in this package.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from megaflex.config_field import opt
from megaflex.parallel.state import ParallelDims

__all__ = ["ParallelConfig", "ParallelConfigError", "check_parallel", "parallel_dims"]


class ParallelConfigError(ValueError):
    """A refused parallel setting: ``key`` (dotted, e.g. ``parallel.zero_stage``) and why."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"{key}: {message}")
        self.key, self.message = key, message


@dataclass
class ParallelConfig:
    """How the world is split: tensor parallel inside a replica, ZeRO across replicas."""

    tensor_parallel_size: int = opt(
        1, "ranks sharing one model replica (Megatron TP); data parallel = world / (TP x CP x PP)"
    )
    pipeline_parallel_size: int = opt(
        1, "pipeline stages, each a contiguous range of blocks (DeepSpeed's pipeline engine, 1F1B over the "
        "step's micro-batches); ZeRO stage 1 (0 without clipping), no context parallelism (docs/training.md)",
    )
    context_parallel_size: int = opt(
        1, "ranks splitting each sequence along its length (LASP-2 style, linear-attention kinds only; "
        "data.seq_len must be a multiple); they hold replicated parameters, so ZeRO reduces over DP x CP",
    )
    sequence_parallel: bool = opt(
        False, "Megatron sequence parallelism (TP > 1): norms, dropout and the residual stream run on 1/TP of each "
        "sequence (reduce-scatter / all-gather instead of all-reduce); data.seq_len / CP must be a multiple of TP",
    )
    zero_stage: int = opt(1, "DeepSpeed ZeRO stage 0-3 (0: plain DDP, 1: optimizer states, 2: +grads, 3: +params)")
    zero_offload_optimizer: bool = opt(False, "keep ZeRO optimizer states in CPU memory (stage >= 1)")
    zero_overlap_comm: bool = opt(False, "overlap ZeRO reductions with backward (GPU; costs memory)")
    zero_reduce_bucket_size: int = opt(500_000_000, "elements per ZeRO gradient-reduction bucket")
    zero_allgather_bucket_size: int = opt(500_000_000, "elements per ZeRO stage 1/2 parameter all-gather bucket")
    zero3_prefetch_bucket_size: int = opt(50_000_000, "elements of parameters prefetched ahead (stage 3)")
    zero3_param_persistence_threshold: int = opt(100_000, "parameters smaller than this stay unpartitioned (stage 3)")
    deferred_init: bool | Literal["auto"] = opt(
        "auto", "build the model under ZeRO-3 `zero.Init`, each block partitioned over DP x CP as soon as it is "
        "built, so no rank holds all the fp32 weights (same init as the eager build for a seed); auto: on with "
        "zero_stage 3; true needs zero_stage 3",
    )
    backend: Literal["auto", "nccl", "gloo"] = opt("auto", "torch.distributed backend (auto: nccl with CUDA, else gloo)")
    timeout_minutes: float = opt(
        10.0, "collective timeout: a peer silent this long (hung, stopped, dead NIC) makes every rank exit naming "
        "the step and the collective (fractions allowed, e.g. 0.1 in tests); torch's default is 30",
    )


def check_parallel(cfg: Any) -> None:
    """Reject impossible parallel settings that need no knowledge of the world size or device."""
    p, d, m = cfg.parallel, cfg.data, cfg.model
    for axis in ("tensor_parallel_size", "context_parallel_size", "pipeline_parallel_size"):
        if getattr(p, axis) < 1:
            raise ParallelConfigError(f"parallel.{axis}", f"expected a positive integer, got {getattr(p, axis)}")
    if p.zero_stage not in (0, 1, 2, 3):
        raise ParallelConfigError("parallel.zero_stage", f"expected one of 0, 1, 2, 3, got {p.zero_stage}")
    if p.deferred_init is True and p.zero_stage != 3:
        raise ParallelConfigError("parallel.deferred_init", f"true needs parallel.zero_stage 3, got stage {p.zero_stage}")
    if p.zero_offload_optimizer and p.zero_stage == 0:
        raise ParallelConfigError("parallel.zero_offload_optimizer", "needs parallel.zero_stage >= 1, got stage 0")
    parallel_dims(cfg, p.tensor_parallel_size * p.context_parallel_size * p.pipeline_parallel_size)  # the model fits
    _check_sequence_parallel(p, d.seq_len)
    if p.pipeline_parallel_size > 1:
        _check_pipeline(cfg)
    if p.context_parallel_size > 1:
        _check_context_parallel(p.context_parallel_size, m, d)


def parallel_dims(cfg: Any, world_size: int) -> ParallelDims:
    """The run's TP x CP x PP x DP grid on ``world_size`` ranks, validated against the model."""
    p, m = cfg.parallel, cfg.model
    try:
        return ParallelDims.for_model(
            world_size, p.tensor_parallel_size, p.context_parallel_size, pp_size=p.pipeline_parallel_size,
            num_heads=m.num_heads, ffn_hidden_size=m.ffn_hidden_size, num_layers=m.num_layers,
        )
    except ValueError as err:
        key = "pipeline_parallel_size" if str(err).startswith("pipeline_parallel_size") else "tensor_parallel_size"
        raise ParallelConfigError(f"parallel.{key}", str(err)) from None


def _check_sequence_parallel(p: ParallelConfig, seq_len: int) -> None:
    if not p.sequence_parallel:
        return
    if p.tensor_parallel_size == 1:
        raise ParallelConfigError("parallel.sequence_parallel", "needs parallel.tensor_parallel_size > 1 (it splits "
                                  "each sequence over the TP ranks); got tensor_parallel_size 1")
    if seq_len % (p.context_parallel_size * p.tensor_parallel_size) != 0:  # CP slices, then TP shards of them
        raise ParallelConfigError(
            "data.seq_len", f"expected a multiple of parallel.context_parallel_size x tensor_parallel_size "
            f"({p.context_parallel_size} x {p.tensor_parallel_size}) with parallel.sequence_parallel, got {seq_len}")


def _check_pipeline(cfg: Any) -> None:
    """What pipeline parallelism (DeepSpeed's pipeline engine) does not run, refused before launch."""
    p, pp = cfg.parallel, cfg.parallel.pipeline_parallel_size
    if p.zero_stage >= 2:
        # deepspeed/runtime/pipe/engine.py (PipelineEngine.__init__) asserts
        # "ZeRO-2 and ZeRO-3 are incompatible with pipeline parallelism"
        raise ParallelConfigError("parallel.zero_stage", f"expected 0 or 1 with parallel.pipeline_parallel_size {pp} "
                                  f"(DeepSpeed's pipeline engine refuses ZeRO-2 and ZeRO-3), got {p.zero_stage}")
    if p.zero_stage == 0 and cfg.train.grad_clip > 0:
        # deepspeed/runtime/utils.py clip_grad_norm_ (ZeRO 0 fp32 clipping) counts a gradient that is not
        # tensor-parallel only on model-parallel rank 0, i.e. the first stage, and the tied embedding twice
        raise ParallelConfigError(
            "parallel.zero_stage", f"expected 1 with parallel.pipeline_parallel_size {pp} and train.grad_clip "
            f"{cfg.train.grad_clip} (DeepSpeed's ZeRO-0 clipping norm is wrong under pipeline parallelism; ZeRO-1's "
            "is right), got 0")
    if cfg.data.document_boundaries == "reset":
        raise ParallelConfigError("data.document_boundaries", f"expected 'none' with parallel.pipeline_parallel_size "
                                  f"{pp} (stages pass only the hidden states, not the document starts), got 'reset'")
    injected = {"fault.nan_loss_at_steps": cfg.fault.nan_loss_at_steps, "fault.inf_grad_at_steps": cfg.fault.inf_grad_at_steps}
    for key, steps in injected.items():
        if steps:  # they act on the per-micro-batch loss, which the pipeline engine keeps to itself
            raise ParallelConfigError(key, f"expected [] with parallel.pipeline_parallel_size {pp}, got {steps}")


def _check_context_parallel(cp: int, m: Any, d: Any) -> None:
    """Context parallelism passes linear attention's state (and the window's halo) between ranks."""
    if d.seq_len % cp != 0:
        raise ParallelConfigError("data.seq_len", f"expected a multiple of parallel.context_parallel_size ({cp}), "
                                  f"got {d.seq_len}")
    if not m.is_linear_attention and not m.softmax_window:
        raise ParallelConfigError(
            "parallel.context_parallel_size", f"expected 1 for model.attention={m.attention!r} (context parallelism "
            f"passes the fixed-size state of linear attention; softmax has none), got {cp}")
    if m.qkv_conv_size or (m.softmax_window and m.window_mixing == "gated"):
        # they read the tokens just before each position, which may live on the previous CP rank (the
        # one-normaliser window exchanges that halo: context_parallel_window.py)
        raise ParallelConfigError(
            "parallel.context_parallel_size", f"expected 1 with model.qkv_conv_size ({m.qkv_conv_size}) or a gated "
            f"model.softmax_window ({m.softmax_window}) set (they need the previous rank's tokens), got {cp}")
    if m.softmax_window and d.document_boundaries == "reset":
        raise ParallelConfigError("parallel.context_parallel_size", "expected 1 with model.softmax_window and "
                                  f"data.document_boundaries=reset (not supported together yet), got {cp}")
    slice_len = d.seq_len // cp
    if m.softmax_window and slice_len < m.softmax_window - 1:
        raise ParallelConfigError(
            "parallel.context_parallel_size", f"expected slices of at least model.softmax_window - 1 = "
            f"{m.softmax_window - 1} tokens (the halo comes from the previous rank), got data.seq_len / {cp} = {slice_len}")
