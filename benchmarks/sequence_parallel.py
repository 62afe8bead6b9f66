"""Sequence parallelism: activation memory kept for backward per TP rank, with and without it.

    python -m benchmarks.sequence_parallel                       # TP 2, N 2048, hidden 512
    python -m benchmarks.sequence_parallel --seq-len 512 --steps 1   # quick check

One fresh set of TP gloo CPU ranks per setting (``parallel.sequence_parallel`` off, then on) runs
forward + backward of the GPT of ``--num-layers``/``--hidden-size``/... on [``--batch``,
``--seq-len``] tokens. Reported per rank:

* ``saved_mib``: bytes of the tensors autograd keeps between forward and backward (every tensor
  packed by ``saved_tensors_hooks``, each storage counted once, parameters left out): the
  activation memory, exact and independent of the allocator. Sequence parallelism divides the
  norms' and column-parallel linears' saved inputs (and residual dropout masks) by TP; the
  attention's per-head tensors are split by TP either way.
* ``step_s``: mean wall time of ``--steps`` steps after a warm-up (the slowest rank's; a shared
  2-core CPU is noisy, and gloo collectives on one host say little about NVLink).

Results go to ``--out`` (``--out docs/results/bench_sequence_parallel.json``: the committed ones).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from megaflex.cli_args import positive_int, scratch_results, writable_file


def _saved_mib(model: Any, step: Any) -> float:
    """MiB of non-parameter storages autograd saves for backward during ``step()``'s forward."""
    import torch

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            storages[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        step()
    return sum(storages.values()) / 2**20


def _rank_main(rank: int, tp: int, port: int, sp: bool, model_kw: dict[str, Any], shape: tuple[int, int], steps: int,
               out_dir: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(tp), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch
    import torch.distributed as dist

    from benchmarks.context_parallel import timed_steps
    from megaflex.model.config import ModelConfig
    from megaflex.model.gpt import GPT
    from megaflex.parallel import ParallelState, parallelize_gpt

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=tp)
    state = ParallelState.create(tensor_parallel_size=tp)
    config = ModelConfig(max_seq_len=shape[1], **model_kw)
    torch.manual_seed(0)
    model = parallelize_gpt(GPT(config), state, seed=0, sequence_parallel=sp)
    tokens = torch.randint(0, config.vocab_size, (shape[0], shape[1] + 1), generator=torch.Generator().manual_seed(1))

    def step() -> float:
        model.zero_grad(set_to_none=True)
        loss = model(tokens[:, :-1], labels=tokens[:, 1:]).loss
        loss.backward()
        return float(loss.detach())

    step()  # warm-up
    loss, elapsed = timed_steps(step, steps)
    result = {"rank": rank, "loss": loss, "step_s": elapsed, "saved_mib": round(_saved_mib(model, step), 2)}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def bench(tp: int, sp: bool, model_kw: dict[str, Any], shape: tuple[int, int], steps: int) -> dict[str, Any]:
    import torch.multiprocessing as mp

    from megaflex.parallel.rendezvous import free_port

    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(_rank_main, args=(tp, free_port(), sp, model_kw, shape, steps, out_dir), nprocs=tp, join=True)
        ranks = [json.loads(Path(out_dir, f"rank{r}.json").read_text()) for r in range(tp)]
    point = {
        "tp": tp, "sequence_parallel": sp, "loss": ranks[0]["loss"], "step_s": round(max(r["step_s"] for r in ranks), 3),
        "saved_mib_per_rank": max(r["saved_mib"] for r in ranks), "ranks": ranks,
    }
    print(json.dumps({k: v for k, v in point.items() if k != "ranks"}), flush=True)
    return point


def main() -> None:
    from benchmarks.common import add_model_arguments
    from benchmarks.context_parallel import MODEL_ARGUMENTS, model_kwargs
    from megaflex.eval.plotting import write_json

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tp", type=positive_int, default=2)
    parser.add_argument("--batch", type=positive_int, default=1)
    parser.add_argument("--seq-len", type=positive_int, default=2048)
    parser.add_argument("--steps", type=positive_int, default=2)
    add_model_arguments(parser, threads=False, **dict(MODEL_ARGUMENTS, vocab_size=1024, hidden_size=512, num_heads=8, feature_dim=32))
    parser.add_argument("--out", type=writable_file, default=str(scratch_results("bench_sequence_parallel.json")))
    args = parser.parse_args()

    model_kw = model_kwargs(args)
    shape = (args.batch, args.seq_len)
    off, on = (bench(args.tp, sp, model_kw, shape, args.steps) for sp in (False, True))
    result = {
        "command": "python -m benchmarks.sequence_parallel " + " ".join(sys.argv[1:]),
        "model": model_kw, "batch": args.batch, "seq_len": args.seq_len, "points": [off, on],
        "saved_ratio_sp_over_tp": round(on["saved_mib_per_rank"] / off["saved_mib_per_rank"], 3),
        "same_loss": on["loss"] == off["loss"],
        "note": "2-core CPU shared with other jobs: timings noisy; gloo ranks on one host",
    }
    print(f"wrote {write_json(args.out, result)}")


if __name__ == "__main__":
    main()
