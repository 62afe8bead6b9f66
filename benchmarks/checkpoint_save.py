"""Step-time stall per checkpoint save, synchronous against ``checkpoint.background`` (CPU). Not a test.

    python -m benchmarks.checkpoint_save [--config configs/flexformer_n_247m.yaml] [--set model.num_layers=8]
        [--seq-len 64] [--micro-batch 1] [--interval 3] [--saves 3] --out docs/results/bench_checkpoint_save.json

Two runs of the real trainer (``python -m megaflex.train``, fresh processes, synthetic tokens), the
same steps each, a save every ``--interval`` steps: synchronous, then in the background. Per save:

* **blocked**: how long the training loop stood still in the save call (the trainer's own line,
  ``saved checkpoint ... (N s)`` or ``... state copied in N s``);
* **step stall**: the time of the step that holds the save (metrics.jsonl with
  ``logging.log_interval=1`` times each step from the previous step's log, so a save after step s
  lands in step s + 1, as does a background commit made then) minus the run's median step without a
  save. Each run is its own reference: on a shared machine the load drifts between runs.

The median step of each run without a save also shows what the writer thread costs the steps it
overlaps (they share the CPU here). Also: the checkpoint's size and each run's peak RSS (rank 0;
the background copy is one more shard in RAM).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "helpers"))

from training_harness import launch  # noqa: E402  (tests/helpers: local multi-process launch)

from megaflex.cli_args import scratch_results, writable_file  # noqa: E402

MODES = {"synchronous": ["checkpoint.background=false"], "background": ["checkpoint.background=true"]}
SAVE_LINE = re.compile(r"^(?:saved checkpoint \S+ \((?P<sync>[\d.]+) s\)|saving checkpoint of step \d+ in the "
                       r"background \(state copied in (?P<copied>[\d.]+) s\))$", re.M)


def run_mode(args: argparse.Namespace, mode: str, steps: int) -> dict:
    from megaflex.checkpoint.layout import complete_tags, directory_size
    from megaflex.training.metrics import read_metrics

    with tempfile.TemporaryDirectory(dir=args.tmp_dir) as tmp:
        cfg_path = Path(tmp) / "bench.yaml"
        cfg_path.write_text((REPO / args.config).read_text())
        overrides = [
            "data.source=synthetic", "data.tokenizer=null", f"data.seq_len={args.seq_len}",
            f"train.micro_batch_size={args.micro_batch}", f"train.global_batch_size={args.micro_batch * args.world_size}",
            f"train.train_iters={steps}", "schedule.warmup_iters=0", f"parallel.zero_stage={args.zero}",
            f"train.precision={args.precision}", "train.eval_interval=0", "train.device=cpu", "checkpoint.save_at_end=false",
            "checkpoint.resume=none", "checkpoint.keep_last=2", "logging.tensorboard=false", "logging.kernel_stats_interval=0",
            "logging.log_interval=1", f"logging.run_dir={tmp}/run", f"checkpoint.save_interval={args.interval}",
            *MODES[mode], *args.set,
        ]
        t0 = time.time()
        result = launch(cfg_path, overrides, world_size=args.world_size, timeout=3600, fresh=True)
        wall = time.time() - t0
        if any(result.returncodes):
            raise SystemExit(f"{mode} run failed:\n{result.output[-3000:]}")
        records = read_metrics(Path(tmp) / "run" / "metrics.jsonl")
        tokens = args.micro_batch * args.world_size * args.seq_len
        tags = complete_tags(Path(tmp) / "run" / "checkpoints")
        blocked = [float(m["sync"] or m["copied"]) for m in SAVE_LINE.finditer(result.outputs[0])]
        return {
            "step_s": {s: tokens / records[s]["tokens_per_s"] for s in sorted(records)},
            "blocked_s": blocked,
            "peak_rss_mb_rank0": max(r["memory_mb"] for r in records.values()),
            "checkpoint_bytes": directory_size(Path(tmp) / "run" / "checkpoints" / tags[-1]) if tags else 0,
            "checkpoints": tags,
            "wall_s": wall,
        }


def summarize(run: dict, interval: int, saves: int) -> dict:
    """Per save: blocked time and step stall against the run's median step without a save (step 1,
    the warm-up, left out)."""
    step_s = run["step_s"]
    holding = {k * interval + 1 for k in range(1, saves + 1)}
    median_step = statistics.median(t for s, t in step_s.items() if s > 1 and s not in holding)
    per_save = [{"after_step": s - 1, "blocked_s": blocked, "step_stall_s": step_s[s] - median_step}
                for s, blocked in zip(sorted(holding), run["blocked_s"])]
    return {"median_step_s": median_step, "per_save": per_save,
            "median_blocked_s": statistics.median(p["blocked_s"] for p in per_save),
            "median_step_stall_s": statistics.median(p["step_stall_s"] for p in per_save),
            "peak_rss_mb_rank0": run["peak_rss_mb_rank0"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/flexformer_n_247m.yaml")
    ap.add_argument("--set", nargs="*", default=[], help="extra config overrides, e.g. model.num_layers=8")
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--world-size", type=int, default=1)
    ap.add_argument("--zero", type=int, default=0)
    ap.add_argument("--precision", default="fp32")
    ap.add_argument("--interval", type=int, default=3, help="steps between saves")
    ap.add_argument("--saves", type=int, default=3)
    ap.add_argument("--tmp-dir", default=None, help="where the runs write (default: the system's temp dir)")
    ap.add_argument("--out", type=writable_file, default=str(scratch_results("bench_checkpoint_save.json")),
                    help="the JSON written (default: a scratch folder; docs/results/ holds the committed one)")
    args = ap.parse_args()

    steps = args.interval * args.saves + 1  # the step after the last save holds its stall
    runs, summary = {}, {}
    for mode in MODES:
        runs[mode] = run_mode(args, mode, steps)
        summary[mode] = summarize(runs[mode], args.interval, args.saves)
        print(f"{mode}: {runs[mode]['wall_s']:.0f} s", flush=True)
    setup = {k: getattr(args, k) for k in ("config", "set", "seq_len", "micro_batch", "world_size", "zero", "precision",
                                           "interval", "saves")}
    command = "python -m benchmarks.checkpoint_save " + " ".join(sys.argv[1:])
    report = {"device": "cpu", "command": command.strip(), "setup": setup,
              "checkpoint_bytes": runs["synchronous"]["checkpoint_bytes"], "summary": summary, "runs": runs}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    print(f"\ncheckpoint {report['checkpoint_bytes'] / 2**30:.2f} GiB")
    print("| save | training blocked per save (s, median) | step stall per save (s, median) | median step without a save (s) "
          "| peak RSS rank 0 (MB) |\n|---|---|---|---|---|")
    for mode, row in summary.items():
        print(f"| {mode} | {row['median_blocked_s']:.2f} | {row['median_step_stall_s']:.2f} | {row['median_step_s']:.2f} "
              f"| {row['peak_rss_mb_rank0']:.0f} |")
    print(f"\nwritten {out}")


if __name__ == "__main__":
    main()
