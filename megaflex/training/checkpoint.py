"""Atomic DeepSpeed checkpoints with everything exact resume needs.

The file layout (tags, ``latest``, metadata, RNG files, checksums) belongs to
``megaflex.checkpoint_layout``; this module drives DeepSpeed through it.

Commit protocol: every rank writes into ``.tmp-<tag>``; the ranks hash a share of the files each
(size and SHA-256, gathered); rank 0 writes them into the metadata, renames the folder to ``<tag>`` and then replaces
``latest`` via write-to-temp + ``os.replace``; a barrier. A crash at any point leaves the
previous tag and ``latest`` untouched; a failed write (e.g. a full disk) removes the temp
folder and raises ``CheckpointError``. The directory must be on a file system all ranks share
(as DeepSpeed itself requires for multi-node checkpoints).

Resume verifies the recorded checksums before DeepSpeed reads anything (the files are split
over the ranks, so each reads only its share); ``resume=auto`` falls back to the newest
checkpoint that verifies, an explicit tag fails naming the bad file.
"""

from __future__ import annotations

import random
import shutil
import signal
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist

from megaflex.checkpoint_layout import (  # noqa: F401  (re-exported for callers of this module)
    FILES_KEY,
    META_FILE,
    CheckpointError,
    CorruptCheckpointError,
    auto_candidates,
    check_writable,
    complete_tags,
    convert_to_universal,
    data_file_names,
    directory_size,
    file_manifest,
    find_resume_path,
    fsync_dir,
    fsync_tree,
    is_out_of_space,
    prune_universal,
    read_latest,
    read_meta,
    resolve_tag,
    rng_file,
    stale_tmp_dirs,
    tag_for,
    tmp_dir,
    universal_dir,
    verify_files,
    write_latest,
    write_meta,
)
from megaflex.parallel import comm


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


def zero_partitions(meta: dict[str, Any]) -> int:
    """The DP x CP count a checkpoint's ZeRO states are partitioned over (CP: 1 before it existed)."""
    return meta["data_parallel_size"] * meta.get("context_parallel_size", 1)


def needs_repartition(meta: dict[str, Any], path: Path, zero_stage: int, dp_size: int, cp_size: int, tp_size: int,
                      universal_allowed: bool) -> bool:
    """Whether resuming ``path`` needs its ZeRO optimizer states repartitioned over another DP x CP
    count (through the universal copy); a ``CheckpointError`` naming both counts and the ways out
    when that is not supported. ZeRO 0 states are whole on every rank: never needed."""
    saved_stage, saved, current = meta.get("zero_stage", 0), zero_partitions(meta), dp_size * cp_size
    if saved_stage == 0 or saved == current:
        return False
    saved_text = f"DP {meta['data_parallel_size']} x CP {meta.get('context_parallel_size', 1)} = {saved}"
    reason = None
    if not universal_allowed:
        reason = "checkpoint.zero_universal_resume is off"
    elif zero_stage == 0 or (saved_stage == 3) != (zero_stage == 3):
        reason = (f"the universal copy loads ZeRO 1/2 into ZeRO 1/2 and ZeRO 3 into ZeRO 3 only (saved at ZeRO "
                  f"{saved_stage}, this run ZeRO {zero_stage})")
    elif tp_size != 1:
        reason = f"the universal copy needs tensor_parallel_size 1 (this run {tp_size}); megaflex records no TP slicing for it"
    if reason is None:
        return True
    raise CheckpointError(
        f"checkpoint {path} holds ZeRO {saved_stage} optimizer states partitioned over {saved_text} ranks, this run "
        f"has DP {dp_size} x CP {cp_size} = {current}, and {reason}. Resume with a DP x CP product of {saved} (any CP "
        f"size whose DP x CP is {saved}), or train with parallel.zero_stage=0 (whole states on every rank) when the "
        "world is to change, or (TP 1, the saved ZeRO stage's family) set checkpoint.zero_universal_resume=true"
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
        tmp = tmp_dir(self.ckpt_dir, tag)
        if self.rank == 0:
            self.ckpt_dir.mkdir(parents=True, exist_ok=True)
            if tmp.exists():
                shutil.rmtree(tmp)  # leftovers of an interrupted save of the same step
        _barrier()
        # DeepSpeed's own barriers stop the other ranks when one fails inside save_checkpoint
        # (its exception ends the process; gloo/nccl then fail the peers' collectives).
        self._guarded(iteration, tmp, lambda: engine.save_checkpoint(str(self.ckpt_dir), tag=tmp.name, save_latest=False))
        # From here every rank is past DeepSpeed's barrier: failures are agreed on collectively.
        self._agreed(iteration, tmp, lambda: _save_rng(rng_file(tmp, self.rank), tp_tracker), every_rank=True)
        files = self._manifest(tmp)  # every rank hashes a share of the files
        self._agreed(iteration, tmp, lambda: (write_meta(tmp, meta, files), fsync_tree(tmp)), every_rank=False)
        if self.before_commit is not None:
            self.before_commit(iteration)
        final = self.ckpt_dir / tag
        if self.rank == 0:
            if final.exists():  # re-saving the same step (e.g. signal right after a periodic save)
                shutil.rmtree(final)
            tmp.rename(final)
            write_latest(self.ckpt_dir, tag)
            self._prune(keep=tag)
        _barrier()
        return final

    def _guarded(self, iteration: int, tmp: Path, write: Callable[[], Any]) -> None:
        try:
            write()
        except Exception as e:
            raise self._save_failed(iteration, tmp, e) from e

    def _agreed(self, iteration: int, tmp: Path, write: Callable[[], Any], every_rank: bool) -> None:
        error = None
        if every_rank or self.rank == 0:
            try:
                write()
            except Exception as e:
                error = e
        if _any_rank(error is not None):
            raise self._save_failed(iteration, tmp, error)

    def _manifest(self, tmp: Path) -> dict[str, dict[str, Any]]:
        """Collective. Sizes and SHA-256 sums of the written files; each rank hashes every
        world-size-th file and the parts are gathered."""
        world = dist.get_world_size() if _distributed() else 1
        part = file_manifest(tmp, data_file_names(tmp)[self.rank::world])
        if world == 1:
            return part
        parts = comm.all_gather_objects(part, comm.world_group())
        return {name: entry for p in parts for name, entry in sorted(p.items())}

    def _save_failed(self, iteration: int, tmp: Path, error: BaseException | None) -> CheckpointError:
        """Remove the partial save; a CheckpointError that says why (disk full named as such)."""
        full = error is not None and is_out_of_space(error, self.ckpt_dir)  # before freeing space
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            kept = read_latest(self.ckpt_dir)
        except CorruptCheckpointError:
            kept = None
        kept_text = f"the previous checkpoint {self.ckpt_dir / kept} is kept" if kept else "no earlier checkpoint exists"
        if full:
            reason = f"no space left on {self.ckpt_dir}"
        elif error is None:
            reason = f"another rank failed to write to {self.ckpt_dir}"
        else:
            reason = f"writing to {self.ckpt_dir} failed: {type(error).__name__}: {error}"
        return CheckpointError(f"saving the checkpoint of step {iteration} failed: {reason}; removed the partial "
                               f"{tmp.name}; {kept_text}. Free space (or set checkpoint.dir) and resume with --resume auto")

    def select_resume(self, resume: str, warn: Callable[[str], None]) -> tuple[Path | None, dict[str, Any] | None]:
        """Collective. The checkpoint to resume from (and its metadata), checksums verified.

        ``auto``: the newest one that verifies, loudly warning about each corrupt newer one; if
        checkpoints exist but none verifies, that is an error (never a silent fresh start)."""
        if resume == "none":
            return None, None
        if resume != "auto":
            path = resolve_tag(self.ckpt_dir, resume)
            return path, self._verified(path)
        corrupt: list[str] = []
        for path in auto_candidates(self.ckpt_dir):
            try:
                meta = self._verified(path)
            except CorruptCheckpointError as e:
                corrupt.append(str(e))
                warn(f"WARNING: {'!' * 60}\nWARNING: skipping checkpoint {path}: {e}\nWARNING: {'!' * 60}")
                continue
            if corrupt:
                warn(f"WARNING: resuming from the OLDER checkpoint {path} because {len(corrupt)} newer one(s) are corrupt")
            return path, meta
        if corrupt:
            raise CheckpointError(f"no checkpoint in {self.ckpt_dir} is intact: " + "; ".join(corrupt)
                                  + ". Delete them (or set checkpoint.resume=none) to start over")
        return None, None

    def _verified(self, path: Path) -> dict[str, Any]:
        """Collective. Metadata of ``path`` after every recorded file's size and SHA-256 are checked;
        each rank hashes its share of the files and the problems are gathered on all ranks."""
        meta = read_meta(path)
        world = dist.get_world_size() if _distributed() else 1
        names = sorted(meta.get(FILES_KEY) or {})
        problems = verify_files(path, meta, names[self.rank::world])
        if world > 1:
            gathered = comm.all_gather_objects(problems, comm.world_group())
            problems = sorted(p for part in gathered for p in part)
        if problems:
            more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
            raise CorruptCheckpointError(f"corrupt checkpoint file {problems[0]}{more}")
        return meta

    def universal_copy(self, path: Path) -> Path:
        """Collective. The universal copy of the ZeRO 1, 2 or 3 checkpoint ``path`` (beside it, in
        ``universal/<tag>``), converted by rank 0 on first use; it loads into the same ZeRO family
        (1/2 into 1/2, 3 into 3) at TP 1 only (``needs_repartition`` rejects the rest)."""
        out = universal_dir(path.parent, path.name)
        error = None
        if self.rank == 0:
            try:
                convert_to_universal(path, out)
            except Exception as e:
                error = e
        if _any_rank(error is not None):
            why = f"{type(error).__name__}: {error}" if error is not None else "rank 0 failed"
            raise CheckpointError(f"converting checkpoint {path} to DeepSpeed's universal form in {out} failed: {why}")
        return out

    def load(self, engine: Any, path: Path, tp_tracker: Any | None, load_rng: bool,
             universal: Path | None = None) -> dict[str, Any]:
        """Collective. Load engine + optimizer states from ``path`` (or its ``universal`` copy: the
        engine was then built with ``checkpoint.load_universal``); returns its metadata.

        RNG states are restored when ``load_rng`` and this rank has a file (same world size)."""
        source = universal or path
        # DeepSpeed 0.19's ZeRO 3 universal load copies param group 0's settings (weight decay,
        # lr_multiplier, ...) into every group (they are this run's configuration, not state: kept)
        # and gives every group one shared Adam step tensor (torch increments it in place: unshared).
        settings = [{k: v for k, v in g.items() if k != "params"} for g in engine.optimizer.param_groups]
        try:
            load_path, _ = engine.load_checkpoint(
                str(source.parent), tag=source.name, load_optimizer_states=True, load_lr_scheduler_states=False
            )
            if universal is not None:
                for group, own in zip(engine.optimizer.param_groups, settings):
                    group.update(own)
                base = getattr(engine.optimizer, "optimizer", engine.optimizer)
                for state in base.state.values():
                    if torch.is_tensor(state.get("step")):
                        state["step"] = state["step"].clone()
        except Exception as e:
            raise CheckpointError(f"DeepSpeed could not read the checkpoint {path}: {type(e).__name__}: {e}") from e
        if load_path is None:
            raise CheckpointError(f"DeepSpeed could not load the checkpoint at {path}")
        rng = rng_file(path, self.rank)
        if load_rng and rng.is_file():
            try:
                state = torch.load(rng, weights_only=False)
            except Exception as e:
                raise CorruptCheckpointError(f"corrupt checkpoint file {rng}: {type(e).__name__}: {e}") from e
            set_rng_state(state, tp_tracker)
        return read_meta(path)

    def _prune(self, keep: str) -> None:
        tags = complete_tags(self.ckpt_dir)
        for tag in tags[: max(0, len(tags) - self.keep_last)]:
            if tag != keep:
                shutil.rmtree(self.ckpt_dir / tag, ignore_errors=True)
        for stale in stale_tmp_dirs(self.ckpt_dir):
            shutil.rmtree(stale, ignore_errors=True)
        prune_universal(self.ckpt_dir)


def _save_rng(path: Path, tp_tracker: Any | None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(rng_state(tp_tracker), path)


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _barrier() -> None:
    if _distributed():
        dist.barrier()


def _any_rank(flag: bool) -> bool:
    return comm.any_rank(flag, comm.world_group())


def preflight(ckpt_dir: Path, num_params: int) -> str | None:
    """Before the first step: fail now (``CheckpointError``) when ``ckpt_dir`` is not writable,
    rather than at the first save; a warning when the free space looks too small for a save
    (the newest checkpoint's size, else ~16 bytes per parameter: fp32 weights, Adam moments,
    fp32 master copy)."""
    free = check_writable(ckpt_dir)
    tags = complete_tags(ckpt_dir)
    need = directory_size(ckpt_dir / tags[-1]) if tags else 16 * num_params
    if free < need:
        return (f"WARNING: only {free / 2**20:.1f} MiB free on {ckpt_dir}, a checkpoint needs about "
                f"{need / 2**20:.1f} MiB: saves will fail with 'no space left'")
    return None


# ------------------------------------------------------------------------------- stop requests
class SignalFlag:
    """Set on SIGTERM/SIGINT/SIGUSR1 (preemption, Ctrl-C) or when the deepspeed launcher that
    started this rank dies: the trainer saves after the current step and exits.

    The launcher watch covers a killed ``deepspeed`` runner, which does not forward signals to
    its ranks on one node: the ranks would be orphaned and train on unsaved."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)

    def __init__(self, enabled: bool, watch_launcher: bool = True, poll_s: float = 1.0) -> None:
        self.signum: int | None = None
        if not enabled:
            return
        for sig in self.SIGNALS:
            signal.signal(sig, self._handle)
        launchers = _launcher_processes() if watch_launcher else []
        if launchers:
            threading.Thread(target=self._watch, args=(launchers, poll_s), daemon=True, name="launcher-watch").start()

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signum is None:
            print(f"received {signal.Signals(signum).name}: saving a checkpoint after this step, then exiting",
                  file=sys.stderr, flush=True)
        self.signum = signum

    def _watch(self, launchers: list[Any], poll_s: float) -> None:
        import time

        while self.signum is None:
            gone = [p for p in launchers if not _alive(p)]
            if gone:
                print(f"the deepspeed launcher (pid {gone[0].pid}) is gone: saving a checkpoint after this step, then "
                      "exiting", file=sys.stderr, flush=True)
                self.signum = int(signal.SIGTERM)
                return
            time.sleep(poll_s)


def _alive(process: Any) -> bool:
    import psutil

    try:  # a killed runner whose parent has not reaped it yet is a zombie: gone all the same
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _launcher_processes() -> list[Any]:
    """The deepspeed launcher processes above this rank (``deepspeed.launcher.launch`` and the
    ``deepspeed`` runner above it), or [] when not started by them."""
    try:
        import psutil  # a DeepSpeed dependency
    except ImportError:
        return []
    try:
        parent = psutil.Process().parent()
        if parent is None or "deepspeed.launcher.launch" not in " ".join(parent.cmdline()):
            return []
        chain = [parent]
        runner = parent.parent()
        if runner is not None and any("deepspeed" in part for part in runner.cmdline()[:2]):
            chain.append(runner)
        return chain
    except (psutil.Error, OSError):
        return []
