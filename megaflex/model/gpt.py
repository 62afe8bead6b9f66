"""GPT: a pre-norm decoder-only transformer whose attention is any kind of ``megaflex.attention``.

    ids [B, N] -> embedding (+ learned positions) -> num_layers x Block -> norm -> logits
    Block:  x = x + Attention(norm(x));  x = x + MLP(norm(x))
    Attention: fused QKV -> [qk_norm(q, k)] -> RoPE(q, k) -> AttentionCore (Flexformer linear attention by default,
               or exact softmax) -> per-head gain -> output projection

The model is always built plain, as on one device (``megaflex.model.layers``); parallelism is
applied afterwards (``megaflex.parallel.parallelize_gpt``: build, then parallelise), which swaps
its linears and embeddings for this rank's shards and sets the ``LayerFactory`` the logits, loss,
RNG contexts and attention run through (``LocalLayers`` until then), so this file never touches
process groups. Under tensor parallelism each rank holds ``num_heads / tp`` whole heads and
``ffn_hidden_size / tp`` MLP channels; the fused layouts below are chosen so that a
*contiguous* shard of an output dim is exactly that.

Training runs the parallel (chunked) attention form over whole sequences. Decoding passes the
``GPTState`` returned by ``forward(..., return_state=True)`` back in: each layer continues from its
recurrent state (a ``LinearAttentionState``, or a ``KVCache`` for softmax), so
``forward(a)`` then ``forward(b, state)`` equals ``forward(a + b)`` up to fp rounding.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from megaflex.attention import AttentionCore, KVCache, LinearAttentionState, padding_mask
from megaflex.attention.documents import DocumentLayout
from megaflex.attention.dispatch import RefusedAttention, refused_setting
from megaflex.attention.hybrid import HybridState, LocalMixingCore, build_attention
from megaflex.attention.inputs import refuse_padded_documents
from megaflex.attention.normalize import is_rms_norm
from megaflex.attention.qk_norm import QKNorm
from megaflex.model.config import ModelConfig
from megaflex.model.cross_entropy import chunked_linear_cross_entropy
from megaflex.model.kernel_stats import kernel_statistics
from megaflex.model.layers import LayerFactory, LocalLayers, linear, norm, normal_init, vocab_embedding
from megaflex.model.rope import RotaryEmbedding

IGNORE_INDEX = -100  # labels equal to this contribute no loss
# one layer's decoding state (linear kinds | softmax | linear with a softmax window or q/k/v convolution)
LayerState = LinearAttentionState | KVCache | HybridState


@dataclass
class GPTState:
    """Decoding state of the whole model."""

    layers: list[LayerState]  # one per block
    offset: int  # tokens consumed so far = absolute position of the next token


@dataclass
class Padding:
    """A padded batch (``GPT.forward(attention_mask=...)``): which tokens are real, and where they sit."""

    key_mask: torch.Tensor  # [B, T] bool over every token so far (cached first), False = padding
    positions: torch.Tensor  # [B, N] position of each new token counted from its row's first real token

    @classmethod
    def from_attention_mask(cls, attention_mask: torch.Tensor | None, batch: int, total: int) -> "Padding | None":
        """None when ``attention_mask`` [B, T] (1 = real) pads nothing; T counts cached tokens too."""
        key_mask = padding_mask(attention_mask, batch, total, "attention_mask")
        if key_mask is None:
            return None
        positions = (key_mask.long().cumsum(-1) - 1).clamp(min=0)  # pads before the first token: 0
        return cls(key_mask, positions)

    def new_tokens(self, n: int) -> "Padding":
        return Padding(self.key_mask, self.positions[:, self.positions.shape[1] - n :])


@dataclass
class Documents:
    """Packed documents of a batch (``data.document_boundaries: reset``; ``attention/documents.py``).

    starts:       [B, N] bool, True where a token begins a document: no attention crosses it
    position_ids: [B, N] int64 positions for RoPE / learned positions (e.g. each token's position in
                  its document, ``data.reset_positions``), None for the absolute positions
    layout:       the starts' ``DocumentLayout`` (host copy, spans, batched plan), built once per
                  forward by ``GPT.forward`` (``laid_out``) and shared by every layer and the
                  backward recompute; None: each attention call builds its own
    """

    starts: torch.Tensor
    position_ids: torch.Tensor | None = None
    layout: DocumentLayout | None = field(default=None, init=False, repr=False, compare=False)

    def laid_out(self) -> "Documents":
        """A copy with ``layout`` built from ``starts``."""
        out = Documents(self.starts, self.position_ids)
        out.layout = DocumentLayout.from_starts(self.starts)
        return out


def _row_positions(padding: Padding | None, documents: Documents | None) -> torch.Tensor | None:
    """[B, N] per-row positions of the new tokens, or None for absolute positions offset + 0 .. N - 1."""
    if padding is not None:
        return padding.positions
    return None if documents is None else documents.position_ids


class ModelOutput(NamedTuple):
    """A tuple, not a dataclass: DeepSpeed hooks the backward of the tensors the engine's forward
    returns only inside tensors/tuples/lists/dicts; that hook runs its backward prologue, which at
    bf16 ZeRO 1 (BF16_Optimizer) zeroes the bf16 gradients of the previous micro-batch. Without it
    the fp32 accumulator summed running totals (4 g1 + 3 g2 + 2 g3 + g4 at grad_accum 4)."""

    # [B, N, padded_vocab / tp]: this rank's vocab shard, padding columns included; use
    # ``GPT.gather_logits`` for the full [B, N, vocab_size] logits. None when the loss was computed
    # chunk by chunk (``GPT.set_loss_chunk_tokens``): the whole logits never existed.
    logits: torch.Tensor | None
    loss: torch.Tensor | None = None  # scalar fp32, mean over non-ignored tokens
    per_token_loss: torch.Tensor | None = None  # [B, N] fp32, 0 where labels == IGNORE_INDEX
    state: GPTState | None = None


def call_attention_core(
    attend: Callable[..., Any], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, state: LayerState | None,
    return_state: bool, kwargs: dict[str, Any],
) -> tuple[torch.Tensor, LayerState | None]:
    """The attention core's call (or its context-parallel stand-in's). A compiled block runs it through
    ``torch.compiler.disable`` (``megaflex.model.compile`` sets ``Attention.run_attention``): a graph break,
    so the core's autograd Functions, Triton kernels, dispatch table, states and document layouts stay
    eager and opaque to the compiler."""
    return attend(q, k, v, state=state, return_state=return_state, **kwargs)


class Attention(nn.Module):
    """Multi-head attention over this rank's ``num_heads / tp`` heads."""

    # what calls the core: ``call_attention_core``, or its ``torch.compiler.disable``d form in a compiled block
    run_attention = staticmethod(call_attention_core)

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        h, d = config.hidden_size, config.head_dim
        self.head_dim = d
        self.local_heads = config.num_heads  # parallelisation keeps num_heads / tp of them
        self.layer_factory: LayerFactory = LocalLayers()
        # Output features ordered (head, {q, k, v}, head_dim): a contiguous 1/tp shard of the
        # 3h outputs is exactly the q, k and v of num_heads / tp whole heads.
        self.qkv = linear(h, 3 * h, bias=config.bias, init_method=normal_init(config.init_std))
        self.rope = RotaryEmbedding(d, config.rope_theta) if config.position == "rope" else None
        # per token and head, before RoPE and every attention form (attention/qk_norm.py); deterministic init
        self.qk_norm = None if config.qk_norm == "none" else QKNorm(config.qk_norm, config.num_heads, d, config.norm_eps)
        self.core = build_attention_core(config, config.num_heads)
        self.causal = config.causal
        # The core's "rms" normalisation is parameter-free; this per-head, per-channel gain is its
        # learnable scale. Flat [heads * d], head-major: a contiguous 1/tp shard is whole heads,
        # and being 1-D it is exempt from weight decay like every other norm gain.
        self.out_gain = None
        if config.is_linear_attention and is_rms_norm(config.normalization):
            self.out_gain = nn.Parameter(torch.ones(self.local_heads * d))
            self.out_gain.tensor_model_parallel = True  # Megatron attribute names: TP-sharded on dim 0
            self.out_gain.partition_dim = 0
            self.out_gain.partition_stride = 1
        self.dropout = nn.Dropout(config.attention_dropout)
        self.proj = linear(h, h, bias=config.bias, init_method=normal_init(_scaled_std(config)))

    def forward(
        self, x: torch.Tensor, state: LayerState | None = None, return_state: bool = False, offset: int = 0,
        padding: Padding | None = None, documents: Documents | None = None,
    ) -> tuple[torch.Tensor, LayerState | None]:
        qkv = self.qkv(x)  # [B, N, 3h / tp]: the whole sequence, also when x is a sequence shard
        B, N = qkv.shape[:2]
        qkv = qkv.view(B, N, self.local_heads, 3, self.head_dim)
        q, k, v = qkv.permute(3, 0, 2, 1, 4).unbind(0)  # each [B, Hl, N, d]
        if self.qk_norm is not None:
            q, k = self.qk_norm(q, k)
        if self.rope is not None:  # absolute positions offset .. offset + N - 1, or each row's own
            q, k = self.rope(q, k, offset, _row_positions(padding, documents))
        attend = self.layer_factory.attention(self.core)  # the core, or its context-parallel stand-in
        kwargs = {}
        if documents is not None:
            kwargs["document_starts"] = documents.starts if documents.layout is None else documents.layout
        if attend is not self.core:  # the context-parallel stand-in: what the dispatch table refuses for it
            refusal = refused_setting(form="causal" if self.causal else "bidirectional", context_parallel=True)
            if refusal is not None:
                raise RefusedAttention(refusal.message)
        if padding is not None:
            if attend is not self.core:
                raise ValueError("attention_mask: padding is not supported under context parallelism")
            kwargs["key_mask"] = padding.key_mask
        out, new_state = self.run_attention(attend, q, k, v, state, return_state, kwargs)  # [B, Hl, N, d]
        out = out.transpose(1, 2).reshape(B, N, self.local_heads * self.head_dim)  # [B, N, h / tp]
        if self.out_gain is not None:
            out = out * self.out_gain.to(out.dtype)
        if self.training and self.dropout.p > 0:
            with self.layer_factory.tp_region_rng():  # sharded activations: masks must differ per TP rank
                out = self.dropout(out)
        return self.proj(out), new_state  # [B, N, h]


class MLP(nn.Module):
    """Column-parallel in, activation, row-parallel out (GELU or SwiGLU)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        h, ffn = config.hidden_size, config.ffn_hidden_size
        self.swiglu = config.mlp == "swiglu"
        # SwiGLU's gate and up projections are fused with outputs interleaved as (ffn, {gate, up}),
        # so any contiguous shard holds matching gate/up channel pairs, independent of tp.
        self.fc_in = linear(
            h, (2 if self.swiglu else 1) * ffn, bias=config.bias, init_method=normal_init(config.init_std)
        )
        self.fc_out = linear(ffn, h, bias=config.bias, init_method=normal_init(_scaled_std(config)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc_in(x)  # [B, N, ffn / tp] (gelu) or [B, N, 2 ffn / tp] (swiglu)
        if self.swiglu:
            gate, up = y.unflatten(-1, (-1, 2)).unbind(-1)  # [B, N, ffn / tp] each
            y = F.silu(gate) * up
        else:
            y = F.gelu(y)
        return self.fc_out(y)  # [B, N, h]


class Block(nn.Module):
    """Pre-norm transformer block."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.attn_norm = _norm(config)
        self.attn = Attention(config)
        self.mlp_norm = _norm(config)
        self.mlp = MLP(config)
        self.dropout = nn.Dropout(config.hidden_dropout)  # on the residual stream: layer_factory.residual_rng
        self.layer_factory: LayerFactory = LocalLayers()

    def forward(
        self, x: torch.Tensor, state: LayerState | None = None, return_state: bool = False, offset: int = 0,
        padding: Padding | None = None, documents: Documents | None = None,
    ) -> tuple[torch.Tensor, LayerState | None]:
        a, new_state = self.attn(self.attn_norm(x), state, return_state, offset, padding, documents)
        x = x + _residual_dropout(self.dropout, self.layer_factory, a)
        x = x + _residual_dropout(self.dropout, self.layer_factory, self.mlp(self.mlp_norm(x)))
        return x, new_state


class GPT(nn.Module):
    """Decoder-only language model, built plain (one device); ``megaflex.parallel.parallelize_gpt``
    parallelises it in place."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.layer_factory: LayerFactory = LocalLayers()
        init = normal_init(config.init_std)

        self.embed = vocab_embedding(config.vocab_size, config.hidden_size, init_method=init)
        self.pos_embed = None
        if config.position == "learned":
            self.pos_embed = nn.Embedding(config.max_seq_len, config.hidden_size)
            init(self.pos_embed.weight)
        self.embed_dropout = nn.Dropout(config.hidden_dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.num_layers))
        self.final_norm = _norm(config)
        # Untied output weight: another [padded_vocab, h] matrix (vocab-sharded once parallelised).
        self.lm_head = None
        if not config.tie_embeddings:
            self.lm_head = vocab_embedding(config.vocab_size, config.hidden_size, init_method=init)
        self.activation_checkpointing = False
        self.set_activation_checkpointing(config.activation_checkpointing)
        self.loss_chunk_tokens = 0  # 0: the whole logits (``set_loss_chunk_tokens``)

    # ------------------------------------------------------------------ forward

    def forward(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor | None = None,
        state: GPTState | None = None,
        return_state: bool = False,
        attention_mask: torch.Tensor | None = None,
        documents: Documents | None = None,
    ) -> ModelOutput:
        """input_ids [B, N] (int) -> ModelOutput; ``state`` continues a previous call.

        ``attention_mask`` [B, state.offset + N] (1 = real token, 0 = padding; one device, no
        context parallelism): padded tokens are invisible to every attention form and cache, and
        positions count from each row's first real token, so a left-padded row computes what it
        computes alone. ``documents`` (packed documents, ``Documents``): attention never crosses a
        document start. Not both at once. With ``labels`` of more than n tokens and
        ``set_loss_chunk_tokens(n)``, n > 0, the loss is computed n tokens at a time and the output's
        ``logits`` is None."""
        self._check_inputs(input_ids, labels, state)
        B, N = input_ids.shape
        # global position of the first token (under context parallelism: of this rank's slice)
        offset = (0 if state is None else state.offset) + self.layer_factory.sequence_offset(N)
        padding = Padding.from_attention_mask(attention_mask, B, offset + N)
        refuse_padded_documents(padding is not None, documents is not None, "attention_mask and documents")
        if padding is not None:
            padding = padding.new_tokens(N)
        if documents is not None:  # read to the host and cut into documents once, for every layer
            documents = documents.laid_out()

        x = self.embed_tokens(input_ids, offset, _row_positions(padding, documents))  # pre_process
        checkpointing = self.activation_checkpointing and self.training and torch.is_grad_enabled()
        x, new_states = run_blocks(
            self.blocks, x, None if state is None else state.layers, return_state, offset, padding, documents,
            checkpoint_context=self.layer_factory.checkpoint_context if checkpointing else None,
        )
        logits = loss = per_token_loss = None
        # post_process without the whole logits, when they would take more than one chunk
        if labels is not None and 0 < self.loss_chunk_tokens < labels.numel():
            loss, per_token_loss = chunked_language_model_loss(
                self.layer_factory, self.config.vocab_size, self.final_norm(x), self.output_weight, labels,
                self.loss_chunk_tokens,
            )
        else:
            logits = self.output_logits(x)  # post_process: [B, N, padded_vocab / tp]
            if labels is not None:
                loss, per_token_loss = language_model_loss(self.layer_factory, self.config.vocab_size, logits, labels)
        state_out = GPTState(layers=new_states, offset=offset + N) if return_state else None
        return ModelOutput(logits, loss, per_token_loss, state_out)

    def encode(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids [B, N] -> the final norm's output [B, N, h], no logits: an encoder's features
        (``megaflex.model.encoder``; bidirectional when ``config.causal`` is false). ``attention_mask``
        [B, N] as in ``forward``: padded keys are invisible, padded rows' outputs are meaningless."""
        self._check_inputs(input_ids, None, None)
        padding = Padding.from_attention_mask(attention_mask, *input_ids.shape)
        x = self.embed_tokens(input_ids, 0, _row_positions(padding, None))
        checkpointing = self.activation_checkpointing and self.training and torch.is_grad_enabled()
        context = self.layer_factory.checkpoint_context if checkpointing else None
        x, _ = run_blocks(self.blocks, x, None, False, 0, padding, None, checkpoint_context=context)
        return self.final_norm(x)

    # ------------------------------------------------------------------ stage parts
    # Megatron's pre_process / post_process split: a pipeline stage runs ``embed_tokens`` (first
    # stage), ``run_blocks`` over its contiguous range (``stage_layers``) and ``output_logits`` +
    # ``language_model_loss`` (last stage); ``forward`` above is the same calls on one device.

    def embed_tokens(
        self, input_ids: torch.Tensor, offset: int = 0, row_positions: torch.Tensor | None = None
    ) -> torch.Tensor:
        """pre_process: ids [B, N] -> hidden [B, N, h] (token + learned positions, dropout)."""
        return embed_tokens(
            self.layer_factory, self.embed, self.pos_embed, self.embed_dropout, input_ids, offset, row_positions
        )

    def output_logits(self, x: torch.Tensor) -> torch.Tensor:
        """post_process: hidden [B, N, h] -> final norm -> this rank's logits [B, N, padded_vocab / tp]."""
        return self.layer_factory.lm_logits(self.final_norm(x), self.output_weight)

    @property
    def output_weight(self) -> torch.Tensor:
        """Vocab-sharded output matrix [padded_vocab / tp, h] (the embedding's when tied)."""
        return self.embed.weight if self.lm_head is None else self.lm_head.weight

    def gather_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """ModelOutput.logits -> full logits [..., vocab_size] (gathered over TP, padding removed)."""
        return self.layer_factory.gather_logits(logits, self.config.vocab_size)

    # ------------------------------------------------------------------ utilities

    def set_activation_checkpointing(self, enabled: bool) -> None:
        """Recompute each block in backward instead of storing its activations."""
        self.activation_checkpointing = bool(enabled)

    def set_loss_chunk_tokens(self, tokens: int) -> None:
        """``tokens`` > 0: a forward with labels of more than ``tokens`` tokens computes the logits and the
        loss that many tokens at a time, recomputing them in backward
        (``megaflex.model.cross_entropy.chunked_linear_cross_entropy``), and returns no logits (one chunk or
        less: the whole logits, which take no more memory than a chunk); 0: the whole logits (the default)."""
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
            raise ValueError(f"loss_chunk_tokens: expected an int >= 0 (0: off), got {tokens!r}")
        self.loss_chunk_tokens = tokens

    def num_parameters(self) -> int:
        """Parameters held by this module (this rank's shards under TP; tied weights once)."""
        return sum(p.numel() for p in self.parameters())

    def kernel_statistics(
        self, probe_ids: torch.Tensor | None = None, reference: dict[str, torch.Tensor] | None = None
    ) -> dict[str, float]:
        """Per-layer kernel statistics as flat scalars (``megaflex.model.kernel_stats``)."""
        return kernel_statistics(self, probe_ids, reference)

    def _check_inputs(self, input_ids: torch.Tensor, labels: torch.Tensor | None, state: GPTState | None) -> None:
        if input_ids.dim() != 2 or input_ids.dtype.is_floating_point or input_ids.dtype == torch.bool:
            raise ValueError(f"input_ids must be an integer tensor [B, N], got {input_ids.dtype} {tuple(input_ids.shape)}")
        if labels is not None and (labels.shape != input_ids.shape or labels.dtype.is_floating_point):
            raise ValueError(
                f"labels must be integer with the shape of input_ids {tuple(input_ids.shape)}, "
                f"got {labels.dtype} {tuple(labels.shape)}"
            )
        if state is not None:
            if not isinstance(state, GPTState) or len(state.layers) != len(self.blocks):
                got = len(state.layers) if isinstance(state, GPTState) else type(state).__name__
                raise ValueError(f"state must be a GPTState with {len(self.blocks)} layer states, got {got}")
        if self.pos_embed is not None:
            n = input_ids.shape[1]
            end = (0 if state is None else state.offset) + self.layer_factory.sequence_offset(n) + n
            if end > self.config.max_seq_len:
                raise ValueError(
                    f"position='learned' supports max_seq_len={self.config.max_seq_len} positions, got up to {end}"
                )


def stage_layers(num_layers: int, pp_size: int, pp_rank: int) -> range:
    """The contiguous blocks pipeline stage ``pp_rank`` of ``pp_size`` holds: as equal as can be,
    the first ``num_layers % pp_size`` stages one more. The first stage also holds the embedding
    (pre_process), the last the final norm, head and loss (post_process)."""
    if not 0 <= pp_rank < pp_size:
        raise ValueError(f"pp_rank: expected 0 <= pp_rank < {pp_size}, got {pp_rank}")
    if num_layers < pp_size:
        raise ValueError(f"num_layers: expected at least one block per pipeline stage ({pp_size}), got {num_layers}")
    base, extra = divmod(num_layers, pp_size)
    start = pp_rank * base + min(pp_rank, extra)
    return range(start, start + base + (1 if pp_rank < extra else 0))


def embed_tokens(
    layers: LayerFactory, embed: nn.Module, pos_embed: nn.Embedding | None, dropout: nn.Dropout,
    input_ids: torch.Tensor, offset: int = 0, row_positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """Token embedding (+ learned positions offset .. offset + N - 1, or ``row_positions`` [B, N]),
    dropout: [B, N, h] (sequence parallel: this TP rank's [B, N / tp, h])."""
    x = embed(input_ids)
    if pos_embed is not None:
        n = input_ids.shape[1]
        positions = torch.arange(offset, offset + n, device=input_ids.device) if row_positions is None else row_positions
        x = x + layers.scatter_sequence(pos_embed(positions))
    return _residual_dropout(dropout, layers, x)


def run_blocks(
    blocks: Sequence[Block], x: torch.Tensor, states: Sequence[LayerState | None] | None = None,
    return_state: bool = False, offset: int = 0, padding: Padding | None = None, documents: Documents | None = None,
    checkpoint_context: Callable[[], Any] | None = None,
) -> tuple[torch.Tensor, list[LayerState | None]]:
    """``blocks`` in order over hidden ``x`` [B, N, h]; ``checkpoint_context`` (a factory's
    ``checkpoint_context``) recomputes each block in backward instead of storing its activations."""
    new_states = []
    for i, block in enumerate(blocks):
        layer_state = None if states is None else states[i]
        if checkpoint_context is not None:
            # Non-reentrant: recomputes the block in backward. torch restores the default RNG
            # for the recompute and the factory's context_fn replays its TP-region stream, so
            # every dropout mask is redrawn identically.
            x, s = checkpoint(
                block, x, layer_state, return_state, offset, padding, documents,
                use_reentrant=False, context_fn=checkpoint_context,
            )
        else:
            x, s = block(x, layer_state, return_state, offset, padding, documents)
        new_states.append(s)
    return x, new_states


def language_model_loss(
    layers: LayerFactory, vocab_size: int, logits: torch.Tensor, labels: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean loss over non-ignored tokens, per-token loss [B, N] fp32 with 0 where ignored) from
    this rank's logits; under context parallelism the mean is over the whole sequences."""
    return _masked_mean_loss(layers, labels, lambda safe: layers.cross_entropy(logits, safe, vocab_size))


def chunked_language_model_loss(
    layers: LayerFactory, vocab_size: int, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
    chunk_tokens: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``language_model_loss`` of the logits ``layers.lm_logits(hidden, weight)`` without them: the
    projection and the factory's (vocab-parallel under TP) loss run ``chunk_tokens`` tokens at a time."""
    scored = functools.partial(layers.cross_entropy, vocab_size=vocab_size)
    x = layers.logits_input(hidden)
    return _masked_mean_loss(layers, labels, lambda safe: chunked_linear_cross_entropy(x, weight, safe, scored, chunk_tokens))


def _masked_mean_loss(
    layers: LayerFactory, labels: torch.Tensor, per_token_loss: Callable[[torch.Tensor], torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean, per-token [B, N] fp32, 0 where ignored) of ``per_token_loss(labels)`` with ignored labels
    mapped to a valid id first (the loss may be vocab-parallel: every id must lie in some shard)."""
    valid = labels != IGNORE_INDEX
    per_token = per_token_loss(labels.masked_fill(~valid, 0)).float() * valid
    loss = layers.sequence_sum(per_token.sum()) / layers.sequence_sum(valid.sum()).clamp(min=1)
    return loss, per_token


def _scaled_std(config: ModelConfig) -> float:
    # Output projections add into the residual stream 2 x num_layers times (GPT-2 / Megatron init).
    return config.init_std / math.sqrt(2 * config.num_layers)


def _residual_dropout(dropout: nn.Dropout, layers: LayerFactory, x: torch.Tensor) -> torch.Tensor:
    """Dropout on the residual stream, drawn from the factory's ``residual_rng`` (per-TP-rank masks
    where the stream is sequence-sharded)."""
    if not dropout.training or dropout.p == 0:
        return x
    with layers.residual_rng():
        return dropout(x)


def _norm(config: ModelConfig) -> nn.Module:
    return norm(config.norm, config.hidden_size, config.norm_eps)


def build_attention_core(config: ModelConfig, num_heads: int) -> AttentionCore | LocalMixingCore:
    """AttentionCore over ``num_heads`` heads (the model's, or one TP rank's), wrapped in a
    ``LocalMixingCore`` when ``softmax_window`` or ``qkv_conv_size`` is set. Draws the feature
    map's random init from the default RNG."""
    core = AttentionCore(
        config.attention,
        num_heads,
        config.head_dim,
        feature_dim=config.feature_dim,
        normalization=config.normalization,
        chunk_size=config.chunk_size,
        max_seq_len=config.max_seq_len,
        backend=config.attention_backend,
        causal=config.causal,
        decay=config.kernel_decay,
        **config.feature_kwargs,
    )
    # the closers' init is deterministic: no RNG drawn there
    return build_attention(core, window=config.softmax_window, conv_size=config.qkv_conv_size, mixing=config.window_mixing,
                           far_gain=config.window_far_gain)
