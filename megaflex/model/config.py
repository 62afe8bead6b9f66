"""Typed configuration of the GPT model.

``ModelConfig`` is the ``model:`` section of a run's YAML file. ``__post_init__`` validates
everything that can be checked without knowing the tensor-parallel size (the model checks
divisibility by ``tp_size`` when it is built) and every error names the offending field.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Mapping

from megaflex.attention import ATTENTION_BACKENDS, ATTENTION_KINDS, NORMALIZATIONS
from megaflex.attention.hybrid import WINDOW_MIXINGS

MLP_KINDS = ("gelu", "swiglu")
NORM_KINDS = ("rmsnorm", "layernorm")
POSITION_KINDS = ("rope", "learned", "none")


@dataclass
class ModelConfig:
    """Decoder-only transformer hyper-parameters (see configs/*.yaml for the named sizes)."""

    vocab_size: int
    num_layers: int
    hidden_size: int
    num_heads: int
    # None -> 4 * hidden for gelu, 8/3 * hidden rounded up to a multiple of 64 for swiglu
    # (equal MLP parameter count).
    ffn_hidden_size: int | None = None
    # Attention ("softmax" or one of the linear feature-map kinds of megaflex.attention).
    attention: str = "flexformer_n"
    feature_dim: int = 128  # F: size of the feature axis (2 x number of frequencies for trig maps)
    # linear attention's output normalisation (attention/base.py): "capped_denominator" (default since
    # study v3/v4: 1.09x softmax against rms's 2.17x, docs/attention.md), "rms" (the default before;
    # checkpoints without the field were trained with it) or "denominator"
    normalization: str = "capped_denominator"
    chunk_size: int = 64  # chunk length of the parallel (training) linear-attention form
    # chunked form's implementation: "auto" (Triton kernels on CUDA, torch on CPU), "torch",
    # "triton" (also on CPU tensors under TRITON_INTERPRET=1: slow, for tests), or "fla"
    # (flash-linear-attention's chunk_simple_gla on CUDA; pip install 'megaflex[gpu]')
    attention_backend: str = "auto"
    feature_kwargs: dict[str, Any] = field(default_factory=dict)  # extra kwargs of the feature map
    # Optional quality closers of linear attention (megaflex.attention.hybrid; 0 = off):
    softmax_window: int = 0  # W > 0: exact softmax attention over the last W tokens (attention/hybrid.py);
    # with attention "softmax": sliding-window softmax (no far field)
    # how the window meets the kernel: "shared_normaliser" (exact weights for the last W keys, the
    # kernel for older ones, one normaliser: attention/window/) or "gated" (the first
    # design: a learned per-head blend of two separately normalised branches; an ablation arm)
    window_mixing: str = "shared_normaliser"
    qkv_conv_size: int = 0  # K > 0: short causal depthwise convolution of q, k, v (K taps)
    # False: bidirectional attention (an encoder: every token attends to every real token, attention_mask
    # as the key padding mask; no decoding state, packed documents or q/k/v convolution). It changes what
    # the weights compute, so a resume may not change it (checkpoint/compat.py).
    causal: bool = True
    mlp: str = "gelu"
    norm: str = "rmsnorm"
    norm_eps: float = 1e-5
    bias: bool = False  # biases in the linear layers
    tie_embeddings: bool = True
    hidden_dropout: float = 0.0  # on embeddings and on each residual branch
    attention_dropout: float = 0.0  # on the attention output of each head (before the out proj)
    max_seq_len: int = 2048
    position: str = "rope"
    rope_theta: float = 10000.0
    init_std: float = 0.02
    activation_checkpointing: bool = False

    def __post_init__(self) -> None:
        for name in ("vocab_size", "num_layers", "hidden_size", "num_heads", "feature_dim", "chunk_size", "max_seq_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.hidden_size % self.num_heads != 0:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must be divisible by num_heads ({self.num_heads}); "
                f"expected a multiple of {self.num_heads}"
            )
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = (
                4 * self.hidden_size if self.mlp == "gelu" else 64 * -(-8 * self.hidden_size // (3 * 64))
            )
        if isinstance(self.ffn_hidden_size, bool) or not isinstance(self.ffn_hidden_size, int) or self.ffn_hidden_size <= 0:
            raise ValueError(f"ffn_hidden_size must be a positive int, got {self.ffn_hidden_size!r}")
        _check_choice("attention", self.attention, ATTENTION_KINDS)
        _check_choice("normalization", self.normalization, NORMALIZATIONS)
        _check_choice("attention_backend", self.attention_backend, ATTENTION_BACKENDS)
        _check_choice("window_mixing", self.window_mixing, WINDOW_MIXINGS)
        _check_choice("mlp", self.mlp, MLP_KINDS)
        _check_choice("norm", self.norm, NORM_KINDS)
        _check_choice("position", self.position, POSITION_KINDS)
        if self.position == "rope" and self.head_dim % 2 != 0:
            raise ValueError(f"position='rope' needs an even head dim (hidden_size / num_heads), got {self.head_dim}")
        for name in ("hidden_dropout", "attention_dropout"):
            value = getattr(self, name)
            if not 0.0 <= value < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {value!r}")
        for name in ("norm_eps", "init_std", "rope_theta"):
            value = getattr(self, name)
            if not value > 0:
                raise ValueError(f"{name} must be > 0, got {value!r}")
        if not isinstance(self.causal, bool):
            raise ValueError(f"causal must be a bool, got {self.causal!r}")
        if not isinstance(self.feature_kwargs, dict):
            raise ValueError(f"feature_kwargs must be a mapping, got {type(self.feature_kwargs).__name__}")
        for name in ("softmax_window", "qkv_conv_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an int >= 0 (0: off), got {value!r}")
            if value and self.attention == "softmax" and (name == "qkv_conv_size" or self.window_mixing != "shared_normaliser"):
                raise ValueError(f"{name} must be 0 for attention='softmax' (it closes linear attention's gaps; "
                                 f"softmax_window with window_mixing 'shared_normaliser' is sliding-window softmax), got {value}")
        if self.attention == "softmax" and self.feature_kwargs:
            raise ValueError(f"feature_kwargs must be empty for attention='softmax', got {sorted(self.feature_kwargs)}")
        self._check_feature_map()

    def _check_feature_map(self) -> None:
        """Build the feature map once (a few kB, the global RNG untouched) so that everything it
        rejects (an odd feature_dim of a trig map, unknown or bad feature_kwargs) is a config error
        here instead of a traceback where the model is built."""
        import torch

        from megaflex.attention.feature_maps import FEATURE_MAPS, build_feature_map

        if self.attention not in FEATURE_MAPS:
            return
        try:
            with torch.random.fork_rng(devices=[]):
                build_feature_map(self.attention, self.num_heads, self.head_dim, self.feature_dim, **self.feature_kwargs)
        except (TypeError, ValueError) as e:
            message = str(e)
            if message.startswith("kwargs: "):
                message = message[len("kwargs: "):]
            key = "feature_dim" if message.startswith("feature_dim") else "feature_kwargs"
            raise ValueError(f"{key} of attention={self.attention!r}: {message.removeprefix(key + ': ')}") from None

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def is_linear_attention(self) -> bool:
        return self.attention != "softmax"

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> "ModelConfig":
        """Build from a mapping (e.g. a YAML ``model:`` section); unknown keys are an error."""
        if not isinstance(values, Mapping):
            raise ValueError(f"model config must be a mapping, got {type(values).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown model config key(s) {unknown}; expected a subset of {sorted(known)}")
        missing = sorted(
            f.name
            for f in dataclasses.fields(cls)
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING and f.name not in values
        )
        if missing:
            raise ValueError(f"model config is missing required key(s) {missing}")
        return cls(**dict(values))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {list(choices)}, got {value!r}")
