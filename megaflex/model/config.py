"""Typed configuration of the GPT model.

``ModelConfig`` is the ``model:`` section of a run's YAML file; each field carries its documentation
(``megaflex.config_field.opt``), which the reference in docs/training.md renders.
``__post_init__`` validates everything that can be checked without knowing the tensor-parallel
size (the model checks divisibility by ``tp_size`` when it is built); every error names the field.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

from megaflex.attention import ATTENTION_BACKENDS, ATTENTION_KINDS, NORMALIZATIONS
from megaflex.attention.dispatch import RefusedAttention, refused_setting
from megaflex.attention.hybrid import WINDOW_MIXINGS, check_far_gain
from megaflex.attention.qk_norm import QK_NORMS
from megaflex.attention.decay import KERNEL_DECAYS
from megaflex.config_field import opt, required

# Model fields added later (or whose default changed), with the value every model had before: a checkpoint
# or an exported config.json that does not record one was built with it, whatever the default is now.
LEGACY_MODEL_FIELDS: dict[str, Any] = {
    "normalization": "rms",  # the default until capped_denominator (study v3/v4)
    "qk_norm": "none", "window_far_gain": False,  # issue 46's remedies (c) and (e)
    "kernel_decay": "none",  # issue 46's remedy (d), the default since study v5
}

MLP_KINDS = ("gelu", "swiglu")
NORM_KINDS = ("rmsnorm", "layernorm")
POSITION_KINDS = ("rope", "learned", "none")


@dataclass
class ModelConfig:
    """Decoder-only transformer hyper-parameters (see configs/*.yaml for the named sizes)."""

    vocab_size: int = required("tokenizer vocabulary (padded internally to a multiple of 128 x TP)")
    num_layers: int = required("transformer blocks")
    hidden_size: int = required("residual width")
    num_heads: int = required("attention heads (divisible by the TP size)")
    # equal MLP parameter count for both defaults
    ffn_hidden_size: int | None = opt(None, "MLP width (default 4h for gelu, 8h/3 rounded up to 64 for swiglu)")
    attention: str = opt(
        "flexformer_n", "softmax or a linear feature map (flexformer_n, flexformer_s, performer, elu, cosformer, hedgehog)"
    )
    feature_dim: int = opt(128, "feature axis F of linear attention (2 x the number of frequencies for trig maps)")
    # the default since study v3/v4: 1.09x softmax against rms's 2.17x (docs/attention.md); checkpoints
    # without the field were trained with rms
    normalization: str = opt(
        "capped_denominator", "linear attention output normalisation: capped_denominator (n / max(d, rms(n)/2)), "
        "rms or denominator (attention/normalize.py)",
    )
    chunk_size: int = opt(64, "chunk length of the chunked linear-attention training form")
    attention_backend: str = opt(
        "auto", "chunked linear attention implementation: auto (Triton on CUDA, torch on CPU), torch, triton (on "
        "CPU tensors it needs TRITON_INTERPRET=1), or fla (flash-linear-attention's chunk_simple_gla; CUDA, extra gpu)",
    )
    feature_kwargs: dict[str, Any] = opt(
        {}, "extra keyword arguments of the feature map (flexformer_n: omega_init paper|tied|correlated (paper: "
        "independent Omega1, Omega2, whose expected kernel has a uniform floor; tied: Omega2 = Omega1 + omega_noise x "
        "noise; correlated: correlation omega_correlation in (0, 1), the same marginal; both without the floor), "
        "omega_noise (default 0.1), omega_correlation (default 0.5), min_log_temperature (tau's soft floor, default "
        "log(2 sqrt d) - 3), max_log_temperature (tau's soft ceiling, default null: none; >= floor + 2.4); "
        "attention/feature_maps/flexformer_n.py)",
    )
    # the optional quality closers of linear attention (megaflex.attention.hybrid; 0 = off)
    softmax_window: int = opt(
        0, "W > 0: exact softmax attention over the last W tokens, the kernel for older ones (see window_mixing; "
        "with attention softmax: sliding-window softmax; 0: off)",
    )
    window_mixing: str = opt(
        "shared_normaliser", "with softmax_window: shared_normaliser (exact weights for the last W keys, the kernel "
        "for older ones, one normaliser) or gated (the old learned per-head blend of two normalised branches)",
    )
    # issue 46, remedy (e); checkpoints without the field were trained without it (checkpoint/metadata.py)
    window_far_gain: bool = opt(
        False, "with softmax_window and window_mixing shared_normaliser: a learned per-head gain e^b_h on the far "
        "field's weights against the window's (LoLCATs), init 1 (b_h = 0): the hybrid without it (attention/hybrid.py)",
    )
    qkv_conv_size: int = opt(0, "K > 0: K-tap causal depthwise convolution of q, k, v before linear attention (0: off)")
    # issue 46, remedy (c); checkpoints without the field were trained with "none" (checkpoint/metadata.py)
    qk_norm: str = opt(
        "none", "norm control of q and k in the attention layer, before RoPE and the feature map (every form sees "
        "it): none; rms (q, k <- g_h x / rms(x), a learned per-head gain g_h = e^s_h shared by q and k, init 1: "
        "||q|| = ||k|| = sqrt(head dim)); affine_rms (ReBased: w * x / rms(x) + b, per head and channel, q and k "
        "apart, init w = 1, b = 0) (attention/qk_norm.py)",
    )
    # issue 46: the default since study v5 (Flexformer_n 7.8% below the undecayed recipe, paired over 3 seeds;
    # docs/studies.md); checkpoints without the field were trained without a decay (checkpoint/metadata.py)
    kernel_decay: str = opt(
        "auto", "auto (learned for causal linear attention, none for softmax and bidirectional attention; a built "
        "config holds the resolved value), none, or learned: a learnable per-head decay gamma_h^(t - s) of linear "
        "attention's weights, so old keys fade (RetNet-style init, half-lives ~22 to ~2,800 tokens; with "
        "softmax_window the far field only, counted from the window's edge; causal only; attention/decay.py)",
    )
    # a resume may not change it: it changes what the weights compute (checkpoint/compat.py)
    causal: bool = opt(
        True, "false: bidirectional attention (an encoder, megaflex.model.encoder; attention_mask is the key "
        "padding mask): no decoding state, packed documents or q/k/v convolution",
    )
    mlp: str = opt("gelu", "gelu or swiglu")
    norm: str = opt("rmsnorm", "rmsnorm or layernorm")
    norm_eps: float = opt(1e-5, "epsilon of the norms")
    bias: bool = opt(False, "biases in linear layers")
    tie_embeddings: bool = opt(True, "share input embedding and output projection")
    hidden_dropout: float = opt(0.0, "dropout on embeddings and residual branches")
    attention_dropout: float = opt(0.0, "dropout on the attention output of each head (before the out projection)")
    max_seq_len: int = opt(2048, "longest sequence (positions)")
    position: str = opt("rope", "rope, learned or none")
    rope_theta: float = opt(10000.0, "RoPE base")
    init_std: float = opt(0.02, "std of the normal initialisation")
    activation_checkpointing: bool = opt(False, "recompute each block in backward (saves activation memory)")

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
        _check_choice("qk_norm", self.qk_norm, QK_NORMS)
        _check_choice("kernel_decay", self.kernel_decay, ("auto", *KERNEL_DECAYS))
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
        for name in ("causal", "window_far_gain"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.kernel_decay == "auto":
            self.kernel_decay = "learned" if self.is_linear_attention and self.causal else "none"
        check_far_gain(self.window_far_gain, self.softmax_window, self.window_mixing, self.is_linear_attention)
        if not isinstance(self.feature_kwargs, dict):
            raise ValueError(f"feature_kwargs must be a mapping, got {type(self.feature_kwargs).__name__}")
        for name in ("softmax_window", "qkv_conv_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an int >= 0 (0: off), got {value!r}")
            if value and self.attention == "softmax" and (name == "qkv_conv_size" or self.window_mixing != "shared_normaliser"):
                raise ValueError(f"{name} must be 0 for attention='softmax' (it closes linear attention's gaps; "
                                 f"softmax_window with window_mixing 'shared_normaliser' is sliding-window softmax), got {value}")
        if self.attention == "softmax" and self.kernel_decay != "none":
            raise ValueError(f"kernel_decay must be 'none' for attention='softmax' (it decays the kernel's weights), "
                             f"got {self.kernel_decay!r}")
        if self.attention == "softmax" and self.feature_kwargs:
            raise ValueError(f"feature_kwargs must be empty for attention='softmax', got {sorted(self.feature_kwargs)}")
        # what the attention dispatch table refuses for these settings (e.g. the causal q/k/v convolution
        # of a bidirectional model), here rather than at the first forward
        refusal = refused_setting(**self.attention_settings())
        if refusal is not None:
            raise RefusedAttention(refusal.message)
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

    def attention_settings(self) -> dict[str, Any]:
        """The settings of this model that the attention dispatch table decides on before any call
        (``dispatch.SETTING_FIELDS``; a run adds its document resets and context parallelism)."""
        return dict(form="causal" if self.causal else "bidirectional", conv_size=self.qkv_conv_size,
                    window=self.softmax_window, mixing=self.window_mixing, decays=self.kernel_decay == "learned")

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
