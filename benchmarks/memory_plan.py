"""The memory plan (``python -m megaflex.model.summary --memory``) against a measured CPU step. Not a test.

    python -m benchmarks.memory_plan [--config configs/flexformer_n_247m.yaml] [--zero 1]
                                     [--precision bf16] [--micro-batch 1] [--seq-len 32]
                                     [--out docs/results/memory_plan_247m.json]

Runs the real trainer (``python -m megaflex.train``, one CPU rank, synthetic tokens) for one
optimizer step of the config and reads its peak RSS from metrics.jsonl; then the same run with
configs/tiny.yaml's model, whose peak is the interpreter, torch, DeepSpeed and the data pipeline
(the tiny model's own ~0.03 GB included). The model's measured memory is the difference, compared
with the plan's total at the same micro-batch, sequence length, ZeRO stage and precision. The
sequence is short because bf16 matmuls are emulated on CPUs without AVX-512 (the 247M step at 256
tokens ran over 10 minutes here); at this size weights, gradients and optimizer states dominate.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from benchmarks.trainer_steps import REPO, TINY_CONFIG, trainer_steps
from megaflex.cli_args import existing_file, positive_int, scratch_results, writable_file
from megaflex.model.cross_entropy import DEFAULT_LOSS_CHUNK_TOKENS
from megaflex.model.memory_plan import memory_plan
from megaflex.model.summary import load_model_config

MIB = 2**20
BASELINE_CONFIG = TINY_CONFIG
PLAN_BYTES = ("weights", "gradients", "optimizer", "activations", "activations_checkpointed", "total", "total_checkpointed")


def step_peak_mib(config: Path, zero: int, precision: str, micro_batch: int, seq_len: int,
                  loss_chunk_tokens: int = DEFAULT_LOSS_CHUNK_TOKENS) -> float:
    """Rank 0's peak RSS (MiB) after one optimizer step of ``config``'s model on one CPU rank."""
    records = trainer_steps(config, [
        f"data.seq_len={seq_len}", f"train.micro_batch_size={micro_batch}", f"train.global_batch_size={micro_batch}",
        f"parallel.zero_stage={zero}", f"train.precision={precision}", f"train.loss_chunk_tokens={loss_chunk_tokens}",
    ], steps=1)
    return max(r["memory_mb"] for r in records)


def compare(config: Path, zero: int = 1, precision: str = "bf16", micro_batch: int = 1, seq_len: int = 32,
            loss_chunk_tokens: int = DEFAULT_LOSS_CHUNK_TOKENS) -> dict[str, Any]:
    """Measured model memory of one step (peak minus the tiny model's run) and the plan's numbers."""
    peak = step_peak_mib(config, zero, precision, micro_batch, seq_len, loss_chunk_tokens)
    baseline = step_peak_mib(BASELINE_CONFIG, zero, precision, micro_batch, min(seq_len, 256), loss_chunk_tokens)
    plan = memory_plan(load_model_config(config), zero=zero, micro_batch=micro_batch, seq_len=seq_len, precision=precision,
                       loss_chunk_tokens=loss_chunk_tokens)
    measured = peak - baseline
    return {
        "config": str(config.relative_to(REPO) if config.is_relative_to(REPO) else config),
        "zero": zero, "precision": precision, "micro_batch": micro_batch, "seq_len": seq_len,
        "loss_chunk_tokens": loss_chunk_tokens, "device": "cpu, 1 rank",
        "peak_rss_mib": round(peak, 1), "baseline_rss_mib": round(baseline, 1), "measured_model_mib": round(measured, 1),
        "plan_mib": {k: round(v / MIB, 1) for k, v in plan.to_dict().items() if k in PLAN_BYTES},
        "parameters": plan.parameters,
        "plan_over_measured": round(plan.total / MIB / measured, 3),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=existing_file, default=REPO / "configs" / "flexformer_n_247m.yaml")
    parser.add_argument("--zero", type=int, default=1, choices=(0, 1, 2))
    parser.add_argument("--precision", default="bf16", choices=("bf16", "fp32"))
    parser.add_argument("--micro-batch", type=positive_int, default=1)
    parser.add_argument("--seq-len", type=positive_int, default=32)
    parser.add_argument("--out", type=writable_file, default=str(scratch_results("memory_plan_247m.json")))
    args = parser.parse_args(argv)
    result = compare(args.config.resolve(), args.zero, args.precision, args.micro_batch, args.seq_len)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
