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
            doc = docs.get(f.name, "")
            type_text = type_name(hints[f.name]).replace(" | ", " or ")
            lines.append(f"| `{name}.{f.name}` | {type_text} | `{default!r}` | {doc} |")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":  # python -m megaflex.training.config --reference > reference.md
    import argparse

    parser = argparse.ArgumentParser(prog="python -m megaflex.training.config", description="the run config's reference")
    # Optional: the reference is all this prints; docs/training.md names the command with the flag.
    parser.add_argument("--reference", action="store_true", help="print the Markdown reference (the default)")
    parser.parse_args()
    print(reference_markdown())
