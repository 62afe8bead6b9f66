"""``FlexformerConfig``: megaflex's ``ModelConfig`` as a ``transformers`` configuration.

Every ``ModelConfig`` field is a top-level key of config.json under its megaflex name, and
``to_model_config()`` rebuilds (and thereby validates) the ``ModelConfig``, so a bad value in
config.json (e.g. an unknown attention kind) fails at load time with megaflex's own message.
The usual Hugging Face names (``num_hidden_layers``, ``num_attention_heads``,
``max_position_embeddings``, ``intermediate_size``) are aliases of the megaflex ones, which is
what lm-evaluation-harness reads to find the context length.
"""

from __future__ import annotations

from typing import Any

from transformers import PreTrainedConfig

from megaflex.model.config import ModelConfig

MODEL_TYPE = "flexformer"


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
    normalization: str = "rms"
    chunk_size: int = 64
    feature_kwargs: dict | None = None
    softmax_window: int = 0  # the hybrid's sliding softmax window (0: off)
    qkv_conv_size: int = 0  # the hybrid's causal q/k/v convolution (0: off)
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
        self.ffn_hidden_size = model_config.ffn_hidden_size
        limit = self.tokenizer_vocab_size
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or not 0 < limit <= self.vocab_size):
            raise ValueError(f"FlexformerConfig (config.json): tokenizer_vocab_size must be an int in [1, vocab_size "
                             f"({self.vocab_size})] or null, got {limit!r}")
        super().__post_init__(**kwargs)

    def to_model_config(self) -> ModelConfig:
        """The megaflex ``ModelConfig`` these values describe (validated)."""
        return ModelConfig(
            vocab_size=self.vocab_size, num_layers=self.num_layers, hidden_size=self.hidden_size,
            num_heads=self.num_heads, ffn_hidden_size=self.ffn_hidden_size, attention=self.attention,
            feature_dim=self.feature_dim, normalization=self.normalization, chunk_size=self.chunk_size,
            feature_kwargs=dict(self.feature_kwargs or {}), softmax_window=self.softmax_window,
            qkv_conv_size=self.qkv_conv_size, mlp=self.mlp, norm=self.norm, norm_eps=self.norm_eps,
            bias=self.bias, tie_embeddings=self.tie_embeddings, hidden_dropout=self.hidden_dropout,
            attention_dropout=self.attention_dropout, max_seq_len=self.max_seq_len, position=self.position,
            rope_theta=self.rope_base, init_std=self.init_std,
        )

    @classmethod
    def from_model_config(cls, model_config: ModelConfig, **kwargs: Any) -> "FlexformerConfig":
        """FlexformerConfig of a megaflex ``ModelConfig`` (plus transformers kwargs, e.g. token ids)."""
        values = model_config.to_dict()
        values.pop("activation_checkpointing")  # a training-time switch, not part of the model
        values["rope_base"] = values.pop("rope_theta")
        return cls(**values, **kwargs)
