"""The one way megaflex code talks to other ranks with tensors.

NCCL only takes CUDA tensors ("No backend type associated with device type cpu"), gloo takes CPU
ones. Every tensor collective outside ``megaflex/parallel/`` goes through this module, which moves
the tensor to the group's communication device and back (a no-op when it already lives there).
``tests/parallel/test_parallel_comm.py`` enforces that rule on the sources.

Groups follow ``ParallelState``: ``None`` means "this rank alone" (no communication at all, no
communicator built); the whole world is ``world_group()``. This is *not* torch.distributed's
convention (there ``None`` is the world): callers never pass torch's default by accident.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
import torch.distributed as dist

Group = Any  # torch.distributed.ProcessGroup, or None for this rank alone
ReduceOp = Literal["sum", "max", "min"]

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def device_for_backend(backend: str) -> torch.device:
    """The device a collective's tensors must live on for ``backend`` (pure): CUDA for NCCL,
    the CPU for gloo/mpi. A backend that serves both (``"cpu:gloo,cuda:nccl"``) takes CPU tensors."""
    names = {part.rpartition(":")[2].strip().lower() for part in backend.split(",")}
    if "nccl" in names and not names & {"gloo", "mpi", "ucc"}:
        return torch.device("cuda")  # the current device (trainer: launcher_env.local_cuda_device)
    return torch.device("cpu")


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def world_group() -> Group:
    """Every rank (torch's default group), or None when there is only this one."""
    if not is_distributed() or dist.get_world_size() == 1:
        return None
    return dist.group.WORLD


def group_size(group: Group) -> int:
    return 1 if group is None or not is_distributed() else dist.get_world_size(group)


def communication_device(group: Group = None) -> torch.device:
    """Where tensors for a collective over ``group`` must live (the default group's backend for None)."""
    if not is_distributed():
        return torch.device("cpu")
    return device_for_backend(str(dist.get_backend(group if group is not None else dist.group.WORLD)))


def _staged(t: torch.Tensor, group: Group) -> torch.Tensor:
    """``t`` itself when it already lives on the communication device, else a contiguous copy there."""
    device = communication_device(group)
    if t.device.type == device.type and t.is_contiguous():
        return t
    return t.to(device).contiguous()


def all_reduce(t: torch.Tensor, op: ReduceOp = "sum", group: Group = None) -> torch.Tensor:
    """Reduce ``t`` over ``group`` in place (and return it); nothing happens for a group of one."""
    if group_size(group) == 1:
        return t
    staged = _staged(t, group)
    dist.all_reduce(staged, op=_OPS[op], group=group)
    if staged is not t:
        t.copy_(staged)
    return t


def reduced(t: torch.Tensor, op: ReduceOp = "sum", group: Group = None) -> torch.Tensor:
    """A reduced copy of ``t`` (``t`` itself is left alone, e.g. a tensor autograd saved)."""
    if group_size(group) == 1:
        return t
    copy = t.detach().to(communication_device(group), copy=True).contiguous()
    dist.all_reduce(copy, op=_OPS[op], group=group)
    return copy.to(t.device)


def any_rank(flag: bool | torch.Tensor, group: Group = None) -> bool:
    """True on every rank when ``flag`` is true on any rank of ``group`` (one host read)."""
    if isinstance(flag, torch.Tensor):
        t = flag.detach().float().reshape(())
    else:
        t = torch.tensor(float(flag))
    if group_size(group) > 1:
        t = t.to(communication_device(group))
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return bool(t.item() > 0)


def broadcast(t: torch.Tensor, src: int, group: Group = None) -> torch.Tensor:
    """``t`` from global rank ``src`` on every rank of ``group``, in place (and returned)."""
    if group_size(group) == 1:
        return t
    staged = _staged(t, group)
    dist.broadcast(staged, src=src, group=group)
    if staged is not t:
        t.copy_(staged)
    return t


def all_gather(t: torch.Tensor, group: Group = None) -> torch.Tensor:
    """[...] on every rank -> [group size, ...] in rank order, on ``t``'s device."""
    size = group_size(group)
    if size == 1:
        return t.unsqueeze(0)
    staged = _staged(t, group)
    out = staged.new_empty(size, *staged.shape)
    dist.all_gather(list(out.unbind(0)), staged, group=group)
    return out.to(t.device)


def all_gather_objects(obj: Any, group: Group = None) -> list[Any]:
    """Every rank's picklable ``obj``, in rank order (torch stages through the backend's device)."""
    size = group_size(group)
    if size == 1:
        return [obj]
    parts: list[Any] = [None] * size
    dist.all_gather_object(parts, obj, group=group)
    return parts
