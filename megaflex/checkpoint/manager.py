"""Atomic DeepSpeed checkpoints with everything exact resume needs.

The file layout (tags, ``latest``, metadata, RNG files, checksums) belongs to
``megaflex.checkpoint.layout``; this module drives DeepSpeed through it. ``select_checkpoint``
is the one place that decides which checkpoint a run resumes from (or an evaluation reads).

Commit protocol: every rank writes into ``.tmp-<tag>``; the ranks hash a share of the files each
(size and SHA-256, gathered); rank 0 writes them into the metadata, renames the folder to ``<tag>`` and then replaces
``latest`` via write-to-temp + ``os.replace``; a barrier. A crash at any point leaves the
previous tag and ``latest`` untouched; a failed write (e.g. a full disk) removes the temp
folder and raises ``CheckpointError``. The directory must be on a file system all ranks share
(as DeepSpeed itself requires for multi-node checkpoints).

Background saves (``checkpoint.background``, ``megaflex.checkpoint.background``): ``save`` copies
the state to host memory inside DeepSpeed's ``save_checkpoint`` and returns; a thread per rank
writes, fsyncs and hashes its files into ``.tmp-<tag>`` while training goes on; the commit above
(metadata, rename, ``latest``) runs on the main thread at the first step boundary where every rank
reports its write done (``advance``), or when ``finish`` waits for it (the next save, the end of
training, a stop signal). A crash before the commit leaves the previous tag and ``latest`` as they
were; a failed write is reported on every rank by that agreement (``CheckpointError``).

Resume verifies the recorded checksums before DeepSpeed reads anything (the files are split
over the ranks, so each reads only its share); ``resume=auto`` falls back to the newest
checkpoint that verifies, an explicit tag fails naming the bad file.

``save_weights_only`` commits a weights-only checkpoint (ZeRO 0 layout, e.g. LoRA-merged
weights) by the same protocol.
"""

from __future__ import annotations

import random
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist

from megaflex.checkpoint.background import BackgroundWrite, capture_engine_files
from megaflex.checkpoint.layout import (
    FILES_KEY,
    CheckpointError,
    CorruptCheckpointError,
    auto_candidates,
    check_writable,
    complete_tags,
    convert_to_universal,
    data_file_names,
    directory_size,
    file_manifest,
    fsync_tree,
    is_out_of_space,
    model_states_file,
    prune_universal,
    read_latest,
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
from megaflex.checkpoint.metadata import CheckpointMeta
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


# ------------------------------------------------------------------------------- manager
# What a rank reports of its background write (``CheckpointManager.writer_status``); the largest
# over the ranks is what every rank acts on (``CheckpointManager.advance``).
WRITE_DONE, WRITE_IN_FLIGHT, WRITE_FAILED = 0, 1, 2


@dataclass
class _PendingSave:
    """A background save: written by ``write``, committed with ``meta`` once every rank is done."""

    iteration: int
    tmp: Path
    meta: CheckpointMeta
    write: BackgroundWrite


@dataclass
class CheckpointManager:
    """Save/load/prune checkpoints of one DeepSpeed engine (every rank holds one).

    ``background``: ``save`` copies the state to host memory and returns; a thread writes and hashes
    the files while training goes on, and the commit follows at the first step boundary where every
    rank reports its write done (``writer_status`` rides on the step's agreed flags, ``advance``
    commits), or in ``finish``. At most one save is in flight: ``save`` first finishes the previous one."""

    ckpt_dir: Path
    keep_last: int
    rank: int
    background: bool = False
    # Called between "all shards written" and the commit (fault injection in tests).
    before_commit: Callable[[int], None] | None = None
    # Background saves: called on the writer thread once its first file is written (fault injection).
    during_write: Callable[[int], None] | None = None
    pending: _PendingSave | None = None

    def save(self, engine: Any, iteration: int, meta: CheckpointMeta, tp_tracker: Any | None) -> Path | None:
        """Collective. Write the checkpoint of ``iteration`` and commit it atomically; returns its folder.
        ``background``: start writing it (after finishing the save in flight) and return None."""
        self.finish()
        tag = tag_for(iteration)
        tmp = tmp_dir(self.ckpt_dir, tag)
        if self.rank == 0:
            self.ckpt_dir.mkdir(parents=True, exist_ok=True)
            if tmp.exists():
                shutil.rmtree(tmp)  # leftovers of an interrupted save of the same step
        _barrier()
        if self.background:
            # The host copies are the only stall; DeepSpeed's barriers inside still apply (see below).
            writer, files = self._guarded(iteration, tmp, lambda: capture_engine_files(engine, self.ckpt_dir, tmp.name))
            files.append((rng_file(tmp, self.rank), rng_state(tp_tracker)))
            self.pending = _PendingSave(iteration, tmp, meta, BackgroundWrite(iteration, tmp, files, writer, self.during_write))
            return None
        # DeepSpeed's own barriers stop the other ranks when one fails inside save_checkpoint
        # (its exception ends the process; gloo/nccl then fail the peers' collectives).
        self._guarded(iteration, tmp, lambda: engine.save_checkpoint(str(self.ckpt_dir), tag=tmp.name, save_latest=False))
        # From here every rank is past DeepSpeed's barrier: failures are agreed on collectively.
        self._agreed(iteration, tmp, lambda: _save_rng(rng_file(tmp, self.rank), tp_tracker), every_rank=True)
        files = self._manifest(tmp)  # every rank hashes a share of the files
        return self._commit(iteration, tmp, meta, files)

    def writer_status(self) -> int:
        """This rank's background write: ``WRITE_DONE`` (also: none), ``WRITE_IN_FLIGHT`` or ``WRITE_FAILED``."""
        if self.pending is None:
            return WRITE_DONE
        if not self.pending.write.done:
            return WRITE_IN_FLIGHT
        return WRITE_FAILED if self.pending.write.error is not None else WRITE_DONE

    def advance(self, agreed_status: int) -> Path | None:
        """Collective. Given the largest ``writer_status`` over the ranks: commit the save in flight once
        every rank wrote its files (returns its folder), raise ``CheckpointError`` when one failed."""
        if self.pending is None or agreed_status == WRITE_IN_FLIGHT:
            return None
        pending, self.pending = self.pending, None
        if agreed_status == WRITE_FAILED:
            raise self._save_failed(pending.iteration, pending.tmp, pending.write.error)
        # Each rank hashed the files it wrote; rank 0 hashes any other (DeepSpeed's NVMe-offload copies) in _commit.
        parts = comm.all_gather_objects(pending.write.manifest, comm.world_group())
        files = {name: entry for part in parts for name, entry in part.items()}
        return self._commit(pending.iteration, pending.tmp, pending.meta, files)

    def finish(self) -> Path | None:
        """Collective. Wait for this rank's background write, then ``advance``: the folder of the
        committed save (None when none was in flight)."""
        if self.pending is None:
            return None
        self.pending.write.wait()
        return self.advance(WRITE_FAILED if _any_rank(self.pending.write.error is not None) else WRITE_DONE)

    def _commit(self, iteration: int, tmp: Path, meta: CheckpointMeta, files: dict[str, dict[str, Any]]) -> Path:
        """Collective, every file written and hashed: the metadata, the rename into place, ``latest``."""
        def write_metadata() -> None:
            missing = sorted(set(data_file_names(tmp)) - set(files))  # background saves: written outside the engine
            write_meta(tmp, meta.to_dict(), {**files, **file_manifest(tmp, missing)} if missing else files)
            fsync_tree(tmp)

        self._agreed(iteration, tmp, write_metadata, every_rank=False)
        if self.before_commit is not None:
            self.before_commit(iteration)
        tag = tag_for(iteration)
        final = self.ckpt_dir / tag
        if self.rank == 0:
            if final.exists():  # re-saving the same step (e.g. signal right after a periodic save)
                shutil.rmtree(final)
            tmp.rename(final)
            write_latest(self.ckpt_dir, tag)
            self._prune(keep=tag)
        _barrier()
        return final

    def _guarded(self, iteration: int, tmp: Path, write: Callable[[], Any]) -> Any:
        try:
            return write()
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

    def select_resume(self, resume: str, warn: Callable[[str], None]) -> tuple[Path | None, CheckpointMeta | None]:
        """Collective. ``select_checkpoint`` with every candidate's checksums verified."""
        return select_checkpoint(self.ckpt_dir, resume, verify=self._verified, warn=warn)

    def _verified(self, path: Path) -> CheckpointMeta:
        """Collective. Metadata of ``path`` after every recorded file's size and SHA-256 are checked;
        each rank hashes its share of the files and the problems are gathered on all ranks."""
        meta = CheckpointMeta.read(path)
        world = dist.get_world_size() if _distributed() else 1
        names = sorted(meta.files or {})
        problems = verify_files(path, {FILES_KEY: meta.files}, names[self.rank::world])
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
             universal: Path | None = None) -> CheckpointMeta:
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
        return CheckpointMeta.read(path)

    def _prune(self, keep: str) -> None:
        tags = complete_tags(self.ckpt_dir)
        for tag in tags[: max(0, len(tags) - self.keep_last)]:
            if tag != keep:
                shutil.rmtree(self.ckpt_dir / tag, ignore_errors=True)
        for stale in stale_tmp_dirs(self.ckpt_dir):
            shutil.rmtree(stale, ignore_errors=True)
        prune_universal(self.ckpt_dir)


def select_checkpoint(
    ckpt_dir: str | Path, resume: str, verify: Callable[[Path], CheckpointMeta] | None = None,
    warn: Callable[[str], None] | None = None,
) -> tuple[Path | None, CheckpointMeta | None]:
    """The checkpoint ``resume`` (``checkpoint.resume``: ``none``, ``auto``, a tag or a folder) picks
    in ``ckpt_dir``, and its metadata when ``verify`` (which reads and checks a candidate) is given.

    ``auto``: the one ``latest`` names, else the newest complete tag; with ``verify``, the newest
    that verifies, loudly ``warn``-ing about each corrupt newer one, and an error when checkpoints
    exist but none verifies (never a silent fresh start). An explicit tag must be complete."""
    if resume == "none":
        return None, None
    if resume != "auto":
        path = resolve_tag(ckpt_dir, resume)
        return path, verify(path) if verify is not None else None
    corrupt: list[str] = []
    for path in auto_candidates(ckpt_dir):
        if verify is None:
            return path, None
        try:
            meta = verify(path)
        except CorruptCheckpointError as e:
            corrupt.append(str(e))
            if warn is not None:
                warn(f"WARNING: {'!' * 60}\nWARNING: skipping checkpoint {path}: {e}\nWARNING: {'!' * 60}")
            continue
        if corrupt and warn is not None:
            warn(f"WARNING: resuming from the OLDER checkpoint {path} because {len(corrupt)} newer one(s) are corrupt")
        return path, meta
    if corrupt:
        raise CheckpointError(f"no checkpoint in {ckpt_dir} is intact: " + "; ".join(corrupt)
                              + ". Delete them (or set checkpoint.resume=none) to start over")
    return None, None


def save_weights_only(root: Path, iteration: int, tp_rank: int, weights: dict[str, torch.Tensor] | None,
                      meta: CheckpointMeta | None, rank: int) -> Path:
    """Collective. Commit a weights-only checkpoint ``root/<tag>`` (ZeRO 0 layout: one model-states
    file per TP rank, ``weights`` given by one rank of each TP rank, None elsewhere) with ``meta``
    (needed on rank 0 only) by the training checkpoints' protocol: written into ``.tmp-<tag>``,
    renamed into place, then ``latest`` replaced. Returns the tag's folder."""
    tag = tag_for(iteration)
    tmp, final = tmp_dir(root, tag), root / tag
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    _barrier()
    if weights is not None:
        tmp.mkdir(parents=True, exist_ok=True)
        torch.save({"module": weights}, model_states_file(tmp, tp_rank))
    _barrier()
    if rank == 0:
        write_meta(tmp, meta.to_dict())
        fsync_tree(tmp)
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
        write_latest(root, tag)
    _barrier()
    return final


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
