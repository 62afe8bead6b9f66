"""Resume incompatibilities read from a checkpoint's metadata, before DeepSpeed reads any file.

DeepSpeed meets a checkpoint of another layout with an unrelated error (``AttributeError:
'NoneType' object has no attribute 'copy'`` for ZeRO 1 -> 0, a bare ``AssertionError`` for
ZeRO 1 -> 3, ``KeyError: 'dp_world_size'`` for a weights-only folder). Each check here names the
saved and current values and the way out. The other layout checks live where their fix does:
TP size and parameter shapes in ``checkpoint.check_compatible`` (reshard), the DP x CP count of
ZeRO states in ``checkpoint.needs_repartition`` (universal copy).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from megaflex.checkpoint_layout import CheckpointError

# ZeRO stages whose optimizer states DeepSpeed loads into each other (1 and 2 share one optimizer
# class and shard format); every other change of stage is refused.
_STAGE_FAMILIES = ({0}, {1, 2}, {3})


def _family(stage: int) -> set[int]:
    return next(f for f in _STAGE_FAMILIES if stage in f)


def check_resume_layout(meta: dict[str, Any], path: Path, zero_stage: int, precision: str) -> None:
    """``CheckpointError`` when this run (at ``zero_stage`` and ``precision``) cannot load the
    engine states of checkpoint ``path`` as recorded in ``meta`` (megaflex records no pipeline
    stages: it has none)."""
    warm_start = (f"start a new run from its weights: checkpoint.init_from={path} checkpoint.resume=none with a new "
                  "logging.run_dir (or checkpoint.dir); the optimizer state starts fresh")
    if "deepspeed_config" not in meta:
        source = meta.get("source", "not megaflex-train")
        raise CheckpointError(f"checkpoint {path} holds weights only (written by {source}), no optimizer or engine "
                              f"state to resume; {warm_start}")
    saved_stage = meta.get("zero_stage", 0)
    if zero_stage not in _family(saved_stage):
        raise CheckpointError(
            f"checkpoint {path} was saved with ZeRO stage {saved_stage}, this run has parallel.zero_stage={zero_stage}; "
            f"DeepSpeed cannot load ZeRO {saved_stage} optimizer states into ZeRO {zero_stage} (only 1 <-> 2 convert). "
            f"Resume with parallel.zero_stage={saved_stage}, or {warm_start}"
        )
    saved_precision = meta.get("precision", precision)
    if saved_precision != precision:
        # DeepSpeed keeps other optimizer states per precision (bf16: its own fp32 master copies
        # and files; fp32 ZeRO 0: none); it fails with a KeyError or a missing file otherwise.
        raise CheckpointError(
            f"checkpoint {path} was saved with train.precision={saved_precision}, this run has {precision}; DeepSpeed "
            f"cannot load {saved_precision} optimizer states into a {precision} run. Resume with "
            f"train.precision={saved_precision}, or {warm_start}"
        )
