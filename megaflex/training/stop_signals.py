"""Stop requests: preemption signals and a vanished launcher make the trainer save and exit;
before the first step (``StartupStop``) the same signals end the process with one line."""

from __future__ import annotations

import os
import signal
import sys
import threading
from typing import Any, Callable

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)


class StartupStop:
    """From the start of a run until the training loop's ``SignalFlag`` takes over (``end``):
    SIGTERM/SIGINT/SIGUSR1 end the process at once with exit status 128 + signum (143 for SIGTERM,
    as their default action would), after one line saying the run stopped during start-up, before
    any step (nothing to save), and with the run lock released (``cleanup``).

    A watcher thread acts, woken through the signal wakeup fd: the main thread may be blocked in C
    for minutes (a rendezvous, a collective), where a Python handler would not run until it returns.
    """

    def __init__(self, prog: str, cleanup: Callable[[], None] = lambda: None) -> None:
        self.prog, self.cleanup = prog, cleanup
        self._lock = threading.Lock()
        self._write: int | None = None
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers belong to the main thread
        self._read, self._write = os.pipe()
        os.set_blocking(self._write, False)
        self._previous = {sig: signal.signal(sig, _noop) for sig in STOP_SIGNALS}  # the C handler writes the fd
        self._previous_fd = signal.set_wakeup_fd(self._write)
        threading.Thread(target=self._watch, daemon=True, name="startup-signals").start()

    def _watch(self) -> None:
        data = os.read(self._read, 1)  # b"" once end() closes the write end
        with self._lock:
            if data:
                self._exit(data[0])
            os.close(self._read)

    def _exit(self, signum: int) -> None:
        print(f"{self.prog}: stopped by {signal.Signals(signum).name} during start-up, before any step (nothing to "
              f"save); exit {128 + signum}", file=sys.stderr, flush=True)
        self.cleanup()
        os._exit(128 + signum)

    def end(self, restore: bool = True) -> None:
        """Stop watching (idempotent); ``restore``: the handlers from before (else the caller installs its own)."""
        with self._lock:
            if self._write is None:
                return
            signal.set_wakeup_fd(self._previous_fd)
            os.close(self._write)
            self._write = None
        if restore:
            for sig, handler in self._previous.items():
                signal.signal(sig, handler)


_startup: list[StartupStop] = []  # the active guard of this process, ended by the loop's SignalFlag


def guard_startup(prog: str, cleanup: Callable[[], None] = lambda: None) -> StartupStop:
    """Install the start-up guard of this process (see ``StartupStop``); ``end_startup`` removes it."""
    end_startup()
    _startup.append(StartupStop(prog, cleanup))
    return _startup[-1]


def end_startup(restore: bool = True) -> None:
    while _startup:
        _startup.pop().end(restore)


def _noop(signum: int, frame: Any) -> None:
    pass  # the watcher thread acts on the wakeup fd


class SignalFlag:
    """Set on SIGTERM/SIGINT/SIGUSR1 (preemption, Ctrl-C) or when the deepspeed launcher that
    started this rank dies: the trainer saves after the current step and exits.

    The launcher watch covers a killed ``deepspeed`` runner, which does not forward signals to
    its ranks on one node: the ranks would be orphaned and train on unsaved."""

    SIGNALS = STOP_SIGNALS

    def __init__(self, enabled: bool, watch_launcher: bool = True, poll_s: float = 1.0) -> None:
        self.signum: int | None = None
        if enabled:
            for sig in self.SIGNALS:
                signal.signal(sig, self._handle)
        # From here on a signal stops the run after a step, with a checkpoint (one caught in between
        # still ends the start-up: no step has run).
        end_startup(restore=not enabled)
        if not enabled:
            # launch/train.sh starts the deepspeed runner ignoring SIGUSR1 (so that a signal to the
            # whole Slurm step does not kill it); the ranks inherit that: give them the default back.
            if signal.getsignal(signal.SIGUSR1) == signal.SIG_IGN:
                signal.signal(signal.SIGUSR1, signal.SIG_DFL)
            return
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
