"""Run independent per-head CPU work on a thread pool (shared by the chunked form and the fused maps)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import torch

_POOLS: dict[int, ThreadPoolExecutor] = {}


def for_each_head(fn: Callable[[int], None], count: int, device: torch.device) -> None:
    """Run ``fn(i)`` for i in range(count): on a multi-threaded CPU, items go to a thread pool.

    Heads are independent, and ATen releases the GIL, so with intra-op threads set to 1 for the
    duration every core works on its own heads with no synchronisation at all. Intra-op
    parallelism would instead put a barrier after each of the many ~1 MiB ops, which costs a
    scheduler time slice per op whenever other processes compete for the cores (a shared
    machine, or data-loader workers). Grad mode is thread-local, hence the no_grad in workers.
    """
    threads = torch.get_num_threads()
    workers = min(threads, count)
    if device.type != "cpu" or workers <= 1:
        for i in range(count):
            fn(i)
        return

    def run(i: int) -> None:
        with torch.no_grad():
            fn(i)

    pool = _POOLS.get(workers)
    if pool is None:
        pool = _POOLS[workers] = ThreadPoolExecutor(workers, thread_name_prefix="megaflex-heads")
    torch.set_num_threads(1)
    try:
        list(pool.map(run, range(count)))  # re-raises a worker's exception
    finally:
        torch.set_num_threads(threads)
