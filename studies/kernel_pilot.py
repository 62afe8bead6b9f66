"""Pilot of the Flexformer-N recipe: kernel LR multiplier x Omega init, one seed, short runs.

    python -m studies.kernel_pilot          # 5 runs x 120 steps, 2 at a time

Used to pick the defaults of ``optimizer.kernel_{frequency,temperature}_lr_multiplier`` and of
Flexformer-N's ``omega_init``. Same model, data and evaluation as ``studies.kernel_study``
(``studies.runner``'s functions, shorter runs on the first 1500 train documents); every run sets both options
explicitly, so the grid does not depend on the current defaults. Single seed: a pilot, not a
result (the study's seed noise on valid ppl was about +-2.7%). Output: ``results.json`` /
``results.md`` / plots in ``--out`` (default ``$XDG_CACHE_HOME/megaflex/kernel_pilot``).
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Sequence

from megaflex.cli_args import nonnegative_int, positive_int, scratch_results
from studies.kernel_study_config import RunSpec, StudyConfig, output_dir_option
from studies.runner import evaluate_run, prepare_data, train_run


TITLE = ("# Kernel pilot: kernel LR multiplier x Omega init (ONE seed, 120 steps: a pilot, not a result)\n\n"
         "Runs are labelled INIT_lrM: `model.feature_kwargs={omega_init: INIT}` and both kernel LR multipliers M.")


def parse_grid(spec: str) -> list[tuple[str, float]]:
    """"paper:1,10 tied:1,10,30" -> [(paper, 1), (paper, 10), (tied, 1), ...]."""
    pairs = []
    for part in spec.split():
        init, sep, multipliers = part.partition(":")
        if not sep or not multipliers:
            raise ValueError(f"--grid: expected 'INIT:M1,M2 ...', got part {part!r}")
        pairs += [(init, float(m)) for m in multipliers.split(",")]
    return pairs


def pilot_runs(grid: Sequence[tuple[str, float]]) -> list[RunSpec]:
    """One Flexformer-N run per (init, LR multiplier); the multiplier applies to Omega and tau."""
    return [
        RunSpec(f"{init}_lr{m:g}", "flexformer_n", [
            f"model.feature_kwargs={{omega_init: {init}}}",
            f"optimizer.kernel_frequency_lr_multiplier={m}", f"optimizer.kernel_temperature_lr_multiplier={m}",
        ])
        for init, m in grid
    ]


def main(argv: Sequence[str] | None = None) -> None:
    from studies.kernel_study_report import write_report

    p = argparse.ArgumentParser(prog="python -m studies.kernel_pilot", description=__doc__.split("\n\n")[0])
    p.add_argument("--grid", default="paper:1,10 tied:1,10,30", help="'INIT:LR_MULTIPLIERS ...' runs")
    p.add_argument("--steps", type=positive_int, default=120)
    p.add_argument("--max-train-docs", type=positive_int, default=1500)
    p.add_argument("--eval-tokens", type=nonnegative_int, default=100_000, help="0: the whole evaluation set")
    p.add_argument("--parallel", type=positive_int, default=2, help="training processes at once")
    p.add_argument("--work-dir", type=output_dir_option, default="work_data/kernel_pilot")
    p.add_argument("--out", type=output_dir_option, default=str(scratch_results("kernel_pilot")))
    args = p.parse_args(argv)
    cfg = StudyConfig(kinds=["flexformer_n"], arms=[], seeds=1, steps=args.steps, max_train_docs=args.max_train_docs,
                      tokenizer_sentences=100_000, eval_tokens=args.eval_tokens, work_dir=args.work_dir, out=args.out)
    runs = pilot_runs(parse_grid(args.grid))
    command = "python -m studies.kernel_pilot " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    start = time.perf_counter()
    data = prepare_data(cfg)
    with ThreadPoolExecutor(args.parallel) as pool:  # each run is its own training subprocess
        run_dirs = list(pool.map(lambda run: train_run(cfg, run, cfg.seed, data), runs))
    rows = []
    for run, run_dir in zip(runs, run_dirs):
        rows.append(evaluate_run(cfg, run, cfg.seed, run_dir))
        print(f"[kernel_pilot] {run.label}: valid ppl {rows[-1]['english_docs_valid_ppl']:.2f}", flush=True)
    write_report(cfg, rows, command.strip(), time.perf_counter() - start)
    md = Path(cfg.out) / "results.md"
    md.write_text(md.read_text().replace("# Kernel study results", TITLE, 1) + ranking(rows))


def ranking(rows: list[dict]) -> str:
    """The runs ranked by english-docs valid ppl, with the change relative to the first grid entry."""
    base = rows[0]
    lines = ["## Ranking (ONE seed: a pilot, not a result; seed noise on valid ppl was about +-2.7% in issue 11)\n",
             "| run | english-docs valid ppl | vs " + base["label"] + " | WikiText-2 test ppl | Omega change |",
             "|---|---:|---:|---:|---:|"]
    for r in sorted(rows, key=lambda r: r["english_docs_valid_ppl"]):
        change = r.get("omega_rel_change")
        lines.append(
            f"| {r['label']} | {r['english_docs_valid_ppl']:.1f} | "
            f"{100 * (r['english_docs_valid_ppl'] / base['english_docs_valid_ppl'] - 1):+.1f}% | "
            f"{r['wikitext2_test_ppl']:.1f} | {f'{100 * sum(change) / len(change):.0f}%' if change else ''} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
