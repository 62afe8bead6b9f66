"""The run configuration: one typed dataclass per section (``config_sections``), loaded from YAML + overrides.

    cfg = load_config(["configs/tiny.yaml", "configs/zero/zero1.yaml"], ["train.lr=3e-4"])

Files are merged in order (later wins, nested sections merge key by key), then dotted
command-line overrides. Unknown keys and wrongly-typed values are rejected by the loader
(``config_loader``) with the key, its source and what is allowed; impossible combinations are
rejected by ``validate`` (static) and ``validate_runtime`` (needs the world size and device).
The DeepSpeed JSON is *generated* from this config (``deepspeed_config.py``), never written by
hand. Validation lives in ``config_checks`` (re-exported here). Every field carries its
documentation in ``metadata["doc"]``; ``reference_markdown()``
renders the reference in docs/training.md.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import get_type_hints

from megaflex.config_field import opt
from megaflex.parallel.config import ParallelConfig
from megaflex.training.config_checks import (  # re-exported: the config's one import for callers
    check_device,
    config_warnings,
    parallel_dims,
    resolve_device,
    validate,
    validate_runtime,
)
from megaflex.training.config_loader import (
    ConfigError,
    Source,
    field_docs,
    load_dataclass,
    parse_overrides,
    read_yaml,
    type_name,
)
from megaflex.training.config_sections import (  # re-exported: one typed dataclass per section
    FLOAT_RANGES,
    SECTIONS,
    CheckpointConfig,
    Config,
    DataConfig,
    DistillConfig,
    FaultConfig,
    LoggingConfig,
    OptimizerConfig,
    ProfileConfig,
    ScheduleConfig,
    TrainConfig,
    WandbConfig,
)


__all__ = [
    "check_device",
    "CheckpointConfig",
    "Config",
    "FLOAT_RANGES",
    "config_from_sources",
    "config_warnings",
    "ConfigError",
    "DataConfig",
    "DistillConfig",
    "FaultConfig",
    "global_batch_size",
    "load_config",
    "LoggingConfig",
    "opt",
    "OptimizerConfig",
    "parallel_dims",
    "ParallelConfig",
    "ProfileConfig",
    "reference_markdown",
    "resolve_device",
    "ScheduleConfig",
    "SECTIONS",
    "TrainConfig",
    "validate",
    "validate_runtime",
    "WandbConfig",
]




def load_config(paths: list[str | Path], overrides: list[str] | None = None) -> Config:
    """Load, merge and statically validate a run config (raises ``ConfigError``)."""
    if not paths:
        raise ConfigError("--config: expected at least one YAML file, got none")
    sources = [read_yaml(p) for p in paths] + [parse_overrides(list(overrides or []))]
    return config_from_sources(sources)


def config_from_sources(sources: list[Source]) -> Config:
    for src in sources:
        if "origins" in src.data:
            raise ConfigError(f"unknown config key 'origins' (from {src.origin}); allowed sections: {', '.join(SECTIONS)}")
    for src in sources:
        if "model" in src.data:
            break
    else:
        raise ConfigError(f"no 'model' section in {', '.join(s.origin for s in sources)}; every run needs one")
    cfg, origins = load_dataclass(Config, sources, FLOAT_RANGES)
    cfg.origins = origins
    validate(cfg)
    return cfg


def global_batch_size(cfg: Config, dp_size: int) -> int:
    return cfg.train.global_batch_size or cfg.train.micro_batch_size * dp_size


def reference_markdown() -> str:
    """Markdown reference of every section and field (type, default, documentation)."""
    lines = []
    section_types = get_type_hints(Config)
    for name in SECTIONS:
        cls = section_types[name]
        lines += [f"### `{name}`", "", (cls.__doc__ or "").strip().splitlines()[0], ""]
        lines += ["| key | type | default | meaning |", "|---|---|---|---|"]
        docs = field_docs(cls)
        hints = get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if f.default is not dataclasses.MISSING:
                default = f.default
            elif f.default_factory is not dataclasses.MISSING:
                default = f.default_factory()
            else:
                default = "(required)"
            doc = docs.get(f.name) or _MODEL_DOCS.get(f.name, "")
            type_text = type_name(hints[f.name]).replace(" | ", " or ")
            lines.append(f"| `{name}.{f.name}` | {type_text} | `{default!r}` | {doc} |")
        lines.append("")
    return "\n".join(lines)


# The model section is owned by megaflex.model; its fields are documented there as comments.
_MODEL_DOCS = {
    "vocab_size": "tokenizer vocabulary (padded internally to a multiple of 128 x TP)",
    "num_layers": "transformer blocks",
    "hidden_size": "residual width",
    "num_heads": "attention heads (divisible by the TP size)",
    "ffn_hidden_size": "MLP width (default 4h for gelu, 8h/3 rounded to 64 for swiglu)",
    "attention": "softmax or a linear feature map (flexformer_n, flexformer_s, performer, elu, cosformer, hedgehog)",
    "feature_dim": "feature axis F of linear attention",
    "normalization": "linear attention output normalisation: capped_denominator (n / max(d, rms(n)/2)), rms or denominator (attention/base.py)",
    "chunk_size": "chunk length of the chunked linear-attention training form",
    "attention_backend": "chunked linear attention implementation: auto (Triton on CUDA, torch on CPU), torch, triton (on CPU tensors it needs TRITON_INTERPRET=1), or fla (flash-linear-attention's chunk_simple_gla; CUDA, extra gpu)",
    "feature_kwargs": "extra keyword arguments of the feature map (flexformer_n: omega_init paper|tied, omega_noise, "
    "min_log_temperature)",
    "softmax_window": "W > 0: exact softmax attention over the last W tokens, the kernel for older ones (see window_mixing; 0: off)",
    "window_mixing": "with softmax_window: shared_normaliser (exact weights for the last W keys, the kernel for older ones, one normaliser) or gated (the old learned per-head blend of two normalised branches)",
    "qkv_conv_size": "K > 0: K-tap causal depthwise convolution of q, k, v before linear attention (0: off)",
    "mlp": "gelu or swiglu",
    "norm": "rmsnorm or layernorm",
    "norm_eps": "epsilon of the norms",
    "bias": "biases in linear layers",
    "tie_embeddings": "share input embedding and output projection",
    "hidden_dropout": "dropout on embeddings and residual branches",
    "attention_dropout": "dropout on attention outputs",
    "max_seq_len": "longest sequence (positions)",
    "position": "rope, learned or none",
    "rope_theta": "RoPE base",
    "init_std": "std of the normal initialisation",
    "activation_checkpointing": "recompute each block in backward (saves activation memory)",
}


if __name__ == "__main__":  # python -m megaflex.training.config --reference > reference.md
    import sys

    if sys.argv[1:] != ["--reference"]:
        sys.exit("usage: python -m megaflex.training.config --reference")
    print(reference_markdown())
