"""Deferred initialisation under ZeRO-3: build a model so that no rank ever holds all its weights.

    model = zero3_build(lambda: GPT(config), ds_config, deepspeed_mpu(state),
                        prepare=lambda module: parallelize_with(module, layers, config))

An eager build holds the whole fp32 model on every rank before ``deepspeed.initialize`` shards
it (28 GB at 7B). Here the model is built inside DeepSpeed's ``zero.Init`` context, so each
transformer block is partitioned over the data-parallel group as soon as it is built: a rank
holds at most one whole block (plus the embeddings until the build ends) and its 1/DP shard of
everything else.

Why per block and not per module (``zero.Init``'s own granularity): our layers are initialised
*after* their module is built (``init_method`` on an ``nn.Linear``), and tensor parallelism is
applied to the whole plain block (``prepare``: ``megaflex.parallel.parallelize_with``, which
slices each full layer and copies the core's heads from the whole core); all of that must see
real tensors. Within a block the build is therefore exactly the eager one: same default-RNG
draws in the same order, on the CPU, in fp32, then parallelised; only then is the block cast to
the training dtype (as ``deepspeed.initialize`` casts an eager model) and partitioned. So a
deferred model's parameters equal the eager model's for a given seed, on any TP size
(``tests/parallel/test_deferred_init.py``). The embeddings are held whole until the build ends.

Other differences from ``zero.Init``'s defaults, all to keep the build identical to the eager one:
no tensor-constructor overrides (they would draw on the accelerator's RNG and in bf16), no
broadcast from rank 0 (every rank draws the same values from the same seed; the broadcast of
each parameter over the DP group would only cost time), and no memory-efficient
``F.linear`` replacement (it patches torch for the whole process).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, ContextManager

import torch
from torch import nn

from megaflex.model.gpt import GPT, Block


def full_shape(param: torch.Tensor) -> torch.Size:
    """The whole parameter's shape, also for a ZeRO-3 partitioned one (whose ``.shape`` is (0,))."""
    return getattr(param, "ds_shape", param.shape)


def full_numel(param: torch.Tensor) -> int:
    """The whole parameter's element count, also for a ZeRO-3 partitioned one."""
    return int(getattr(param, "ds_numel", param.numel()))


def is_partitioned(param: torch.Tensor) -> bool:
    """True for a ZeRO-3 parameter (built by ``zero3_build`` or sharded by a stage-3 engine)."""
    return hasattr(param, "ds_id")


def gathered(param: torch.Tensor, modified: bool = False) -> ContextManager[Any]:
    """Context holding the whole of a ZeRO-3 partitioned ``param`` (a no-op for any other);
    ``modified``: every rank writes the same value, kept (re-partitioned) on exit."""
    if not is_partitioned(param):
        return contextlib.nullcontext()
    from deepspeed.runtime.zero.partition_parameters import GatheredParameters

    return GatheredParameters([param], modifier_rank=0 if modified else None)


def zero3_build(
    build: Callable[[], nn.Module],
    ds_config: dict[str, Any],
    mpu: Any = None,
    partition_at: tuple[type[nn.Module], ...] = (Block,),
    prepare: Callable[[nn.Module], Any] | None = None,
) -> nn.Module:
    """``build()`` under ZeRO-3 ``zero.Init``: each ``partition_at`` module is partitioned over
    the data-parallel group of ``mpu`` (what ``deepspeed.initialize(mpu=...)`` gets; None: the
    world) as soon as its ``__init__`` returns, the rest of the model when ``build`` returns.
    ``prepare(module)`` (in place) runs on each of them, and on the whole model, just before it
    is partitioned (e.g. tensor parallelism: parallelise each plain block before partitioning).
    ``ds_config`` is the run's DeepSpeed config (stage 3; its bf16/fp16 flag sets the dtype the
    shards are kept in; its batch sizes are checked against the mpu's data-parallel size)."""
    init_cls = _blockwise_init_class()
    init_config = dict(ds_config, zero_optimization=dict(ds_config["zero_optimization"], memory_efficient_linear=False))
    context = init_cls(
        partition_at,
        prepare,
        config_dict_or_path=init_config,
        mpu=mpu,
        data_parallel_group=mpu.get_data_parallel_group() if mpu is not None else None,
        tensor_overrides=[],
    )
    with context:
        model = build()
        if prepare is not None:
            prepare(model)
        context.partition_tree(model)
    return model


def register_zero3_external_parameters(model: GPT) -> None:
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


def _blockwise_init_class() -> type:
    import deepspeed
    from deepspeed.runtime.zero.partition_parameters import is_zero_param

    class BlockwiseInit(deepspeed.zero.Init):
        """``zero.Init`` that partitions whole ``partition_at`` subtrees, not every module."""

        def __init__(
            self, partition_at: tuple[type[nn.Module], ...], prepare: Callable[[nn.Module], Any] | None, **kwargs: Any
        ) -> None:
            super().__init__(**kwargs)
            self.partition_at = partition_at
            self.prepare = prepare

        def _post_init_method(self, module: nn.Module) -> None:  # called after every module's __init__
            if isinstance(module, self.partition_at):
                if self.prepare is not None:
                    self.prepare(module)
                self.partition_tree(module)

        def partition_tree(self, root: nn.Module) -> None:
            """Cast, move and partition every not yet partitioned parameter under ``root``."""
            for module in root.modules():
                for name, buffer in module.named_buffers(recurse=False):
                    # zero.Init moves parameters only; the engine does not move a zero.Init model
                    module._buffers[name] = buffer.to(self.local_device)
                for param in module.parameters(recurse=False):
                    if not is_zero_param(param) and param.is_floating_point():
                        param.data = param.data.to(self.dtype)  # what deepspeed.initialize does eagerly
                super()._post_init_method(module)

        def _zero_init_param(self, param: torch.nn.Parameter) -> None:
            # zero.Init broadcasts rank 0's value first; ours are equal on every rank by seeding.
            self._convert_to_deepspeed_param(param)
            param.partition()

    return BlockwiseInit
