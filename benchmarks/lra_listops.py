"""LRA ListOps accuracy: softmax, Flexformer_n (the default recipe), Performer and cosFormer encoders,
several seeds, at the LRA recipe scaled to this CPU.

    python -m data_prep.listops --out work_data/listops          # 96k/2k/2k, about 2 minutes
    python -m benchmarks.lra_listops --data work_data/listops --seeds 1234,1235 \\
        --out docs/results/lra_listops                             # the committed results

Each (kind, seed) is one ``megaflex.training.classify`` run (bidirectional encoder, mean pooling,
AdamW, warm-up and cosine decay; test accuracy at the best valid step), stored as
``OUT/runs/<kind>_s<seed>.json`` as it finishes, with a fingerprint of what its result depends on
(``run_fingerprint``: every classify setting but places, and the SHA-256 of the three data files).
A stored run is reused only when its fingerprint matches (``--fresh`` retrains it anyway), so a
stopped benchmark resumes, and a folder holding runs of other settings or other data has them
retrained, never reported under this run's header. ``OUT/results.json`` and ``results.md`` hold
every run of this invocation, mean and standard deviation per kind, and LRA's published accuracies
as anchors. Without ``--out`` the results go to ``$XDG_CACHE_HOME/megaflex/lra_listops``: only an
explicit ``--out docs/results/...`` writes the committed results. Ctrl-C keeps the finished runs
(exit 130). Not a test.

LRA's ListOps recipe (Tay et al. 2020): 4 layers, width 512, 8 heads, MLP 1024, batch 32, 5k steps,
lengths up to 2,000. The defaults here are that recipe cut to what two CPU cores train in minutes;
every setting is recorded with the results and can be raised on a GPU (``--device cuda``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shlex
import statistics
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any, Sequence

import torch

from megaflex.attention import ATTENTION_KINDS
from megaflex.cli_args import positive_int, scratch_results, writable_dir
from megaflex.data.lra import listops_path
from megaflex.hashing import sha256_file
from megaflex.training.classify import OPTION_CHOICES, OPTION_TYPES, ClassifyConfig, train

# LRA's Table 1 (Tay et al. 2020), ListOps test accuracy (%)
LRA_ANCHORS = {"softmax": 36.37, "performer": 18.01, "linear_transformer": 16.13}
KINDS = ("softmax", "flexformer_n", "performer", "cosformer")
# the classify settings this benchmark sets, and its defaults (LRA's recipe cut to a 2-core CPU)
RECIPE: dict[str, Any] = {
    "num_layers": 2, "hidden_size": 64, "num_heads": 2, "ffn_hidden_size": 128, "feature_dim": 32, "steps": 600,
    "batch_size": 16, "lr": 1e-3, "warmup": 80, "weight_decay": 0.1, "eval_every": 150, "eval_examples": 400,
    "max_train_examples": 0, "max_len": 2000, "pooling": "mean", "device": "cpu",
}  # fmt: skip
# ClassifyConfig fields that name places or set logging, not what a run computes: not fingerprinted
NOT_FINGERPRINTED = ("data", "out", "log_interval")
SPLITS = ("train", "valid", "test")


def run_config(args: argparse.Namespace, kind: str, seed: int) -> ClassifyConfig:
    return ClassifyConfig(task="listops", data=str(args.data), attention=kind, seed=seed,
                          **{name: getattr(args, name) for name in RECIPE})  # fmt: skip


def data_fingerprint(data: str | Path) -> dict[str, str]:
    """SHA-256 of each split file (the same path may hold other data tomorrow)."""
    return {split: sha256_file(listops_path(data, split)) for split in SPLITS}


def run_fingerprint(cfg: ClassifyConfig, data: dict[str, str]) -> dict[str, Any]:
    """What a run's result depends on: every classify setting but places (kind and seed included; the
    defaults this benchmark does not set too, so a changed default retrains), and the data's digests;
    ``digest`` (a sha256 prefix) to compare."""
    inputs = {"settings": {k: v for k, v in asdict(cfg).items() if k not in NOT_FINGERPRINTED}, "data": data}
    return {"digest": hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:16], **inputs}


def load_run(path: Path, fingerprint: dict[str, Any]) -> dict[str, Any] | None:
    """The stored run at ``path`` if its fingerprint is ``fingerprint``, else None (said when one is there)."""
    if not path.is_file():
        return None
    stored = json.loads(path.read_text())
    if stored.get("fingerprint", {}).get("digest") != fingerprint["digest"]:
        why = "other settings or data" if "fingerprint" in stored else "no fingerprint (an earlier version)"
        print(f"[lra_listops] {path}: stored with {why}; it will be retrained", flush=True)
        return None
    return stored["row"]


def run_one(cfg: ClassifyConfig) -> dict[str, Any]:
    """One classify run in this process (``--threads`` torch threads)."""
    return train(cfg, log=lambda line: print(f"[{cfg.attention} s{cfg.seed}] {line}", flush=True))


def summarise(rows: list[dict[str, Any]], kinds: Sequence[str]) -> dict[str, Any]:
    """Per kind: test accuracy (%) of each seed, mean, standard deviation (n - 1)."""
    out = {}
    for kind in kinds:
        accs = [100 * r["test_accuracy"] for r in rows if r["config"]["attention"] == kind]
        if accs:
            out[kind] = {"seeds": len(accs), "test_accuracy": accs, "mean": statistics.mean(accs),
                         "std": statistics.stdev(accs) if len(accs) > 1 else None}  # fmt: skip
    return out


def write_report(out: Path, rows: list[dict[str, Any]], kinds: Sequence[str], args: argparse.Namespace,
                 data: dict[str, str], command: str) -> None:  # fmt: skip
    """results.json and results.md of ``rows``: every one has ``args``' settings on ``data`` (fingerprints)."""
    summary = summarise(rows, kinds)
    majority = 100 * rows[0]["majority_test_accuracy"] if rows else None
    config = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k != "fresh"}
    (out / "results.json").write_text(json.dumps({"command": command, "config": config, "data_sha256": data,
                                                  "summary": summary, "lra_anchors": LRA_ANCHORS,
                                                  "majority_test_accuracy": majority, "runs": rows}, indent=1) + "\n")  # fmt: skip
    meta_path = Path(args.data) / "basic_meta.json"  # written by data_prep.listops
    lengths = json.loads(meta_path.read_text())["lra_length"]["test"] if meta_path.is_file() else None
    data_line = f"Data: `{args.data}`" + (f", test lengths {lengths['min']}-{lengths['max']} (mean {lengths['mean']:.0f}) "
                                         "in LRA's count (operators 2, digits 1)" if lengths else "") + "."  # fmt: skip
    lines = ["# LRA ListOps, generated locally (`python -m benchmarks.lra_listops`)", "", data_line, "",
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


def _kinds(text: str) -> list[str]:
    kinds = [k for k in text.split(",") if k]
    unknown = sorted(set(kinds) - set(ATTENTION_KINDS))
    if not kinds or unknown:
        raise argparse.ArgumentTypeError(f"expected comma-separated kinds of {list(ATTENTION_KINDS)}, got {text!r}")
    return kinds


def _seeds(text: str) -> list[int]:
    try:
        seeds = [int(s) for s in text.split(",") if s]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not seeds:
        raise argparse.ArgumentTypeError("expected at least one seed")
    return seeds


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.lra_listops", description=__doc__.split("\n\n")[0])
    p.add_argument("--data", required=True, help="folder of basic_{train,val,test}.tsv (data_prep.listops or LRA's)")
    p.add_argument("--kinds", type=_kinds, default=list(KINDS), help=f"comma-separated (default {','.join(KINDS)})")
    p.add_argument("--seeds", type=_seeds, default=[1234, 1235, 1236], help="comma-separated (default 1234,1235,1236)")
    p.add_argument("--out", type=writable_dir, default=None,
                   help="results folder (default $XDG_CACHE_HOME/megaflex/lra_listops; docs/results/lra_listops: the committed one)")
    p.add_argument("--threads", type=positive_int, default=1)
    p.add_argument("--fresh", action="store_true", help="retrain runs stored with the same fingerprint too")
    for name, default in RECIPE.items():
        p.add_argument("--" + name.replace("_", "-"), type=OPTION_TYPES.get(name, str), choices=OPTION_CHOICES.get(name),
                       default=default, help=f"default {default!r}")  # fmt: skip
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    out = args.out or scratch_results("lra_listops")
    args.out = out
    missing = [str(listops_path(args.data, s)) for s in SPLITS if not listops_path(args.data, s).is_file()]
    if missing:
        print(f"lra_listops: error: --data {args.data}: missing {', '.join(missing)}; generate it with "
              "`python -m data_prep.listops --out DIR` or use LRA's listops_*/basic_*.tsv", file=sys.stderr)  # fmt: skip
        return 2
    torch.set_num_threads(args.threads)
    command = "python -m benchmarks.lra_listops " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    data = data_fingerprint(args.data)
    (out / "runs").mkdir(parents=True, exist_ok=True)
    rows = []
    try:
        for seed in args.seeds:  # seed-major: a stopped benchmark still has whole seeds
            for kind in args.kinds:
                cfg = run_config(args, kind, seed)
                fingerprint = run_fingerprint(cfg, data)
                path = out / "runs" / f"{kind}_s{seed}.json"
                row = None if args.fresh else load_run(path, fingerprint)
                if row is None:
                    row = run_one(cfg)
                    path.write_text(json.dumps({"fingerprint": fingerprint, "command": command, "row": row}, indent=1) + "\n")
                rows.append(row)
                write_report(out, rows, args.kinds, args, data, command)
    except KeyboardInterrupt:
        print(f"lra_listops: interrupted; the {len(rows)} finished runs are in {out / 'runs'} (the same command "
              "resumes); exit 130", file=sys.stderr)  # fmt: skip
        return 130
    except (ValueError, FileNotFoundError) as error:  # a setting or data file classify refuses: one line
        print(f"lra_listops: error: {error}", file=sys.stderr)
        return 2
    print(f"[lra_listops] {len(rows)} runs; results in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
