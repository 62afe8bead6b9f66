"""Megatron-style tensor parallelism and LASP-2-style context parallelism: the ``parallel:``
config section and its checks (``config``), the parallel grid (``ParallelDims``) and process-group state, region mappings, sharded layers, the parallelisation
of a plain GPT (``parallelize_gpt``), vocab-parallel cross-entropy, context-parallel linear
attention, a TP-aware RNG tracker and checkpoint resharding.

Layering: this package may import ``megaflex.attention`` and ``megaflex.model`` (the
``LayerFactory`` protocol it implements); the model never imports it.
"""

from megaflex.parallel.context_parallel import (
    ContextParallelAttention,
    sequence_slice,
    sequence_sum,
)
from megaflex.parallel.cross_entropy import vocab_parallel_cross_entropy
from megaflex.parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    TensorParallelLayers,
    VocabParallelEmbedding,
    is_tensor_parallel,
    mark_head_sharded_params,
    set_tensor_parallel_attributes,
)
from megaflex.parallel.mappings import (
    copy_to_tp_region,
    gather_from_tp_region,
    reduce_from_tp_region,
    scatter_to_tp_region,
)
from megaflex.parallel.parallelize import parallel_layers, parallelize_gpt, parallelize_with
from megaflex.parallel.random import TensorParallelRNGTracker, model_parallel_seed, model_parallel_tracker
from megaflex.parallel.state import (
    DeepSpeedMPU,
    ParallelDims,
    ParallelState,
    deepspeed_mpu,
    initialize_parallel_state,
)

__all__ = [
    "ContextParallelAttention",
    "ParallelDims",
    "sequence_slice",
    "sequence_sum",
    "ColumnParallelLinear",
    "DeepSpeedMPU",
    "ParallelState",
    "RowParallelLinear",
    "TensorParallelLayers",
    "TensorParallelRNGTracker",
    "VocabParallelEmbedding",
    "copy_to_tp_region",
    "deepspeed_mpu",
    "gather_from_tp_region",
    "initialize_parallel_state",
    "is_tensor_parallel",
    "mark_head_sharded_params",
    "model_parallel_seed",
    "model_parallel_tracker",
    "parallel_layers",
    "parallelize_gpt",
    "parallelize_with",
    "reduce_from_tp_region",
    "scatter_to_tp_region",
    "set_tensor_parallel_attributes",
    "vocab_parallel_cross_entropy",
]
