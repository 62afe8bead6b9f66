"""Weights & Biases sink of the rank-0 metrics (``logging.wandb``).

    logger.add_sink(WandbSink.open(cfg.logging.wandb, run_dir, cfg.to_dict(), resuming=True))

The sink receives exactly the scalars TensorBoard gets (``metrics.ScalarSink``: ``train/loss``,
``train/lr``, ``train/mfu``, ``kernel/layer00/tau_mean``, ``valid/ppl``, ...) at their optimizer
step, and the run's resolved config. The W&B run id is kept in ``<run_dir>/wandb_run_id``: a run
that resumes from a checkpoint reopens that W&B run (``resume="allow"``), a fresh start begins a
new one. Steps logged again after resuming from an older checkpoint are below W&B's current step;
W&B keeps its first values for them (the same values: resume is bit-exact).

``wandb`` is an optional dependency (``pip install 'megaflex[wandb]'``), imported only here.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from megaflex.training.config import WandbConfig
from megaflex.training.config_loader import ConfigError

RUN_ID_FILE = "wandb_run_id"


def import_wandb() -> Any:
    """The ``wandb`` module; ConfigError naming the extra when it is not installed (the trainer
    calls this on every rank before setting anything up, so all ranks stop alike)."""
    try:
        import wandb
    except ImportError:
        raise ConfigError(
            "logging.wandb: the wandb package is not installed; pip install 'megaflex[wandb]' (or drop logging.wandb)"
        ) from None
    return wandb


class WandbSink:
    """Scalars of each logged step to a W&B run (``metrics.ScalarSink``)."""

    def __init__(self, run: Any) -> None:
        self.run = run

    @classmethod
    def open(cls, settings: WandbConfig, run_dir: Path, config: dict[str, Any], resuming: bool) -> WandbSink:
        """Start (or, when ``resuming`` and ``run_dir`` names one, continue) the W&B run of ``run_dir``."""
        wandb = import_wandb()
        id_file = Path(run_dir) / RUN_ID_FILE
        run_id = id_file.read_text().strip() if resuming and id_file.is_file() else None  # None: W&B draws one
        run = wandb.init(
            project=settings.project, entity=settings.entity, name=settings.name or Path(run_dir).resolve().name,
            mode=settings.mode, tags=list(settings.tags), config=config, id=run_id, resume="allow",
            dir=None if os.environ.get("WANDB_DIR") else str(run_dir),
        )
        id_file.write_text(f"{run.id}\n")
        return cls(run)

    def write(self, scalars: dict[str, float], step: int) -> None:
        self.run.log(scalars, step=step)

    def close(self) -> None:
        self.run.finish()
