"""Megatron-style tensor-parallel layers and the ``TensorParallelLayers`` factory.

Every sharded parameter carries Megatron's attributes

    tensor_model_parallel = True   (DeepSpeed counts it on every rank when reducing grad norms)
    partition_dim         = 0 | 1  (the dim that is split over TP ranks)
    partition_stride      = 1

and vocabulary-padded ones additionally ``true_vocab_size`` (rows at or past it are padding).
``megaflex.checkpoint.reshard`` uses these tags to convert checkpoints between TP sizes.

Initialisation: each layer is constructed from an existing plain layer and keeps this rank's
slice of it (the GPT is built plain, then parallelised: ``megaflex.parallel.parallelize``). So a
TP=k model holds exactly the slices of the TP=1 model built after the same seed. Materialising the full weight is cheap at the
sizes this project trains; for very large models build under ZeRO-3
(``megaflex.parallel.deferred_init``) or on the meta device and load a resharded checkpoint.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, ContextManager

import torch
import torch.nn.functional as F
from torch import nn

from megaflex.attention import named_kernel_parameters
from megaflex.model.layers import LocalLayers, check_tensor_parallel_fit, pad_vocab_size
from megaflex.parallel.context_parallel import ContextParallelAttention, sequence_sum
from megaflex.parallel.context_parallel_window import ContextParallelWindowAttention
from megaflex.parallel.cross_entropy import vocab_parallel_cross_entropy
from megaflex.parallel.mappings import (
    copy_to_tp_region,
    gather_from_tp_region,
    reduce_from_tp_region,
    scatter_to_tp_region,
)
from megaflex.parallel.random import TensorParallelRNGTracker, model_parallel_tracker
from megaflex.parallel.sequence_parallel import (
    gather_from_sequence,
    gathered_linear,
    reduce_scatter_to_sequence,
    scatter_to_sequence,
    summed_over_sequence,
)
from megaflex.parallel.state import ParallelState


# context parallelism of each attention module, by the ``op`` it declares (``AttentionCore.op``,
# ``LocalMixingCore.op``); which module a layer holds is decided by ``attention.dispatch`` (op "module")
_CONTEXT_PARALLEL = {"core": ContextParallelAttention, "local_mixing": ContextParallelWindowAttention}

def set_tensor_parallel_attributes(param: torch.Tensor, partition_dim: int, stride: int = 1) -> None:
    """Tag ``param`` as split along ``partition_dim`` over the TP group (Megatron's convention)."""
    param.tensor_model_parallel = True
    param.partition_dim = partition_dim
    param.partition_stride = stride


def is_tensor_parallel(param: torch.Tensor) -> bool:
    return bool(getattr(param, "tensor_model_parallel", False))


def mark_head_sharded_params(model: nn.Module) -> int:
    """Tag every learnable kernel parameter in ``model`` (Omega, tau, ...) as split on dim 0 (heads).

    Feature maps declare their parameters (``named_kernel_parameters``; heads are always dim 0)
    and know nothing about TP, so the tags are added afterwards. Call it once after building a TP
    model: DeepSpeed's grad norm only counts untagged parameters on TP rank 0. Returns the number
    of tagged params.
    """
    count = 0
    for _, kp in named_kernel_parameters(model):
        if not is_tensor_parallel(kp.param):
            set_tensor_parallel_attributes(kp.param, 0)
            count += 1
    return count


def shard_parameter(param: torch.Tensor, state: ParallelState, dim: int) -> nn.Parameter:
    """This TP rank's contiguous slice of ``param`` along ``dim`` (a copy), tagged as split there."""
    shard = nn.Parameter(param.detach().chunk(state.tp_size, dim=dim)[state.tp_rank].clone(), param.requires_grad)
    set_tensor_parallel_attributes(shard, dim)
    return shard


class ColumnParallelLinear(nn.Module):
    """y = x A^T + b with A split by rows (output features): x [..., in] -> y [..., out / tp].

    ``gather_output=True`` all-gathers y to [..., out]. The output shard of rank r holds output
    features [r * out / tp, (r + 1) * out / tp), so order features so that a contiguous block
    is a self-contained unit (the fused QKV is ordered (head, {q,k,v}, head_dim)).
    ``sequence_parallel=True``: x is this rank's sequence shard [..., N / tp, in], all-gathered
    along the sequence first (``megaflex.parallel.sequence_parallel``).
    """

    def __init__(
        self, layer: nn.Linear, state: ParallelState, *, gather_output: bool = False, sequence_parallel: bool = False
    ) -> None:
        """This rank's shard of the plain ``layer`` (its weight rows and bias entries)."""
        super().__init__()
        check_tensor_parallel_fit("out_features", layer.out_features, state.tp_size)
        self.state = state
        self.in_features, self.out_features = layer.in_features, layer.out_features
        self.gather_output = gather_output
        self.sequence_parallel = sequence_parallel
        self.weight = shard_parameter(layer.weight, state, 0)  # [out / tp, in]
        self.bias = None if layer.bias is None else shard_parameter(layer.bias, state, 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            y = gathered_linear(x, self.weight, self.bias, self.state)  # [..., N, out / tp]
        else:
            y = F.linear(copy_to_tp_region(x, self.state), self.weight, self.bias)  # [..., out / tp]
        return gather_from_tp_region(y, self.state) if self.gather_output else y

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, tp={self.state.tp_size}, bias={self.bias is not None}"


class RowParallelLinear(nn.Module):
    """y = x A^T + b with A split by columns (input features): x [..., in / tp] -> y [..., out].

    Each rank computes a partial product; one all-reduce sums them. The bias is replicated and
    added after the reduce (adding it per rank would count it tp times).
    ``input_is_parallel=False`` accepts a full x and scatters it first.
    ``sequence_parallel=True``: the partial sums are reduce-scattered along the sequence instead,
    y [..., N / tp, out] (this rank's shard), and the bias's gradient is summed over the shards.
    """

    def __init__(
        self, layer: nn.Linear, state: ParallelState, *, input_is_parallel: bool = True, sequence_parallel: bool = False
    ) -> None:
        """This rank's shard of the plain ``layer`` (its weight columns; the bias replicated)."""
        super().__init__()
        check_tensor_parallel_fit("in_features", layer.in_features, state.tp_size)
        self.state = state
        self.in_features, self.out_features = layer.in_features, layer.out_features
        self.input_is_parallel = input_is_parallel
        self.sequence_parallel = sequence_parallel
        self.weight = shard_parameter(layer.weight, state, 1)  # [out, in / tp]
        self.bias = None if layer.bias is None else nn.Parameter(layer.bias.detach().clone(), layer.bias.requires_grad)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_tp_region(x, self.state)
        if self.sequence_parallel:
            y = reduce_scatter_to_sequence(F.linear(x, self.weight), self.state)  # [..., N / tp, out]
            return y + summed_over_sequence(self.bias, self.state) if self.bias is not None else y
        y = reduce_from_tp_region(F.linear(x, self.weight), self.state)  # [..., out]
        return y + self.bias if self.bias is not None else y

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, tp={self.state.tp_size}, bias={self.bias is not None}"


class VocabParallelEmbedding(nn.Module):
    """Embedding with the (padded) vocabulary split over TP ranks: ids [...] -> [..., hidden].

    The vocabulary is padded to ``pad_vocab_size(vocab_size, tp)``; rank r owns rows
    [r * V_local, (r + 1) * V_local). Ids outside a rank's slice produce zeros there and the
    all-reduce assembles the full embedding.

    Built from the plain model's table ([pad_vocab_size(vocab_size, 1), hidden]) with the extra
    TP padding rows zero-filled, so all rows it has match the TP=1 model.
    ``sequence_parallel=True``: ids [..., N] -> this rank's sequence shard [..., N / tp, hidden]
    (a reduce-scatter instead of the all-reduce).
    """

    def __init__(self, embedding: nn.Embedding, state: ParallelState, *, sequence_parallel: bool = False) -> None:
        """This rank's rows of the plain ``embedding`` (``.vocab_size`` set; its table padded
        further with zero rows to ``pad_vocab_size(vocab_size, tp)``)."""
        super().__init__()
        self.state = state
        self.sequence_parallel = sequence_parallel
        self.vocab_size = vocab_size = embedding.vocab_size
        table = embedding.weight
        self.hidden = table.shape[1]
        self.padded_vocab_size = pad_vocab_size(vocab_size, state.tp_size)
        per_rank = self.padded_vocab_size // state.tp_size
        self.vocab_start = state.tp_rank * per_rank
        self.vocab_end = self.vocab_start + per_rank
        rows = table.detach()[self.vocab_start : self.vocab_end]  # the rows the table has
        shard = torch.zeros(per_rank, self.hidden, dtype=table.dtype, device=table.device)
        shard[: rows.shape[0]] = rows
        self.weight = nn.Parameter(shard, table.requires_grad)
        set_tensor_parallel_attributes(self.weight, 0)
        self.weight.true_vocab_size = vocab_size

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.state.tp_size == 1:
            return F.embedding(ids, self.weight)
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local = (ids - self.vocab_start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)  # [..., hidden]
        if self.sequence_parallel:
            return reduce_scatter_to_sequence(out, self.state)
        return reduce_from_tp_region(out, self.state)

    def extra_repr(self) -> str:
        return f"vocab={self.vocab_size} (padded {self.padded_vocab_size}), hidden={self.hidden}, tp={self.state.tp_size}"


class TensorParallelLayers:
    """``LayerFactory`` of a model parallelised over ``state`` (``parallelize_gpt`` sets it): the
    vocab-parallel logits and loss, the TP RNG contexts and the context-parallel attention.

    ``rng_tracker`` provides the per-rank stream for ``tp_region_rng``; by default one is
    created with ``model_parallel_tracker(seed, tp_rank)``. The default RNG is left alone: the
    caller seeds it identically on every TP rank (``model_parallel_seed`` does both), so the
    plain model the shards are cut from is the same on every rank.

    ``sequence_parallel=True`` (TP > 1): the residual stream between the parallel linears is split
    along the sequence over the TP group (``megaflex.parallel.sequence_parallel``); the model's
    residual dropouts then run on this rank's shard, and the logits gather it back.
    """

    def __init__(
        self, state: ParallelState, rng_tracker: TensorParallelRNGTracker | None = None, *, seed: int = 1234,
        sequence_parallel: bool = False,
    ) -> None:
        if sequence_parallel and state.tp_size == 1:
            raise ValueError("sequence_parallel: needs a tensor-parallel size > 1 (it splits the sequence over TP ranks)")
        self.state = state
        self.rng_tracker = rng_tracker if rng_tracker is not None else model_parallel_tracker(seed, state.tp_rank)
        self.sequence_parallel = sequence_parallel

    @property
    def tp_size(self) -> int:
        return self.state.tp_size

    @property
    def tp_rank(self) -> int:
        return self.state.tp_rank

    def scatter_sequence(self, x: torch.Tensor) -> torch.Tensor:
        return scatter_to_sequence(x, self.state) if self.sequence_parallel else x

    def residual_rng(self) -> ContextManager[None]:
        # sequence shards differ per TP rank, so their dropout masks must too
        return self.tp_region_rng() if self.sequence_parallel else contextlib.nullcontext()

    def logits_input(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., h] (replicated; under sequence parallelism this rank's shard [..., N / tp, h],
        gathered) -> [..., N, h], whose gradient is all-reduced (reduce-scattered) over TP."""
        if self.sequence_parallel:
            return gather_from_sequence(hidden, self.state)
        return copy_to_tp_region(hidden, self.state)

    def lm_logits(self, hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """hidden [..., h] x weight [V_padded / tp, h] -> logits [..., N, V_padded / tp]."""
        return F.linear(self.logits_input(hidden), weight)

    def cross_entropy(
        self, logits: torch.Tensor, labels: torch.Tensor, vocab_size: int, label_smoothing: float = 0.0
    ) -> torch.Tensor:
        if self.state.tp_size == 1:  # whole vocabulary here (context parallelism alone): torch's leaner kernel
            return LocalLayers().cross_entropy(logits, labels, vocab_size, label_smoothing)
        return vocab_parallel_cross_entropy(logits, labels, vocab_size, self.state, label_smoothing=label_smoothing)

    def gather_logits(self, logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """[..., V_padded / tp] -> [..., vocab_size] (all-gather, then drop padding columns)."""
        return gather_from_tp_region(logits, self.state)[..., :vocab_size]

    def tp_region_rng(self) -> ContextManager[None]:
        return self.rng_tracker.fork()

    def checkpoint_context(self) -> tuple[ContextManager[None], ContextManager[None]]:
        """``context_fn`` for non-reentrant activation checkpointing that also replays the
        TP-region RNG in the recompute (see ``TensorParallelRNGTracker.checkpoint_context``)."""
        return self.rng_tracker.checkpoint_context()

    # context parallelism: the model holds this CP rank's slice of every sequence
    def sequence_offset(self, local_len: int) -> int:
        return self.state.cp_rank * local_len

    def sequence_sum(self, x: torch.Tensor) -> torch.Tensor:
        return sequence_sum(x, self.state)

    def attention(self, core: nn.Module) -> Callable[..., Any]:
        if self.state.cp_size == 1:
            return core
        return _CONTEXT_PARALLEL[core.op](core, self.state)
