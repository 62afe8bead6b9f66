"""A collective timeout for every process group, and a message naming the step and collective.

torch's default (30 minutes for gloo groups, 10 for NCCL) leaves the healthy ranks of a run
with one frozen peer (SIGSTOP, a dead NIC) waiting silently. ``parallel.timeout_minutes`` is set
on the default group and on every group megaflex creates; the rendezvous itself keeps at least
``RENDEZVOUS_MINUTES`` (ranks start seconds apart). The trainer marks where each step is
(``progress.at(step, name)``); when a collective fails, ``describe_failure`` turns the error
into ``rank R: collective timed out at step S in <name> after T min`` (or, on the ranks whose
peer already exited, ``... failed ... (a peer is gone)``), printed as one line by the entry point.
On NCCL, torch's watchdog may end the process itself after the timeout (its log names the
collective as ``OpType``); the step is then in the line above from ``progress``.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Iterable

import torch.distributed as dist

RENDEZVOUS_MINUTES = 5.0
_TIMEOUT_MARKERS = ("timed out", "timeout")
_PEER_GONE_MARKERS = ("connection closed", "connection reset", "broken pipe", "socket closed", "peer")


@dataclass
class StepProgress:
    """Where the training loop is (for the message of a failed collective)."""

    step: int = 0
    name: str = "start-up"
    timeout_minutes: float = 0.0

    def at(self, step: int, name: str) -> None:
        self.step, self.name = step, name


progress = StepProgress()


def collective_timeout(minutes: float) -> timedelta:
    return timedelta(minutes=minutes)


def rendezvous_timeout(minutes: float) -> timedelta:
    """The process-group start-up timeout: at least ``RENDEZVOUS_MINUTES`` (ranks import for seconds)."""
    return timedelta(minutes=max(minutes, RENDEZVOUS_MINUTES))


def apply_timeout(minutes: float, groups: Iterable[Any] = ()) -> None:
    """Set the collective timeout on the default group and on ``groups`` (None entries skipped)."""
    progress.timeout_minutes = minutes
    if not dist.is_initialized():
        return
    from torch.distributed.distributed_c10d import _set_pg_timeout

    timeout = collective_timeout(minutes)
    seen: set[int] = set()
    for group in [None, *groups]:
        if group is not None and (id(group) in seen or group == dist.GroupMember.NON_GROUP_MEMBER):
            continue
        if group is not None:
            seen.add(id(group))
        _set_pg_timeout(timeout, group)


def parallel_groups(state: Any) -> list[Any]:
    """Every process group of a ``ParallelState`` (attributes ending in ``_group``)."""
    return [value for name, value in vars(state).items() if name.endswith("_group") and value is not None]


def every_process_group() -> list[Any]:
    """Every process group this process has created so far, whoever created it (DeepSpeed too)."""
    if not dist.is_initialized():
        return []
    from torch.distributed.distributed_c10d import _world

    return list(_world.pg_map)


def describe_failure(error: BaseException) -> str | None:
    """One line naming rank, step and collective when ``error`` is a failed collective, else None."""
    if not isinstance(error, RuntimeError):  # torch's DistError family included
        return None
    text = str(error).lower()
    from_a_backend = isinstance(error, getattr(dist, "DistError", ())) or any(
        name in text for name in ("gloo", "nccl", "c10d", "processgroup"))
    if not from_a_backend:
        return None
    timed_out = any(m in text for m in _TIMEOUT_MARKERS)
    if not timed_out and not any(m in text for m in _PEER_GONE_MARKERS):
        return None
    rank = dist.get_rank() if dist.is_initialized() else 0
    first = str(error).strip().splitlines()[0][:200] if str(error).strip() else type(error).__name__
    where = f"at step {progress.step} in {progress.name}"
    if timed_out:
        return (f"rank {rank}: collective timed out {where} after {progress.timeout_minutes:g} min "
                f"(parallel.timeout_minutes); a peer rank is hung or unreachable ({first})")
    return f"rank {rank}: collective failed {where} (a peer is gone: {first})"
