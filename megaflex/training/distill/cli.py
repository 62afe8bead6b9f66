"""``megaflex-distill`` / ``python -m megaflex.distill``: convert a softmax checkpoint into a linear-attention model.

    megaflex-distill --teacher runs/softmax --config my.yaml distill.stage=attention_transfer
    megaflex-distill --teacher runs/softmax --stage finetune --config my.yaml \\
        checkpoint.init_from=runs/stage1 distill.lora_rank=8

The run config is the training config (same sections, YAML files + dotted overrides, deepspeed
launcher, ZeRO, TP) plus ``distill:``. Its defaults come from the checkpoints: ``model`` is the
teacher's with ``attention: distill.student_attention`` (or, when ``checkpoint.init_from`` names
a linear-attention checkpoint such as a stage-1 output, that checkpoint's model), ``data`` is the
teacher's, ``checkpoint.init_from`` is the teacher. The YAML files and overrides win over them,
except that an explicitly set ``distill.student_attention`` always sets ``model.attention``.
"""

from __future__ import annotations

import sys
from typing import Any

from megaflex.checkpoint import CheckpointMeta, resolve_checkpoint
from megaflex.model.config import ModelConfig
from megaflex.training.config import Config, ConfigError, DistillConfig, config_from_sources
from megaflex.training.config_loader import Source, parse_overrides, read_yaml
from megaflex.training.distill.objectives import check_softmax_teacher, check_student_matches_teacher
from megaflex.training.train import EXIT_CONFIG, build_parser, execute, finish_args, print_once

STAGES = ("attention_transfer", "finetune")


def parse_args(argv: list[str] | None = None) -> Any:
    ap = build_parser("megaflex-distill", "Distil a megaflex softmax checkpoint into a linear-attention student. "
                      "Positional key=value arguments override config keys.")
    ap.add_argument("--teacher", default=None, help="softmax teacher checkpoint (= distill.teacher=...)")
    ap.add_argument("--stage", choices=STAGES, default=None, help="= distill.stage=...")
    args = finish_args(ap.parse_intermixed_args(argv))  # overrides may come before and after --teacher/--stage
    if args.teacher is not None:
        args.overrides.append(f"distill.teacher={args.teacher}")
    if args.stage is not None:
        args.overrides.append(f"distill.stage={args.stage}")
    return args


def _setting(sources: list[Source], section: str, key: str, default: Any = None) -> Any:
    """The value the last source sets for ``section.key`` (before the config is built)."""
    value = default
    for src in sources:
        part = src.data.get(section)
        if isinstance(part, dict) and key in part:
            value = part[key]
    return value


def _checkpoint_config(path: Any, key: str) -> tuple[str, dict[str, Any]]:
    """(resolved folder, resolved run config) of a checkpoint named by config key ``key``."""
    try:
        folder = resolve_checkpoint(str(path))
    except ValueError as e:
        raise ConfigError(f"{key}: {e}") from None
    meta = CheckpointMeta.read(folder)
    return str(folder), {**meta.config, "model": meta.model_config}


def distill_config(paths: list[str], overrides: list[str]) -> Config:
    """The run config of a distillation stage (ConfigError on bad input, naming the key)."""
    sources = [read_yaml(p) for p in paths] + [parse_overrides(overrides)]
    teacher = _setting(sources, "distill", "teacher")
    if not teacher:
        raise ConfigError("distill.teacher: expected the softmax teacher's checkpoint (--teacher PATH), got none")
    teacher_path, teacher_cfg = _checkpoint_config(teacher, "distill.teacher")
    teacher_model = ModelConfig.from_dict(teacher_cfg["model"])
    check_softmax_teacher(teacher_model, teacher_path)
    student = _setting(sources, "distill", "student_attention", DistillConfig().student_attention)
    if student == "softmax":
        raise ConfigError("distill.student_attention: expected a linear attention kind (e.g. flexformer_n, performer), got 'softmax'")
    # The student is a new linear model: the softmax teacher's normalization (which it never used,
    # "rms" in teachers saved before capped_denominator became the default) must not pass to it.
    model = {**{k: v for k, v in teacher_cfg["model"].items() if k != "normalization"}, "attention": student}
    init_from = _setting(sources, "checkpoint", "init_from")
    if init_from:  # e.g. finetune from the stage-1 output: its (student) model
        _, init_cfg = _checkpoint_config(init_from, "checkpoint.init_from")
        if init_cfg["model"].get("attention") != "softmax":
            model = dict(init_cfg["model"])
    defaults = {"model": model, "data": teacher_cfg.get("data", {}), "checkpoint": {"init_from": teacher_path}}
    chosen = []  # an explicit distill.student_attention wins over a model.attention of the YAML files
    if _setting(sources, "distill", "student_attention") is not None:
        chosen = [Source({"model": {"attention": student}}, "distill.student_attention")]
    cfg = config_from_sources([Source(defaults, f"teacher checkpoint {teacher_path}"), *sources, *chosen])
    if not cfg.model.is_linear_attention:
        raise ConfigError(f"model.attention (from {cfg.where('model.attention')}): the student needs a linear attention "
                          f"kind, got {cfg.model.attention!r}")
    check_student_matches_teacher(cfg.model, teacher_model)
    return cfg


def build_objective(cfg: Config) -> Any:
    from megaflex.training.distill.objectives import AttentionTransfer, Finetune

    return AttentionTransfer(cfg.distill) if cfg.distill.stage == "attention_transfer" else Finetune(cfg.distill)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        cfg = distill_config(args.config, args.overrides)
    except ConfigError as e:
        print_once(f"megaflex-distill: config error: {e}")
        return EXIT_CONFIG
    return execute("megaflex-distill", cfg, build_objective(cfg))


if __name__ == "__main__":
    sys.exit(main())
