"""``train.compile`` against eager: CPU training speed and compile time. Not a test.

    python -m benchmarks.compile [--shapes study cpu4x] [--steps 8] [--repeats 2] --out docs/results/bench_compile.json

The real trainer on one CPU rank in fp32 (``benchmarks.trainer_steps``) at the kernel study's shapes
(``studies/kernel_study_config.py``: the ``cpu`` preset, 4 layers x 128, and ``cpu4x``, 6 x 160; micro-batch
8 x 256 tokens, 2 micro-batches per step), eager and with ``train.compile=true``, the arms of a repeat one
after the other. Per arm: tokens per CPU second (the median of the steps after the first, the median over
repeats; one thread per rank, so not the neighbours' load) and per wall second, and the compile time apart:
the first step's wall time minus a steady step's, with an empty inductor cache (``TORCHINDUCTOR_CACHE_DIR``
fresh per run: what a first run pays; a warm cache, e.g. a resumed run, pays much less). The C++ compiler
runs in subprocesses, so the compile time is wall time, shared with whatever else the machine runs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.trainer_steps import REPO, TINY_CONFIG, steady, study_shape, trainer_steps
from megaflex.cli_args import scratch_results, writable_file
from megaflex.training.config import load_config

SHAPES = {"study": "cpu", "cpu4x": "cpu4x"}  # shape name -> the kernel study's preset


def measure(shape: str, steps: int, repeats: int) -> dict[str, Any]:
    overrides = study_shape(SHAPES[shape])
    cfg = load_config([str(TINY_CONFIG)], overrides)
    tokens = cfg.train.global_batch_size * cfg.data.seq_len  # per optimizer step (one rank)
    runs: dict[str, list[list[dict[str, Any]]]] = {"eager": [], "compiled": []}
    for _ in range(repeats):
        for arm in runs:
            with tempfile.TemporaryDirectory() as cache:
                os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache  # the trainer inherits it: a cold compile
                runs[arm].append(trainer_steps(TINY_CONFIG, [*overrides, f"train.compile={str(arm == 'compiled').lower()}"], steps))
            print(f"{shape} {arm}: CPU s per step {[s['cpu_s'] for s in runs[arm][-1]]}", flush=True)
    out: dict[str, Any] = {"overrides": overrides, "tokens_per_step": tokens}
    for arm, repeats_of in runs.items():
        out[arm] = {
            "tokens_per_cpu_s": round(statistics.median(tokens / steady(r, "cpu_s") for r in repeats_of), 1),
            "tokens_per_cpu_s_each_repeat": [round(tokens / steady(r, "cpu_s"), 1) for r in repeats_of],
            "tokens_per_wall_s": round(statistics.median(tokens / steady(r, "wall_s") for r in repeats_of), 1),
            "first_step_wall_s": [round(r[0]["wall_s"], 1) for r in repeats_of],
            "first_step_minus_steady_wall_s": [round(r[0]["wall_s"] - steady(r, "wall_s"), 1) for r in repeats_of],
            "losses_first_repeat": [round(s["loss"], 6) for s in repeats_of[0]],
        }
    out["compiled_over_eager_tokens_per_cpu_s"] = round(out["compiled"]["tokens_per_cpu_s"] / out["eager"]["tokens_per_cpu_s"], 3)
    out["compile_time_s"] = statistics.median(out["compiled"]["first_step_minus_steady_wall_s"])
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", type=writable_file, default=str(scratch_results("bench_compile.json")),
                        help="the JSON written (default: a scratch folder; docs/results/ holds the committed one)")
    args = parser.parse_args(argv)
    import torch

    result: dict[str, Any] = {
        "command": "python -m benchmarks.compile " + " ".join(sys.argv[1:] if argv is None else argv),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores shared with other jobs, "
                   f"1 thread per rank (OMP_NUM_THREADS=1), fp32, torch {torch.__version__} (inductor's C++ backend)",
        "shapes": {},
    }
    for shape in args.shapes:
        result["shapes"][shape] = measure(shape, args.steps, args.repeats)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")  # after every shape: a stopped run keeps its rows
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
