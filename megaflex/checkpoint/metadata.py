"""``CheckpointMeta``: the typed form of a checkpoint's ``megaflex.json``.

One record serves every writer: ``megaflex-train`` (every field), and the weights-only writers
(``megaflex-export --from-hf``, resharding, the LoRA-merged weights of ``megaflex-distill``), which
leave the training-state fields unset. The JSON is the one written before this class existed:

* a field that is ``None`` is not written, except ``tokenizer`` and ``init_from`` of a training
  checkpoint (one with ``deepspeed_config``) built here, which record "none" as ``null``; metadata
  read from disk writes back exactly the nulls it had (old checkpoints have neither key);
* keys this class does not know are kept in ``extra`` and written back unchanged;
* ``files`` (the per-file checksums, ``layout.FILES_KEY``) is filled in by ``layout.write_meta``.

Older checkpoints lack ``context_parallel_size`` (CP 1), ``optimizer_groups`` (decay/no_decay),
``nonfinite_total`` and ``files``; the accessors below give their meaning.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megaflex.checkpoint.layout import FILES_KEY, read_meta
from megaflex.model.config import LEGACY_MODEL_FIELDS

# Recorded as null (not left out) in training checkpoints: "no tokenizer", "no warm start".
_NULL_IN_TRAINING = ("tokenizer", "init_from")
# Optimizer param groups of checkpoints written before the kernel LR groups existed.
LEGACY_OPTIMIZER_GROUPS = ["decay", "no_decay"]


@dataclass
class CheckpointMeta:
    """What a checkpoint records beside its tensors (``megaflex.json``)."""

    iteration: int = 0
    consumed_samples: int | None = None
    nonfinite_total: int | None = None
    world_size: int | None = None
    tensor_parallel_size: int = 1
    data_parallel_size: int | None = None
    context_parallel_size: int | None = None
    pipeline_parallel_size: int | None = None  # written only when > 1 (per-stage DeepSpeed files)
    zero_stage: int | None = None
    precision: str | None = None
    parameter_shapes: dict[str, list[int]] | None = None  # per TP rank (TP shards)
    num_parameters: int | None = None
    config: dict[str, Any] = field(default_factory=dict)  # the resolved run config; "model" builds the GPT
    deepspeed_config: dict[str, Any] | None = None  # only megaflex-train writes it: engine state to resume
    optimizer_groups: list[str] | None = None
    sampler: dict[str, Any] | None = None
    tokenizer: dict[str, Any] | None = None  # megaflex.data.card record of the training tokenizer
    init_from: dict[str, Any] | None = None  # the warm start of a fresh run (checkpoint.init_from)
    source: str | None = None  # who wrote a weights-only checkpoint (e.g. megaflex-export --from-hf)
    resharded_from: int | None = None  # the TP size a resharded copy was cut from
    lora_merged: bool | None = None  # LoRA adapters merged into the weights (megaflex-distill)
    extra: dict[str, Any] = field(default_factory=dict)  # keys this version does not know
    files: dict[str, dict[str, Any]] | None = None  # {relative path: {"size", "sha256"}}
    # Keys that were null in the JSON this was read from (None: built here, not read).
    read_nulls: frozenset[str] | None = field(default=None, repr=False, compare=False)

    # ------------------------------------------------------------------ JSON
    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "CheckpointMeta":
        names = {f.name for f in dataclasses.fields(cls)} - {"extra", "read_nulls"}
        known = {k: v for k, v in data.items() if k in names}
        nulls = frozenset(k for k, v in known.items() if v is None)
        return cls(**known, extra={k: v for k, v in data.items() if k not in names}, read_nulls=nulls)

    def to_dict(self) -> dict[str, Any]:
        """The ``megaflex.json`` object (see the module docstring for which keys are written)."""
        if self.read_nulls is not None:
            nulls = self.read_nulls
        else:
            nulls = frozenset(_NULL_IN_TRAINING) if self.is_training_checkpoint else frozenset()
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            if f.name in ("extra", "read_nulls", FILES_KEY):
                continue
            value = getattr(self, f.name)
            if value is not None or f.name in nulls:
                out[f.name] = value
        out.update(self.extra)
        if self.files is not None:
            out[FILES_KEY] = self.files
        return out

    @classmethod
    def read(cls, tag_dir: str | Path) -> "CheckpointMeta":
        """The metadata of the checkpoint folder ``tag_dir`` (``layout.read_meta``'s errors)."""
        return cls.from_dict(read_meta(tag_dir))

    # ------------------------------------------------------------------ meaning of absent fields
    @property
    def is_training_checkpoint(self) -> bool:
        """Whether it holds engine and optimizer state to resume (written by megaflex-train)."""
        return self.deepspeed_config is not None

    @property
    def model_config(self) -> dict[str, Any]:
        """The saved model fields. A window hybrid saved before ``window_mixing`` existed is the gated
        blend (the only window hybrid then), not today's default one-normaliser form; a model saved
        without ``normalization`` was trained with "rms", not today's default "capped_denominator";
        one without a field of ``LEGACY_MODEL_FIELDS`` with that field's value then."""
        model = self.config["model"]
        if model.get("softmax_window") and "window_mixing" not in model:
            model = {**model, "window_mixing": "gated"}
        return {**LEGACY_MODEL_FIELDS, **model}

    @property
    def cp_size(self) -> int:
        return self.context_parallel_size or 1  # 1 before context parallelism existed

    @property
    def pp_size(self) -> int:
        return self.pipeline_parallel_size or 1  # 1 when not recorded

    @property
    def zero_partitions(self) -> int:
        """The DP x CP count its ZeRO states are partitioned over."""
        return (self.data_parallel_size or 1) * self.cp_size

    @property
    def param_groups(self) -> list[str]:
        return self.optimizer_groups if self.optimizer_groups is not None else LEGACY_OPTIMIZER_GROUPS
