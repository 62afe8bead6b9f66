"""GPT model: decoding/continuation equivalence, checkpointing, loss, TP layouts, validation."""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
import torch.nn.functional as F

from megaflex.attention.qk_norm import QKNorm
from megaflex.model import GPT, GPTState, ModelConfig
from megaflex.model.gpt import (
    IGNORE_INDEX, MLP, Attention, build_attention_core, language_model_loss, run_blocks, stage_layers,
)
from megaflex.model.layers import LocalLayers
from numerics import assert_close, gpt_steps, normwise_scale

pytestmark = pytest.mark.numerics

VOCAB = 97

# (attention kind, extra feature-map kwargs): the learnable maps, a positive map and softmax.
DECODE_KINDS = [
    ("flexformer_n", {}),
    ("flexformer_s", {}),
    ("performer", {"variant": "positive"}),
    ("cosformer", {}),  # position-dependent feature map: exercises state.offset
    ("softmax", {}),
]


def tiny_config(attention: str = "flexformer_n", **overrides) -> ModelConfig:
    values = dict(
        vocab_size=VOCAB,
        num_layers=2,
        hidden_size=32,
        num_heads=4,
        ffn_hidden_size=64,
        attention=attention,
        feature_dim=16,
        chunk_size=8,
        max_seq_len=64,
        # A large init makes attention (and therefore state handling) matter for the logits.
        init_std=0.2,
    )
    values.update(overrides)
    return ModelConfig(**values)


def build(config: ModelConfig, seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(config).eval()


def ids(batch: int, n: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, n), generator=torch.Generator().manual_seed(seed))


def assert_close_logits(got: torch.Tensor, want: torch.Tensor, model: GPT, seq_len: int) -> None:
    # fp32 end to end; logits have O(1) scale at this init (the bound is relative to it)
    assert want.std() > 0.3
    assert_close(got, want, steps=gpt_steps(model.config, seq_len), name="logits")


@pytest.mark.parametrize("kind,kwargs", DECODE_KINDS, ids=[k + str(v.get("variant", "")) for k, v in DECODE_KINDS])
def test_token_by_token_decoding_matches_training_forward(kind, kwargs):
    model = build(tiny_config(kind, feature_kwargs=kwargs))
    x = ids(2, 21)
    with torch.no_grad():
        full = model(x).logits  # [2, 21, V]
        state, steps = None, []
        for t in range(x.shape[1]):
            out = model(x[:, t : t + 1], state=state, return_state=True)
            state = out.state
            steps.append(out.logits)
    assert state.offset == x.shape[1]
    assert_close_logits(torch.cat(steps, dim=1), full, model, x.shape[1])


@pytest.mark.parametrize("kind,kwargs", DECODE_KINDS, ids=[k + str(v.get("variant", "")) for k, v in DECODE_KINDS])
def test_chunked_continuation_matches_one_forward(kind, kwargs):
    model = build(tiny_config(kind, feature_kwargs=kwargs))
    x = ids(2, 45)  # split 19 + 26: neither is a multiple of chunk_size=8
    with torch.no_grad():
        full = model(x).logits
        first = model(x[:, :19], return_state=True)
        second = model(x[:, 19:], state=first.state, return_state=True)
    assert second.state.offset == 45
    assert_close_logits(torch.cat([first.logits, second.logits], dim=1), full, model, x.shape[1])


@pytest.mark.parametrize(
    "overrides",
    [
        {"norm": "layernorm", "bias": True},
        {"mlp": "swiglu", "tie_embeddings": False},
        {"position": "none", "normalization": "denominator", "attention": "elu"},
        {"position": "learned", "attention": "hedgehog"},
    ],
    ids=["layernorm-bias", "swiglu-untied", "nopos-denominator", "learned-hedgehog"],
)
def test_config_variants_continue_exactly(overrides):
    model = build(tiny_config(**overrides))
    x = ids(2, 27)
    with torch.no_grad():
        full = model(x).logits
        first = model(x[:, :20], return_state=True)
        steps = [first.logits]
        state = first.state
        for t in range(20, 27):  # recurrent decoding after a chunked prefix
            out = model(x[:, t : t + 1], state=state, return_state=True)
            state, steps = out.state, steps + [out.logits]
    assert_close_logits(torch.cat(steps, dim=1), full, model, x.shape[1])


@pytest.mark.parametrize("attention", ["flexformer_n", "softmax"])
def test_bfloat16_model_tracks_fp32(attention):
    fp32 = build(tiny_config(attention, init_std=0.05)).train()
    bf16 = build(tiny_config(attention, init_std=0.05)).train().to(torch.bfloat16)
    x, y = ids(2, 40, seed=8), ids(2, 40, seed=9)
    want = fp32(x, labels=y).loss
    out = bf16(x, labels=y)
    assert out.logits.dtype == torch.bfloat16 and out.loss.dtype == torch.float32
    assert abs(out.loss.item() - want.item()) < 0.02 * want.item()
    out.loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in bf16.parameters())


@pytest.mark.parametrize("position", ["rope", "learned"])
def test_continuation_uses_absolute_positions(position):
    """Continuing from a state must use positions state.offset..; restarting them at 0 differs."""
    model = build(tiny_config(position=position))
    x = ids(1, 30)
    with torch.no_grad():
        full = model(x).logits
        first = model(x[:, :10], return_state=True)
        right = model(x[:, 10:], state=first.state).logits
        wrong_state = GPTState(layers=first.state.layers, offset=0)
        wrong = model(x[:, 10:], state=wrong_state).logits
    assert_close_logits(right, full[:, 10:], model, x.shape[1])
    assert (wrong - full[:, 10:]).abs().max() > 1e-2


@pytest.mark.parametrize("attention", ["flexformer_n", "softmax"])
def test_activation_checkpointing_gives_identical_loss_and_grads(attention):
    # Dropout on: checkpoint's recompute must replay the same masks.
    config = tiny_config(attention, hidden_dropout=0.1, attention_dropout=0.1, init_std=0.02)
    model = build(config).train()
    x, y = ids(2, 24, seed=3), ids(2, 24, seed=4)

    def loss_and_grads(checkpointing: bool):
        model.set_activation_checkpointing(checkpointing)
        model.zero_grad()
        torch.manual_seed(123)
        loss = model(x, labels=y).loss
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    loss_plain, grads_plain = loss_and_grads(False)
    loss_ckpt, grads_ckpt = loss_and_grads(True)
    torch.testing.assert_close(loss_ckpt, loss_plain, rtol=0, atol=0)
    assert grads_plain.keys() == grads_ckpt.keys()
    # the recompute replays the same forward; the backward may sum in another order: gradients sum
    # over every (batch, token) position too, on the largest gradient's scale
    steps = gpt_steps(config, 24, backward=True) + 2 * x.numel()
    terms = max(normwise_scale(g) for g in grads_plain.values())
    for name, grad in grads_plain.items():
        assert_close(grads_ckpt[name], grad, steps=steps, floor=terms, name=name)


def test_loss_matches_reference_cross_entropy_and_ignores_labels():
    model = build(tiny_config())
    x, y = ids(2, 16, seed=5), ids(2, 16, seed=6)
    y[0, :5] = IGNORE_INDEX
    out = model(x, labels=y)
    full_logits = model.gather_logits(out.logits)
    assert full_logits.shape == (2, 16, VOCAB)
    want = F.cross_entropy(full_logits.reshape(-1, VOCAB), y.reshape(-1), ignore_index=IGNORE_INDEX)
    # same logits; the loss's vocab-term log-sum-exp (exp arguments up to 2 max |logit|) and token mean
    assert_close(out.loss, want, steps=VOCAB + 32 + 2 * full_logits.abs().max().item() + 8)
    assert out.loss.dtype == torch.float32
    assert torch.all(out.per_token_loss[0, :5] == 0) and torch.all(out.per_token_loss[0, 5:] > 0)


def test_tied_and_untied_output_weights():
    tied = build(tiny_config())
    untied = build(tiny_config(tie_embeddings=False))
    assert tied.output_weight is tied.embed.weight
    assert untied.output_weight is untied.lm_head.weight
    assert untied.num_parameters() - tied.num_parameters() == untied.lm_head.weight.numel()
    assert tied.num_parameters() == sum(p.numel() for p in tied.parameters())


def test_swiglu_default_width_and_forward():
    config = tiny_config(mlp="swiglu", ffn_hidden_size=None)
    assert config.ffn_hidden_size == 64 * math.ceil(8 * 32 / 3 / 64)
    model = build(config)
    assert model.blocks[0].mlp.fc_in.weight.shape == (2 * config.ffn_hidden_size, 32)
    assert torch.isfinite(model(ids(1, 9), labels=ids(1, 9, seed=2)).loss)


def test_kernel_statistics_reports_tau_and_frequency_norms():
    model = build(tiny_config("flexformer_n"))
    feature_map = model.blocks[1].attn.core.feature_map
    with torch.no_grad():
        feature_map.tau.copy_(torch.tensor([1.0, 2.0, 3.0, 4.0]))
        feature_map.omega1.zero_()
        feature_map.omega1[2, 0, :4] = torch.tensor([3.0, 4.0, 0.0, 0.0])  # one frequency of norm 5
    stats = model.kernel_statistics()
    assert stats["layer01/tau_mean"] == pytest.approx(2.5)
    assert stats["layer01/tau_min"] == pytest.approx(1.0) and stats["layer01/tau_max"] == pytest.approx(4.0)
    assert stats["layer01/omega1_norm_max"] == pytest.approx(5.0)
    assert stats["layer01/omega1_norm_min"] == 0.0
    assert {"layer00/tau_mean", "layer00/omega2_norm_mean"} <= stats.keys()
    assert build(tiny_config("softmax")).kernel_statistics() == {}


# ---------------------------------------------------------------- tensor-parallel layouts
# A single-process stand-in for a TP rank: column layers keep out/tp outputs, row layers take
# in/tp inputs and return partial sums (the parallel layers all-reduce them). Summing the
# partial outputs of all ranks must reproduce the tp=1 module when every weight is the
# contiguous shard of the tp=1 weight: that is the layout contract the model promises
# (``megaflex.parallel.parallelize_gpt`` cuts exactly these shards).


def shard_attention(config: ModelConfig, full: Attention, rank: int, tp: int) -> Attention:
    h, local_heads = config.hidden_size, config.num_heads // tp
    part = Attention(config)
    part.qkv = torch.nn.Linear(h, 3 * h // tp, bias=config.bias)
    part.proj = torch.nn.Linear(h // tp, h, bias=config.bias)
    part.core, part.local_heads = build_attention_core(config, local_heads), local_heads
    if part.out_gain is not None:
        part.out_gain = torch.nn.Parameter(torch.ones(h // tp))
    if part.qk_norm is not None:
        part.qk_norm = QKNorm(config.qk_norm, local_heads, config.head_dim, config.norm_eps)
    part.load_state_dict(shard_state_dict(full.state_dict(), rank, tp))
    return part


def shard_mlp(config: ModelConfig, full: MLP, rank: int, tp: int) -> MLP:
    part = MLP(config)
    h, ffn = config.hidden_size, config.ffn_hidden_size
    part.fc_in = torch.nn.Linear(h, (2 if part.swiglu else 1) * ffn // tp, bias=config.bias)
    part.fc_out = torch.nn.Linear(ffn // tp, h, bias=config.bias)
    part.load_state_dict(shard_state_dict(full.state_dict(), rank, tp))
    return part


def shard_state_dict(full: dict[str, torch.Tensor], rank: int, tp: int) -> dict[str, torch.Tensor]:
    def piece(t: torch.Tensor, dim: int) -> torch.Tensor:
        return t.chunk(tp, dim=dim)[rank]

    out = {}
    for name, t in full.items():
        if name.endswith(("qkv.weight", "fc_in.weight")) or ".feature_map." in f".{name}" or name == "out_gain" \
                or name.startswith("qk_norm.") or name in ("core.decay_logit", "core.far_log_gain"):
            out[name] = piece(t, 0)  # column-parallel outputs / per-head tensors: dim 0
        elif name.endswith(("proj.weight", "fc_out.weight")):
            out[name] = piece(t, 1)  # row-parallel inputs: dim 1
        else:
            out[name] = t
    return out


@pytest.mark.parametrize("kind", ["flexformer_n", "softmax"])
def test_attention_contiguous_shards_hold_whole_heads(kind):
    config, tp = tiny_config(kind), 2
    torch.manual_seed(0)
    full = Attention(config).eval()
    with torch.no_grad():
        if full.out_gain is not None:
            full.out_gain.uniform_(0.5, 1.5)  # make the per-head gain layout observable
        x = torch.randn(2, 11, config.hidden_size)
        want, _ = full(x)
        got = 0
        for rank in range(tp):
            part = shard_attention(config, full, rank, tp).eval()
            got = got + part(x)[0]
    assert_close(got, want, steps=gpt_steps(config, 11) / config.num_layers)  # one layer's attention


@pytest.mark.parametrize("mlp", ["gelu", "swiglu"])
def test_mlp_contiguous_shards_are_consistent(mlp):
    config, tp = tiny_config(mlp=mlp), 2
    torch.manual_seed(0)
    full = MLP(config)
    x = torch.randn(3, 5, config.hidden_size)
    with torch.no_grad():
        want = full(x)
        got = 0
        for rank in range(tp):
            part = shard_mlp(config, full, rank, tp)
            got = got + part(x)
    # hidden- and ffn-term sums (the ffn split over tp shards, their partial sums added)
    assert_close(got, want, steps=config.hidden_size + (config.ffn_hidden_size or 4 * config.hidden_size) + tp + 4)


# ---------------------------------------------------------------- validation


def test_forward_rejects_bad_inputs():
    model = build(tiny_config(position="learned"))
    with pytest.raises(ValueError, match="input_ids"):
        model(torch.zeros(2, 3))
    with pytest.raises(ValueError, match="input_ids"):
        model(torch.zeros(6, dtype=torch.long))
    with pytest.raises(ValueError, match="labels"):
        model(ids(2, 4), labels=ids(2, 5))
    with pytest.raises(ValueError, match="labels"):
        model(ids(2, 4), labels=ids(2, 4).float())
    with pytest.raises(ValueError, match="state"):
        model(ids(1, 4), state=GPTState(layers=[None], offset=0))
    with pytest.raises(ValueError, match="max_seq_len"):
        model(ids(1, 65))


class RecordingCheckpointLayers(LocalLayers):
    """Local layers that record which checkpoint contexts the model entered."""

    def __init__(self) -> None:
        self.entered: list[str] = []

    def checkpoint_context(self):
        return self._record("forward"), self._record("recompute")

    @contextlib.contextmanager
    def _record(self, phase: str):
        self.entered.append(phase)
        yield


def test_activation_checkpointing_uses_the_factory_checkpoint_context():
    """The TP factory replays its TP-region RNG in the recompute through this hook."""
    layers = RecordingCheckpointLayers()
    torch.manual_seed(0)
    model = GPT(tiny_config(activation_checkpointing=True)).train()
    model.layer_factory = layers  # the runtime factory (what parallelisation sets)
    loss = model(ids(1, 8), labels=ids(1, 8, seed=2)).loss
    assert layers.entered == ["forward"] * 2  # one per block
    loss.backward()
    assert layers.entered == ["forward"] * 2 + ["recompute"] * 2
    with torch.no_grad():  # no recompute without autograd: the hook is not used
        model(ids(1, 8))
    assert len(layers.entered) == 4


@pytest.mark.parametrize(("num_layers", "pp_size"), [(4, 2), (5, 2), (7, 3), (3, 3)])
def test_stage_layers_split_blocks_contiguously_and_evenly(num_layers, pp_size):
    stages = [stage_layers(num_layers, pp_size, r) for r in range(pp_size)]
    assert [i for s in stages for i in s] == list(range(num_layers))  # contiguous, in order, each once
    assert max(map(len, stages)) - min(map(len, stages)) <= 1
    assert len(stages[0]) == max(map(len, stages))  # the extra blocks go to the first stages
    with pytest.raises(ValueError, match="at least one block per pipeline stage"):
        stage_layers(2, 3, 0)


@pytest.mark.parametrize("tie", [True, False])
def test_stage_parts_composed_over_any_split_equal_forward(tie):
    torch.manual_seed(0)
    model = GPT(tiny_config(num_layers=3, tie_embeddings=tie, position="learned", hidden_dropout=0.0)).eval()
    ids = torch.randint(0, VOCAB, (2, 12))
    labels = torch.randint(0, VOCAB, (2, 12))
    expected = model(ids, labels=labels)
    for pp_size in (1, 2, 3):
        x = model.embed_tokens(ids)  # first stage
        for rank in range(pp_size):
            blocks = [model.blocks[i] for i in stage_layers(3, pp_size, rank)]
            x, _ = run_blocks(blocks, x)
        logits = model.output_logits(x)  # last stage
        loss, per_token = language_model_loss(model.layer_factory, VOCAB, logits, labels)
        torch.testing.assert_close(logits, expected.logits, rtol=0, atol=0)
        torch.testing.assert_close(loss, expected.loss, rtol=0, atol=0)
        torch.testing.assert_close(per_token, expected.per_token_loss, rtol=0, atol=0)
