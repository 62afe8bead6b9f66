"""Tiny multi-process launcher for tests: N gloo ranks on localhost, one function per rank.

    from distributed import run_distributed

    def worker(rank: int, world_size: int, x: int) -> float:   # module-level (picklable)
        ...                                                   # torch.distributed is initialised
        return result                                         # anything picklable

    results = run_distributed(worker, world_size=2, args=(3,))  # [result of rank 0, rank 1]

Each rank is a fresh process, forked from a multiprocessing fork server that has imported torch,
``torch._dynamo`` and DeepSpeed once (``fork_server``; each rank imports the test module and megaflex
itself, as a ``spawn``-ed one does), with OMP_NUM_THREADS=1 and the torchrun env vars
(RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT on a free port), so code under test
may also call ``initialize_parallel_state`` / ``deepspeed.init_distributed`` itself
(pass ``init_process_group=False``). If any rank raises, the others are terminated and a
``RuntimeError`` carrying that rank's traceback is raised in the caller. Every worker ends
with a barrier and ``destroy_process_group()``.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import time
import traceback
from typing import Any, Callable, Sequence

from megaflex.parallel.rendezvous import free_port


# Imported once by the fork server (third-party only), instead of ~7 s of CPU per rank: torch,
# torch._dynamo (torch.optim's first step imports it; so does DeepSpeed's ZeRO 1/2 reduction,
# through the Muon optimizer module) and DeepSpeed.
FORK_SERVER_PRELOAD = ["numpy", "yaml", "torch", "torch.distributed", "torch._dynamo", "deepspeed",
                       "deepspeed.runtime.zero.muon.muon_optimizer"]


def fork_server() -> Any:
    """The multiprocessing context test ranks start from (``ForkServerContext``)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(FORK_SERVER_PRELOAD)
    return ctx


def _worker(
    rank: int,
    world_size: int,
    port: int,
    fn: Callable[..., Any],
    args: Sequence[Any],
    kwargs: dict[str, Any],
    init_process_group: bool,
    results: "mp.Queue[tuple[int, bool, bytes]]",
) -> None:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        OMP_NUM_THREADS="1",
    )
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        if init_process_group:
            dist.init_process_group("gloo", rank=rank, world_size=world_size)
        out = fn(rank, world_size, *args, **kwargs)
        # Plain pickle copies tensor data into the bytes; a queue would otherwise share
        # tensor storage with a process that is about to exit.
        payload = (rank, True, pickle.dumps(out))
    except BaseException:  # noqa: BLE001 - everything goes back to the parent
        payload = (rank, False, traceback.format_exc().encode())
    results.put(payload)
    if not payload[1]:
        return  # peers may be stuck in a collective; the parent terminates them
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    args: Sequence[Any] = (),
    kwargs: dict[str, Any] | None = None,
    *,
    init_process_group: bool = True,
    timeout: float = 300.0,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` gloo ranks; return per-rank results."""
    if world_size < 1:
        raise ValueError(f"world_size: expected >= 1, got {world_size}")
    ctx = fork_server()
    results: mp.Queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_worker,
            args=(rank, world_size, port, fn, tuple(args), dict(kwargs or {}), init_process_group, results),
            daemon=False,  # ranks may start their own children (e.g. DataLoader workers)
        )
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    outputs: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(outputs) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"run_distributed({fn.__name__}): ranks {sorted(set(range(world_size)) - set(outputs))} "
                                   f"did not finish within {timeout:.0f}s")
            try:
                rank, ok, payload = results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if r not in outputs and p.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(f"run_distributed({fn.__name__}): rank(s) {dead} died "
                                       f"(exit codes {[procs[r].exitcode for r in dead]}) without a result")
                continue
            if not ok:
                raise RuntimeError(f"run_distributed({fn.__name__}): rank {rank} raised:\n{payload.decode()}")
            outputs[rank] = pickle.loads(payload)
        for proc in procs:
            proc.join(timeout=max(deadline - time.monotonic(), 1.0))
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.terminate()
                proc.join(5)
        results.close()
    return [outputs[r] for r in range(world_size)]
