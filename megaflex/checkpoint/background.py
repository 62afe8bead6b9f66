"""Checkpoint writes off the training step (``checkpoint.background``): host copies, written by a thread.

``capture_engine_files`` runs DeepSpeed's own ``save_checkpoint`` with its checkpoint engine
swapped for ``HostCopyEngine``, which keeps a host-memory copy of every state dict DeepSpeed
would write instead of writing it. ``BackgroundWrite`` then writes those copies through the
original engine (same serialization, same bytes as a synchronous save), fsyncs and hashes them on
a thread while training goes on. The commit (metadata, rename, ``latest``) stays with
``megaflex.checkpoint.manager``, on the main thread.

Why not DeepSpeed 0.19's ``DecoupledCheckpointEngine``: on CPU/gloo it fails for ZeRO 1 and 2
(``Cowardly refusing to serialize non-leaf tensor which requires_grad`` when the optimizer state is
put on its queue) and without an mpu (``'UniversalParallelInfo' object has no attribute 'dp_rank'``);
where it runs it shares the live tensors with its subprocess, so it blocks the next optimizer step
until the write ends (overlap: one forward/backward), and its spawned writer dies on the SIGTERM a
scheduler sends to every process, taking the write in flight with it.
"""

from __future__ import annotations

import copy
import os
import sys
import threading
from pathlib import Path
from typing import Any, Callable

import torch

from megaflex.checkpoint.layout import file_manifest, fsync_path

HostFile = tuple[Path, Any]  # (path, host copy of the state DeepSpeed saves there)


def host_copy(obj: Any) -> Any:
    """A copy of ``obj`` whose tensors live in fresh host memory and which pickles exactly as ``obj``
    did when it was taken: storages shared by several tensors (views) stay shared, and an object
    reached twice (a tensor, or the ``betas`` tuple every optimizer param group holds) is one copy,
    so ``torch.save`` writes the same bytes."""
    return _HostCopier().copy(obj)


class _HostCopier:
    def __init__(self) -> None:
        self.objects: dict[int, Any] = {}  # id of an original -> its copy (the originals stay alive meanwhile)
        self.storages: dict[int, torch.UntypedStorage] = {}  # a storage's identity, as torch.save tells them apart

    def copy(self, obj: Any) -> Any:
        if id(obj) in self.objects:
            return self.objects[id(obj)]
        if isinstance(obj, torch.Tensor):
            out = self._tensor(obj)
        elif isinstance(obj, dict):
            out = self.objects[id(obj)] = copy.copy(obj)  # keeps the type (OrderedDict, defaultdict's factory)
            for key, value in obj.items():
                out[key] = self.copy(value)
        elif isinstance(obj, list):
            out = self.objects[id(obj)] = []
            out.extend(self.copy(v) for v in obj)
        elif isinstance(obj, tuple):
            values = [self.copy(v) for v in obj]
            out = type(obj)(*values) if hasattr(obj, "_fields") else type(obj)(values)
        else:
            out = copy.deepcopy(obj)  # numbers and strings are returned as they are
        self.objects[id(obj)] = out
        return out

    def _tensor(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        host = self.storages.get(storage._cdata)
        if host is None:
            host = self.storages[storage._cdata] = storage.clone() if storage.device.type == "cpu" else storage.cpu()
        out = torch.empty((0,), dtype=t.dtype).set_(host, t.storage_offset(), t.size(), t.stride())
        if isinstance(t, torch.nn.Parameter):
            out = torch.nn.Parameter(out, requires_grad=t.requires_grad)
        else:
            out.requires_grad_(t.requires_grad)  # torch.save records the flag
        if t.__dict__:  # Python attributes (e.g. ZeRO 3's ds_id on its flat partitions) are pickled too
            out.__dict__.update(self.copy(t.__dict__))
        return out


class HostCopyEngine:
    """Stands in for a DeepSpeed checkpoint engine during one ``save_checkpoint``: ``save`` records a
    host copy of the state dict and its path; directories are made, loads delegated, as before."""

    def __init__(self, original: Any) -> None:
        self.original = original
        self.files: list[HostFile] = []

    def save(self, state_dict: Any, path: str) -> None:
        self.files.append((Path(path), host_copy(state_dict)))

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        self.original.makedirs(path, exist_ok=exist_ok)

    def __getattr__(self, name: str) -> Any:  # create, commit, load, is_decoupled, preserves_storage_sharing, ...
        return getattr(self.original, name)


def capture_engine_files(engine: Any, save_dir: Path, tag: str) -> tuple[Any, list[HostFile]]:
    """Collective. DeepSpeed's ``save_checkpoint`` of ``engine`` into ``save_dir/tag`` with every state
    dict copied to host memory instead of written (files DeepSpeed copies itself, e.g. its
    ``zero_to_fp32.py``, are written as usual). Returns (the engine's checkpoint engine, the copies)."""
    original = engine.checkpoint_engine
    capture = HostCopyEngine(original)
    engine.checkpoint_engine = capture
    try:
        engine.save_checkpoint(str(save_dir), tag=tag, save_latest=False)
    finally:
        engine.checkpoint_engine = original
    return original, capture.files


class BackgroundWrite:
    """A thread that writes ``files`` (host copies) with ``writer.save(obj, path)``, fsyncs each, then
    hashes them: ``manifest`` ({path relative to ``root``: size and SHA-256}) once ``done``, or
    ``error``. ``after_first_file(iteration)`` runs on the thread once the first file is written
    (fault injection: a signal or kill -9 in the middle of the write)."""

    def __init__(self, iteration: int, root: Path, files: list[HostFile], writer: Any,
                 after_first_file: Callable[[int], None] | None = None) -> None:
        self.iteration, self.root = iteration, root
        self.manifest: dict[str, dict[str, Any]] = {}
        self.error: BaseException | None = None
        self._files, self._writer, self._after_first_file = files, writer, after_first_file
        # A daemon: a run that fails for another reason exits without waiting for an abandoned write.
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"checkpoint-writer-{iteration}")
        self._thread.start()

    def _run(self) -> None:
        _lowest_cpu_priority()
        files, self._files = self._files, []
        try:
            names: list[str] = []
            while files:
                path, obj = files.pop(0)
                path.parent.mkdir(parents=True, exist_ok=True)
                self._writer.save(obj, str(path))
                del obj  # each host copy is freed once written
                fsync_path(path)
                names.append(path.relative_to(self.root).as_posix())
                if len(names) == 1 and self._after_first_file is not None:
                    self._after_first_file(self.iteration)
            self.manifest = file_manifest(self.root, names)
        except BaseException as e:  # reported to every rank by the manager's next agreement
            self.error = e

    @property
    def done(self) -> bool:
        return not self._thread.is_alive()

    def wait(self) -> None:
        self._thread.join()


def _lowest_cpu_priority() -> None:
    """Run this thread (and the hashing threads it starts, which inherit it) at nice 19, so the write
    takes only CPU time the training step leaves idle: on a 2-core machine at normal priority its
    SHA-256 slowed the overlapping steps by about as much as the save no longer stalled them.
    Linux only (there a thread has its own nice value; elsewhere the call would renice a process)."""
    if sys.platform.startswith("linux"):
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        except OSError:
            pass  # not permitted: normal priority
