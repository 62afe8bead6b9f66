"""The run's model: built eagerly, or partitioned while it is built under ZeRO-3.

    model = build_gpt(cfg, state, layers, device)

``parallel.deferred_init`` (``auto``: on with ``parallel.zero_stage: 3``) builds the GPT inside
DeepSpeed's ``zero.Init``, each block partitioned over DeepSpeed's data-parallel group (DP x CP)
as soon as it is built (``megaflex.parallel.deferred_init``), so no rank ever holds all the fp32
weights; the parameters equal the eager build's for the same seed.
"""

from __future__ import annotations

from megaflex.model.gpt import GPT
from megaflex.model.layers import LayerFactory
from megaflex.parallel import ParallelState, deepspeed_mpu
from megaflex.parallel.deferred_init import zero3_build
from megaflex.training.config import Config
from megaflex.training.deepspeed_config import deepspeed_config


def uses_deferred_init(cfg: Config) -> bool:
    deferred = cfg.parallel.deferred_init
    return cfg.parallel.zero_stage == 3 if deferred == "auto" else bool(deferred)


def build_gpt(cfg: Config, state: ParallelState, layers: LayerFactory, device: str) -> GPT:
    """The GPT of ``cfg.model`` through ``layers``, seeded by the caller; partitioned if deferred."""
    if not uses_deferred_init(cfg):
        return GPT(cfg.model, layers=layers)
    ds_config = deepspeed_config(cfg, state.dp_size, state.cp_size, on_cuda=device == "cuda")
    return zero3_build(lambda: GPT(cfg.model, layers=layers), ds_config, deepspeed_mpu(state))
