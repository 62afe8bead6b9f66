"""``python -m module`` processes for tests, forked instead of started (not a test module).

A fresh interpreter costs ~7 CPU seconds before it runs a line of ours: importing torch (~3.5 s),
``torch._dynamo`` (~3.9 s: torch.optim's first optimizer imports it, even under
TORCHDYNAMO_DISABLE=1) and DeepSpeed. A tiny training run is mostly that. So test processes are
forked from a multiprocessing fork server that imported them once (``distributed.fork_server``)
and then run the module as ``python -m`` would: their own environment, working directory,
``sys.argv``, ``__main__``, exit code (negative for a signal), atexit handlers, and output to a file.

* ``ForkedProcess``: one such process, ``subprocess.Popen``-like (``pid``, ``poll``, ``wait``,
  ``kill``, ``returncode``); ``training_harness.launch`` starts its ranks this way.
* ``forking_process_pool``: a stand-in for a product's ``ProcessPoolExecutor`` whose workers do
  the same for their ``python -m`` children.
* ``fork_python_modules(monkeypatch)``: for a test of product code that itself starts
  ``[sys.executable, "-m", module, ...]`` (the studies' training runs, gpu_check's stages and their
  trainers): ``subprocess.run`` / ``subprocess.Popen`` fork those, and so do the forked processes
  for their own children (a direct ``os.fork``: they are single-threaded, fork-server children);
  every other command runs as before.

What forking skips is a fresh interpreter's start and teardown: tests of launchers and signals,
and ``MEGAFLEX_TEST_FRESH_PROCESSES=1``, keep fresh interpreters.
"""

from __future__ import annotations

import atexit
import io
import os
import runpy
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Sequence

from distributed import fork_server

REPO = Path(__file__).resolve().parents[2]
_REAL_RUN, _REAL_POPEN = subprocess.run, subprocess.Popen


def _become(module: str, argv: Sequence[str], env: dict[str, str], cwd: str, out: str, err: str, new_session: bool,
            nested: bool) -> None:
    """In the forked process: turn into ``python -m module *argv`` (output appended to ``out`` / ``err``)."""
    if new_session:
        os.setsid()
    for fd, path in ((1, out), (2, err)):
        target = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        os.dup2(target, fd)
        os.close(target)
    # unbuffered, as PYTHONUNBUFFERED=1 makes a fresh process: one that kills itself keeps its output
    sys.stdout = io.TextIOWrapper(open(1, "wb", buffering=0, closefd=False), write_through=True)
    sys.stderr = io.TextIOWrapper(open(2, "wb", buffering=0, closefd=False), write_through=True)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    sys.path[:0] = [cwd, *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
    sys.argv = [module, *argv]
    if nested:
        _patch_subprocess(setattr, _DirectFork)
    atexit._clear()  # the parent's handlers are not this process's
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    finally:
        atexit._run_exitfuncs()  # an interpreter's exit runs them; multiprocessing's does not


def _exit_status(code: object) -> int:
    """The exit status ``sys.exit(code)`` gives an interpreter."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


class ForkedProcess:
    """``python -m module *argv`` forked from the fork server (``distributed.fork_server``)."""

    def __init__(self, module: str, argv: Sequence[str], env: dict[str, str], log_path: str, *, cwd: str | Path = REPO,
                 err_path: str | None = None, new_session: bool = False, nested: bool = False) -> None:
        self.args = [sys.executable, "-m", module, *argv]
        self._process = fork_server().Process(
            target=_become, args=(module, list(argv), env, str(cwd), log_path, err_path or log_path, new_session, nested),
            daemon=False,
        )  # fmt: skip
        self._process.start()
        self.pid = self._process.pid

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        self._process.is_alive()  # reaps it when it has ended
        return self._process.exitcode

    def kill(self) -> None:
        self._process.kill()

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return self._process.exitcode


class _DirectFork:
    """A forked process's own ``python -m`` child: ``os.fork`` of this (single-threaded) process."""

    def __init__(self, module: str, argv: Sequence[str], env: dict[str, str], log_path: str, *, cwd: str | Path = REPO,
                 err_path: str | None = None, new_session: bool = False, nested: bool = False) -> None:
        self.args = [sys.executable, "-m", module, *argv]
        self.returncode: int | None = None
        sys.stdout.flush()
        sys.stderr.flush()
        self.pid = os.fork()
        if self.pid == 0:
            status = 1
            try:
                _become(module, argv, env, str(cwd), log_path, err_path or log_path, new_session, nested)
                status = 0
            except SystemExit as e:
                status = _exit_status(e.code)
            except BaseException:  # noqa: BLE001 - reported as an interpreter would
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(status)

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def kill(self) -> None:
        if self.returncode is None:
            os.kill(self.pid, 9)

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:  # polling: a waiter thread would make this process multi-threaded
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            time.sleep(0.02)
        return self.returncode


def _python_module(cmd: Any) -> tuple[str, list[str]] | None:
    """(module, argv) of ``[sys.executable, "-m", module, *argv]``, else None."""
    if isinstance(cmd, (list, tuple)) and len(cmd) >= 3 and cmd[0] == sys.executable and cmd[1] == "-m":
        return str(cmd[2]), [str(a) for a in cmd[3:]]
    return None


def _scratch_file() -> str:
    fd, path = tempfile.mkstemp(prefix="forked-", suffix=".log")
    os.close(fd)
    return path


def _patch_subprocess(setattr_: Any, process: type) -> None:
    """Make ``subprocess.run`` / ``subprocess.Popen`` start ``python -m`` commands as ``process``
    (output to a file object's file, or, for ``run``, captured or passed on through scratch files)."""

    def ours(cmd: Any, args: tuple, kwargs: dict) -> tuple[str, list[str]] | None:
        found = _python_module(cmd)
        if found is None or args or kwargs.get("shell") or kwargs.get("input") is not None or kwargs.get("check"):
            return None
        if process is _DirectFork and threading.active_count() > 1:
            return None  # forking a multi-threaded process is unsafe: start a real one
        return found

    def start(found: tuple[str, list[str]], out: str, err: str, kwargs: dict) -> Any:
        return process(found[0], found[1], dict(kwargs.get("env") or os.environ), out, cwd=kwargs.get("cwd") or os.getcwd(),
                       err_path=err, new_session=bool(kwargs.get("start_new_session")), nested=True)  # fmt: skip

    def file_of(stream: Any) -> str | None:
        name = getattr(stream, "name", None)
        return str(name) if isinstance(name, str) and os.path.isfile(name) else None

    def popen(cmd: Any, *args: Any, **kwargs: Any) -> Any:
        found = ours(cmd, args, kwargs)
        out = file_of(kwargs.get("stdout"))
        stderr = kwargs.get("stderr")
        err = out if stderr == subprocess.STDOUT else file_of(stderr)
        if found is None or out is None or err is None:  # pipes and inherited streams: a real process
            return _REAL_POPEN(cmd, *args, **kwargs)
        kwargs["stdout"].flush()
        return start(found, out, err, kwargs)

    def run(cmd: Any, *args: Any, **kwargs: Any) -> Any:
        found = ours(cmd, args, kwargs)
        if found is None:
            return _REAL_RUN(cmd, *args, **kwargs)
        capture = kwargs.pop("capture_output", False)
        text = kwargs.pop("text", False) or kwargs.pop("universal_newlines", False)
        timeout = kwargs.pop("timeout", None)
        stdout = subprocess.PIPE if capture else kwargs.get("stdout")
        stderr = subprocess.PIPE if capture else kwargs.get("stderr")
        out = file_of(stdout) or _scratch_file()
        err = out if stderr == subprocess.STDOUT else file_of(stderr) or _scratch_file()
        if file_of(stdout):
            stdout.flush()
        proc = start(found, out, err, kwargs)
        try:
            code = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise
        results = []
        for stream, path, sink in ((stdout, out, sys.stdout), (stderr, err, sys.stderr)):
            if file_of(stream) or stream == subprocess.STDOUT:
                results.append(None)
                continue
            data = Path(path).read_bytes()
            os.unlink(path)
            if stream == subprocess.PIPE:
                results.append(data.decode(errors="replace") if text else data)
            else:  # inherited (None) or DEVNULL
                results.append(None)
                if stream is None:
                    sink.write(data.decode(errors="replace"))
        return subprocess.CompletedProcess(cmd, code, *results)

    setattr_(subprocess, "Popen", popen)
    setattr_(subprocess, "run", run)


def _fork_children() -> None:
    _patch_subprocess(setattr, _DirectFork)


def forking_process_pool(max_workers: int | None = None, mp_context: Any = None, initializer: Any = None,
                         initargs: tuple = ()) -> Any:
    """A ``ProcessPoolExecutor`` (stand-in for product code's spawned pools) whose workers are
    fork-server children that fork their own ``python -m`` children (``initializer`` not supported)."""
    from concurrent.futures import ProcessPoolExecutor

    if os.environ.get("MEGAFLEX_TEST_FRESH_PROCESSES") == "1":
        return ProcessPoolExecutor(max_workers, mp_context=mp_context, initializer=initializer, initargs=initargs)
    if initializer is not None:
        raise NotImplementedError("forking_process_pool: the pool's initializer installs the forking subprocess")
    return ProcessPoolExecutor(max_workers, mp_context=fork_server(), initializer=_fork_children)


def fork_python_modules(monkeypatch: Any) -> None:
    """For one test: ``python -m`` commands started through ``subprocess`` are forked (module doc)."""
    if os.environ.get("MEGAFLEX_TEST_FRESH_PROCESSES") != "1":
        _patch_subprocess(monkeypatch.setattr, ForkedProcess)
