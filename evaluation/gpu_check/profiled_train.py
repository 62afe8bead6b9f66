"""``megaflex-train`` with torch.profiler around chosen optimizer steps, summarised to JSON.

    python -m evaluation.gpu_check.profiled_train --steps 6 8 --json P.json -- --config ... overrides

The trainer is the real one (``megaflex.training.train.main``); the profiler starts when step
``first - 1`` is logged and stops when step ``last`` is (train records, so ``logging.log_interval=1``).
The summary splits device time (CPU time on a CPU run) into GEMMs, each attention kernel, feature
maps and the rest, per step, and counts device-to-host copies and ``.item()``-style reads.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

GEMM = re.compile(r"gemm|cutlass|cublas|xmma|nvjet|^aten::(mm|addmm|bmm|baddbmm|addbmm|_addmm_activation)_?$", re.I)
ATTENTION = re.compile(r"chunk_|gla|flash|fmha|attention|scaled_dot_product|linear_attention", re.I)
FEATURE_MAP = re.compile(r"\b(cos|sin)|cos_|sin_|sincos|trig|feature", re.I)


def category(name: str) -> str:
    if GEMM.search(name):
        return "gemm"
    if ATTENTION.search(name):
        return "attention"
    if FEATURE_MAP.search(name):
        return "feature_maps"
    return "other"


def summarize(events: list[Any], steps: int, on_gpu: bool) -> dict[str, Any]:
    """Per-step ms by category (device kernels on GPU, self CPU time of ops on CPU), the attention
    kernels one by one, the top 15 entries, and device-to-host copy counts per step."""
    totals = {"gemm": 0.0, "attention": 0.0, "feature_maps": 0.0, "other": 0.0}
    attention: dict[str, float] = {}
    rows = []
    dtoh = local_scalar = 0
    for evt in events:
        name = evt.key
        if "DtoH" in name or "Device -> Host" in name:
            dtoh += evt.count
        if name == "aten::_local_scalar_dense":
            local_scalar += evt.count
        if on_gpu:
            us = getattr(evt, "self_device_time_total", 0.0) or 0.0
            if getattr(evt, "device_type", None) is not None and "CUDA" not in str(evt.device_type):
                continue
        else:
            us = evt.self_cpu_time_total
        if us <= 0 or name.startswith("ProfilerStep") or "Memcpy" in name or "Memset" in name:
            continue
        ms = us / 1000 / steps
        kind = category(name)
        totals[kind] += ms
        if kind == "attention":
            attention[name[:120]] = attention.get(name[:120], 0.0) + ms
        rows.append((ms, name[:120], kind, evt.count / steps))
    rows.sort(reverse=True)
    total = sum(totals.values())
    return {
        "steps": steps,
        "time": "device kernels" if on_gpu else "CPU ops (self time)",
        "ms_per_step": {k: round(v, 3) for k, v in totals.items()},
        "share": {k: round(v / total, 4) if total else None for k, v in totals.items()},
        "attention_kernels_ms_per_step": {k: round(v, 3) for k, v in sorted(attention.items(), key=lambda kv: -kv[1])},
        "top": [{"name": n, "kind": k, "ms_per_step": round(ms, 3), "calls_per_step": c} for ms, n, k, c in rows[:15]],
        "dtoh_copies_per_step": dtoh / steps,
        "item_reads_per_step": local_scalar / steps,
    }


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", nargs=2, type=int, required=True, metavar=("FIRST", "LAST"))
    ap.add_argument("--json", type=Path, required=True)
    args = ap.parse_args(argv[:split])
    first, last = args.steps

    import torch
    from torch.profiler import ProfilerActivity, profile

    from megaflex.training import metrics
    from megaflex.training.train import main as train_main

    on_gpu = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    prof = profile(activities=activities, record_shapes=False)
    state = {"running": False, "summary": None}
    original_log = metrics.MetricsLogger.log

    def log(self: Any, record: dict[str, Any], scalars: dict[str, float] | None = None) -> None:
        original_log(self, record, scalars)
        if record.get("kind", "train") != "train":
            return
        if record["step"] == first - 1 and not state["running"]:
            if on_gpu:
                torch.cuda.synchronize()
            prof.start()
            state["running"] = True
        elif record["step"] == last and state["running"]:
            if on_gpu:
                torch.cuda.synchronize()
            prof.stop()
            state["running"] = False
            state["summary"] = summarize(list(prof.key_averages()), last - first + 1, on_gpu)

    metrics.MetricsLogger.log = log
    status = train_main(argv[split + 1 :])
    args.json.write_text(json.dumps(state["summary"] or {"error": f"steps {first}-{last} were not all logged"}, indent=1))
    return status


if __name__ == "__main__":
    sys.exit(main())
