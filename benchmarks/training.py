"""Training throughput and peak memory per ZeRO stage and precision (CPU by default). Not a test.

    python -m benchmarks.training [--configs tiny 41m] [--zero 0 1 2 3] [--precision fp32 bf16]
                                  [--world-size 2] [--steps 6] [--out docs/results/bench_training.json]

Each cell launches the real trainer (``python -m megaflex.train``) on ``--world-size`` local gloo
ranks with synthetic tokens (no data files needed) and reads tokens/s (median of the steps after
the first, which includes warm-up) and peak memory (rank 0's peak RSS on CPU, allocator peak on GPU)
from metrics.jsonl. Writes JSON and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "helpers"))

from training_harness import launch  # noqa: E402  (tests/helpers: local multi-process launch)
from megaflex.cli_args import positive_int, scratch_results, writable_file  # noqa: E402

CONFIGS = {"tiny": "configs/tiny.yaml", "41m": "configs/flexformer_n_41m.yaml"}


def bench_cell(config: str, zero: int, precision: str, world: int, steps: int, seq_len: int, micro: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        cfg_path = Path(tmp) / "bench.yaml"
        cfg_path.write_text((REPO / config).read_text())
        overrides = [
            "data.source=synthetic", "data.tokenizer=null", f"data.seq_len={seq_len}", f"train.micro_batch_size={micro}",
            f"train.global_batch_size={micro * world}", f"train.train_iters={steps}", "schedule.warmup_iters=0",
            f"parallel.zero_stage={zero}", f"train.precision={precision}", "train.eval_interval=0", "train.device=cpu",
            "checkpoint.save_interval=0", "checkpoint.save_at_end=false", "checkpoint.resume=none",
            "logging.tensorboard=false", "logging.kernel_stats_interval=0", f"logging.run_dir={tmp}/run",
        ]
        t0 = time.time()
        result = launch(cfg_path, overrides, world_size=world, timeout=1800, fresh=True)  # as users start ranks
        wall = time.time() - t0
        if any(result.returncodes):
            return {"error": result.output[-2000:]}
        from megaflex.training.metrics import read_metrics

        records = read_metrics(Path(tmp) / "run" / "metrics.jsonl")
        rates = [records[s]["tokens_per_s"] for s in sorted(records) if s > 1]
        return {
            "tokens_per_s": statistics.median(rates),
            "peak_memory_mb_rank0": max(r["memory_mb"] for r in records.values()),
            "final_loss": records[max(records)]["loss"],
            "wall_s": wall,
        }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", nargs="+", default=["tiny", "41m"], choices=sorted(CONFIGS))
    ap.add_argument("--zero", nargs="+", type=int, default=[0, 1, 2, 3])
    ap.add_argument("--precision", nargs="+", default=["fp32", "bf16"])
    ap.add_argument("--world-size", type=positive_int, default=2)
    ap.add_argument("--steps", type=positive_int, default=6)
    ap.add_argument("--seq-len", type=positive_int, default=128)
    ap.add_argument("--micro-batch", type=positive_int, default=4)
    ap.add_argument("--out", type=writable_file, default=str(scratch_results("bench_training.json")))
    args = ap.parse_args()

    rows = []
    for name in args.configs:
        for zero in args.zero:
            for precision in args.precision:
                cell = bench_cell(CONFIGS[name], zero, precision, args.world_size, args.steps, args.seq_len, args.micro_batch)
                row = {"config": name, "zero_stage": zero, "precision": precision, **cell}
                rows.append(row)
                print(json.dumps(row), flush=True)
    setup = {k: getattr(args, k) for k in ("world_size", "steps", "seq_len", "micro_batch")}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"device": "cpu", "setup": setup, "results": rows}, indent=1))
    print("\n| config | ZeRO | precision | tokens/s | peak RSS rank 0 (MB) |\n|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['config']} | {r['zero_stage']} | {r['precision']} | error | |")
        else:
            print(f"| {r['config']} | {r['zero_stage']} | {r['precision']} | {r['tokens_per_s']:.0f} | {r['peak_memory_mb_rank0']:.0f} |")
    print(f"\nwritten {out}")


if __name__ == "__main__":
    main()
