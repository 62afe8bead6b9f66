"""Report of the kernel-transfer experiment: B test perplexity per kind and arm, the drops
relative to the kernel learned on B, and a bar plot.

``drop(arm) = ppl(arm) / ppl(learned_b) - 1`` per seed (positive: worse than learning the kernel
on B), then mean +- std over seeds. Two arms (or two kinds' drops) are called different only when
the seeds separate them: paired by seed (every arm of a seed shares its data order and non-kernel
init), the per-seed log-ratios' mean +- SE against the t quantile for n - 1 degrees of freedom
(``studies.paired_stats``); with one seed nothing is claimed.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

from studies.kernel_study_report import mean_std
from studies.paired_stats import Comparison, compare
from studies.kernel_transfer_config import ARMS, B_METRIC, TransferConfig

A_METRIC = "english_docs_valid_ppl"
DROP_ARMS = ("transfer", "random")


def summarize(rows: list[dict[str, Any]], kinds: tuple[str, ...]) -> dict[str, dict[str, Any]]:
    """Per kind: mean/std of every arm's B test ppl, A's numbers, the per-seed drops and their mean/std."""
    out: dict[str, dict[str, Any]] = {}
    for kind in kinds:
        mine = [r for r in rows if r["kind"] == kind]
        seeds = sorted({r["seed"] for r in mine})
        by = {(r["arm"], r["seed"]): r for r in mine}
        entry: dict[str, Any] = {"seeds": len(seeds)}
        for arm in ("A", *ARMS):
            for metric in (B_METRIC, A_METRIC):
                values = [by[arm, s][metric] for s in seeds if (arm, s) in by]
                if values:
                    entry[f"{arm}_{metric}_mean"], entry[f"{arm}_{metric}_std"] = mean_std(values)
        for arm in DROP_ARMS:
            drops = [by[arm, s][B_METRIC] / by["learned_b", s][B_METRIC] - 1 for s in seeds
                     if (arm, s) in by and ("learned_b", s) in by]
            entry[f"{arm}_drop_per_seed"] = drops
            if drops:
                entry[f"{arm}_drop_mean"], entry[f"{arm}_drop_std"] = mean_std(drops)
        out[kind] = entry
    return out


def seed_values(rows: list[dict[str, Any]], kind: str, arm: str) -> dict[int, float]:
    """``{seed: B test ppl}`` of one kind's arm."""
    return {r["seed"]: r[B_METRIC] for r in rows if r["kind"] == kind and r["arm"] == arm}


def drop_ratios(rows: list[dict[str, Any]], kind: str, arm: str) -> dict[int, float]:
    """``{seed: ppl(arm) / ppl(learned_b)}`` (1 + the drop) of one kind, on the seeds with both."""
    arm_ppl, learned = seed_values(rows, kind, arm), seed_values(rows, kind, "learned_b")
    return {s: v / learned[s] for s, v in arm_ppl.items() if s in learned}


def separated(a: dict[int, float], b: dict[int, float], better: str, worse: str) -> str:
    """'better'/'worse' when the seeds separate a from b (lower is better, ``paired_stats.compare``),
    else 'not separated by the seeds'; the comparison's numbers in brackets."""
    if not a or not b:
        return "not separated by the seeds (no values)"
    c: Comparison = compare(a, b)
    word = {True: better, False: worse, None: "not separated by the seeds"}[c.a_better]
    return f"{word} ({c.describe()})"


def findings(summary: dict[str, dict[str, Any]], rows: list[dict[str, Any]]) -> list[str]:
    """Plain sentences, claiming only what the seeds separate."""
    lines = []
    for kind, s in summary.items():
        if "transfer_drop_mean" not in s:
            continue
        transfer = seed_values(rows, kind, "transfer")
        lines.append(f"- {kind}: the A kernel (frozen) is {pct(s['transfer_drop_mean'])} vs the kernel learned on B "
                     f"({separated(transfer, seed_values(rows, kind, 'learned_b'), 'better', 'worse')}); the untrained "
                     f"kernel (frozen) {pct(s['random_drop_mean'])}. The A kernel against the untrained one: "
                     f"{separated(transfer, seed_values(rows, kind, 'random'), 'better', 'worse')}.")
    if all(k in summary and "transfer_drop_mean" in summary[k] for k in ("flexformer_n", "hedgehog")):
        fn, hh = summary["flexformer_n"], summary["hedgehog"]
        verdict = separated(drop_ratios(rows, "flexformer_n", "transfer"), drop_ratios(rows, "hedgehog", "transfer"),
                            "smaller than Hedgehog's (separated by the seeds)", "larger than Hedgehog's (separated by the seeds)")
        lines.append(f"- Transfer drop of Flexformer-N {pct(fn['transfer_drop_mean'])} vs Hedgehog "
                     f"{pct(hh['transfer_drop_mean'])}: {verdict}.")
        verdict = separated(seed_values(rows, "flexformer_n", "transfer"), seed_values(rows, "hedgehog", "transfer"),
                            "lower than Hedgehog's (separated by the seeds)", "higher than Hedgehog's (separated by the seeds)")
        lines.append(f"- B test ppl with the A kernel, Flexformer-N {fn[f'transfer_{B_METRIC}_mean']:.1f} vs Hedgehog "
                     f"{hh[f'transfer_{B_METRIC}_mean']:.1f}: {verdict}.")
    return lines


def pct(x: float) -> str:
    return f"{100 * x:+.1f}%"


def cell(s: dict[str, Any], key: str) -> str:
    if f"{key}_mean" not in s:
        return "-"
    std = s.get(f"{key}_std")
    return f"{s[f'{key}_mean']:.2f}" + (f" ± {std:.2f}" if std is not None else "")


def write_report(cfg: TransferConfig, rows: list[dict[str, Any]], command: str, seconds: float) -> None:
    from megaflex.eval.plotting import markdown_table, write_json

    out = Path(cfg.study.out)
    out.mkdir(parents=True, exist_ok=True)
    summary = summarize(rows, cfg.kinds)
    plot_bars(out / "transfer.png", summary, cfg)
    study = cfg.study
    keep = ("label", "kind", "domain", "arm", "seed", "overrides", B_METRIC, A_METRIC, "wikitext2_test_tokens",
            "english_docs_valid_tokens", "final_train_loss", "train_tokens_per_s", "omega_rel_change", "seconds",
            "kernel_max_abs_diff_vs_A", "kernel_max_abs_diff_vs_init")
    runs = [{k: r[k] for k in keep if k in r} for r in rows]
    run_seconds = sum(r.get("seconds") or 0.0 for r in rows)
    write_json(out / "results.json", {
        "command": command, "config": {**asdict(cfg), "study": asdict(study)}, "seconds": seconds,
        "run_seconds": run_seconds, "tokens_a": cfg.steps_a * study.global_batch_size * study.seq_len,
        "tokens_b": cfg.steps_b * study.global_batch_size * study.seq_len, "summary": summary, "runs": runs,
    })
    table = []
    for kind, s in summary.items():
        table.append({
            "kind": kind, "seeds": s["seeds"], "A: own valid": cell(s, f"A_{A_METRIC}"), "A: B test": cell(s, f"A_{B_METRIC}"),
            **{f"B {arm}": cell(s, f"{arm}_{B_METRIC}") for arm in ARMS},
            **{f"drop {arm}": (pct(s[f"{arm}_drop_mean"]) if f"{arm}_drop_mean" in s else "-") for arm in DROP_ARMS},
        })
    checks = [f"- {r['label']} seed {r['seed']}: max |kernel - A's kernel| = {r['kernel_max_abs_diff_vs_A']:.3g}"
              for r in rows if "kernel_max_abs_diff_vs_A" in r]
    checks += [f"- {r['label']} seed {r['seed']}: max |kernel - its init| = {r['kernel_max_abs_diff_vs_init']:.3g}"
               for r in rows if "kernel_max_abs_diff_vs_init" in r]
    pilot = ("**One seed: a pilot.** Seed noise of this model size is several percent (kernel study), so single-seed "
             "gaps of that size show nothing.\n" if study.seeds == 1 else "")

    def tokens(steps: int) -> str:
        return f"{steps} steps x {study.global_batch_size} x {study.seq_len} = {steps * study.global_batch_size * study.seq_len:,} tokens"

    md = [
        "# Kernel transfer across domains\n", f"Command: `{command}`\n", pilot,
        f"Model: the kernel study's ({study.num_layers} layers, hidden {study.hidden_size}, {study.num_heads} heads, "
        f"feature_dim {study.feature_dim}, vocab {study.vocab_size}, lr {study.lr}, cosine to {study.min_lr}); "
        f"seeds {study.seed_list}; compute {run_seconds / 60:.1f} min (train + evaluate, summed over runs).\n",
        f"- Domain A: english-docs train, {tokens(cfg.steps_a)}"
        f"{f' (the kernel study runs in `{cfg.a_runs}`, not retrained)' if cfg.a_runs else ''}.",
        f"- Domain B: WikiText-2 raw **valid** split to train on (there is no WikiText-2 train split in the shared "
        f"data), {tokens(cfg.steps_b)}; evaluated on WikiText-2 raw **test** "
        f"({'whole set' if not study.eval_tokens else f'first {study.eval_tokens:,} tokens'}), never trained on.\n",
        "Arms on B (same seed: same non-kernel init and data order):\n",
        *(f"- `{arm}`: {text}" for arm, text in ARMS.items()), "",
        "Perplexity (mean ± std over seeds). `A: own valid` = the A model on english-docs valid, `A: B test` = the A "
        "model on WikiText-2 test without B training. Drop = ppl / ppl(learned_b) - 1 (positive: worse than learning "
        "the kernel on B), mean over seeds.\n",
        markdown_table(table, list(table[0]) if table else []), "",
        "## Findings (computed; paired by seed, t test at 95% for n - 1 degrees of freedom)\n",
        *findings(summary, rows), "",
        "## Frozen kernels stayed put\n", *(checks or ["- (no newly trained frozen runs in this session)"]), "",
    ]
    (out / "results.md").write_text("\n".join(md) + "\n")


def plot_bars(path: Path, summary: dict[str, dict[str, Any]], cfg: TransferConfig) -> None:
    """B test ppl per kind (groups) and arm (bars), +-1 std over seeds when there are several."""
    import megaflex.eval.plotting  # noqa: F401  (headless backend first)
    import matplotlib.pyplot as plt

    kinds, arms = list(summary), list(ARMS)
    width = 0.8 / len(arms)
    fig, ax = plt.subplots(figsize=(2.2 + 2.4 * len(kinds), 4.5))
    for i, arm in enumerate(arms):
        xs = [k + (i - (len(arms) - 1) / 2) * width for k in range(len(kinds))]
        means = [summary[k].get(f"{arm}_{B_METRIC}_mean", float("nan")) for k in kinds]
        stds = [summary[k].get(f"{arm}_{B_METRIC}_std") or 0.0 for k in kinds]
        bars = ax.bar(xs, means, width, yerr=stds if any(stds) else None, capsize=3, label=arm)
        ax.bar_label(bars, fmt="%.0f", fontsize=8)
    ax.set_xticks(range(len(kinds)), kinds)
    ax.set_ylabel("WikiText-2 test perplexity (lower is better)")
    seeds = cfg.study.seeds
    ax.set_title(f"Kernel from english-docs vs learned on WikiText-2 vs untrained ({seeds} seed{'s' * (seeds > 1)})", fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
