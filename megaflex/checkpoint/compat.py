"""Resume incompatibilities read from a checkpoint's metadata, before DeepSpeed reads any file.

DeepSpeed meets a checkpoint of another layout with an unrelated error (``AttributeError:
'NoneType' object has no attribute 'copy'`` for ZeRO 1 -> 0, a bare ``AssertionError`` for
ZeRO 1 -> 3, ``KeyError: 'dp_world_size'`` for a weights-only folder). Each check here names the
saved and current values and the way out: TP size, parameter shapes and every model field that
decides what the weights compute (``check_compatible``: reshard, or resume with the saved values),
ZeRO stage and precision (``check_resume_layout``), optimizer groups, and the DP x CP count of ZeRO
states (``needs_repartition``: the universal copy).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import dataclasses

import torch

from megaflex.checkpoint.layout import CheckpointError
from megaflex.checkpoint.metadata import CheckpointMeta
from megaflex.model.config import LEGACY_MODEL_FIELDS, ModelConfig
from megaflex.parallel.deferred_init import full_shape

# ZeRO stages whose optimizer states DeepSpeed loads into each other (1 and 2 share one optimizer
# class and shard format); every other change of stage is refused.
_STAGE_FAMILIES = ({0}, {1, 2}, {3})


# Model fields a resume may change: none changes what the saved weights compute.
#   attention_backend: another implementation of the same maths (equal to rounding);
#   chunk_size: the chunked training form is exact for every chunk length;
#   activation_checkpointing: recomputation in backward, memory only;
#   hidden_dropout, attention_dropout: training-time noise, the function itself is the same;
#   init_std: initialisation only, a resume loads every weight;
#   max_seq_len: bounds positions only (RoPE computes them; a learned table's length is a shape,
#     checked as one), except for cosformer, whose angles pi t / (2 max_seq_len) depend on it.
# Every other field changes the maths of weights that may keep every shape (norm, position,
# attention kind, normalization, rope_theta, norm_eps, softmax_window, window_mixing, causal, ...);
# a checkpoint without ``causal`` was trained causal (its default).
RESUMABLE_MODEL_FIELDS = frozenset({
    "attention_backend", "chunk_size", "activation_checkpointing", "hidden_dropout", "attention_dropout", "init_std",
    "max_seq_len",
})


def _family(stage: int) -> set[int]:
    return next(f for f in _STAGE_FAMILIES if stage in f)


def _warm_start_hint(path: Path | str) -> str:
    return (f"start a new run from its weights: checkpoint.init_from={path} checkpoint.resume=none with a new "
            "logging.run_dir (or checkpoint.dir); the optimizer state starts fresh")


def check_resume_layout(meta: CheckpointMeta, path: Path, zero_stage: int, precision: str, pp_size: int = 1) -> None:
    """``CheckpointError`` when this run (at ``zero_stage``, ``precision`` and ``pp_size`` pipeline
    stages) cannot load the engine states of checkpoint ``path`` as recorded in ``meta``."""
    warm_start = _warm_start_hint(path)
    if not meta.is_training_checkpoint:
        source = meta.source or "not megaflex-train"
        raise CheckpointError(f"checkpoint {path} holds weights only (written by {source}), no optimizer or engine "
                              f"state to resume; {warm_start}")
    if meta.pp_size != pp_size:
        # The pipeline engine writes per-layer weights and per-stage optimizer partitions, the plain one a
        # module per TP rank: neither engine reads the other's files, and DeepSpeed does not re-cut stages.
        raise CheckpointError(
            f"checkpoint {path} was saved with pipeline_parallel_size={meta.pp_size}, this run has {pp_size}; "
            f"DeepSpeed cannot load its engine states into another number of pipeline stages. Resume with "
            f"parallel.pipeline_parallel_size={meta.pp_size}, or {warm_start}"
        )
    saved_stage = meta.zero_stage or 0
    if zero_stage not in _family(saved_stage):
        raise CheckpointError(
            f"checkpoint {path} was saved with ZeRO stage {saved_stage}, this run has parallel.zero_stage={zero_stage}; "
            f"DeepSpeed cannot load ZeRO {saved_stage} optimizer states into ZeRO {zero_stage} (only 1 <-> 2 convert). "
            f"Resume with parallel.zero_stage={saved_stage}, or {warm_start}"
        )
    saved_precision = meta.precision or precision
    if saved_precision != precision:
        # DeepSpeed keeps other optimizer states per precision (bf16: its own fp32 master copies
        # and files; fp32 ZeRO 0: none); it fails with a KeyError or a missing file otherwise.
        raise CheckpointError(
            f"checkpoint {path} was saved with train.precision={saved_precision}, this run has {precision}; DeepSpeed "
            f"cannot load {saved_precision} optimizer states into a {precision} run. Resume with "
            f"train.precision={saved_precision}, or {warm_start}"
        )


def parameter_shapes(model: torch.nn.Module) -> dict[str, list[int]]:
    """Name -> this rank's shape (TP shards), as recorded in and checked against checkpoints."""
    return {name: list(full_shape(p)) for name, p in model.named_parameters()}  # ZeRO-3 shards too


def check_compatible(
    meta: CheckpointMeta, model_config: dict[str, Any], shapes: dict[str, list[int]], tp_size: int,
    path: Path | str = "",
) -> None:
    """Refuse a checkpoint (at ``path``) whose model does not match this run's ``model_config``:
    another TP size, another value of a model field that changes what the weights compute (naming
    both values; some keep every shape), or another parameter shape (naming both shapes)."""
    saved_tp = meta.tensor_parallel_size
    if saved_tp != tp_size:
        raise CheckpointError(
            f"checkpoint has tensor_parallel_size={saved_tp}, this run {tp_size}; reshard it first "
            f"(megaflex.checkpoint.reshard) or launch with parallel.tensor_parallel_size={saved_tp}"
        )
    saved_shapes, other_shape = meta.parameter_shapes, ""
    if saved_shapes != shapes:
        names = sorted(set(saved_shapes) ^ set(shapes)) or [n for n in shapes if shapes[n] != saved_shapes[n]]
        first = names[0]
        other_shape = f"{first}: checkpoint {saved_shapes.get(first, 'absent')} vs config {shapes.get(first, 'absent')}"
    # Fields first: they name the setting to change back (e.g. rms -> capped_denominator also drops out_gain).
    _check_model_fields(meta, model_config, path or "<checkpoint>", other_shape)
    if other_shape:  # no acting field differs: another code version, or learned positions' max_seq_len
        saved_model, mine = meta.model_config, model_config
        diff = {k: (saved_model.get(k), mine.get(k)) for k in sorted(set(saved_model) | set(mine)) if saved_model.get(k) != mine.get(k)}
        raise CheckpointError(
            f"checkpoint model shape does not match the config: {other_shape}; model fields (checkpoint, config): {diff}"
        )


def _acting_model_fields(model: dict[str, Any]) -> dict[str, Any]:
    """The fields of a ``model`` config (complete: every ``ModelConfig`` field) that decide what its
    weights compute (``RESUMABLE_MODEL_FIELDS`` left out, and fields the model does not read)."""
    out = {k: v for k, v in model.items() if k not in RESUMABLE_MODEL_FIELDS}
    if model["attention"] == "cosformer":
        out["max_seq_len"] = model["max_seq_len"]
    if model["attention"] == "softmax":  # no feature map; normalisation only through a window
        del out["feature_dim"], out["feature_kwargs"]
        if not model["softmax_window"]:
            del out["normalization"]
    if not model["softmax_window"]:
        del out["window_mixing"]
    return out


def _check_model_fields(meta: CheckpointMeta, model_config: dict[str, Any], path: Path | str, other_shape: str) -> None:
    """CheckpointError naming each acting model field whose saved value differs from this run's
    (and ``other_shape``, the first parameter whose shape differs, if any).
    A field the checkpoint does not record has its legacy meaning (``CheckpointMeta.model_config``)
    or, for a field added later, its default (added so as to keep the earlier models' maths)."""
    if "model" not in meta.config:  # nothing recorded to compare (not a megaflex-built model)
        return
    defaults = {f.name: f.default for f in dataclasses.fields(ModelConfig) if f.default is not dataclasses.MISSING}
    defaults.update({f.name: f.default_factory() for f in dataclasses.fields(ModelConfig)
                     if f.default_factory is not dataclasses.MISSING})
    names = {f.name for f in dataclasses.fields(ModelConfig)}
    recorded = meta.model_config
    saved = _acting_model_fields({**defaults, **{k: v for k, v in recorded.items() if k in names}})
    mine = _acting_model_fields({**defaults, **{k: v for k, v in model_config.items() if k in names}})
    # A field that acts on one side only (window_mixing without a window) has its condition differ too.
    differ = [k for k in sorted(set(saved) & set(mine)) if saved[k] != mine[k]]
    if not differ:
        return
    was = ", ".join(f"model.{k}={saved[k]}" for k in differ)
    now = ", ".join(f"model.{k}={mine[k]}" for k in differ)
    fix = " ".join(f"model.{k}={saved[k]}" for k in differ)
    legacy = ""
    if "normalization" in differ and "normalization" not in meta.config["model"]:
        legacy = (f" (it records no model.normalization: written when {LEGACY_MODEL_FIELDS['normalization']} was the default; "
                  f"the default is now {defaults['normalization']})")
    elif "kernel_decay" in differ and "kernel_decay" not in meta.config["model"]:
        legacy = (f" (it records no model.kernel_decay: written before the decay existed, so {LEGACY_MODEL_FIELDS['kernel_decay']}; "
                  "the default is now learned for causal linear attention)")
    consequence = (f"its parameters do not fit ({other_shape})" if other_shape else "the weights and their optimizer "
                   "moments would continue as another model (same shapes, other maths)")
    raise CheckpointError(
        f"checkpoint {path} was trained with {was}{legacy}, this run has {now}; {consequence}. Set {fix} to continue "
        f"this run, or {_warm_start_hint(path)}"
    )


def check_optimizer_groups(meta: CheckpointMeta, current: list[str], path: Path) -> None:
    """Clear error when the checkpoint's optimizer has other param groups (names) than this run's.

    Checkpoints from before the kernel LR groups (no ``optimizer_groups``) have the two groups
    decay/no_decay; they resume with both kernel LR multipliers at 1."""
    saved = meta.param_groups
    if saved != current:
        raise ValueError(
            f"checkpoint {path}: optimizer param groups {saved} differ from this run's {current}; resume with "
            "the optimizer.kernel_{frequency,temperature}_lr_multiplier values the checkpoint was trained with "
            "(1 for checkpoints without kernel groups)"
        )


def needs_repartition(meta: CheckpointMeta, path: Path, zero_stage: int, dp_size: int, cp_size: int, tp_size: int,
                      universal_allowed: bool) -> bool:
    """Whether resuming ``path`` needs its ZeRO optimizer states repartitioned over another DP x CP
    count (through the universal copy); a ``CheckpointError`` naming both counts and the ways out
    when that is not supported. ZeRO 0 states are whole on every rank: never needed."""
    saved_stage, saved, current = meta.zero_stage or 0, meta.zero_partitions, dp_size * cp_size
    if saved_stage == 0 or saved == current:
        return False
    saved_text = f"DP {meta.data_parallel_size} x CP {meta.cp_size} = {saved}"
    reason = None
    if not universal_allowed:
        reason = "checkpoint.zero_universal_resume is off"
    elif zero_stage == 0 or (saved_stage == 3) != (zero_stage == 3):
        reason = (f"the universal copy loads ZeRO 1/2 into ZeRO 1/2 and ZeRO 3 into ZeRO 3 only (saved at ZeRO "
                  f"{saved_stage}, this run ZeRO {zero_stage})")
    elif tp_size != 1:
        reason = f"the universal copy needs tensor_parallel_size 1 (this run {tp_size}); megaflex records no TP slicing for it"
    elif meta.pp_size != 1:
        reason = f"the universal copy is not wired up for pipeline checkpoints (pipeline_parallel_size {meta.pp_size})"
    if reason is None:
        return True
    raise CheckpointError(
        f"checkpoint {path} holds ZeRO {saved_stage} optimizer states partitioned over {saved_text} ranks, this run "
        f"has DP {dp_size} x CP {cp_size} = {current}, and {reason}. Resume with a DP x CP product of {saved} (any CP "
        f"size whose DP x CP is {saved}), or train with parallel.zero_stage=0 (whole states on every rank) when the "
        "world is to change, or (TP 1, the saved ZeRO stage's family) set checkpoint.zero_universal_resume=true"
    )
