"""The kernel study: does a learnable kernel (Flexformer) beat fixed linear kernels, and how close
does it come to softmax? Version 2: several seeds, mean +- std, and arms of the Flexformer-N recipe.

    python -m studies.kernel_study                         # 7 kinds + 4 arms x 3 seeds (CPU preset)
    python -m studies.kernel_study --device cuda --preset 41m   # the paper's 41M shape on a GPU
    python -m studies.kernel_study --arms v5_controls,v5_remedies --seeds 1   # named arm sets (ARM_SETS)

trains one small GPT per run: every attention kind with the project's default recipe, plus the
*arms*, Flexformer-N variants that change one thing of that recipe (``ARMS``: the tied init,
the kernel LR multipliers off, Omega frozen, the sliding softmax window). Everything else is identical: data, token budget,
optimizer, schedule, and for one seed also the data order and the initialisation of every shared
weight. Each run is evaluated on the english-docs valid split and on WikiText-2 test; results go
to ``--out`` (default ``$XDG_CACHE_HOME/megaflex/kernel_study``; the committed ``docs/results/...`` only
when ``--out`` names it):

* ``results.json`` / ``results.md``: per run and seed, and mean +- std over seeds per kind/arm:
  perplexity and bits per byte on both sets, training tokens/s, final tau per layer, relative
  change of Omega since init, negative-weight fraction and effective keys per query (the trainer's
  kernel statistics on a fixed probe batch); a verdict that only claims what the seeds support;
* ``loss_curves.png``: training loss, mean over seeds with a +-1 std band;
* ``spectrum.png``: ||omega|| per layer, learned vs init (first seed) and the Gaussian density;
* ``tau.png``: Flexformer-N's tau (mean over heads and layers) over training;
* ``runs/<label>_s<seed>.json``: each finished run's row with a fingerprint of its settings.

Resumable: the full study (33 runs at the CPU preset) does not fit one session. A run whose row
is stored with the same fingerprint (``run_fingerprint``: the StudyConfig fields that change a
result, the run's kind and overrides, its seed) is skipped (``--fresh`` retrains it); the report is
rewritten after every run from every stored row of the study and names the runs still missing.
``--order kinds`` trains all seeds of one kind/arm before the next (default ``seeds``: seed-major),
``--only LABEL[,..]`` trains just those kinds/arms. Per-run checkpoints stay in ``--work-dir``.
``--report-only`` trains nothing: it rewrites the report from the stored rows (give the training
command's flags, so that the fingerprints match); the report names that command without the flag.

Training uses the project's trainer (``megaflex-train``, DeepSpeed ZeRO-0, one process, one
subprocess per run). Data: a sentencepiece BPE tokenizer trained on the english-docs train shards,
which are then preprocessed to ``.bin/.idx`` (cached under ``--work-dir``). Evaluation:
``megaflex.eval.scoring`` in ``windows`` mode with the training sequence length, every target token once.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path
from typing import Any, Sequence

from megaflex.attention import NORMALIZATIONS
from megaflex.cli_args import available_device, positive_int, positive_int_list
from studies.kernel_study_config import (
    ARM_SETS, ARMS, KINDS, ORDERS, PRESETS, RunSpec, StudyConfig, number_type, output_dir_option, path_option,
)
from studies.kernel_study_report import write_report
from studies.runner import evaluate_run, load_row, prepare_data, reuse_rows, save_row, train_run


# ------------------------------------------------------------------------------- run order
def plan(cfg: StudyConfig, runs: list[RunSpec], order: str = "seeds") -> list[tuple[RunSpec, int]]:
    """Every (run, seed) of the study: seed-major (``seeds``) or kind-major (``kinds``)."""
    if order not in ORDERS:
        raise ValueError(f"order: expected one of {ORDERS}, got {order!r}")
    if order == "seeds":
        return [(run, seed) for seed in cfg.seed_list for run in runs]
    return [(run, seed) for run in runs for seed in cfg.seed_list]


# ------------------------------------------------------------------------------- driver and CLI
def run_study(
    cfg: StudyConfig, runs: list[RunSpec], command: str, order: str = "seeds",
    only: Sequence[str] | None = None, fresh: bool = False, report_only: bool = False,
) -> list[dict[str, Any]]:
    """Train and evaluate the runs not stored yet (``only``: just these labels; ``fresh``: retrain
    stored ones too), rewriting the report after each; returns every available row, seed-major.
    ``report_only``: train nothing, rewrite the report from the stored rows."""
    labels = [r.label for r in runs]
    unknown = sorted(set(only or ()) - set(labels))
    if unknown:
        raise ValueError(f"only: expected labels of this study {labels}, got unknown {unknown}")
    start = time.perf_counter()
    report_order = plan(cfg, runs, "seeds")
    todo = [(run, seed) for run, seed in plan(cfg, runs, order) if only is None or run.label in only]
    redo = {(run.label, seed) for run, seed in todo} if fresh else set()
    rows: dict[tuple[str, int], dict[str, Any]] = {}
    for run, seed in report_order:
        stored = None if (run.label, seed) in redo else load_row(cfg, run, seed)
        if stored is not None:
            rows[run.label, seed] = stored

    def report() -> list[dict[str, Any]]:
        available = [rows[r.label, s] for r, s in report_order if (r.label, s) in rows]
        missing = [f"{r.label}_s{s}" for r, s in report_order if (r.label, s) not in rows]
        if available:
            write_report(cfg, available, command, time.perf_counter() - start, missing)
        return available

    todo = [] if report_only else [(run, seed) for run, seed in todo if (run.label, seed) not in rows]
    print(f"[kernel_study] {len(rows)} of {len(report_order)} runs stored; training {len(todo)} now", flush=True)
    data = prepare_data(cfg) if todo else {}
    available = []
    for run, seed in todo:
        t0 = time.perf_counter()
        row = evaluate_run(cfg, run, seed, train_run(cfg, run, seed, data))
        row["seconds"] = time.perf_counter() - t0
        save_row(cfg, run, seed, row, command)
        rows[run.label, seed] = row
        available = report()
        print(f"[kernel_study] {run.label} seed {seed}: valid ppl {row['english_docs_valid_ppl']:.2f}, "
              f"WikiText-2 test ppl {row['wikitext2_test_ppl']:.2f} ({row['seconds']:.0f}s)", flush=True)
    if not todo:  # else the last run's report is the final one
        available = report()
    print(f"[kernel_study] results in {cfg.out}")
    return available


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m studies.kernel_study", description=__doc__.split("\n\n")[0])
    defaults = StudyConfig()
    p.add_argument("--kinds", default=",".join(defaults.kinds), help="comma-separated attention kinds")
    p.add_argument("--arms", default=",".join(defaults.arms),
                   help=f"comma-separated arms of {list(ARMS)}, or named sets of them: {list(ARM_SETS)}")
    p.add_argument("--preset", default="cpu", choices=list(PRESETS), help="model/training shape (41m: the paper's)")
    p.add_argument("--device", type=available_device, default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--data-root", type=path_option, default=defaults.data_root)
    for name in ("work_dir", "out"):
        p.add_argument("--" + name.replace("_", "-"), type=output_dir_option, default=getattr(defaults, name))
    for name in ("vocab_size", "num_layers", "hidden_size", "num_heads", "feature_dim", "steps", "seq_len",
                 "micro_batch_size", "global_batch_size", "warmup", "seed", "seeds", "tokenizer_sentences",
                 "eval_batch_size", "eval_tokens", "lr", "min_lr", "kernel_frequency_lr_multiplier",
                 "kernel_temperature_lr_multiplier"):
        p.add_argument("--" + name.replace("_", "-"), type=number_type(name), default=None,
                       help=f"default {getattr(defaults, name)}")
    p.add_argument("--max-train-docs", type=positive_int, default=None, help="use only the first N train-00 documents")
    p.add_argument("--document-boundaries", default=None, choices=["none", "reset"],
                   help="data.document_boundaries of every run (default none: packed documents attend to each other)")
    p.add_argument("--order", default="seeds", choices=ORDERS,
                   help="seeds: every kind/arm of one seed, then the next seed; kinds: all seeds of one kind/arm, then the next")
    p.add_argument("--only", default=None, help="comma-separated kinds/arms to train now (the report still covers all)")
    p.add_argument("--fresh", action="store_true", help="retrain runs whose row is stored with the same fingerprint")
    p.add_argument("--report-only", action="store_true",
                   help="train nothing: rewrite the report from the stored rows (give the training command's flags)")
    p.add_argument("--normalization", default=None, choices=list(NORMALIZATIONS),
                   help=f"model.normalization of every run whose arm does not set it (default {defaults.normalization})")
    p.add_argument("--long-contexts", type=positive_int_list, default=None,
                   help="comma-separated context lengths at which english-docs valid is also scored (windows and stateful)")
    p.add_argument("--reuse-from", type=path_option, default=None, metavar="STUDY_DIR",
                   help="first copy rows of another study folder (e.g. docs/results/kernel_study_v3) whose training "
                        "recipe equals a run of this one (same settings, kind, overrides and effective normalisation)")
    return p


def config_from_args(args: argparse.Namespace) -> StudyConfig:
    """StudyConfig from parsed arguments: defaults < preset < explicit flags."""
    selection = ("order", "only", "fresh", "reuse_from", "report_only")  # how this session runs the study, not what the study is
    values = {**PRESETS[args.preset], **{k: v for k, v in vars(args).items() if v is not None and k not in selection}}
    values["kinds"] = [k for k in args.kinds.split(",") if k]
    values["arms"] = list(dict.fromkeys(arm for a in args.arms.split(",") if a for arm in ARM_SETS.get(a, (a,))))
    for name, given, known in (("--kinds", values["kinds"], KINDS), ("--arms", values["arms"], tuple(ARMS))):
        unknown = sorted(set(given) - set(known))
        if unknown:
            raise ValueError(f"{name}: expected a subset of {list(known)}, got unknown {unknown}")
    return StudyConfig(**values)


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    args = build_parser().parse_args(argv)
    cfg = config_from_args(args)
    command = command_of(argv if argv is not None else sys.argv[1:])
    only = [label for label in args.only.split(",") if label] if args.only is not None else None
    if args.report_only:
        if args.fresh or args.reuse_from:
            raise ValueError("--report-only: expected neither --fresh nor --reuse-from (it trains and copies nothing)")
        command = command_of([a for a in (argv if argv is not None else sys.argv[1:]) if a != "--report-only"])
    if args.reuse_from:
        source = Path(args.reuse_from)
        if not (source / "runs").is_dir():
            raise ValueError(f"--reuse-from: {source} holds no runs/ folder of a study")
        copied = reuse_rows(cfg, cfg.runs(), source)
        print(f"[kernel_study] reused {len(copied)} rows of {source}: {', '.join(copied) or 'none'}", flush=True)
    return run_study(cfg, cfg.runs(), command.strip(), order=args.order, only=only, fresh=args.fresh,
                     report_only=args.report_only)


def command_of(argv: Sequence[str]) -> str:
    return "python -m studies.kernel_study " + " ".join(shlex.quote(a) for a in argv)


if __name__ == "__main__":
    main()
