"""The model's plain layers and the runtime interface it runs them through.

The GPT is always built from the plain single-device modules below (``linear``,
``vocab_embedding``, ``norm``: one device's init, whatever the run's parallelism), and parallelised
afterwards (``megaflex.parallel.parallelize_gpt``, torchtitan's build-then-parallelise): that swaps
its modules for this rank's tensor-parallel shards and sets its ``LayerFactory``. The model never
talks to process groups; it asks its factory for what runs differently per layout: the logits,
the loss, the RNG contexts, the attention over a split sequence. ``LocalLayers`` (here) is the
single-device factory, ``megaflex.parallel.TensorParallelLayers`` the Megatron-style one. Shapes
below use ``tp`` for the factory's tensor-parallel size. Under context parallelism the model sees
only this rank's slice of each sequence; the factory supplies the slice's global offset, the
attention over the whole sequence and the sum of the loss over the slices. Under sequence
parallelism the residual stream between the parallel linears is this TP rank's sequence shard
[B, N / tp, h]: the embedding and row-parallel linears return shards, the column-parallel linears
and the logits take them, the norms sum their parameter gradients over the shards, and the factory
supplies the position embeddings' split and the RNG of the residual dropouts.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Callable, ContextManager, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from megaflex.model.cross_entropy import blockwise_cross_entropy

InitMethod = Callable[[torch.Tensor], None]


def normal_init(std: float) -> InitMethod:
    """In-place N(0, std^2) initialiser."""
    return lambda weight: nn.init.normal_(weight, mean=0.0, std=std)


def pad_vocab_size(vocab_size: int, tp_size: int, multiple: int = 128) -> int:
    """Vocabulary padded to a multiple of ``multiple * tp_size`` (Megatron's rule)."""
    step = multiple * tp_size
    return int(math.ceil(vocab_size / step) * step)


def check_tensor_parallel_fit(name: str, value: int, tp_size: int) -> None:
    """ValueError unless ``value`` (a head count or feature width) splits evenly over ``tp_size`` ranks.
    The one copy of this check: ``megaflex.parallel.ParallelDims`` and the TP layers call it too."""
    if value % tp_size != 0:
        raise ValueError(f"{name}: expected a multiple of the tensor-parallel size {tp_size}, got {value}")


def check_model_fit(num_heads: int, ffn_hidden_size: int, tp_size: int) -> None:
    """ValueError unless every TP rank gets whole heads and an equal MLP slice."""
    check_tensor_parallel_fit("num_heads", num_heads, tp_size)
    check_tensor_parallel_fit("ffn_hidden_size", ffn_hidden_size, tp_size)


class LayerFactory(Protocol):
    """What the model runs through that depends on its parallel layout (set by parallelisation)."""

    tp_size: int
    tp_rank: int

    def scatter_sequence(self, x: torch.Tensor) -> torch.Tensor:
        """A replicated [..., N, h] tensor added to the residual stream (learned positions) ->
        this rank's part of it (sequence parallel: its shard; else x itself)."""

    def residual_rng(self) -> ContextManager[None]:
        """Context for random ops on the residual stream (embedding and hidden dropout): the
        default RNG where it is replicated over TP, ``tp_region_rng`` where it is sharded."""

    def logits_input(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., N, h] (the residual stream) -> what multiplies the output matrix: [..., N, h]
        over the whole sequence, its gradient summed over the ranks that use it (TP)."""

    def lm_logits(self, hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """hidden [..., N, h] (the residual stream) x vocab-sharded weight [padded_vocab / tp, h]
        -> logits shard [..., N, padded_vocab / tp] over the whole sequence: ``logits_input(hidden)``
        times the weight."""

    def cross_entropy(
        self, logits: torch.Tensor, labels: torch.Tensor, vocab_size: int, label_smoothing: float = 0.0
    ) -> torch.Tensor:
        """Per-token loss (fp32) from vocab-sharded logits; padded vocab entries are excluded."""

    def gather_logits(self, logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """Vocab-sharded logits -> full logits [..., vocab_size] (padding removed)."""

    def tp_region_rng(self) -> ContextManager[None]:
        """Context in which random ops (dropout on sharded activations) differ per TP rank."""

    def checkpoint_context(self) -> tuple[ContextManager[None], ContextManager[None]]:
        """``context_fn`` for non-reentrant ``torch.utils.checkpoint``: (forward, recompute)
        contexts under which the recompute replays ``tp_region_rng``'s random stream."""

    def sequence_offset(self, local_len: int) -> int:
        """Global position of this rank's first token, its slices holding ``local_len`` tokens each."""

    def sequence_sum(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of ``x`` over the slices of the sequence (gradient: this slice's own term)."""

    def attention(self, core: nn.Module) -> Callable[..., Any]:
        """What runs the attention core over the whole (possibly split) sequence: ``core`` itself
        or a stand-in with its call signature."""


class LocalLayers:
    """Single-device implementation of ``LayerFactory`` (tp_size = 1)."""

    tp_size = 1
    tp_rank = 0

    def scatter_sequence(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def residual_rng(self) -> ContextManager[None]:
        return contextlib.nullcontext()

    def logits_input(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden

    def lm_logits(self, hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, weight)

    def cross_entropy(
        self, logits: torch.Tensor, labels: torch.Tensor, vocab_size: int, label_smoothing: float = 0.0
    ) -> torch.Tensor:
        # fp32 a block of rows at a time: no fp32 copy of every logit (megaflex.model.cross_entropy)
        return blockwise_cross_entropy(logits[..., :vocab_size], labels, label_smoothing)

    def gather_logits(self, logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
        return logits[..., :vocab_size]

    def tp_region_rng(self) -> ContextManager[None]:
        return contextlib.nullcontext()

    def checkpoint_context(self) -> tuple[ContextManager[None], ContextManager[None]]:
        # No TP-region stream: torch's own RNG restore covers the default generator.
        return contextlib.nullcontext(), contextlib.nullcontext()

    def sequence_offset(self, local_len: int) -> int:
        return 0

    def sequence_sum(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def attention(self, core: nn.Module) -> Callable[..., Any]:
        return core


def linear(in_features: int, out_features: int, *, bias: bool, init_method: InitMethod) -> nn.Linear:
    """nn.Linear with ``init_method`` on its weight and a zero bias."""
    layer = nn.Linear(in_features, out_features, bias=bias)
    init_method(layer.weight)
    if bias:
        nn.init.zeros_(layer.bias)
    return layer


def vocab_embedding(vocab_size: int, hidden: int, *, init_method: InitMethod) -> nn.Embedding:
    """ids [..., N] -> [..., N, hidden]: ``.weight`` [pad_vocab_size(vocab_size, 1), hidden] and
    ``.vocab_size`` the true vocabulary size; rows past it are padding."""
    embedding = nn.Embedding(pad_vocab_size(vocab_size, 1), hidden)
    init_method(embedding.weight)
    embedding.vocab_size = vocab_size
    return embedding


def norm(kind: str, hidden: int, eps: float) -> nn.Module:
    """An ``nn.RMSNorm`` (kind "rmsnorm") or ``nn.LayerNorm`` over the residual stream."""
    return nn.RMSNorm(hidden, eps=eps) if kind == "rmsnorm" else nn.LayerNorm(hidden, eps=eps)
