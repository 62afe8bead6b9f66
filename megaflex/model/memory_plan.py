"""Per-rank memory plan of a training layout: weights, gradients, optimizer states, activations.

    plan = memory_plan(config, tp=8, pp=1, zero=3, world=64, micro_batch=1, seq_len=4096)
    print(plan.format())            # or plan.to_dict() (``--json``)

A derived estimate (no model is materialised: shapes come from a meta-device build), for
DeepSpeed 0.19 with megaflex's torch AdamW, on the heaviest rank: the pipeline stage holding
the embedding (and, tied, its copy on the last stage). Bytes per parameter P of a rank:

    weights     2 P (bf16/fp16) or 4 P (fp32);                       / DP under ZeRO-3
    gradients   the low-precision .grad (2 P; 4 P in fp32)            / DP under ZeRO-2/3
                + the fp32 accumulation buffer of bf16/fp16 runs with ZeRO >= 1
                  (train.grad_accum_dtype: fp32, 4 P; ZeRO-1 keeps it whole)   / DP under ZeRO-2/3
    optimizer   AdamW moments 8 P + the fp32 master copy 4 P (bf16/fp16)  / DP under ZeRO >= 1

Activations (bytes e per element: 2 in bf16/fp16, 4 in fp32; b micro-batch, s sequence, h hidden,
a heads, d head dim, F feature-map size per head, f ffn width, t TP size, V padded vocabulary), per
block kept for backward (after Korthikanti et al., "Reducing Activation Recomputation", with
dropout 0 and linear attention, which has no s^2 term):

    e s b h (4)                  the two norms' inputs, the QKV and MLP inputs (replicated over TP;
                                 / t under sequence parallelism, which keeps them sequence-sharded)
    e s b h/t (7)                q, k, v, RoPE'd q and k, the attention output, the gained output
    e s b (a/t) 2 (d + F/2)      the feature maps of q and k (inputs, and the F/2 projections
                                 x Omega that both cos and sin features come from)
    4 s b (a/t) (2 F + 2 d)      the chunked core's fp32 saves: phi(q), phi(k), [v, 1], numerator
    e s b f/t (2 | 4)            GELU input and output | SwiGLU gate/up, silu(gate), product

Softmax attention runs torch SDPA (flash / memory-efficient kernels: no s^2 matrix is stored),
so its core keeps q, k, v and the output only. Outside the blocks: the embedding output and final
norm input (2 e s b h) and the logits with their gradient (2 e s b V/t), or, with the chunked loss
(``loss_chunk_tokens`` = c > 0, ``train.loss_chunk_tokens``; not under pipeline parallelism), one chunk's
logits and gradient and two fp32 working copies of them ((2 e + 8) min(c, s b) V/t) plus, in bf16/fp16,
the fp32 sum of the output matrix's gradient over the chunks (4 V/t h). With activation
checkpointing a block keeps only its input (e s b h) and one block is recomputed at a time (its
full activations once). Under pipeline parallelism (1F1B) the first stage holds ``pp``
micro-batches in flight. Context parallelism gives each rank s / cp tokens (and ZeRO partitions
over DP x CP, the group it reduces over); sequence parallelism divides the h-wide replicated
terms (and the checkpointed block inputs, the embedding output and final norm input) by t. Not
counted: the interpreter, communication buckets and allocator slack.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

from megaflex.model.config import ModelConfig
from megaflex.model.gpt import GPT
from megaflex.model.layers import check_model_fit, pad_vocab_size

GIB = 2**30
PRECISIONS = ("bf16", "fp16", "fp32")

# Parameters of a block that stay whole on every TP rank (norm gains, biases added after the
# row-parallel all-reduce); every other block parameter is split over TP (GPT's module docs).
_TP_REPLICATED_SUFFIXES = ("norm.weight", "norm.bias", "proj.bias", "fc_out.bias")


@dataclass(frozen=True)
class MemoryPlan:
    """Bytes per rank; ``*_checkpointed`` with activation checkpointing."""

    tp: int
    pp: int
    dp: int
    cp: int
    sequence_parallel: bool
    zero: int
    precision: str
    micro_batch: int
    seq_len: int
    loss_chunk_tokens: int  # 0: the whole logits
    parameters: int  # the whole model
    rank_parameters: int  # held by the heaviest rank before ZeRO partitions them
    weights: int
    gradients: int
    optimizer: int
    activations: int
    activations_checkpointed: int

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.optimizer + self.activations

    @property
    def total_checkpointed(self) -> int:
        return self.weights + self.gradients + self.optimizer + self.activations_checkpointed

    def to_dict(self) -> dict[str, int | str]:
        return dict(asdict(self), total=self.total, total_checkpointed=self.total_checkpointed)

    def format(self) -> str:
        rows = [
            ("weights", self.weights), ("gradients", self.gradients), ("optimizer states", self.optimizer),
            ("activations", self.activations), ("total", self.total),
            ("activations (checkpointed)", self.activations_checkpointed),
            ("total (checkpointed)", self.total_checkpointed),
        ]
        sp = " (sequence parallel)" if self.sequence_parallel else ""
        loss = f"loss in chunks of {self.loss_chunk_tokens} tokens" if self.loss_chunk_tokens else "whole logits"
        head = (f"memory plan per rank: TP {self.tp}{sp} x CP {self.cp} x PP {self.pp} x DP {self.dp}, ZeRO {self.zero}, "
                f"{self.precision}, "
                f"micro-batch {self.micro_batch} x seq {self.seq_len}, {loss}\n"
                f"  parameters {self.parameters:,d} ({self.rank_parameters:,d} on the heaviest rank before ZeRO)")
        return "\n".join([head] + [f"  {name:<28s} {value / GIB:>9.2f} GiB" for name, value in rows])


def memory_plan(
    config: ModelConfig,
    *,
    tp: int = 1,
    pp: int = 1,
    cp: int = 1,
    sequence_parallel: bool = False,
    zero: int = 1,
    world: int = 1,
    micro_batch: int = 1,
    seq_len: int | None = None,
    precision: str = "bf16",
    grad_accum_dtype: str = "fp32",
    loss_chunk_tokens: int = 0,
) -> MemoryPlan:
    """The plan of ``config`` on ``world`` ranks split TP x CP x PP x DP (pure: builds on the meta device)."""
    for name, value in {"tp": tp, "pp": pp, "cp": cp, "world": world, "micro_batch": micro_batch}.items():
        if value < 1:
            raise ValueError(f"{name}: expected a positive integer, got {value}")
    if world % (tp * pp * cp) != 0:
        raise ValueError(f"world: expected a multiple of tp x cp x pp = {tp * cp * pp}, got {world}")
    check_model_fit(config.num_heads, config.ffn_hidden_size, tp)  # the trainer refuses such a TP size too
    if sequence_parallel and tp == 1:
        raise ValueError("sequence_parallel: needs tp > 1")
    seq_len = config.max_seq_len if seq_len is None else seq_len
    if seq_len < 1:
        raise ValueError(f"seq_len: expected a positive integer, got {seq_len}")
    split = cp * tp if sequence_parallel else cp
    if seq_len % split != 0:
        raise ValueError(f"seq_len: expected a multiple of {'cp x tp' if sequence_parallel else 'cp'} = {split}, "
                         f"got {seq_len}")
    if zero not in (0, 1, 2, 3):
        raise ValueError(f"zero: expected one of 0, 1, 2, 3, got {zero}")
    if precision not in PRECISIONS:
        raise ValueError(f"precision: expected one of {PRECISIONS}, got {precision!r}")
    if pp > config.num_layers:
        raise ValueError(f"pp: expected at most num_layers={config.num_layers} stages, got {pp}")
    if loss_chunk_tokens < 0:
        raise ValueError(f"loss_chunk_tokens: expected >= 0 (0: the whole logits), got {loss_chunk_tokens}")
    loss_chunk_tokens = 0 if pp > 1 else loss_chunk_tokens  # the pipeline's last stage keeps the whole logits
    dp = world // (tp * pp * cp)
    shards = dp * cp  # ZeRO partitions over the DP x CP group it reduces over
    with torch.device("meta"):
        model = GPT(config)
    rank_params = _heaviest_stage_parameters(model, config, tp, pp)

    low = 4 if precision == "fp32" else 2
    accumulate = 4 if precision != "fp32" and zero >= 1 and grad_accum_dtype == "fp32" else 0
    master = 0 if precision == "fp32" else 4
    weights = low * rank_params / (shards if zero == 3 else 1)
    gradients = (low + accumulate) * rank_params / (shards if zero >= 2 else 1)
    optimizer = (8 + master) * rank_params / (shards if zero >= 1 else 1)

    block, outside, block_input = _activation_bytes(
        model, config, tp, micro_batch, seq_len // cp, low, sequence_parallel, loss_chunk_tokens
    )
    blocks = math.ceil(config.num_layers / pp)
    activations = pp * blocks * block + outside
    checkpointed = pp * blocks * block_input + block + outside
    return MemoryPlan(
        tp=tp, pp=pp, dp=dp, cp=cp, sequence_parallel=sequence_parallel, zero=zero, precision=precision, micro_batch=micro_batch, seq_len=seq_len,
        loss_chunk_tokens=loss_chunk_tokens, parameters=model.num_parameters(), rank_parameters=rank_params,
        weights=int(weights), gradients=int(gradients), optimizer=int(optimizer),
        activations=int(activations), activations_checkpointed=int(checkpointed),
    )


def _heaviest_stage_parameters(model: GPT, config: ModelConfig, tp: int, pp: int) -> int:
    """Parameters on the TP rank of the heavier of the first and last pipeline stage."""
    block = sum(
        p.numel() if name.endswith(_TP_REPLICATED_SUFFIXES) else p.numel() // tp
        for name, p in model.blocks[0].named_parameters()
    )
    vocab_rows = pad_vocab_size(config.vocab_size, tp) // tp
    embedding = vocab_rows * config.hidden_size
    positions = 0 if model.pos_embed is None else model.pos_embed.weight.numel()
    final_norm = sum(p.numel() for p in model.final_norm.parameters())
    blocks = math.ceil(config.num_layers / pp) * block
    # Untied: a separate head; tied: the last stage keeps its own copy of the embedding (Megatron).
    head = embedding if (not config.tie_embeddings or pp > 1) else 0
    if pp == 1:
        return embedding + positions + blocks + final_norm + (head if not config.tie_embeddings else 0)
    first = embedding + positions + blocks
    last = blocks + final_norm + head
    return max(first, last)


def _activation_bytes(
    model: GPT, config: ModelConfig, tp: int, b: int, s: int, e: int, sequence_parallel: bool = False,
    loss_chunk_tokens: int = 0,
) -> tuple[int, int, int]:
    """(one block's saved activations, those outside the blocks, one block's checkpointed input)
    for ``s`` tokens per sequence on this rank."""
    h, d, f = config.hidden_size, config.head_dim, config.ffn_hidden_size
    heads = config.num_heads // tp
    tokens = b * s
    residual = h // tp if sequence_parallel else h  # h-wide tensors on the residual stream
    block = e * tokens * (4 * residual + 7 * h // tp)
    block += e * tokens * f // tp * (4 if config.mlp == "swiglu" else 2)
    feature_map = model.blocks[0].attn.core.feature_map
    if config.is_linear_attention and feature_map is not None:
        feat = feature_map.feature_dim
        block += e * tokens * heads * 2 * (d + feat // 2)  # feature maps of q and k
        block += 4 * tokens * heads * (2 * feat + 2 * d)  # the chunked core's fp32 saves
    vocab = pad_vocab_size(config.vocab_size, tp) // tp
    if loss_chunk_tokens:
        logits = (2 * e + 8) * min(loss_chunk_tokens, tokens) * vocab + (4 * vocab * h if e < 4 else 0)
    else:
        logits = 2 * e * tokens * vocab
    outside = 2 * e * tokens * residual + logits
    return block, outside, e * tokens * residual
