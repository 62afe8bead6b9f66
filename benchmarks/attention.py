"""Attention-layer benchmark (not a test): fwd+bwd wall time and peak memory, SDPA vs linear kinds.

    python -m benchmarks.attention [--seq-lens 1024 4096 16384 65536] [--json PATH]

One causal attention layer (``AttentionCore``: feature map included for the linear kinds) at
batch 1, 8 heads, head_dim 64, feature dim F = 128 (64 frequencies for the trig maps), fp32 on
CPU, for: softmax (``F.scaled_dot_product_attention``, causal), flexformer_n / flexformer_s /
performer (chunked form), and flexformer_n with a W-token softmax window under one normaliser
(``flexformer_n_window16`` / ``flexformer_n_window64``: its chunked form, ``window/chunk.py``; ``peak_vs_sdpa``
compares its peak memory with SDPA's). Each (impl, seq_len) runs in a *fresh subprocess*:

* time: one warm-up fwd+bwd, then ``--repeats`` timed fwd+bwd (loss = <out, fixed random probe>);
  ``fwd_bwd_s`` is the best, ``fwd_bwd_s_median`` the median. SDPA above ``--sdpa-max-seq`` is not
  run but *estimated* from the longest measured SDPA length by quadratic scaling
  (``"estimated": true``); at or below it, lengths > 16k run once without warm-up (minutes each).
* allocator: workers run with ``MALLOC_TUNING`` (glibc never mmaps/trims; ``benchmarks/common.py``) unless
  ``--no-malloc-tuning``.
* peak memory: ``peak_mem_mb`` = the process's peak RSS (VmHWM) during the first fwd+bwd minus its
  RSS just before it (inputs and parameters already allocated, ``torch.utils.checkpoint`` imported):
  the extra memory the layer's forward + backward needs, activations and temporaries included.
  It varies between fresh processes (SDPA's at 16k tokens: 228-230 or 260-262 MB): ``--processes P``
  runs P of them per row and keeps the median peak (each in ``peak_mem_mb_runs``) and the best time.

Also measured: this machine's dense fp32 matmul GFLOP/s (best of 2048^3 and 4096^3 products)
and, for the linear kinds, the GFLOP/s of the matmuls the chunked algorithm executes (see
``linear_layer_flops``) and their fraction of the dense rate. The 1-minute load average is
recorded per row: the machine may be shared, so compare rows measured side by side.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from benchmarks.common import MALLOC_TUNING, worker_env
from megaflex.cli_args import nonnegative_int, positive_float, positive_int, scratch_results, writable_file

REPO = Path(__file__).resolve().parents[1]
IMPLS = ("softmax", "flexformer_n", "flexformer_s", "performer")
# the one-normaliser window hybrid (attention/window/) over flexformer_n: impl "flexformer_n_window<W>"
WINDOW_IMPLS = ("flexformer_n_window16", "flexformer_n_window64")
HEADS, HEAD_DIM, FEATURE_DIM = 8, 64, 128
# issue #2 targets for flexformer_n, checked in the summary
TARGET_SPEEDUP = {4096: 1.0, 16384: 5.0, 65536: 15.0}
TARGET_RATIO_64K_16K = 4.3
TARGET_MATMUL_FRACTION = 0.5


def matmul_gflops(repeats: int = 5) -> float:
    """Best dense fp32 matmul rate (GFLOP/s) over square products of size 2048 and 4096."""
    best = 0.0
    for size in (2048, 4096):
        a, b = torch.randn(size, size), torch.randn(size, size)
        a @ b  # warm-up
        for _ in range(repeats):
            t0 = time.perf_counter()
            a @ b
            best = max(best, 2 * size**3 / (time.perf_counter() - t0) / 1e9)
    return best


def linear_layer_flops(impl: str, seq_len: int, chunk_size: int, heads: int = HEADS, head_dim: int = HEAD_DIM,
                       feature_dim: int = FEATURE_DIM) -> float:
    """Matmul FLOPs of one fwd+bwd of a chunked linear-attention layer ("rms"), as executed.

    Per token and head, with F features, Dv = head_dim values, C = chunk size (full C x C
    blocks, masked half included); the state carries one extra k_sum column (Dv + 1), which
    "rms" needs only in the two matmuls that build or differentiate the state from the keys:
      inter-chunk  fwd 2 F (Dv + 1) (k^T v) + 2 F Dv (q S),  bwd 2 x 2 F (Dv + 1) (the chunk
                   states recomputed, d state) + 3 x 2 F Dv
      intra-chunk  fwd 2 C F + 2 C Dv,          bwd 3 x 2 C F + 2 x 2 C Dv
      feature map  projections x [d, P] for q and k, fwd 2 x 2 d P, bwd 2x that (dx, d omega;
                   performer's frozen omega: dx only) plus, for the paired flexformer_n, the
                   projection recomputed; P = projected rows: 2D = F for flexformer_n ([O1; O2])
                   and performer-positive, D = F/2 for flexformer_s.
    ``tests/benchmarks/test_attention_bench.py`` checks this against torch's FLOP counter on the real layer.
    """
    f, dv, c, d = feature_dim, head_dim, min(chunk_size, seq_len), head_dim
    proj_rows = {"flexformer_n": f, "flexformer_s": f // 2, "performer": f}[impl]
    inter = 2 * f * (dv + 1) + 2 * f * dv + 2 * 2 * f * (dv + 1) + 3 * 2 * f * dv
    # forward + dx (+ d omega for learnable frequencies) (+ the paired map's recomputed projection)
    map_passes = {"flexformer_n": 4, "flexformer_s": 3, "performer": 2}[impl]
    per_token = inter + (2 * c * f + 2 * c * dv) + (6 * c * f + 4 * c * dv) + map_passes * (2 * 2 * d * proj_rows)
    return float(per_token) * seq_len * heads


def _rss_kb(field: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def run_one(impl: str, seq_len: int, chunk_size: int, repeats: int, warmup: bool, segment_tokens: int = 0) -> dict:
    """Time fwd+bwd of one layer in this process (meant to be a fresh subprocess)."""
    from megaflex.attention import AttentionCore

    torch.manual_seed(0)
    kind, _, window = impl.partition("_window")
    core = AttentionCore(kind, HEADS, HEAD_DIM, feature_dim=FEATURE_DIM, chunk_size=chunk_size, max_seq_len=seq_len)
    if window:
        from megaflex.attention.hybrid import LocalMixingCore

        core = LocalMixingCore(core, window=int(window))
        if segment_tokens:
            core.segment_tokens = segment_tokens
    q, k, v = (torch.randn(1, HEADS, seq_len, HEAD_DIM).mul_(0.5).requires_grad_() for _ in range(3))
    probe = torch.randn(1, HEADS, seq_len, HEAD_DIM)

    def step() -> float:
        for t in (q, k, v, *core.parameters()):
            t.grad = None
        t0 = time.perf_counter()
        out, _ = core(q, k, v)
        out.backward(probe)
        return time.perf_counter() - t0

    # torch.utils.checkpoint's first call (the hybrid's long-sequence segments) imports ~900 modules
    # (~146 MB RSS): a one-time cost of the process, not the layer's memory; pay it before measuring
    from torch.utils.checkpoint import checkpoint

    checkpoint(torch.neg, torch.zeros(1, requires_grad=True), use_reentrant=True)
    rss_before = _rss_kb("VmRSS")
    first = step()
    peak_mb = (_rss_kb("VmHWM") - rss_before) / 1024
    times = [step() for _ in range(repeats)] if warmup else [first]
    return {
        "impl": impl,
        "seq_len": seq_len,
        "fwd_bwd_s": min(times),
        "fwd_bwd_s_median": statistics.median(times),
        "peak_mem_mb": round(peak_mb, 1),
        "runs": len(times),
        "chunk_size": chunk_size if impl != "softmax" else None,
        "estimated": False,
        "load_avg_1m": round(os.getloadavg()[0], 2),
    }


def flexformer_n_targets(results: list[dict]) -> dict:
    """The issue #2 targets for flexformer_n, from rows measured side by side: value and pass/fail."""
    rows = {r["seq_len"]: r for r in results if r["impl"] == "flexformer_n"}
    summary: dict = {}
    for seq_len, target in TARGET_SPEEDUP.items():
        if "speedup_vs_sdpa" in rows.get(seq_len, {}):
            speedup = rows[seq_len]["speedup_vs_sdpa"]
            summary[f"speedup_vs_sdpa_{seq_len}"] = {"value": speedup, "target": target, "met": speedup >= target}
    if 16384 in rows and 65536 in rows:
        ratio = round(rows[65536]["fwd_bwd_s"] / rows[16384]["fwd_bwd_s"], 2)
        summary["time_64k_over_16k"] = {"value": ratio, "target": TARGET_RATIO_64K_16K, "met": ratio <= TARGET_RATIO_64K_16K}
    for seq_len, row in sorted(rows.items()):
        fraction = row["matmul_fraction"]
        summary[f"matmul_fraction_{seq_len}"] = {"value": fraction, "target": TARGET_MATMUL_FRACTION,
                                                 "met": fraction >= TARGET_MATMUL_FRACTION}
    return summary


def merge_processes(rows: list[dict]) -> dict:
    """One row of several fresh processes' rows of one (impl, seq_len): the best time, the median
    peak memory, and every process's peak (``peak_mem_mb_runs``) when there are several."""
    row = dict(min(rows, key=lambda r: r["fwd_bwd_s"]))
    if len(rows) > 1:
        peaks = [r["peak_mem_mb"] for r in rows]
        row.update(peak_mem_mb=statistics.median(peaks), peak_mem_mb_runs=peaks, processes=len(rows))
    return row


def run_subprocess(impl: str, seq_len: int, chunk_size: int, repeats: int, warmup: bool, timeout: float,
                   malloc_tuning: bool, segment_tokens: int = 0) -> dict:
    cmd = [sys.executable, "-m", "benchmarks.attention", "--worker", impl, str(seq_len),
           "--chunk-size", str(chunk_size), "--repeats", str(repeats), "--segment-tokens", str(segment_tokens)]
    cmd += [] if warmup else ["--no-warmup"]
    env = worker_env(malloc_tuning)
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"worker {impl} {seq_len} failed:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq-lens", type=positive_int, nargs="+", default=[1024, 4096, 16384, 65536])
    parser.add_argument("--impls", nargs="+", default=list(IMPLS), choices=IMPLS + WINDOW_IMPLS)
    parser.add_argument("--json", type=writable_file, default=str(scratch_results("bench_attention.json")),
                        help="where to write the results (docs/results/bench_attention.json: the committed ones)")
    parser.add_argument("--chunk-size", type=positive_int, default=64, help="chunk size of the linear kinds")
    parser.add_argument("--repeats", type=positive_int, default=3)
    parser.add_argument("--segment-tokens", type=nonnegative_int, default=0,
                        help="window hybrids: LocalMixingCore.segment_tokens (0: its default, 512)")
    parser.add_argument("--processes", type=positive_int, default=1,
                        help="fresh processes per (impl, length): best time, median peak memory")
    parser.add_argument("--sdpa-max-seq", type=positive_int, default=65536, help="longer SDPA runs are estimated, not run")
    parser.add_argument("--timeout", type=positive_float, default=1800.0, help="per-config subprocess timeout (s)")
    parser.add_argument("--no-malloc-tuning", action="store_true", help="run workers with glibc malloc defaults")
    parser.add_argument("--worker", nargs=2, metavar=("IMPL", "SEQ_LEN"), help=argparse.SUPPRESS)
    parser.add_argument("--no-warmup", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.worker:
        impl, seq_len = args.worker[0], int(args.worker[1])
        print(json.dumps(run_one(impl, seq_len, args.chunk_size, args.repeats, not args.no_warmup, args.segment_tokens)))
        return

    gflops = matmul_gflops()
    load_start = os.getloadavg()[0]
    print(f"dense fp32 matmul: {gflops:.1f} GFLOP/s ({torch.get_num_threads()} threads), "
          f"load avg {load_start:.2f}", flush=True)
    results: list[dict] = []
    sdpa: dict[int, float] = {}
    sdpa_peak: dict[int, float | None] = {}
    for seq_len in sorted(args.seq_lens):
        for impl in args.impls:
            if impl == "softmax" and seq_len > args.sdpa_max_seq:
                if not sdpa:
                    continue
                ref_len = max(sdpa)
                row = {"impl": impl, "seq_len": seq_len, "fwd_bwd_s": sdpa[ref_len] * (seq_len / ref_len) ** 2,
                       "peak_mem_mb": None, "estimated": True, "estimated_from_seq_len": ref_len}
            else:
                long_sdpa = impl == "softmax" and seq_len > 16384
                row = merge_processes([
                    run_subprocess(impl, seq_len, args.chunk_size, 1 if long_sdpa else args.repeats, not long_sdpa,
                                   args.timeout, not args.no_malloc_tuning, args.segment_tokens)
                    for _ in range(args.processes)
                ])  # fmt: skip
            if impl == "softmax":
                sdpa[seq_len] = row["fwd_bwd_s"]
                sdpa_peak[seq_len] = row["peak_mem_mb"]
            elif impl in WINDOW_IMPLS:
                if seq_len in sdpa:
                    row["speedup_vs_sdpa"] = round(sdpa[seq_len] / row["fwd_bwd_s"], 2)
                if sdpa_peak.get(seq_len):
                    row["peak_vs_sdpa"] = round(row["peak_mem_mb"] / sdpa_peak[seq_len], 2)
            else:
                flops = linear_layer_flops(impl, seq_len, args.chunk_size)
                row["gflops"] = round(flops / row["fwd_bwd_s"] / 1e9, 2)
                row["matmul_fraction"] = round(row["gflops"] / gflops, 3)
                if seq_len in sdpa:
                    row["speedup_vs_sdpa"] = round(sdpa[seq_len] / row["fwd_bwd_s"], 2)
            row["fwd_bwd_s"] = round(row["fwd_bwd_s"], 4)
            results.append(row)
            extra = "".join(f"  {key}={row[key]}" for key in ("gflops", "matmul_fraction", "speedup_vs_sdpa", "peak_vs_sdpa", "estimated")
                            if row.get(key))  # fmt: skip
            print(f"{impl:>13} N={seq_len:>6}  {row['fwd_bwd_s']:>9.4f} s  peak {row['peak_mem_mb']} MB{extra}", flush=True)

    summary = flexformer_n_targets(results)
    report = {
        "matmul_gflops": round(gflops, 1),
        "load_avg_1m_start_end": [round(load_start, 2), round(os.getloadavg()[0], 2)],
        "results": results,
        "summary": summary,
        "config": {"batch": 1, "heads": HEADS, "head_dim": HEAD_DIM, "feature_dim": FEATURE_DIM, "dtype": "float32",
                   "chunk_size": args.chunk_size, "repeats": args.repeats, "processes": args.processes,
                   "segment_tokens": args.segment_tokens or None,
                   "threads": torch.get_num_threads(),
                   "torch": torch.__version__, "machine": platform.processor() or platform.machine(),
                   "cpus": os.cpu_count(), "peak_mem": "VmHWM - VmRSS before the first fwd+bwd, fresh process",
                   "malloc_env": {} if args.no_malloc_tuning else MALLOC_TUNING},
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2) + "\n")
    for name, check in summary.items():
        print(f"flexformer_n {name}: {check['value']} (target {check['target']}) {'met' if check['met'] else 'MISSED'}")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
