"""LRA ListOps accuracy: softmax, Flexformer_n (the default recipe), Performer and cosFormer encoders,
several seeds, at the LRA recipe scaled to this CPU.

    python -m data_prep.listops --out work_data/listops          # 96k/2k/2k, about 2 minutes
    python -m benchmarks.lra_listops --data work_data/listops --seeds 1234,1235 \\
        --out docs/results/lra_listops

Each (kind, seed) is one ``megaflex.training.classify`` run (bidirectional encoder, mean pooling,
AdamW, warm-up and cosine decay; test accuracy at the best valid step), stored as
``OUT/runs/<kind>_s<seed>.json`` as it finishes; a stored run is not trained again (``--fresh``
retrains), so a stopped benchmark resumes. ``OUT/results.json`` and ``results.md`` hold every
run, mean and standard deviation per kind, and LRA's published accuracies as anchors. Not a test.

LRA's ListOps recipe (Tay et al. 2020): 4 layers, width 512, 8 heads, MLP 1024, batch 32, 5k steps,
lengths up to 2,000. The defaults here are that recipe cut to what two CPU cores train in minutes;
every setting is recorded with the results and can be raised on a GPU (``--device cuda``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any, Sequence

import torch

# LRA's Table 1 (Tay et al. 2020), ListOps test accuracy (%)
LRA_ANCHORS = {"softmax": 36.37, "performer": 18.01, "linear_transformer": 16.13}
KINDS = ("softmax", "flexformer_n", "performer", "cosformer")
_CLASSIFY_FLAGS = ("num_layers", "hidden_size", "num_heads", "ffn_hidden_size", "feature_dim", "steps", "batch_size",
                   "lr", "warmup", "weight_decay", "eval_every", "eval_examples", "max_train_examples", "max_len",
                   "pooling", "device")  # fmt: skip


def run_one(args: argparse.Namespace, kind: str, seed: int) -> dict[str, Any]:
    """One classify run in this process (``--threads`` torch threads)."""
    from megaflex.training.classify import ClassifyConfig, train

    cfg = ClassifyConfig(task="listops", data=args.data, attention=kind, seed=seed,
                         **{name: getattr(args, name) for name in _CLASSIFY_FLAGS})  # fmt: skip
    return train(cfg, log=lambda line: print(f"[{kind} s{seed}] {line}", flush=True))


def summarise(rows: list[dict[str, Any]], kinds: Sequence[str]) -> dict[str, Any]:
    """Per kind: test accuracy (%) of each seed, mean, standard deviation (n - 1)."""
    out = {}
    for kind in kinds:
        accs = [100 * r["test_accuracy"] for r in rows if r["config"]["attention"] == kind]
        if accs:
            out[kind] = {"seeds": len(accs), "test_accuracy": accs, "mean": statistics.mean(accs),
                         "std": statistics.stdev(accs) if len(accs) > 1 else None}  # fmt: skip
    return out


def write_report(out: Path, rows: list[dict[str, Any]], kinds: Sequence[str], args: argparse.Namespace) -> None:
    summary = summarise(rows, kinds)
    majority = 100 * rows[0]["majority_test_accuracy"] if rows else None
    config = {k: v for k, v in vars(args).items() if k != "fresh"}
    (out / "results.json").write_text(json.dumps({"config": config, "summary": summary, "lra_anchors": LRA_ANCHORS,
                                                  "majority_test_accuracy": majority, "runs": rows}, indent=1) + "\n")  # fmt: skip
    meta_path = Path(args.data) / "basic_meta.json"  # written by data_prep.listops
    lengths = json.loads(meta_path.read_text())["lra_length"]["test"] if meta_path.is_file() else None
    data = f"Data: `{args.data}`" + (f", test lengths {lengths['min']}-{lengths['max']} (mean {lengths['mean']:.0f}) "
                                    "in LRA's count (operators 2, digits 1)" if lengths else "") + "."  # fmt: skip
    lines = ["# LRA ListOps, generated locally (`python -m benchmarks.lra_listops`)", "", data, "",
             f"Recipe: {args.num_layers} layers, width {args.hidden_size}, {args.num_heads} heads, MLP {args.ffn_hidden_size}, "
             f"F = {args.feature_dim}, batch {args.batch_size}, {args.steps} steps (lr {args.lr}), mean pooling; "
             f"test accuracy (2,000 examples) at the best valid step. Always answering the most frequent label "
             f"scores {majority:.2f}%." if majority is not None else "", "",
             "| kind | seeds | test accuracy (%) | mean ± std | LRA's (%) |", "|---|---|---|---|---|"]  # fmt: skip
    for kind, s in summary.items():
        spread = f"{s['mean']:.2f}" + (f" ± {s['std']:.2f}" if s["std"] is not None else "")
        anchor = LRA_ANCHORS.get(kind, "")
        lines.append(f"| {kind} | {s['seeds']} | {', '.join(f'{a:.2f}' for a in s['test_accuracy'])} | {spread} | {anchor} |")
    lines += ["", f"LRA's Linear Transformer: {LRA_ANCHORS['linear_transformer']}%. Settings: `results.json`."]
    (out / "results.md").write_text("\n".join(lines) + "\n")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.lra_listops", description=__doc__.split("\n\n")[0])
    p.add_argument("--data", required=True, help="folder of basic_{train,val,test}.tsv (data_prep.listops or LRA's)")
    p.add_argument("--kinds", default=",".join(KINDS))
    p.add_argument("--seeds", default="1234,1235,1236")
    p.add_argument("--out", default="docs/results/lra_listops")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--fresh", action="store_true", help="retrain stored runs")
    p.add_argument("--num-layers", type=int, default=2)
    p.add_argument("--hidden-size", type=int, default=64)
    p.add_argument("--num-heads", type=int, default=2)
    p.add_argument("--ffn-hidden-size", type=int, default=128)
    p.add_argument("--feature-dim", type=int, default=32)
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=80)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--eval-every", type=int, default=150)
    p.add_argument("--eval-examples", type=int, default=400, help="valid examples per evaluation (0: all)")
    p.add_argument("--max-train-examples", type=int, default=0)
    p.add_argument("--max-len", type=int, default=2000)
    p.add_argument("--pooling", default="mean")
    p.add_argument("--device", default="cpu")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    kinds = [k for k in args.kinds.split(",") if k]
    seeds = [int(s) for s in args.seeds.split(",") if s]
    out = Path(args.out)
    (out / "runs").mkdir(parents=True, exist_ok=True)
    rows = []
    for seed in seeds:  # seed-major: a stopped benchmark still has whole seeds
        for kind in kinds:
            path = out / "runs" / f"{kind}_s{seed}.json"
            if path.is_file() and not args.fresh:
                rows.append(json.loads(path.read_text()))
                continue
            row = run_one(args, kind, seed)
            path.write_text(json.dumps(row, indent=1) + "\n")
            rows.append(row)
            write_report(out, rows, kinds, args)
    write_report(out, rows, kinds, args)
    print(f"[lra_listops] {len(rows)} runs; results in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
