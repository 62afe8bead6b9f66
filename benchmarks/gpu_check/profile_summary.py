"""The trainer's profile of a few steps (``logging.profile``: ``training/profiling.py`` writes
``rank0.steps<N>-<M>.ops.json``), summarised for gpu_check: device time (CPU time on a CPU run) split
into GEMMs, each attention kernel, feature maps and the rest, per step, and counts of device-to-host
copies and ``.item()``-style reads.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from megaflex.training.profiling import read_ops

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


def summarize(ops_json: Path) -> dict[str, Any]:
    """Per-step ms by category (device kernels on GPU, self CPU time of ops on CPU), the attention
    kernels one by one, the top 15 entries, and device-to-host copy counts per step."""
    profile = read_ops(ops_json)
    steps, on_gpu = profile["steps"], profile["device"] == "cuda"
    totals = {"gemm": 0.0, "attention": 0.0, "feature_maps": 0.0, "other": 0.0}
    attention: dict[str, float] = {}
    rows = []
    dtoh = local_scalar = 0
    for op in profile["ops"]:
        name = op["name"]
        if "DtoH" in name or "Device -> Host" in name:
            dtoh += op["count"]
        if name == "aten::_local_scalar_dense":
            local_scalar += op["count"]
        if on_gpu:
            us = op["self_device_us"]
            if op["device_type"] and "CUDA" not in op["device_type"]:
                continue
        else:
            us = op["self_cpu_us"]
        # megaflex.* are record_function ranges around the kernels (their device time is the kernels'
        # own, counted again): counting them inflated attention's share (first H200 run: 70% vs 54%)
        if us <= 0 or name.startswith(("ProfilerStep", "megaflex.")) or "Memcpy" in name or "Memset" in name:
            continue
        ms = us / 1000 / steps
        kind = category(name)
        totals[kind] += ms
        if kind == "attention":
            attention[name[:120]] = attention.get(name[:120], 0.0) + ms
        rows.append((ms, name[:120], kind, op["count"] / steps))
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
