"""Stop requests: preemption signals and a vanished launcher make the trainer save and exit."""

from __future__ import annotations

import signal
import sys
import threading
from typing import Any


class SignalFlag:
    """Set on SIGTERM/SIGINT/SIGUSR1 (preemption, Ctrl-C) or when the deepspeed launcher that
    started this rank dies: the trainer saves after the current step and exits.

    The launcher watch covers a killed ``deepspeed`` runner, which does not forward signals to
    its ranks on one node: the ranks would be orphaned and train on unsaved."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)

    def __init__(self, enabled: bool, watch_launcher: bool = True, poll_s: float = 1.0) -> None:
        self.signum: int | None = None
        if not enabled:
            # launch/train.sh starts the deepspeed runner ignoring SIGUSR1 (so that a signal to the
            # whole Slurm step does not kill it); the ranks inherit that: give them the default back.
            if signal.getsignal(signal.SIGUSR1) == signal.SIG_IGN:
                signal.signal(signal.SIGUSR1, signal.SIG_DFL)
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
