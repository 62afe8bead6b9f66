"""``FlexformerConfig``: megaflex's ``ModelConfig`` as a ``transformers`` configuration.

Every ``ModelConfig`` field is a top-level key of config.json under its megaflex name (only
``rope_theta`` is renamed ``rope_base``: transformers rewrites "rope_theta"), and
``to_model_config()`` rebuilds (and thereby validates) the ``ModelConfig`` from all of them
(``MODEL_CONFIG_KEYS``: a field this class lacks is an error, not a silent default), so a bad value in
config.json (e.g. an unknown attention kind) fails at load time with megaflex's own message.
The usual Hugging Face names (``num_hidden_layers``, ``num_attention_heads``,
``max_position_embeddings``, ``intermediate_size``) are aliases of the megaflex ones, which is
what lm-evaluation-harness reads to find the context length.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from transformers import PreTrainedConfig

from megaflex.model.config import LEGACY_MODEL_FIELDS, ModelConfig

MODEL_TYPE = "flexformer"
_RENAMED = {"rope_theta": "rope_base"}  # ModelConfig field -> config.json key
# (ModelConfig field, config.json key) of every field
MODEL_CONFIG_KEYS = tuple((f.name, _RENAMED.get(f.name, f.name)) for f in dataclasses.fields(ModelConfig))


class FlexformerConfig(PreTrainedConfig):
    """Hyper-parameters of a megaflex GPT (see ``megaflex.model.config.ModelConfig``)."""

    model_type = MODEL_TYPE
    attribute_map = {
        "num_hidden_layers": "num_layers",
        "num_attention_heads": "num_heads",
        "max_position_embeddings": "max_seq_len",
        "intermediate_size": "ffn_hidden_size",
    }

    vocab_size: int = 32000
    num_layers: int = 12
    hidden_size: int = 768
    num_heads: int = 12
    ffn_hidden_size: int | None = None
    attention: str = "flexformer_n"
    feature_dim: int = 128
    # ModelConfig's default; a config.json without the key was exported before that default
    # (exports write every field), so it was trained with rms: from_dict reads it as "rms"
    normalization: str = "capped_denominator"
    chunk_size: int = 64
    attention_backend: str = "auto"  # the chunked form's implementation (auto: Triton on CUDA, torch on CPU)
    feature_kwargs: dict | None = None
    softmax_window: int = 0  # the hybrid's sliding softmax window (0: off)
    window_mixing: str = "shared_normaliser"  # how the window meets the kernel (one normaliser | gated)
    window_far_gain: bool = False  # the window's learned per-head far-field gain (absent: exported before it existed)
    qkv_conv_size: int = 0  # the hybrid's causal q/k/v convolution (0: off)
    # the value before the field existed (a config.json without it was exported then), not ModelConfig's default
    qk_norm: str = "none"  # norm control of q and k before the feature map (none | rms | affine_rms)
    # ModelConfig's default; a config.json without the key was exported before the decay existed
    # (exports write every field, resolved): from_dict reads it as "none"
    kernel_decay: str = "auto"
    causal: bool = True  # False: a bidirectional encoder (no decoding state: generate() refuses it)
    mlp: str = "gelu"
    norm: str = "rmsnorm"
    norm_eps: float = 1e-5
    bias: bool = False
    tie_embeddings: bool = True
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    max_seq_len: int = 2048
    position: str = "rope"
    rope_base: float = 10000.0  # megaflex's rope_theta (renamed: transformers rewrites "rope_theta")
    init_std: float = 0.02
    activation_checkpointing: bool = False  # recompute blocks in backward (fine-tuning memory)
    # The megaflex run config the weights were trained with (model card, round trip), or None.
    megaflex_run_config: dict | None = None
    megaflex_iteration: int | None = None  # training iterations of those weights
    # The tokenizer's vocabulary when vocab_size is padded beyond it: logits of ids >= this are
    # -inf, so generate() never emits an id the tokenizer cannot decode (None: no padding known).
    tokenizer_vocab_size: int | None = None
    # megaflex's tied output matrix is the embedding itself (no second parameter), so
    # transformers' own weight tying stays off.
    tie_word_embeddings: bool = False
    use_cache: bool = True  # forward returns the decoding state (FlexformerCache)

    def __post_init__(self, **kwargs: Any) -> None:
        if self.feature_kwargs is None:
            self.feature_kwargs = {}
        # Validate now, so config.json errors surface at from_pretrained (ValueError naming the field).
        try:
            model_config = self.to_model_config()
        except ValueError as err:
            raise ValueError(f"FlexformerConfig (config.json): {err}") from None
        # derived or resolved on construction (ffn width; kernel_decay auto), so config.json records what was built
        self.ffn_hidden_size, self.kernel_decay = model_config.ffn_hidden_size, model_config.kernel_decay
        limit = self.tokenizer_vocab_size
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or not 0 < limit <= self.vocab_size):
            raise ValueError(f"FlexformerConfig (config.json): tokenizer_vocab_size must be an int in [1, vocab_size "
                             f"({self.vocab_size})] or null, got {limit!r}")
        super().__post_init__(**kwargs)

    @classmethod
    def from_dict(cls, config_dict: dict[str, Any], **kwargs: Any) -> Any:
        """``PreTrainedConfig.from_dict`` (what ``from_pretrained`` reads config.json with); a
        config.json without a field is an export from before it: ``LEGACY_MODEL_FIELDS``."""
        config_dict = {**LEGACY_MODEL_FIELDS, **config_dict}
        return super().from_dict(config_dict, **kwargs)

    def to_model_config(self) -> ModelConfig:
        """The megaflex ``ModelConfig`` these values describe (validated)."""
        values = {field: getattr(self, key) for field, key in MODEL_CONFIG_KEYS}
        values["feature_kwargs"] = dict(values["feature_kwargs"] or {})
        return ModelConfig(**values)

    @classmethod
    def from_model_config(cls, model_config: ModelConfig, **kwargs: Any) -> "FlexformerConfig":
        """FlexformerConfig of a megaflex ``ModelConfig`` (plus transformers kwargs, e.g. token ids)."""
        values = model_config.to_dict()
        return cls(**{key: values[field] for field, key in MODEL_CONFIG_KEYS}, **kwargs)
