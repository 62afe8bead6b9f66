"""``FlexformerConfig`` restates ``ModelConfig``'s fields by hand (transformers reads them as class
annotations); these tests fail when the two drift apart: a field added to one and not the other, a
changed type, or a default that moved in one place only."""

from __future__ import annotations

import dataclasses

from megaflex.hf.configuration import MODEL_CONFIG_KEYS, FlexformerConfig
from megaflex.model.config import ModelConfig

# transformers-side fields with no ModelConfig counterpart (export metadata and HF switches)
HF_ONLY = {"megaflex_run_config", "megaflex_iteration", "tokenizer_vocab_size", "tie_word_embeddings", "use_cache"}
# annotations that differ on purpose: config.json may write null for an empty feature_kwargs
TYPE_EXCEPTIONS = {"feature_kwargs": ("dict[str, Any]", "dict | None")}
# defaults a config.json without the key must read as: the value before the field existed (exports
# write every field), whatever ModelConfig's default becomes
OLD_EXPORT_DEFAULTS = {"qk_norm": "none", "kernel_decay": "none"}


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
    """Where ModelConfig has a default, a config.json without the key builds the same model
    (apart from the old-export defaults, pinned here)."""
    built = FlexformerConfig().to_model_config()
    differ = {}
    for f in dataclasses.fields(ModelConfig):
        if f.name in OLD_EXPORT_DEFAULTS:
            assert getattr(built, f.name) == OLD_EXPORT_DEFAULTS[f.name], f.name
            continue
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            continue  # required in ModelConfig (vocab_size, ...): the HF defaults are transformers'
        if f.name == "ffn_hidden_size":
            continue  # None: derived from hidden_size on construction, in both
        if getattr(built, f.name) != default:
            differ[f.name] = (getattr(built, f.name), default)
    assert differ == {}


def test_a_non_default_model_config_round_trips() -> None:
    config = ModelConfig(vocab_size=97, num_layers=3, hidden_size=48, num_heads=3, attention="elu", feature_dim=16,
                         normalization="rms", chunk_size=32, softmax_window=8, qkv_conv_size=4, qk_norm="rms",
                         kernel_decay="learned", mlp="swiglu", norm="layernorm", bias=True, tie_embeddings=False,
                         max_seq_len=128, rope_theta=5000.0, init_std=0.01)  # fmt: skip
    assert FlexformerConfig.from_model_config(config).to_model_config() == config
