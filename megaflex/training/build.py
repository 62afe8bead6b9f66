"""The run's model: built eagerly, or partitioned while it is built under ZeRO-3.

    model = build_gpt(cfg, state, device, rng_tracker)

``parallel.deferred_init`` (``auto``: on with ``parallel.zero_stage: 3``) builds the GPT inside
DeepSpeed's ``zero.Init``, each block parallelised and partitioned over DeepSpeed's data-parallel
group (DP x CP) as soon as it is built (``megaflex.parallel.deferred_init``), so no rank ever holds
all the fp32 weights; the parameters equal the eager build's for the same seed. Either way the GPT
is built plain and parallelised over ``state`` (``megaflex.parallel.parallelize``), then told its loss
chunking (``train.loss_chunk_tokens``) and, with ``train.compile``, its blocks compiled in place
(``megaflex.model.compile``) before DeepSpeed wraps it.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from megaflex.model.compile import compile_blocks
from megaflex.model.gpt import GPT
from megaflex.parallel import ParallelState, is_tensor_parallel, TensorParallelRNGTracker, deepspeed_mpu, parallel_layers, parallelize_with
from megaflex.parallel.deferred_init import full_numel, zero3_build
from megaflex.training.config import Config
from megaflex.training.deepspeed_config import deepspeed_config


def uses_deferred_init(cfg: Config) -> bool:
    deferred = cfg.parallel.deferred_init
    return cfg.parallel.zero_stage == 3 if deferred == "auto" else bool(deferred)


def build_gpt(cfg: Config, state: ParallelState, device: str, rng_tracker: TensorParallelRNGTracker | None = None,
              ds_config: dict[str, Any] | None = None) -> GPT:
    """The GPT of ``cfg.model`` parallelised over ``state`` (``rng_tracker``: its TP-region
    stream), seeded by the caller; partitioned if deferred (``ds_config``: the run's DeepSpeed
    config, when the caller has it already)."""
    layers = parallel_layers(state, rng_tracker, sequence_parallel=cfg.parallel.sequence_parallel)

    def parallelize(module: nn.Module) -> nn.Module:
        return module if layers is None else parallelize_with(module, layers, cfg.model)

    if not uses_deferred_init(cfg):
        model = parallelize(GPT(cfg.model))
    else:
        if ds_config is None:
            ds_config = deepspeed_config(cfg, state.dp_size, state.cp_size, on_cuda=device == "cuda")
        model = zero3_build(lambda: GPT(cfg.model), ds_config, deepspeed_mpu(state), prepare=parallelize)
    model.set_loss_chunk_tokens(cfg.train.loss_chunk_tokens)
    if cfg.train.compile:
        compile_blocks(model)  # in place: parameter names (checkpoint keys) unchanged
    return model


def full_parameter_count(model: nn.Module, tp_size: int) -> int:
    """Parameters of the whole model (TP shards counted once per shard, replicated ones once)."""
    return sum(full_numel(p) * (tp_size if tp_size > 1 and is_tensor_parallel(p) else 1) for p in model.parameters())
