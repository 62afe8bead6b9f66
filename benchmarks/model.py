"""Training throughput and peak memory vs sequence length: Flexformer_n GPT vs a same-size softmax GPT.

    python -m benchmarks.model                                    # 1k ... 32k, both kinds
    python -m benchmarks.model --seq-lens 1024,2048 --steps 2     # quick
    python -m benchmarks.model --seq-lens 256,512 --batch-size 8 --hidden-size 128 \
        --vocab-size 4096 --steps 5 --rounds 3 --threads 1 \
        --out docs/results/model_kernel_shape                      # the kernel-study shape
    python -m benchmarks.model --encoder-towers 2 --kinds softmax,softmax_math,flexformer_n_capped --seq-lens 4000 \
        --batch-size 1 --vocab-size 260 --hidden-size 128 --num-heads 4 --feature-dim 128 --steps 2 \
        --rounds 2 --threads 2 --out docs/results/lra_retrieval_speed   # LRA Retrieval's shape

A kind is an attention kind (``benchmarks.common.model_config``'s suffixes apply), or ``softmax_math``:
softmax through SDPA's math kernel, which holds the N x N weights as the vanilla Transformer does.
Each (kind, sequence length) runs in a fresh subprocess (so peak memory is its own): one
training step (forward, backward, AdamW) untimed, then ``--steps`` timed ones of ``--batch-size``
sequences (default 1). The kinds alternate per length, ``--rounds`` times; each row keeps its
best round (on a shared machine, the least disturbed one). CPU workers run with
``benchmarks.common.MALLOC_TUNING`` (glibc never mmaps or trims, as ``launch/setup_env.sh`` sets on CPU
nodes) unless ``--no-malloc-tuning``: with glibc's defaults every step's temporaries fault their
pages in again (at the kernel-study shape: 20-25% fewer tokens/s for every kind, and window
hybrid / plain kernel ratios 0.03-0.05 higher, since that cost hides the hybrid's own).
Peak memory: ``torch.cuda.max_memory_allocated`` on GPU; on CPU the growth of the process's
peak resident set (VmHWM, ``megaflex.training.metrics.peak_rss_kib``) over its value once the model and optimizer exist, i.e.
activations, gradients and optimizer states. A run that exceeds ``--timeout`` seconds is
recorded as such. Writes ``model.json``, ``model_throughput.png`` and ``model_memory.png`` under
``--out``. Not a test.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from benchmarks.common import MALLOC_TUNING, add_model_arguments, model_config, worker_env
from megaflex.cli_args import (
    available_device, positive_float, positive_int, positive_int_list, scratch_results, writable_dir,
)
from megaflex.training.metrics import peak_rss_kib

REPO = Path(__file__).resolve().parents[1]
DEFAULT_SEQ_LENS = "1024,2048,4096,8192,16384,32768"


def _rss_mb() -> float:
    return peak_rss_kib() / 1024  # this process's own peak (megaflex.training.metrics)


def worker(args: argparse.Namespace) -> dict[str, Any]:
    """One (kind, seq_len) measurement in this process."""
    from megaflex.model.gpt import GPT

    torch.manual_seed(0)
    if args.threads:
        torch.set_num_threads(args.threads)
    # "softmax_math": softmax through SDPA's math kernel, which materialises the N x N weights like
    # the vanilla Transformer (the default kernels never hold them)
    kind, math_kernel = (args.kind.removesuffix("_math"), True) if args.kind.endswith("_math") else (args.kind, False)
    config = model_config(args, kind, max_seq_len=args.seq_len)
    towers = args.encoder_towers
    if towers:  # the encoder classifier (bidirectional) over one sequence or a pair of documents
        from megaflex.model.encoder import EncoderClassifier

        model = EncoderClassifier(dataclasses.replace(config, causal=False, kernel_decay="auto"), 2, "mean", towers).to(args.device).train()
        docs = torch.randint(0, config.vocab_size, (towers, args.batch_size, args.seq_len), device=args.device)
        labels = torch.randint(0, 2, (args.batch_size,), device=args.device)
        forward = lambda: model(docs[0], labels=labels, pair_ids=docs[1] if towers == 2 else None).loss  # noqa: E731
    else:
        model = GPT(config).to(args.device).train()
        ids = torch.randint(0, config.vocab_size, (args.batch_size, args.seq_len + 1), device=args.device)
        forward = lambda: model(ids[:, :-1], labels=ids[:, 1:]).loss  # noqa: E731
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    cuda = args.device.startswith("cuda")

    def step() -> None:
        with sdpa_kernel([SDPBackend.MATH]) if math_kernel else contextlib.nullcontext():
            loss = forward()
            loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()

    base = _rss_mb()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    step()  # warm-up (also allocates the optimizer states)
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    seconds = min(times)
    return {
        "kind": args.kind, "seq_len": args.seq_len, "batch_size": args.batch_size, "encoder_towers": towers,
        "tokens_per_s": args.batch_size * args.seq_len * max(1, towers) / seconds,
        "step_seconds": seconds, "num_parameters": sum(p.numel() for p in model.parameters()),
        "peak_memory_mb": torch.cuda.max_memory_allocated() / 2**20 if cuda else _rss_mb() - base,
        "memory_kind": "cuda max_memory_allocated" if cuda else "peak RSS growth over model+optimizer",
    }


def run_one(args: argparse.Namespace, kind: str, seq_len: int) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "benchmarks.model", "--worker", "--kind", kind, "--seq-len", str(seq_len)]
    for name in ("steps", "batch_size", "vocab_size", "num_layers", "hidden_size", "num_heads", "feature_dim", "threads",
                 "encoder_towers"):
        cmd += ["--" + name.replace("_", "-"), str(getattr(args, name))]
    cmd += ["--device", args.device]
    try:
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=args.timeout,
                              env=worker_env(not args.no_malloc_tuning))
    except subprocess.TimeoutExpired:
        return {"kind": kind, "seq_len": seq_len, "error": f"timeout after {args.timeout}s"}
    if proc.returncode != 0:
        return {"kind": kind, "seq_len": seq_len, "error": proc.stderr.strip().splitlines()[-1:]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.model", description=__doc__.split("\n\n")[0])
    p.add_argument("--kinds", default="flexformer_n,softmax")
    p.add_argument("--seq-lens", type=positive_int_list, default=DEFAULT_SEQ_LENS)
    p.add_argument("--steps", type=positive_int, default=2)
    p.add_argument("--rounds", type=positive_int, default=1, help="alternations of the kinds per length; best round kept")
    p.add_argument("--batch-size", type=positive_int, default=1, help="sequences (pairs with 2 towers) per step (8 at the kernel-study shape)")
    p.add_argument("--encoder-towers", type=int, default=0, choices=(0, 1, 2),
                   help="0: the causal LM; 1 or 2: the bidirectional encoder classifier over one sequence or a pair "
                        "of documents (LRA Text / Retrieval; megaflex.model.encoder)")
    add_model_arguments(p)
    p.add_argument("--timeout", type=positive_float, default=900.0, help="seconds per (kind, seq_len) run")
    p.add_argument("--device", type=available_device, default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", type=writable_dir, default=str(scratch_results("model")))
    p.add_argument("--no-malloc-tuning", action="store_true", help="run workers with glibc malloc defaults")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--kind", default=None, help=argparse.SUPPRESS)
    p.add_argument("--seq-len", type=positive_int, default=None, help=argparse.SUPPRESS)
    return p


def main(argv: Sequence[str] | None = None) -> dict[str, Any] | None:
    args = build_parser().parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args)))
        return None
    from megaflex.eval.plotting import line_plot, write_json

    kinds = [k for k in args.kinds.split(",") if k]
    rows = []
    # kinds alternate per length (and per round), so each ratio compares runs taken close together
    # on a shared machine; a row keeps the best round's tokens/s (the least disturbed one)
    for seq_len in args.seq_lens:
        best: dict[str, dict[str, Any]] = {}
        for _ in range(args.rounds):
            for kind in kinds:
                r = run_one(args, kind, seq_len)
                summary = r["error"] if "error" in r else f"{r['tokens_per_s']:.0f} tok/s, peak +{r['peak_memory_mb']:.0f} MB"
                print(f"{kind:>14} seq {seq_len:>6}: {summary}", flush=True)
                if kind not in best or "error" in best[kind] or r.get("tokens_per_s", 0) > best[kind]["tokens_per_s"]:
                    best[kind] = r
        rows += [best[kind] for kind in kinds]
    config = {k: v for k, v in vars(args).items() if k not in ("worker", "kind", "seq_len", "out")}
    config["malloc_env"] = {} if args.no_malloc_tuning else MALLOC_TUNING
    result = {"config": config, "rows": rows}
    write_json(f"{args.out}/model.json", result)
    ok = [r for r in rows if "error" not in r]
    line_plot(f"{args.out}/model_throughput.png",
              {k: [(r["seq_len"], r["tokens_per_s"]) for r in ok if r["kind"] == k] for k in kinds},
              title=f"Training throughput (batch {args.batch_size})", xlabel="sequence length", ylabel="tokens / s", logx=True)
    line_plot(f"{args.out}/model_memory.png",
              {k: [(r["seq_len"], r["peak_memory_mb"]) for r in ok if r["kind"] == k] for k in kinds},
              title="Peak training memory", xlabel="sequence length", ylabel="MB", logx=True, logy=True)
    return result


if __name__ == "__main__":
    main()
