"""The chunked cross-entropy (``train.loss_chunk_tokens``) against the whole logits: memory and speed. Not a test.

    python -m benchmarks.chunked_ce [--chunks 256 1024] [--shapes study cpu4x 41m] [--steps 6] [--repeats 2]
                                    --out docs/results/bench_chunked_ce.json

An existing ``--out`` file keeps the shapes this run does not measure (``commands`` lists every run).

* ``plan_247m``: the per-rank memory plan (``python -m megaflex.model.summary --memory``) at
  configs/flexformer_n_247m.yaml's shape, micro-batch 8 x 1,024 tokens, bf16, ZeRO 1, with and without
  activation checkpointing, for the whole logits (chunk 0) and each chunk size.
* ``measured``: the real trainer on one CPU rank in fp32 (``benchmarks.trainer_steps``) at each shape:
  ``study`` and ``cpu4x`` (the kernel study's presets, vocabulary 4,096) and ``41m``
  (configs/flexformer_n_41m.yaml's model, vocabulary 32,000, micro-batch 4 x 512). Per chunk size: the peak
  RSS over the run (the lowest of the repeats: the allocator's slack only adds), the model's plan at the same
  shape, and tokens per CPU second (the median of the steps after the first, the median over repeats: one
  thread per rank, so not the neighbours' load) and per wall second.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
from pathlib import Path
from typing import Any

from benchmarks.trainer_steps import REPO, TINY_CONFIG, steady, study_shape, trainer_steps
from megaflex.cli_args import scratch_results, writable_file
from megaflex.model.memory_plan import memory_plan
from megaflex.model.summary import load_model_config
from megaflex.training.config import load_config

MIB = 2**20
CONFIG_247M = REPO / "configs" / "flexformer_n_247m.yaml"
CONFIG_41M = REPO / "configs" / "flexformer_n_41m.yaml"
# shape name -> (config file, overrides of it)
SHAPES: dict[str, tuple[Path, list[str]]] = {
    "study": (TINY_CONFIG, study_shape("cpu")),
    "cpu4x": (TINY_CONFIG, study_shape("cpu4x")),
    "41m": (CONFIG_41M, ["data.seq_len=512", "train.micro_batch_size=4", "train.global_batch_size=4",
                         "train.precision=fp32"]),
}


def plan_247m(chunks: list[int]) -> dict[str, Any]:
    """The 247M plan per chunk size (0: the whole logits), in MiB."""
    config = load_model_config(CONFIG_247M)
    out = {}
    for chunk in [0, *chunks]:
        plan = memory_plan(config, zero=1, micro_batch=8, seq_len=1024, precision="bf16", loss_chunk_tokens=chunk)
        out[str(chunk)] = {k: round(plan.to_dict()[k] / MIB, 1)
                           for k in ("activations", "total", "activations_checkpointed", "total_checkpointed")}
    return {"config": str(CONFIG_247M.relative_to(REPO)), "micro_batch": 8, "seq_len": 1024, "precision": "bf16",
            "zero": 1, "mib_by_chunk_tokens": out}


def measure(shape: str, chunks: list[int], steps: int, repeats: int) -> dict[str, Any]:
    config, overrides = SHAPES[shape]
    cfg = load_config([str(config)], overrides)  # the run's model and batch
    micro, seq = cfg.train.micro_batch_size, cfg.data.seq_len
    tokens = (cfg.train.global_batch_size or micro) * seq  # per optimizer step (one rank)
    runs: dict[int, list[list[dict[str, Any]]]] = {chunk: [] for chunk in [0, *chunks]}
    for _ in range(repeats):
        for chunk in runs:
            runs[chunk].append(trainer_steps(config, [*overrides, f"train.loss_chunk_tokens={chunk}"], steps))
            print(f"{shape} chunk {chunk}: CPU s per step {[s['cpu_s'] for s in runs[chunk][-1]]}", flush=True)
    arms = {}
    for chunk, repeats_of in runs.items():
        plan = memory_plan(cfg.model, zero=0, micro_batch=micro, seq_len=seq, precision="fp32", loss_chunk_tokens=chunk)
        arms[str(chunk)] = {
            "tokens_per_cpu_s": round(statistics.median(tokens / steady(r, "cpu_s") for r in repeats_of), 1),
            "tokens_per_cpu_s_each_repeat": [round(tokens / steady(r, "cpu_s"), 1) for r in repeats_of],
            "tokens_per_wall_s": round(statistics.median(tokens / steady(r, "wall_s") for r in repeats_of), 1),
            "peak_rss_mib": round(min(r[-1]["memory_mb"] for r in repeats_of), 1),
            "plan_activations_mib": round(plan.activations / MIB, 1),
            "losses_first_repeat": [round(s["loss"], 6) for s in repeats_of[0]],
        }
    whole = arms["0"]
    for chunk in chunks:
        arm = arms[str(chunk)]
        arm["cpu_speed_over_whole"] = round(arm["tokens_per_cpu_s"] / whole["tokens_per_cpu_s"], 3)
        arm["peak_rss_saved_mib"] = round(whole["peak_rss_mib"] - arm["peak_rss_mib"], 1)
        arm["plan_saved_mib"] = round(whole["plan_activations_mib"] - arm["plan_activations_mib"], 1)
    return {"config": str(config.relative_to(REPO)), "overrides": overrides, "vocab_size": cfg.model.vocab_size,
            "tokens_per_micro_batch": micro * seq, "tokens_per_step": tokens, "by_chunk_tokens": arms}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunks", type=int, nargs="+", default=[256, 1024], help="chunk sizes against 0 (whole)")
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", type=writable_file, default=str(scratch_results("bench_chunked_ce.json")),
                        help="the JSON written (default: a scratch folder; docs/results/ holds the committed one)")
    args = parser.parse_args(argv)
    command = "python -m benchmarks.chunked_ce " + " ".join(sys.argv[1:] if argv is None else argv)
    # an existing file keeps the shapes this run does not measure (each shape's command is listed)
    result: dict[str, Any] = json.loads(args.out.read_text()) if args.out.exists() else {"commands": [], "measured": {}}
    result.update(machine=f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores shared with other "
                          "jobs, 1 thread per rank (OMP_NUM_THREADS=1), fp32, launch/setup_env.sh's malloc settings",
                  plan_247m=plan_247m(args.chunks))
    result["commands"].append(command)
    for shape in args.shapes:
        result["measured"][shape] = {**measure(shape, args.chunks, args.steps, args.repeats), "command": command}
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")  # after every shape: a stopped run keeps its rows
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
