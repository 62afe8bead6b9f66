"""Compile every Triton kernel launch of every shipped config for A100 (sm_80) and H100 (sm_90), here.

    python -m benchmarks.triton_aot --out docs/results/triton_aot.json [--dtypes bf16 fp16 fp32]

For each linear-attention config in configs/ (feature dim F, head dim = value dim, default
chunk) and each input dtype, ``megaflex.attention.triton.aot`` records the launches the
dispatcher makes in forward + backward (at B = 1 and B = 8: the scans' blocks depend on the
number of programs), compiles each distinct one with Triton's compiler and ptxas (no GPU needed)
and reads shared memory, registers and spills. Exit status 1 when a launch needs more shared
memory than its target has. The JSON holds one row per (launch, target) and which configs use it.
Trig maps (every shipped linear config) take the dispatcher's path, features computed in the
kernels (``trig_linear_attention``'s default); ``--unfused-trig`` compiles its reference path.

    python -m benchmarks.triton_aot --window-only --out docs/results/triton_aot_window.json

``--window`` adds (``--window-only``: compiles only) the one-normaliser window hybrid's Triton form
(``megaflex/attention/triton/window.py``) at the shapes of ``WINDOW_CONFIGS``, its rows labelled
'<config>+window/<dtype>': the window and the lookback are runtime arguments, so one window
compiles every window; the features are given (the feature map runs in torch).

    python -m benchmarks.triton_aot --normalization capped_denominator --dtypes bf16 --out docs/results/triton_aot_capped.json

``--normalization`` compiles every linear config with that output normalisation (the shipped
configs use capped_denominator since round 4, rms before; ``chunk_outputs`` specialises on it).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from dataclasses import dataclass
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch
import yaml

from megaflex.attention.triton.aot import (
    SHARED_MEMORY_LIMIT, Compiled, Launch, compile_launch, record_launches, record_window_launches,
)  # fmt: skip
from megaflex.attention import AttentionCore
from megaflex.attention.normalize import NORMALIZATIONS
from megaflex.cli_args import existing_file, positive_int, scratch_results, writable_file
from megaflex.model.config import ModelConfig

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
ARCHS = (80, 90)
BATCHES = (1, 8)
# configs whose shapes the window hybrid's kernels are compiled at (``model.softmax_window`` on them)
WINDOW_CONFIGS = ("flexformer_n_247m", "flexformer_n_1.3b")
WINDOW_SUFFIX = "+window"


@dataclass(frozen=True)
class Shape:
    """What the kernels see of one config: heads, F, Dv (= head dim), chunk, normalisation, and
    for trig maps (the kernels compute their features) whether the map is paired."""

    heads: int
    feat: int
    dv: int
    chunk: int
    normalization: str
    trig: bool = False
    paired: bool = False


def shipped_shapes(config_dir: Path = CONFIG_DIR) -> dict[Shape, list[str]]:
    """Kernel shapes of the linear-attention configs in ``config_dir`` -> the config names using each."""
    shapes: dict[Shape, list[str]] = {}
    for path in sorted(config_dir.glob("*.yaml")):
        model = (yaml.safe_load(path.read_text()) or {}).get("model")
        if not model:
            continue
        config = ModelConfig(**model)
        if config.attention == "softmax":
            continue
        core = AttentionCore(
            config.attention, config.num_heads, config.head_dim, feature_dim=config.feature_dim,
            max_seq_len=config.max_seq_len, **config.feature_kwargs,
        )  # fmt: skip
        spec = core.feature_map.trig_spec() if hasattr(core.feature_map, "trig_spec") else None
        shape = Shape(
            config.num_heads, config.feature_dim, config.head_dim, config.chunk_size, config.normalization,
            trig=spec is not None, paired=spec is not None and spec[2],
        )  # fmt: skip
        shapes.setdefault(shape, []).append(path.stem)
    return shapes


def launches_of(shapes: dict[Shape, list[str]], dtypes: list[str], fused_trig: bool = True) -> dict[Launch, set[str]]:
    """Distinct launches (forward + backward, B in ``BATCHES``) -> '<config>/<dtype>' using them.
    ``fused_trig``: trig maps take ``trig_linear_attention``'s default path (features computed in
    the kernels, what the dispatcher runs); False: its reference path (``fused_map=False``,
    features computed in torch and given to the kernels)."""
    found: dict[Launch, set[str]] = {}
    for shape, names in shapes.items():
        for dtype in dtypes:
            for batch in BATCHES:
                for launch in record_launches(
                    shape.feat, shape.dv, DTYPES[dtype], shape.chunk, bh=batch * shape.heads, normalization=shape.normalization,
                    trig_head_dim=shape.dv if shape.trig and fused_trig else None, paired=shape.paired,
                ):
                    found.setdefault(launch, set()).update(f"{name}/{dtype}" for name in names)
    return found


def window_launches_of(shapes: dict[Shape, list[str]], dtypes: list[str]) -> dict[Launch, set[str]]:
    """Distinct launches of the window hybrid's Triton form (forward + backward, B in ``BATCHES``) at
    the shapes of ``WINDOW_CONFIGS`` -> '<config>+window/<dtype>' using them."""
    found: dict[Launch, set[str]] = {}
    for shape, names in shapes.items():
        names = [name for name in names if name in WINDOW_CONFIGS]
        for dtype in dtypes if names else []:
            for batch in BATCHES:
                for launch in record_window_launches(shape.dv, shape.feat, shape.dv, DTYPES[dtype], shape.chunk, bh=batch * shape.heads):
                    found.setdefault(launch, set()).update(f"{name}{WINDOW_SUFFIX}/{dtype}" for name in names)
    return found


def markdown_table(report: dict, configs: tuple[str, ...] = ("flexformer_n_247m", "flexformer_n_1.3b"), dtype: str = "bf16") -> str:
    """The table in docs/design.md "GPU": per config and kernel, shared memory / registers / spills on sm_80 and sm_90."""
    lines = [
        "| config | kernel | blocks, warps, stages | sm_80 smem / regs / spill B | sm_90 smem / regs / spill B |",
        "|---|---|---|---|---|",
    ]
    for config in configs:
        cells: dict[tuple[str, str], dict[int, str]] = {}
        for row in report["kernels"]:
            if f"{config}/{dtype}" not in row["configs"]:
                continue
            blocks = row["constexprs"]
            if "BF" not in blocks:  # trig_grads (fused trig path): frequency blocks BJ
                blocks = blocks | {"BF": blocks["BJ"], "BV": "-"}
            name = row["kernel"] + (" (bwd)" if blocks.get("BACKWARD") else "")
            head = f" BD={blocks['BD']}" if blocks.get("TRIG", "BJ" in blocks) else ""  # head-dim block of in-kernel features
            key = (name, f"C={blocks['CHUNK']} BF={blocks['BF']} BV={blocks['BV']}{head} w={row['num_warps']} s={row['num_stages']}")
            cells.setdefault(key, {})[row["arch"]] = f"{row['shared_bytes']:,} / {row['registers']} / {row['spill_store_bytes']}"
        for (name, blocks), by_arch in cells.items():
            lines.append(f"| {config} | {name} | {blocks} | {by_arch.get(80, '-')} | {by_arch.get(90, '-')} |")
    return "\n".join(lines)


def _compile_one(job: tuple[Launch, int]) -> Compiled:
    return compile_launch(*job)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=writable_file, default=str(scratch_results("triton_aot.json")))
    parser.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), default=["bf16", "fp16", "fp32"])
    parser.add_argument("--archs", nargs="+", type=int, choices=ARCHS, default=list(ARCHS))
    parser.add_argument(
        "--unfused-trig", action="store_true", help="trig maps on the reference path (trig_linear_attention(fused_map=False))"
    )
    parser.add_argument("--window", action="store_true", help="add the window hybrid's launches (WINDOW_CONFIGS' shapes)")
    parser.add_argument("--window-only", action="store_true", help="compile the window hybrid's launches only")
    parser.add_argument("--normalization", choices=NORMALIZATIONS,
                        help="compile every linear config with this output normalisation instead of its own")
    parser.add_argument("--table", type=existing_file, help="print the docs/design.md table of this report (JSON) and exit")
    parser.add_argument("--jobs", type=positive_int, default=os.cpu_count() or 1, help="compiles in parallel (default: one per CPU)")
    args = parser.parse_args(argv)
    if args.table:
        print(markdown_table(json.loads(args.table.read_text())))
        return 0
    import triton

    start = time.perf_counter()
    shapes = shipped_shapes()
    if args.normalization:
        renamed: dict[Shape, list[str]] = {}
        for shape, names in shapes.items():
            renamed.setdefault(dataclasses.replace(shape, normalization=args.normalization), []).extend(names)
        shapes = renamed
    found = {} if args.window_only else launches_of(shapes, args.dtypes, not args.unfused_trig)
    if args.window or args.window_only:
        for launch, users in window_launches_of(shapes, args.dtypes).items():
            found.setdefault(launch, set()).update(users)
    jobs = [(launch, arch, sorted(users)) for launch, users in found.items() for arch in args.archs]
    rows = []
    with ProcessPoolExecutor(args.jobs) as pool:  # each compile is one single-threaded ptxas run
        for (_, _, users), compiled in zip(jobs, pool.map(_compile_one, [job[:2] for job in jobs])):
            row = compiled.as_dict() | {"configs": users}
            rows.append(row)
            print(
                f"sm_{row['arch']} {row['kernel']:18s} {row['dtype']:4s} {row['constexprs']} warps={row['num_warps']} "
                f"smem={row['shared_bytes']} regs={row['registers']} spills={row['spill_store_bytes']}"
                + ("" if row["fits"] else "  EXCEEDS SHARED MEMORY"),
                flush=True,
            )
    failures = [r for r in rows if not r["fits"]]
    report = {
        "triton": triton.__version__,
        "trig_path": "features" if args.unfused_trig else "fused",
        "normalization": args.normalization or "each config's",
        "shared_memory_limit": {f"sm_{arch}": limit for arch, limit in SHARED_MEMORY_LIMIT.items()},
        "compiles": len(rows),
        "exceeding_shared_memory": len(failures),
        "spilling": sum(r["spill_store_bytes"] > 0 for r in rows),
        "seconds": round(time.perf_counter() - start, 1),
        "kernels": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1, default=str) + "\n")
    print(f"{len(rows)} compiles, {len(failures)} over shared memory, {report['spilling']} spilling -> {args.out}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
