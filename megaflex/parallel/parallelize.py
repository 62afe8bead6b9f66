"""Build, then parallelise (torchtitan's order): the GPT is built plain, as on one device, and
``parallelize_gpt`` turns it into this rank's part of the parallel model, in place.

    torch.manual_seed(seed)                      # the same on every rank (``model_parallel_seed``)
    model = parallelize_gpt(GPT(config), state, tracker, sequence_parallel=sp)

Tensor parallelism (Megatron layout) swaps, per block, the fused QKV and the MLP input for
``ColumnParallelLinear``, the attention and MLP outputs for ``RowParallelLinear``, the attention
core for one over this rank's ``num_heads / tp`` heads and the per-head gain for its slice; the
embedding (and an untied head) become ``VocabParallelEmbedding``; under sequence parallelism the
norms become their sequence-parallel versions. Context parallelism alone (TP=1) gets the same
layer classes (whole weights, tagged with their TP layout), cores and gains unchanged. Every shard is the plain weight's slice, so the
parallel model holds exactly the TP=1 model's values for the seed, and parallelising draws no
random numbers. Every module's ``layer_factory`` becomes the ``TensorParallelLayers`` that runs
the logits, loss, RNG contexts and (context parallelism, also alone) the attention.

``parallelize_with`` does the same for a given factory and also takes a single ``Block``: the
ZeRO-3 deferred build parallelises each block as soon as it is built, before it is partitioned
(``megaflex.training.build``); blocks already parallelised are left alone.
"""

from __future__ import annotations

from typing import TypeVar

import torch
from torch import nn

from megaflex.model.config import ModelConfig
from megaflex.model.gpt import GPT, Attention, Block, build_attention_core
from megaflex.parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    TensorParallelLayers,
    VocabParallelEmbedding,
    mark_head_sharded_params,
    shard_parameter,
)
from megaflex.parallel.random import TensorParallelRNGTracker
from megaflex.parallel.sequence_parallel import SequenceParallelLayerNorm, SequenceParallelRMSNorm
from megaflex.parallel.state import ParallelState

ModuleT = TypeVar("ModuleT", GPT, Block)


def parallel_layers(
    state: ParallelState, rng_tracker: TensorParallelRNGTracker | None = None, *, seed: int = 1234,
    sequence_parallel: bool = False,
) -> TensorParallelLayers | None:
    """The factory a model parallelised over ``state`` runs through; None where it stays plain
    (one TP and one CP rank, no sequence parallelism)."""
    if state.tp_size == 1 and state.cp_size == 1 and not sequence_parallel:
        return None
    return TensorParallelLayers(state, rng_tracker, seed=seed, sequence_parallel=sequence_parallel)


def parallelize_gpt(
    model: GPT, state: ParallelState, rng_tracker: TensorParallelRNGTracker | None = None, *, seed: int = 1234,
    sequence_parallel: bool = False,
) -> GPT:
    """Parallelise a plain ``model`` over ``state`` in place and return it (unchanged where
    ``parallel_layers`` is None). ``rng_tracker``/``seed``/``sequence_parallel``: as for
    ``TensorParallelLayers``. ValueError where heads or MLP width do not split over the TP ranks."""
    layers = parallel_layers(state, rng_tracker, seed=seed, sequence_parallel=sequence_parallel)
    return model if layers is None else parallelize_with(model, layers, model.config)


def parallelize_with(module: ModuleT, layers: TensorParallelLayers, config: ModelConfig) -> ModuleT:
    """``module`` (a plain ``GPT`` of ``config``, or one of its ``Block``s) parallelised in place
    over ``layers.state``, running through ``layers``; what is already on ``layers`` is skipped."""
    state = layers.state
    state.dims.check_model_fit(config.num_heads, config.ffn_hidden_size)
    if isinstance(module, Block):
        _parallelize_block(module, layers, config)
        return module
    if module.layer_factory is layers:
        return module
    for block in module.blocks:
        _parallelize_block(block, layers, config)
    sp = layers.sequence_parallel
    module.embed = VocabParallelEmbedding(module.embed, state, sequence_parallel=sp)
    if module.lm_head is not None:
        module.lm_head = VocabParallelEmbedding(module.lm_head, state, sequence_parallel=sp)
    if layers.sequence_parallel:
        module.final_norm = _sequence_parallel_norm(module.final_norm, state)
    module.layer_factory = layers
    return module


def _parallelize_block(block: Block, layers: TensorParallelLayers, config: ModelConfig) -> None:
    if block.layer_factory is layers:
        return
    state, sp = layers.state, layers.sequence_parallel
    attn, mlp = block.attn, block.mlp
    # also at TP=1 (context parallelism alone): the TP layers' partition tags name the layout
    attn.qkv = ColumnParallelLinear(attn.qkv, state, sequence_parallel=sp)
    attn.proj = RowParallelLinear(attn.proj, state, sequence_parallel=sp)
    mlp.fc_in = ColumnParallelLinear(mlp.fc_in, state, sequence_parallel=sp)
    mlp.fc_out = RowParallelLinear(mlp.fc_out, state, sequence_parallel=sp)
    if state.tp_size > 1:
        _shard_heads(attn, state, config)
    if sp:
        block.attn_norm = _sequence_parallel_norm(block.attn_norm, state)
        block.mlp_norm = _sequence_parallel_norm(block.mlp_norm, state)
    block.layer_factory = attn.layer_factory = layers
    if state.tp_size > 1:
        mark_head_sharded_params(block)  # feature-map params (Omega, tau): grad norms count every shard


def _shard_heads(attn: Attention, state: ParallelState, config: ModelConfig) -> None:
    """Keep this rank's contiguous ``num_heads / tp`` heads of the core and the per-head gain."""
    local_heads = config.num_heads // state.tp_size
    full = attn.core
    # Built without touching the default RNG (its random init is overwritten below), so the
    # stream after parallelising is what it was after the plain build.
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    with torch.random.fork_rng(devices=[torch.cuda.current_device()] if cuda else []):
        core = build_attention_core(config, local_heads)
    lo, hi = state.tp_rank * local_heads, (state.tp_rank + 1) * local_heads
    full_state = full.state_dict()
    # Tensors with the heads on dim 0 (every feature map's convention) keep this rank's heads.
    core.load_state_dict({
        name: t[lo:hi] if t.dim() > 0 and t.shape[0] == config.num_heads else t
        for name, t in full_state.items()
    })
    reference = next(iter(full_state.values()), None)
    if reference is not None:
        core.to(reference.device)
    full_params = dict(full.named_parameters())
    for name, p in core.named_parameters():
        p.requires_grad_(full_params[name].requires_grad)
    attn.core = core
    if attn.out_gain is not None:
        attn.out_gain = shard_parameter(attn.out_gain, state, 0)
    if attn.qk_norm is not None:  # its parameters have the heads on dim 0
        for name, param in list(attn.qk_norm.named_parameters(recurse=False)):
            setattr(attn.qk_norm, name, shard_parameter(param, state, 0))
    attn.local_heads = local_heads


def _sequence_parallel_norm(norm: nn.Module, state: ParallelState) -> nn.Module:
    """The sequence-parallel version of a plain RMSNorm / LayerNorm, holding its parameters."""
    cls = SequenceParallelRMSNorm if isinstance(norm, nn.RMSNorm) else SequenceParallelLayerNorm
    sequence_parallel = cls(norm.normalized_shape, norm.eps, state)
    for name, param in norm.named_parameters(recurse=False):
        setattr(sequence_parallel, name, param)
    return sequence_parallel
