"""One live run per run directory: ``<logging.run_dir>/run.lock``.

Global rank 0 creates the lock file (``O_EXCL``) holding its pid, host, the pid's start time and
the start date before anything else is written to the run directory; the other ranks learn the
outcome through a broadcast, so every rank of a refused run exits with the same config error
naming the holder. A lock whose process is gone (same host: no such pid, or the pid now belongs
to a process started later) is stale: it is taken over with a warning. A lock from another host
cannot be checked from here: the message says to delete it if that run is over. The lock is
removed when the run ends (``release_held``, also at interpreter exit); kill -9 leaves it stale.
"""

from __future__ import annotations

import atexit
import json
import os
import socket
import time
from pathlib import Path
from typing import Callable

import torch.distributed as dist

from megaflex.parallel import comm

from megaflex.training.config_loader import ConfigError

LOCK_FILE = "run.lock"
_held: list[Path] = []  # lock files this process holds


def _start_time(pid: int) -> str | None:
    """Start time of ``pid`` in clock ticks since boot (Linux ``/proc``), None when unknown."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]  # field 22 of proc(5); the name may contain spaces


def _alive(pid: int, started: str | None) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, another user's
    now = _start_time(pid)
    return started is None or now is None or now == started


def _record() -> dict[str, object]:
    return {"pid": os.getpid(), "host": socket.gethostname(), "pid_start": _start_time(os.getpid()),
            "started": time.strftime("%Y-%m-%d %H:%M:%S")}


def _holder_text(info: dict) -> str:
    return f"pid {info.get('pid')} on host {info.get('host')} (started {info.get('started')})"


def acquire(run_dir: Path, warn: Callable[[str], None]) -> None:
    """Take ``run_dir``'s lock for this process (``ConfigError`` naming the live holder, or
    saying the directory cannot be written: the lock is the run's first write there)."""
    path = run_dir / LOCK_FILE
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise _unwritable(run_dir, e) from None
    mine = _record()
    for _ in range(3):  # a stale lock removed by a racing run: try again
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666)
        except FileExistsError:
            pass
        except OSError as e:  # read-only file system, no permission (as root too: EROFS)
            raise _unwritable(run_dir, e) from None
        else:
            with os.fdopen(fd, "w") as f:
                json.dump(mine, f)
            _hold(path)
            return
        try:
            info = json.loads(path.read_text())
            pid = int(info["pid"])
        except FileNotFoundError:
            continue
        except (OSError, ValueError, KeyError, TypeError):
            raise ConfigError(f"logging.run_dir {run_dir}: unreadable lock file {path} (another run is starting, or it "
                              "was damaged); delete it if no run uses this directory") from None
        same_host = info.get("host") == mine["host"]
        if same_host and pid == os.getpid():
            _hold(path)  # this process's own earlier run
            return
        if same_host and not _alive(pid, info.get("pid_start")):
            warn(f"WARNING: taking over the stale lock {path} of {_holder_text(info)}: that process is gone")
            path.unlink(missing_ok=True)
            continue
        hint = "" if same_host else "; if that run is over (its host cannot be checked from here), delete the lock file"
        raise ConfigError(f"logging.run_dir {run_dir} is in use by a live run: {_holder_text(info)} holds {path}; "
                          f"use another logging.run_dir or stop that run{hint}")
    raise ConfigError(f"logging.run_dir {run_dir}: could not take the lock {path} (other runs keep taking it)")


def _unwritable(run_dir: Path, err: OSError) -> ConfigError:
    return ConfigError(f"logging.run_dir {run_dir} is not writable: {err.strerror or err}; "
                       "set logging.run_dir to a folder this user can write")


def _hold(path: Path) -> None:
    if path not in _held:
        _held.append(path)


def release_held() -> None:
    """Remove the lock files this process holds (when they still name it)."""
    while _held:
        path = _held.pop()
        try:
            if json.loads(path.read_text()).get("pid") == os.getpid():
                path.unlink()
        except (OSError, ValueError):
            pass


atexit.register(release_held)


def hold_run_lock(run_dir: Path, warn: Callable[[str], None] = print) -> None:
    """Collective. Global rank 0 takes ``run_dir``'s lock; every rank raises the same
    ``ConfigError`` when it is held by another live run."""
    error = None
    if not dist.is_initialized() or dist.get_rank() == 0:
        try:
            acquire(run_dir, warn)
        except ConfigError as e:
            error = str(e)
    error = comm.all_gather_objects(error, comm.world_group())[0]  # rank 0's verdict, on every rank
    if error is not None:
        raise ConfigError(error)
