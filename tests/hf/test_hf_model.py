"""megaflex.hf on single-rank models of every attention kind: transformers round trip, cache, generate().

Cheap (no training): a randomly initialised GPT per kind is wrapped, saved with save_pretrained
and loaded back through AutoModelForCausalLM; logits must equal megaflex's own forward.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

import megaflex.hf  # noqa: F401  (registers the Auto classes)
from megaflex.eval.generate import SamplingConfig, generate
from megaflex.attention import ATTENTION_KINDS
from megaflex.hf import FlexformerCache, FlexformerConfig, FlexformerForCausalLM
from megaflex.model.config import ModelConfig
from numerics import assert_close, gpt_steps
from transformers import AutoConfig, AutoModelForCausalLM

pytestmark = pytest.mark.numerics

VOCAB = 203  # odd, and not a multiple of the 128 padding


def _model(kind: str, seed: int = 0) -> FlexformerForCausalLM:
    torch.manual_seed(seed)
    mc = ModelConfig(vocab_size=VOCAB, num_layers=2, hidden_size=48, num_heads=3, attention=kind, feature_dim=16,
                     chunk_size=8, max_seq_len=64, position="learned" if kind == "cosformer" else "rope")
    model = FlexformerForCausalLM(FlexformerConfig.from_model_config(mc, bos_token_id=2, eos_token_id=2))
    return model.eval()


@pytest.mark.parametrize("kind", ATTENTION_KINDS)
def test_auto_model_logits_equal_megaflex_for_every_kind(kind: str, tmp_path: Path) -> None:
    model = _model(kind)
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert type(loaded) is FlexformerForCausalLM and loaded.config.attention == kind
    ids = torch.randint(0, VOCAB, (2, 21), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        reference = model.model.gather_logits(model.model(ids).logits)  # megaflex's own GPT
        logits = loaded(ids).logits
    assert logits.shape == (2, 21, VOCAB)
    assert_close(logits, reference, steps=gpt_steps(model.model.config, 21))


@pytest.mark.parametrize("kind", ["flexformer_n", "softmax", "cosformer"])
def test_cache_continues_the_sequence(kind: str) -> None:
    model = _model(kind)
    ids = torch.randint(0, VOCAB, (2, 23), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
        first = model(ids[:, :17], use_cache=True)
        assert isinstance(first.cache, FlexformerCache) and first.cache.get_seq_length() == 17
        steps = [first.logits]
        state_size = _state_numel(first.cache)
        for t in range(17, 23):  # token by token: the recurrent O(1) path (KV cache for softmax)
            steps.append(model(ids[:, t:t + 1], cache=first.cache).logits)
    assert first.cache.get_seq_length() == 23
    if kind == "softmax":  # the KV cache grows with the context ...
        assert _state_numel(first.cache) > state_size
    else:  # ... the recurrent state of linear attention does not: O(1) memory per token
        assert _state_numel(first.cache) == state_size
    assert_close(torch.cat(steps, dim=1), full, steps=gpt_steps(model.model.config, 23))


def _state_numel(cache: FlexformerCache) -> int:
    layers = cache.state.layers
    return sum(t.numel() for s in layers for t in ((s.k, s.v) if hasattr(s, "k") else (s.kv, s.k_sum, s.log_max)))


@pytest.mark.parametrize("kind", ["flexformer_n", "softmax", "performer"])
def test_greedy_generate_equals_megaflex_generate(kind: str) -> None:
    model = _model(kind)
    prompt = torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(3))
    out = model.generate(prompt, max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)
    reference = generate(model.model, prompt, 12, SamplingConfig(temperature=0))
    assert torch.equal(out[:, 7:], reference)


def test_cache_reuse_and_sampling() -> None:
    model = _model("flexformer_n")
    ids = torch.randint(0, VOCAB, (1, 9), generator=torch.Generator().manual_seed(4))
    plain = model.generate(ids, max_new_tokens=8, do_sample=False, eos_token_id=None)
    with torch.no_grad():
        prefix_cache = model(ids[:, :6], use_cache=True).cache  # pre-filled cache of the first 6 tokens
    reused = model.generate(ids, cache=copy.deepcopy(prefix_cache), max_new_tokens=8, do_sample=False, eos_token_id=None)
    assert torch.equal(reused, plain)
    # sampling with top_k=1 can only pick the argmax; free sampling is seeded and stays in the vocabulary
    top1 = model.generate(ids, max_new_tokens=8, do_sample=True, top_k=1, eos_token_id=None)
    assert torch.equal(top1, plain)
    torch.manual_seed(0)
    a = model.generate(ids, max_new_tokens=8, do_sample=True, temperature=1.5, eos_token_id=None)
    torch.manual_seed(0)
    b = model.generate(ids, max_new_tokens=8, do_sample=True, temperature=1.5, eos_token_id=None)
    assert torch.equal(a, b) and int(a.max()) < VOCAB and a.shape == (1, 17)
    with pytest.raises(ValueError, match="already holds"):
        model.generate(ids[:, :6], cache=copy.deepcopy(prefix_cache), max_new_tokens=2)


def test_beam_search_reorders_the_state() -> None:
    model = _model("flexformer_n")
    ids = torch.randint(0, VOCAB, (1, 5), generator=torch.Generator().manual_seed(5))
    out = model.generate(ids, max_new_tokens=6, num_beams=3, num_return_sequences=3, do_sample=False,
                         eos_token_id=None, length_penalty=0.0, return_dict_in_generate=True, output_scores=True)
    # each beam's score (sum of its token log-probs, computed through reordered caches) must equal
    # a fresh forward over that sequence: a wrongly reordered state would score another prefix
    with torch.no_grad():
        logp = model(out.sequences, use_cache=False).logits.log_softmax(-1)
    fresh = logp[:, 4:-1].gather(-1, out.sequences[:, 5:, None]).squeeze(-1).sum(-1)
    # the model on 11 tokens, log-softmax over the vocabulary, the 6 log-probs' sum
    steps = gpt_steps(model.model.config, 11) + model.model.config.vocab_size + 6
    assert_close(out.sequences_scores, fresh, steps=steps, floor=logp.abs().max().item())
    assert len({tuple(s) for s in out.sequences.tolist()}) == 3


def test_labels_loss_and_padding_errors() -> None:
    model = _model("softmax")
    ids = torch.randint(0, VOCAB, (2, 11), generator=torch.Generator().manual_seed(6))
    out = model(ids, labels=ids, use_cache=False)
    per_token = model.model(ids[:, :-1], labels=ids[:, 1:]).loss
    # the same forward and loss, but for the mean over 20 tokens (and the log-softmax's vocab sum)
    assert_close(out.loss, per_token, steps=gpt_steps(model.model.config, 11) + model.model.config.vocab_size + 20)
    with pytest.raises(ValueError, match=r"attention_mask: expected shape \[2, 11\]"):
        model(ids, attention_mask=torch.ones(2, 12, dtype=torch.long))


def test_unknown_attention_kind_in_config_json(tmp_path: Path) -> None:
    _model("elu").config.save_pretrained(tmp_path)
    text = (tmp_path / "config.json").read_text().replace('"elu"', '"flash_kernel_9000"')
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(ValueError, match=r"config.json.*attention must be one of .*flash_kernel_9000"):
        AutoConfig.from_pretrained(tmp_path)


def test_ids_beyond_tokenizer_vocab_size_are_masked(tmp_path: Path) -> None:
    model = _model("flexformer_n")
    limit = 150  # the tokenizer's vocabulary; the model's is VOCAB = 203 (a padded config)
    model.config.tokenizer_vocab_size = limit
    ids = torch.randint(0, limit, (2, 9), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        logits = model(ids, use_cache=False).logits
    assert logits.shape[-1] == VOCAB and bool(torch.isneginf(logits[..., limit:]).all())
    assert bool(torch.isfinite(logits[..., :limit]).all())
    torch.manual_seed(0)
    sampled = model.generate(ids, max_new_tokens=30, do_sample=True, temperature=3.0, eos_token_id=None, pad_token_id=0)
    assert int(sampled[:, 9:].max()) < limit
    model.save_pretrained(tmp_path)  # the field travels in config.json
    again = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert again.config.tokenizer_vocab_size == limit
    with pytest.raises(ValueError, match="tokenizer_vocab_size must be an int in \\[1, vocab_size"):
        FlexformerConfig.from_model_config(model.model.config, tokenizer_vocab_size=VOCAB + 1)


# a valid non-default value of every ModelConfig field: a new field fails the first test below
# until it is listed here, i.e. until its export is checked. causal=False is checked on its own: the
# convolution and the gated window are causal only (the dispatch table refuses them with it).
NON_DEFAULTS = dict(
    vocab_size=VOCAB, num_layers=3, hidden_size=64, num_heads=4, ffn_hidden_size=96, attention="flexformer_n",
    feature_dim=24, normalization="denominator", chunk_size=16, attention_backend="torch",
    feature_kwargs={"omega_init": "tied"}, softmax_window=5, window_mixing="gated", qkv_conv_size=2, qk_norm="affine_rms", causal=True, mlp="swiglu",
    window_far_gain=False,  # needs the one-normaliser window, not the gated one: set in BIDIRECTIONAL below
    norm="layernorm", norm_eps=1e-6, bias=True, tie_embeddings=False, hidden_dropout=0.1, attention_dropout=0.05,
    max_seq_len=96, position="learned", rope_theta=500.0, init_std=0.05, activation_checkpointing=True,
    kernel_decay="none",  # the default (auto) builds learned here
)
BIDIRECTIONAL = dict(NON_DEFAULTS, causal=False, window_mixing="shared_normaliser", qkv_conv_size=0, window_far_gain=True)


def test_every_model_config_field_is_exported(tmp_path: Path) -> None:
    import dataclasses

    assert set(NON_DEFAULTS) == {f.name for f in dataclasses.fields(ModelConfig)}, "list the new field in NON_DEFAULTS"
    defaults = ModelConfig(vocab_size=VOCAB, num_layers=3, hidden_size=64, num_heads=4)
    differ = []
    for values in (NON_DEFAULTS, BIDIRECTIONAL):
        mc = ModelConfig(**values)
        differ.append([f.name for f in dataclasses.fields(ModelConfig) if getattr(mc, f.name) == getattr(defaults, f.name)])
        FlexformerConfig.from_model_config(mc).save_pretrained(tmp_path)
        assert AutoConfig.from_pretrained(tmp_path).to_model_config() == mc
    assert differ[0] == ["vocab_size", "num_layers", "hidden_size", "num_heads", "attention", "window_far_gain", "causal"], differ
    assert "causal" not in differ[1] and "window_far_gain" not in differ[1], differ


def test_a_fresh_config_has_model_config_defaults(tmp_path: Path) -> None:
    """Issue 45: FlexformerConfig() defaulted to normalization 'rms', ModelConfig to 'capped_denominator'.
    Every field ModelConfig has a default for defaults alike in both; a config.json written before the
    field (an rms model: exports write every field) still reads as rms."""
    import dataclasses
    import json

    from megaflex.hf.configuration import MODEL_CONFIG_KEYS

    fresh = FlexformerConfig()
    required = {f.name for f in dataclasses.fields(ModelConfig)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
    keys = dict(MODEL_CONFIG_KEYS)
    model_defaults = ModelConfig(**{name: getattr(fresh, keys[name]) for name in required})
    differ = {name: (getattr(fresh, key), getattr(model_defaults, name)) for name, key in MODEL_CONFIG_KEYS
              if name not in required and getattr(fresh, key) != getattr(model_defaults, name)}
    assert differ == {}
    assert fresh.to_model_config() == model_defaults
    fresh.save_pretrained(tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    assert written["normalization"] == "capped_denominator"
    assert AutoConfig.from_pretrained(tmp_path).normalization == "capped_denominator"
    del written["normalization"]
    (tmp_path / "config.json").write_text(json.dumps(written))
    assert AutoConfig.from_pretrained(tmp_path).normalization == "rms"


def test_a_bidirectional_model_answers_a_plain_call_and_refuses_to_generate(tmp_path: Path) -> None:
    """Issue 45: model(ids) of a causal=False export failed (use_cache defaulted to True, and a
    bidirectional model has no decoding state); it returns the logits, and generate() is refused in one line."""
    torch.manual_seed(0)
    mc = ModelConfig(vocab_size=VOCAB, num_layers=2, hidden_size=48, num_heads=3, feature_dim=16, chunk_size=8,
                     max_seq_len=64, causal=False)
    FlexformerForCausalLM(FlexformerConfig.from_model_config(mc, bos_token_id=2, eos_token_id=2)).save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    ids = torch.randint(0, VOCAB, (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = model(ids)
        reference = model.model.gather_logits(model.model(ids).logits)
    assert out.cache is None and torch.equal(out.logits, reference)
    with pytest.raises(ValueError, match="use_cache: this model is bidirectional .* cannot continue a sequence or generate"):
        model.generate(ids, max_new_tokens=2, do_sample=False, pad_token_id=0)


@pytest.mark.parametrize("mixing", ["shared_normaliser", "gated"])
def test_hybrid_export_loads_and_gives_megaflex_loss(mixing: str, tmp_path: Path) -> None:
    torch.manual_seed(0)
    mc = ModelConfig(vocab_size=VOCAB, num_layers=2, hidden_size=48, num_heads=3, feature_dim=16, chunk_size=8,
                     max_seq_len=64, init_std=0.2, softmax_window=6, qkv_conv_size=3, window_mixing=mixing, qk_norm="rms",
                     window_far_gain=mixing == "shared_normaliser", kernel_decay="learned")
    model = FlexformerForCausalLM(FlexformerConfig.from_model_config(mc, bos_token_id=2, eos_token_id=2)).eval()
    with torch.no_grad():  # the hybrid's own parameters (and the q/k norm's gains) away from their init
        for name, p in model.named_parameters():
            if name.endswith(("window_mix", "conv_weight", "log_gain", "far_log_gain", "decay_logit")):
                p.add_(0.5 * torch.randn_like(p))
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert loaded.config.to_model_config() == mc
    ids = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        reference = model.model(ids[:, :-1], labels=ids[:, 1:]).loss  # megaflex's GPT
        got = loaded(ids, labels=ids, use_cache=False).loss
    assert abs(got.item() - reference.item()) <= 1e-5


def test_hybrid_generate_and_beam_search() -> None:
    torch.manual_seed(0)
    mc = ModelConfig(vocab_size=VOCAB, num_layers=2, hidden_size=48, num_heads=3, feature_dim=16, chunk_size=8,
                     max_seq_len=64, init_std=0.2, softmax_window=4)
    model = FlexformerForCausalLM(FlexformerConfig.from_model_config(mc, bos_token_id=2, eos_token_id=2)).eval()
    prompt = torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(3))
    out = model.generate(prompt, max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert torch.equal(out[:, 7:], generate(model.model, prompt, 12, SamplingConfig(temperature=0)))
    beams = model.generate(prompt[:1], max_new_tokens=6, num_beams=3, num_return_sequences=3, do_sample=False,
                           eos_token_id=None, length_penalty=0.0, return_dict_in_generate=True, output_scores=True)
    with torch.no_grad():
        logp = model(beams.sequences, use_cache=False).logits.log_softmax(-1)
    fresh = logp[:, 6:-1].gather(-1, beams.sequences[:, 7:, None]).squeeze(-1).sum(-1)
    steps = gpt_steps(mc, 13) + mc.vocab_size + 6
    assert_close(beams.sequences_scores, fresh, steps=steps, floor=logp.abs().max().item())
