"""Pipeline parallelism on DeepSpeed's pipeline engine (``deepspeed.pipe.PipelineModule``, 1F1B).

The GPT is built whole and then cut into stages (parallelise after build): the layer list is

    [embedding (pre_process), block 0, ..., block L-1, final norm, logits (post_process)]

and stage ``r`` of ``P`` holds the blocks ``megaflex.model.gpt.stage_layers(L, P, r)``, the first
stage also the embedding, the last also the final norm, the logits and the loss. Every item
wraps the GPT's own modules and runs the GPT's own stage parts (``embed_tokens``,
``run_blocks``, ``language_model_loss``), so a stage computes exactly what ``GPT.forward``
computes for its range; TP layers from the factory work unchanged inside a stage.

Tied embeddings are a ``TiedLayerSpec`` owned by the first and the last stage: DeepSpeed
broadcasts the weight from the first stage at build time and all-reduces the two copies'
gradients before every update (``PipelineEngine._exec_reduce_tied_grads``), so both copies stay
the one weight of the single-device model.

Stages exchange only the hidden states [B, N, h]: every position is absolute (no padding, no
document resets; the config refuses ``data.document_boundaries: reset`` with PP).
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from torch import nn

from megaflex.model.gpt import GPT, Block, embed_tokens, language_model_loss, run_blocks, stage_layers
from megaflex.model.layers import LayerFactory
from megaflex.parallel.state import ParallelState

TIED_EMBEDDING = "embedding"


class EmbeddingStage(nn.Module):
    """pre_process: ids [B, N] -> hidden [B, N, h]; the GPT's embedding modules (names kept)."""

    def __init__(self, model: GPT) -> None:
        super().__init__()
        self.embed, self.pos_embed, self.embed_dropout = model.embed, model.pos_embed, model.embed_dropout
        self.layer_factory = model.layer_factory

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        # contiguous: the stage boundary is a p2p send (a sequence-parallel shard may be a strided view)
        return embed_tokens(self.layer_factory, self.embed, self.pos_embed, self.embed_dropout, input_ids).contiguous()


class BlockStage(nn.Module):
    """One transformer block on hidden states, recomputed in backward under activation checkpointing."""

    def __init__(self, block: Block, model: GPT) -> None:
        super().__init__()
        self.block = block
        self.layer_factory = model.layer_factory
        self.activation_checkpointing = model.activation_checkpointing

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        checkpointing = self.activation_checkpointing and self.training and torch.is_grad_enabled()
        context = self.layer_factory.checkpoint_context if checkpointing else None
        return run_blocks([self.block], x, checkpoint_context=context)[0].contiguous()


class FinalNormStage(nn.Module):
    def __init__(self, model: GPT) -> None:
        super().__init__()
        self.final_norm = model.final_norm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.final_norm(x)


class OutputStage(nn.Module):
    """post_process: hidden -> this rank's logits, through ``lm_head`` or (tied) the last stage's
    copy of the token embedding, held as ``embed`` like the first stage's."""

    def __init__(self, model: GPT) -> None:
        super().__init__()
        if model.lm_head is None:
            self.embed = model.embed
        else:
            self.lm_head = model.lm_head
        self.layer_factory = model.layer_factory

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.embed.weight if hasattr(self, "embed") else self.lm_head.weight
        return self.layer_factory.lm_logits(x, weight)


def pipeline_loss(layers: LayerFactory, vocab_size: int, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The last stage's loss: the GPT's (mean over non-ignored tokens)."""
    return language_model_loss(layers, vocab_size, logits, labels)[0]


def pipeline_layers(model: GPT) -> list[Any]:
    """The flat layer list DeepSpeed partitions: embedding, blocks, final norm, logits."""
    from deepspeed.pipe import LayerSpec, TiedLayerSpec

    if model.lm_head is None:
        # Each stage builds the tied module from the first spec of the key in its own range: the
        # first stage an EmbeddingStage, the last an OutputStage; both hold the matrix as embed.weight.
        first = TiedLayerSpec(TIED_EMBEDDING, EmbeddingStage, model, tied_weight_attr="embed.weight")
        last = TiedLayerSpec(TIED_EMBEDDING, OutputStage, model, tied_weight_attr="embed.weight")
    else:
        first, last = LayerSpec(EmbeddingStage, model), LayerSpec(OutputStage, model)
    blocks = [LayerSpec(BlockStage, block, model) for block in model.blocks]
    return [first, *blocks, LayerSpec(FinalNormStage, model), last]


def stage_bounds(num_layers: int, pp_size: int) -> list[int]:
    """Start index of each stage in ``pipeline_layers`` (and the end): the first stage starts with
    the embedding, the last ends with the final norm and logits, the blocks per ``stage_layers``."""
    starts = [0] + [1 + stage_layers(num_layers, pp_size, r).start for r in range(1, pp_size)]
    return starts + [num_layers + 3]


def build_pipeline(model: GPT, state: ParallelState) -> nn.Module:
    """This rank's stage of ``model`` as a ``PipelineModule`` on the run's (pp, dp, tp) grid.

    Collective (DeepSpeed creates its pipeline groups). Pass the result to
    ``deepspeed.initialize`` without an ``mpu``: the pipeline engine uses the module's own grid."""
    from deepspeed.pipe import PipelineModule
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    if state.pp_size < 2:  # one stage would hold both tied specs of the embedding: use the GPT itself
        raise ValueError(f"pipeline_parallel_size: expected at least 2 stages, got {state.pp_size}")
    if state.cp_size != 1:
        raise ValueError(f"context_parallel_size: expected 1 with pipeline parallelism, got {state.cp_size}")
    topology = PipeModelDataParallelTopology(num_pp=state.pp_size, num_mp=state.tp_size, num_dp=state.dp_size)
    coord = topology.get_coord(state.rank)
    if (coord.pipe, coord.data, coord.model) != (state.pp_rank, state.dp_rank, state.tp_rank):
        raise RuntimeError(f"DeepSpeed's pipeline topology places rank {state.rank} at {coord}, the grid at {state}")
    bounds = stage_bounds(len(model.blocks), state.pp_size)

    class StagedPipelineModule(PipelineModule):
        def _partition_layers(self, method: str = "uniform") -> None:
            # the stages of ``stage_layers`` instead of DeepSpeed's own balancing
            self.parts = bounds
            self._set_bounds(start=bounds[self.stage_id], stop=bounds[self.stage_id + 1])

    pipeline = StagedPipelineModule(
        layers=pipeline_layers(model), topology=topology,
        loss_fn=partial(pipeline_loss, model.layer_factory, model.config.vocab_size),
        partition_method="uniform",
    )
    # The specs hold the whole GPT; DeepSpeed reads them only while building (0.19: partitioning,
    # _build, _index_tied_modules), so dropping them frees the other stages' weights.
    pipeline._layer_specs = [type(spec).__name__ for spec in pipeline._layer_specs]
    return pipeline


def gpt_parameter_name(name: str, num_layers: int) -> str:
    """A ``PipelineModule`` parameter name (``tied_modules.embedding.embed.weight``,
    ``3.block.attn.qkv.weight``, ``0.embed.weight`` ...) -> the GPT's (``embed.weight``,
    ``blocks.2.attn.qkv.weight``): the stage modules keep the GPT's attribute names."""
    tied = f"tied_modules.{TIED_EMBEDDING}."
    if name.startswith(tied):
        return name[len(tied):]
    index, rest = name.split(".", 1)
    if 1 <= int(index) <= num_layers:
        return f"blocks.{int(index) - 1}.{rest.removeprefix('block.')}"
    return rest
