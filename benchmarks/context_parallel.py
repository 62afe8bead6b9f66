"""Context-parallel training step: per-rank peak memory, step time and bytes communicated.

    python -m benchmarks.context_parallel            # N = 64k, 128k, 256k x CP 1, 2; then 1M on 2 ranks
    python -m benchmarks.context_parallel --lengths 4096 --no-long   # quick check

Each point is a fresh set of gloo CPU ranks (one spawned process per CP rank) running one
warm-up and ``--steps`` timed steps (forward + backward of one sequence of N tokens; the
optimizer update is O(parameters), independent of N, and left out) of the tiny GPT of
``--num-layers``/``--hidden-size``/... (default: 2 layers, hidden 32, 2 heads, F 16, vocab 256).
Reported per rank:

* ``peak_rss_mib``: the process's peak resident memory (VmHWM: Python, torch, the model
  and the step's activations); ``step_rss_mib`` is what the step added over the RSS before it
  (taken after a barrier and a first ``torch.utils.checkpoint`` call, so the communicator's setup
  and the ~150 MiB of modules that call imports, loaded in DeepSpeed training anyway, are not counted).
* ``step_tensor_mib``: the peak bytes of live tensors during one more (profiled) step, over those
  alive before it: the step's memory without the allocator's fragmentation, exact and repeatable.
* ``memory_fit``: least squares memory = a + b N per CP size for both, with b_CP / (b_1 / CP)
  (1.0: a CP rank holds exactly 1/CP of the per-token memory of CP=1).
* ``step_s``: mean wall time of a timed step (the slowest rank's).
* ``cp_bytes_per_layer``: bytes this rank contributed to the CP all-gathers per layer per step
  (forward state + backward state gradient), counted at the collective; it must not depend on N.

Then one step of a ``--long-length`` (1,048,576) token sequence on ``--long-cp`` ranks of a smaller
model with activation checkpointing. Results go to ``--out`` (``--out docs/results/bench_context_parallel.json``:
the committed ones).
CPU timings on a shared machine are noisy: compare CP=1 and CP=2 measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.common import add_model_arguments
from megaflex.cli_args import positive_int, scratch_results, writable_file


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _peak_tensor_mib(step: Any) -> float:
    """Peak bytes of live CPU tensors during ``step()``, over those alive when it starts: the
    allocator-independent memory of the step (RSS also counts glibc heap fragmentation).

    Read from the profiler's raw allocation events (a free counts only when its allocation was in
    the step). torch's ``MemoryProfile`` timeline gave the same numbers but builds a data-flow
    graph that sometimes fails its own "version mismatch" assertion (pytorch/pytorch#167838)."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        event = stack.pop()
        stack.extend(event.children)
        if event.typed[0] == _EventType.Allocation and event.typed[1].device.type == "cpu":
            events.append((event.start_time_ns, event.typed[1].alloc_size, event.typed[1].allocation_id))
    live = peak = 0
    made: set[int] = set()
    for _, size, allocation in sorted(events, key=lambda e: e[0]):
        if size > 0:
            made.add(allocation)
        elif allocation not in made:  # a tensor from before the step
            continue
        live += size
        peak = max(peak, live)
    return peak / 2**20


def timed_steps(step: Any, steps: int) -> tuple[float, float]:
    """(the last result, mean wall seconds) of ``steps`` calls of ``step()``, between barriers of all ranks."""
    import torch.distributed as dist

    dist.barrier()
    start = time.perf_counter()
    for _ in range(steps):
        result = step()
    dist.barrier()
    return result, (time.perf_counter() - start) / steps


def _rank_main(rank: int, cp: int, port: int, model_kw: dict[str, Any], n: int, steps: int, out: "mp.Queue") -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(cp), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch
    import torch.distributed as dist
    import torch.utils.checkpoint

    import megaflex.parallel.context_parallel as cp_module
    from megaflex.model.config import ModelConfig
    from megaflex.model.gpt import GPT
    from megaflex.parallel import ParallelState, parallelize_gpt, sequence_slice
    from megaflex.training.metrics import peak_rss_kib

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=cp)
    state = ParallelState.create(context_parallel_size=cp)
    sent = [0]
    gather = cp_module.cp_all_gather

    def counting_gather(x: torch.Tensor, st: ParallelState) -> torch.Tensor:
        sent[0] += x.numel() * x.element_size()
        return gather(x, st)

    cp_module.cp_all_gather = counting_gather  # count what this rank puts into each CP collective
    config = ModelConfig(max_seq_len=n, **model_kw)
    torch.manual_seed(0)
    model = parallelize_gpt(GPT(config), state, seed=0)
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, config.vocab_size, (1, n + 1), generator=gen)
    ids, labels = (sequence_slice(t, state.cp_rank, cp) for t in (tokens[:, :-1], tokens[:, 1:]))

    def step() -> float:
        model.zero_grad(set_to_none=True)
        loss = model(ids, labels=labels).loss
        (loss * cp).backward()
        return float(loss.detach())

    dist.barrier()  # the communicator's one-time setup (gloo pairs and buffers) is not the step's memory
    # torch.utils.checkpoint (used by the CP local state and by activation checkpointing) imports ~900
    # modules (~150 MiB) on first use; DeepSpeed training has them loaded anyway: load them here in every process
    x = torch.ones(1, requires_grad=True)
    torch.utils.checkpoint.checkpoint(torch.exp, x, use_reentrant=False).backward()
    rss_before = _rss_mib()
    loss = step()  # warm-up (allocator, lazily built buffers)
    sent[0] = 0
    loss, elapsed = timed_steps(step, steps)
    peak = peak_rss_kib() / 1024
    bytes_per_layer = sent[0] // (steps * config.num_layers) if cp > 1 else 0
    peak_tensors = _peak_tensor_mib(step)  # after the RSS reading: the profiler's own memory is left out
    out.put({
        "rank": rank, "loss": loss, "step_s": elapsed, "peak_rss_mib": round(peak, 1),
        "step_rss_mib": round(peak - rss_before, 1), "step_tensor_mib": round(peak_tensors, 1),
        "cp_bytes_per_layer": bytes_per_layer,
    })
    dist.destroy_process_group()


def bench_point(model_kw: dict[str, Any], n: int, cp: int, steps: int) -> dict[str, Any]:
    """One (N, CP) point on fresh processes: per-rank numbers and the slowest rank's step time."""
    from megaflex.parallel.rendezvous import free_port

    ctx = mp.get_context("spawn")
    queue: mp.Queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, cp, port, model_kw, n, steps, queue)) for r in range(cp)]
    for p in procs:
        p.start()
    ranks = []
    while len(ranks) < cp:
        try:
            ranks.append(queue.get(timeout=5))
        except Exception:  # noqa: BLE001 - queue.Empty: check for dead ranks
            dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if dead:
                for p in procs:
                    p.kill()
                raise RuntimeError(f"N={n} CP={cp}: a rank died (exit codes {dead}); out of memory?") from None
    for p in procs:
        p.join()
    ranks.sort(key=lambda r: r["rank"])
    point = {
        "seq_len": n, "cp": cp, "tokens_per_rank": n // cp, "loss": ranks[0]["loss"],
        "step_s": round(max(r["step_s"] for r in ranks), 3),
        "peak_rss_mib_per_rank": max(r["peak_rss_mib"] for r in ranks),
        "step_rss_mib_per_rank": max(r["step_rss_mib"] for r in ranks),
        "step_tensor_mib_per_rank": max(r["step_tensor_mib"] for r in ranks),
        "cp_bytes_per_layer": ranks[0]["cp_bytes_per_layer"], "ranks": ranks,
    }
    print(json.dumps({k: v for k, v in point.items() if k != "ranks"}), flush=True)
    return point


def fit_memory(points: list[dict[str, Any]]) -> dict[str, Any]:
    """Least-squares memory = a + b N per CP size and metric (N: tokens of the whole sequence), and
    b_CP / (b_1 / CP): 1.0 when CP ranks hold exactly 1/CP of CP=1's per-token memory."""
    fits: dict[str, Any] = {}
    for metric in ("step_rss_mib_per_rank", "step_tensor_mib_per_rank"):
        per_cp = {}
        for cp in sorted({p["cp"] for p in points}):
            xs, ys = zip(*[(p["seq_len"], p[metric]) for p in points if p["cp"] == cp])
            if len(set(xs)) < 2:
                continue
            mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
            b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
            per_cp[cp] = {"a_mib": round(my - b * mx, 1), "b_kib_per_token": round(b * 1024, 3)}
        if 1 in per_cp:
            for cp, fit in per_cp.items():
                fit["b_over_b1_per_cp"] = round(fit["b_kib_per_token"] / (per_cp[1]["b_kib_per_token"] / cp), 3)
        fits[metric.removesuffix("_per_rank")] = {str(cp): fit for cp, fit in per_cp.items()}
    return fits


MODEL_ARGUMENTS = dict(vocab_size=256, num_layers=2, hidden_size=32, num_heads=2, feature_dim=16, chunk_size=64)


def model_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """``ModelConfig`` keywords from the ``MODEL_ARGUMENTS`` options (``common.add_model_arguments``)."""
    return dict({name: getattr(args, name) for name in MODEL_ARGUMENTS}, attention="flexformer_n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=positive_int, nargs="+", default=[32768, 65536, 131072, 262144])
    parser.add_argument("--cp", type=positive_int, nargs="+", default=[1, 2])
    parser.add_argument("--steps", type=positive_int, default=2)
    add_model_arguments(parser, threads=False, **MODEL_ARGUMENTS)
    parser.add_argument("--activation-checkpointing", action="store_true", help="recompute blocks in backward")
    parser.add_argument("--no-long", action="store_true", help="skip the long-sequence step")
    parser.add_argument("--long-length", type=positive_int, default=1 << 20)
    parser.add_argument("--long-cp", type=positive_int, default=2)
    parser.add_argument("--out", type=writable_file, default=str(scratch_results("bench_context_parallel.json")))
    args = parser.parse_args()

    model_kw = dict(model_kwargs(args), activation_checkpointing=args.activation_checkpointing)
    points = [bench_point(model_kw, n, cp, args.steps) for n in args.lengths for cp in args.cp]
    long_point = None
    if not args.no_long:
        # ~6 KiB of activations per token: 512k tokens per rank stay within ~3 GiB each
        long_kw = dict(
            model_kw, vocab_size=64, num_layers=1, hidden_size=16, num_heads=1, feature_dim=8, activation_checkpointing=True
        )
        long_point = dict(bench_point(long_kw, args.long_length, args.long_cp, 1), model=long_kw)
    result = {
        "command": "python -m benchmarks.context_parallel " + " ".join(sys.argv[1:]),
        "model": model_kw, "steps": args.steps, "points": points, "memory_fit": fit_memory(points),
        "long_sequence": long_point,
        "note": "2-core CPU shared with other jobs (loaded): timings noisy; gloo ranks on one host",
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
