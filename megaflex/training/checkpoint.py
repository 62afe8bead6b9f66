"""Atomic DeepSpeed checkpoints with everything exact resume needs.

Layout of ``checkpoint.dir``::

    latest                     text file naming the newest complete tag (replaced by rename)
    step_00000010/             one complete checkpoint
        mp_rank_00_model_states.pt, zero_pp_rank_*_optim_states.pt, ...   (DeepSpeed engine)
        megaflex.json          iteration, consumed samples, sizes, parameter shapes, resolved config
        rng/rank_00000.pt      per-rank RNG states (python, numpy, torch, CUDA, TP tracker)
    .tmp-step_00000015/        a save in progress (or interrupted: ignored, removed by the next save)

Commit protocol: every rank writes into ``.tmp-<tag>``; a barrier; rank 0 renames the folder to
``<tag>`` and then replaces ``latest`` via write-to-temp + ``os.replace``; a barrier. A crash at
any point leaves the previous tag and ``latest`` untouched. The directory must be on a
file system all ranks share (as DeepSpeed itself requires for multi-node checkpoints).
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist

TAG_RE = re.compile(r"^step_(\d{8,})$")
TMP_PREFIX = ".tmp-"
META_FILE = "megaflex.json"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used with this run (missing, incomplete or mismatched)."""


def tag_for(iteration: int) -> str:
    return f"step_{iteration:08d}"


def complete_tags(ckpt_dir: str | Path) -> list[str]:
    """Committed tags (those with their metadata file), oldest first."""
    root = Path(ckpt_dir)
    if not root.is_dir():
        return []
    tags = [p.name for p in root.iterdir() if p.is_dir() and TAG_RE.match(p.name) and (p / META_FILE).is_file()]
    return sorted(tags, key=lambda t: int(TAG_RE.match(t).group(1)))


def find_resume_path(ckpt_dir: str | Path, resume: str) -> Path | None:
    """Resolve ``checkpoint.resume``: ``none`` -> None; ``auto`` -> newest complete tag or None;
    otherwise a checkpoint folder path or a tag inside ``ckpt_dir`` (must exist and be complete)."""
    if resume == "none":
        return None
    root = Path(ckpt_dir)
    if resume == "auto":
        pointer = root / "latest"
        if pointer.is_file():
            tag = pointer.read_text().strip()
            if (root / tag / META_FILE).is_file():
                return root / tag
        tags = complete_tags(root)  # pointer missing or stale: fall back to the newest complete
        return root / tags[-1] if tags else None
    path = Path(resume)
    if not path.is_dir():
        path = root / resume
    if not (path / META_FILE).is_file():
        raise CheckpointError(
            f"checkpoint.resume: {resume!r} is not a complete checkpoint (no {META_FILE} in {path}); "
            f"complete ones in {root}: {complete_tags(root) or 'none'}"
        )
    return path


def read_meta(path: str | Path) -> dict[str, Any]:
    with open(Path(path) / META_FILE) as f:
        return json.load(f)


# ------------------------------------------------------------------------------- RNG states
def rng_state(tp_tracker: Any | None) -> dict[str, Any]:
    """This process's RNG states (python, numpy, torch CPU, CUDA, TP tracker)."""
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
        "tp_tracker": tp_tracker.get_states() if tp_tracker is not None else None,
    }


def set_rng_state(state: dict[str, Any], tp_tracker: Any | None) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if tp_tracker is not None and state.get("tp_tracker") is not None:
        tp_tracker.set_states(state["tp_tracker"])


# ------------------------------------------------------------------------------- shapes
def parameter_shapes(model: torch.nn.Module) -> dict[str, list[int]]:
    """Name -> this rank's shape (TP shards), as recorded in and checked against checkpoints."""
    return {name: list(p.shape) for name, p in model.named_parameters()}


def check_compatible(meta: dict[str, Any], model_config: dict[str, Any], shapes: dict[str, list[int]], tp_size: int) -> None:
    """Refuse a checkpoint whose model does not match this run, naming both shapes."""
    saved_tp = meta["tensor_parallel_size"]
    if saved_tp != tp_size:
        raise CheckpointError(
            f"checkpoint has tensor_parallel_size={saved_tp}, this run {tp_size}; reshard it first "
            f"(megaflex.parallel reshard) or launch with parallel.tensor_parallel_size={saved_tp}"
        )
    saved_shapes = meta["parameter_shapes"]
    if saved_shapes != shapes:
        saved_model, mine = meta["config"]["model"], model_config
        diff = {k: (saved_model.get(k), mine.get(k)) for k in sorted(set(saved_model) | set(mine)) if saved_model.get(k) != mine.get(k)}
        names = sorted(set(saved_shapes) ^ set(shapes)) or [n for n in shapes if shapes[n] != saved_shapes[n]]
        first = names[0]
        raise CheckpointError(
            "checkpoint model shape does not match the config: "
            f"{first}: checkpoint {saved_shapes.get(first, 'absent')} vs config {shapes.get(first, 'absent')}; "
            f"model fields (checkpoint, config): {diff}"
        )


# ------------------------------------------------------------------------------- manager
@dataclass
class CheckpointManager:
    """Save/load/prune checkpoints of one DeepSpeed engine (every rank holds one)."""

    ckpt_dir: Path
    keep_last: int
    rank: int
    # Called between "all shards written" and the commit (fault injection in tests).
    before_commit: Callable[[int], None] | None = None

    def save(self, engine: Any, iteration: int, meta: dict[str, Any], tp_tracker: Any | None) -> Path:
        """Collective. Write the checkpoint of ``iteration`` and commit it atomically."""
        tag = tag_for(iteration)
        tmp_tag = TMP_PREFIX + tag
        tmp = self.ckpt_dir / tmp_tag
        if self.rank == 0:
            self.ckpt_dir.mkdir(parents=True, exist_ok=True)
            if tmp.exists():
                shutil.rmtree(tmp)  # leftovers of an interrupted save of the same step
        _barrier()
        engine.save_checkpoint(str(self.ckpt_dir), tag=tmp_tag, save_latest=False)
        (tmp / "rng").mkdir(parents=True, exist_ok=True)
        torch.save(rng_state(tp_tracker), tmp / "rng" / f"rank_{self.rank:05d}.pt")
        if self.rank == 0:
            _write_atomic(tmp / META_FILE, json.dumps(meta, indent=1))
        _barrier()
        if self.rank == 0:
            _fsync_tree(tmp)  # all shards reach the disk before the commit can
        if self.before_commit is not None:
            self.before_commit(iteration)
        final = self.ckpt_dir / tag
        if self.rank == 0:
            if final.exists():  # re-saving the same step (e.g. signal right after a periodic save)
                shutil.rmtree(final)
            os.rename(tmp, final)
            _write_atomic(self.ckpt_dir / "latest", tag + "\n")
            _fsync_dir(self.ckpt_dir)
            self._prune(keep=tag)
        _barrier()
        return final

    def load(self, engine: Any, path: Path, tp_tracker: Any | None, load_rng: bool) -> dict[str, Any]:
        """Collective. Load engine + optimizer states from ``path``; returns its metadata.

        RNG states are restored when ``load_rng`` and this rank has a file (same world size)."""
        load_path, _ = engine.load_checkpoint(
            str(path.parent), tag=path.name, load_optimizer_states=True, load_lr_scheduler_states=False
        )
        if load_path is None:
            raise CheckpointError(f"DeepSpeed could not load the checkpoint at {path}")
        rng_file = path / "rng" / f"rank_{self.rank:05d}.pt"
        if load_rng and rng_file.is_file():
            set_rng_state(torch.load(rng_file, weights_only=False), tp_tracker)
        return read_meta(path)

    def _prune(self, keep: str) -> None:
        tags = complete_tags(self.ckpt_dir)
        for tag in tags[: max(0, len(tags) - self.keep_last)]:
            if tag != keep:
                shutil.rmtree(self.ckpt_dir / tag, ignore_errors=True)
        for stale in self.ckpt_dir.glob(TMP_PREFIX + "*"):
            shutil.rmtree(stale, ignore_errors=True)


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    """Flush every file of a checkpoint so a power loss after the commit cannot lose them."""
    for path in [*root.rglob("*"), root]:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


class SignalFlag:
    """Set on SIGTERM/SIGUSR1 (preemption): the trainer saves after the current step and exits."""

    def __init__(self, enabled: bool) -> None:
        self.signum: int | None = None
        if enabled:
            for sig in (signal.SIGTERM, signal.SIGUSR1):
                signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        self.signum = signum
