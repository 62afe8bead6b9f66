"""``FlexformerConfig`` restates ``ModelConfig``'s fields by hand (transformers reads them as class
annotations); these tests fail when the two drift apart: a field added to one and not the other, a
changed type, or a default that moved in one place only."""

from __future__ import annotations

import dataclasses

from megaflex.hf.configuration import MODEL_CONFIG_KEYS, FlexformerConfig
from megaflex.model.config import LEGACY_MODEL_FIELDS, ModelConfig

# transformers-side fields with no ModelConfig counterpart (export metadata and HF switches)
HF_ONLY = {"megaflex_run_config", "megaflex_iteration", "tokenizer_vocab_size", "tie_word_embeddings", "use_cache"}
# annotations that differ on purpose: config.json may write null for an empty feature_kwargs
TYPE_EXCEPTIONS = {"feature_kwargs": ("dict[str, Any]", "dict | None")}


def _annotations() -> dict[str, str]:
    return {key: str(value) for key, value in FlexformerConfig.__annotations__.items()}


def test_every_model_config_field_is_a_config_json_key_and_nothing_else() -> None:
    fields = [f.name for f in dataclasses.fields(ModelConfig)]
    assert [field for field, _ in MODEL_CONFIG_KEYS] == fields
    keys = {key for _, key in MODEL_CONFIG_KEYS}
    assert set(_annotations()) - HF_ONLY == keys, "FlexformerConfig and ModelConfig declare different fields"
    assert not HF_ONLY & keys


def test_the_field_types_agree() -> None:
    annotations = _annotations()
    differ = {}
    for f in dataclasses.fields(ModelConfig):
        key = dict(MODEL_CONFIG_KEYS)[f.name]
        pair = (str(f.type), annotations[key])
        if pair[0] != pair[1] and TYPE_EXCEPTIONS.get(f.name) != pair:
            differ[f.name] = pair
    assert differ == {}


def test_the_defaults_agree() -> None:
    """Where ModelConfig has a default, a fresh FlexformerConfig builds the same model (defaults resolved on
    construction, e.g. kernel_decay auto, alike in both)."""
    built = FlexformerConfig().to_model_config()
    required = [f.name for f in dataclasses.fields(ModelConfig)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    assert built == ModelConfig(**{name: getattr(built, name) for name in required})


def test_a_config_json_without_a_later_field_reads_the_value_from_before_it() -> None:
    """Exports write every field, so a config.json without one was exported before it existed (or before its
    default changed): it reads as the value every model had then (``LEGACY_MODEL_FIELDS``), not today's default."""
    written = FlexformerConfig().to_dict()
    assert {key: written[key] for key in LEGACY_MODEL_FIELDS} == {
        "normalization": "capped_denominator", "qk_norm": "none", "window_far_gain": False, "kernel_decay": "learned"}
    old = FlexformerConfig.from_dict({k: v for k, v in written.items() if k not in LEGACY_MODEL_FIELDS})
    assert {key: getattr(old, key) for key in LEGACY_MODEL_FIELDS} == LEGACY_MODEL_FIELDS
    assert FlexformerConfig.from_dict(written).kernel_decay == "learned"  # recorded: taken as written


def test_a_non_default_model_config_round_trips() -> None:
    config = ModelConfig(vocab_size=97, num_layers=3, hidden_size=48, num_heads=3, attention="elu", feature_dim=16,
                         normalization="rms", chunk_size=32, softmax_window=8, qkv_conv_size=4, qk_norm="rms",
                         kernel_decay="learned", mlp="swiglu", norm="layernorm", bias=True, tie_embeddings=False,
                         max_seq_len=128, rope_theta=5000.0, init_std=0.01)  # fmt: skip
    assert FlexformerConfig.from_model_config(config).to_model_config() == config
