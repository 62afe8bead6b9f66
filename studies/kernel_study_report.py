"""Report of the kernel study: mean +- std over seeds, a verdict the seeds support, and plots.

``write_report(cfg, rows, command, seconds, missing)`` writes ``results.json`` (every available
run and the aggregates), ``results.md`` (a partial report first lists the ``missing`` runs), ``loss_curves.png`` (mean over seeds, +-1 std band), ``spectrum.png``
(learned ||omega|| vs init, first seed) and ``tau.png`` (tau over training, mean over seeds).

Verdict rule: "A beats B" only when the gap of the means exceeds twice the standard error of
that gap, sqrt(std_A^2 / n_A + std_B^2 / n_B); otherwise the pair is called "within seed noise".
With one seed there is no std, so nothing is claimed beyond the single numbers.
"""

from __future__ import annotations

import math
import re
import statistics
from pathlib import Path
from typing import Any, Sequence

import torch

from studies.kernel_study_config import ARM_KINDS, ARMS, LEARNED_SPECTRUM, StudyConfig

METRICS = ("english_docs_valid_ppl", "wikitext2_test_ppl")
EVAL_SETS = {"english_docs_valid_ppl": "english-docs valid", "wikitext2_test_ppl": "WikiText-2 test"}
PER_LAYER = ("omega_rel_change", "negative_fraction", "effective_keys", "tau_per_layer", "far_share")
LEARNED_KINDS = ("flexformer_n", "flexformer_s")
FIXED_KINDS = ("performer", "cosformer", "elu", "hedgehog")
LONG_CONTEXT = re.compile(r"english_docs_valid_ppl_(windows|stateful)(\d+)")


def long_context_metrics(rows: list[dict[str, Any]]) -> list[str]:
    """The long-context columns present in ``rows`` (``--long-contexts``), by length then mode."""
    keys = {k for r in rows for k in r if LONG_CONTEXT.fullmatch(k)}
    return sorted(keys, key=lambda k: (int(LONG_CONTEXT.fullmatch(k)[2]), LONG_CONTEXT.fullmatch(k)[1] != "windows"))


def mean_std(values: list[float]) -> tuple[float, float | None]:
    """Mean and sample standard deviation (None for a single value)."""
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else None)


def aggregate(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One entry per label (kind or arm), in first-seen order: mean/std of each metric over seeds,
    and the per-layer kernel statistics averaged over layers and seeds."""
    labels = list(dict.fromkeys(r["label"] for r in rows))
    out = []
    for label in labels:
        runs = [r for r in rows if r["label"] == label]
        agg: dict[str, Any] = {"label": label, "kind": runs[0]["kind"], "seeds": len(runs)}
        for metric in METRICS + ("final_train_loss", "train_tokens_per_s") + tuple(long_context_metrics(runs)):
            values = [r[metric] for r in runs if r.get(metric) is not None]
            if values:
                agg[f"{metric}_mean"], agg[f"{metric}_std"] = mean_std(values)
                agg[f"{metric}_seeds"] = len(values)  # rows reused from an earlier study may lack a column
        for key in PER_LAYER:
            values = [statistics.fmean(r[key]) for r in runs if r.get(key)]
            agg[f"{key}_mean"] = statistics.fmean(values) if values else None
        shares = [r["far_share"] for r in runs if r.get("far_share")]
        agg["far_share_per_layer"] = [statistics.fmean(layer) for layer in zip(*shares)] if shares else None
        out.append(agg)
    return out


def beats(a: dict[str, Any], b: dict[str, Any], metric: str) -> bool | None:
    """True/False if the seeds separate a and b on ``metric`` (lower is better), None if they do not."""
    sa, sb = a.get(f"{metric}_std"), b.get(f"{metric}_std")
    if sa is None or sb is None:
        return None
    gap = b[f"{metric}_mean"] - a[f"{metric}_mean"]
    if abs(gap) <= 2 * math.sqrt(sa**2 / a["seeds"] + sb**2 / b["seeds"]):
        return None
    return gap > 0


def verdict(summary: list[dict[str, Any]]) -> str:
    """The study's questions answered from the aggregates, claiming only what the seeds support."""
    by = {s["label"]: s for s in summary}
    if "flexformer_n" not in by:
        return ""
    fn = by["flexformer_n"]
    lines = []
    for metric, name in EVAL_SETS.items():
        others = [s for s in summary if s["kind"] not in ("softmax",) and s["label"] != "flexformer_n"]
        parts = [f"Flexformer-N (default recipe) {fn[f'{metric}_mean']:.1f}"]
        for other in others:
            result = beats(fn, other, metric)
            word = {True: "better than", False: "worse than", None: "not separated from"}[result]
            parts.append(f"{word} {other['label']} ({other[f'{metric}_mean']:.1f})")
        if "softmax" in by:
            ratio = fn[f"{metric}_mean"] / by["softmax"][f"{metric}_mean"]
            parts.append(f"{ratio:.2f}x softmax ({by['softmax'][f'{metric}_mean']:.1f})")
        lines.append(f"- {name}: " + "; ".join(parts) + ".")
        if "softmax" in by:
            ratios = [f"{s['label']} {s[f'{metric}_mean'] / by['softmax'][f'{metric}_mean']:.2f}x"
                      for s in summary if s["label"] != "softmax"]
            lines.append(f"  - {name} ppl / softmax: " + ", ".join(ratios) + ".")
    if fn.get("omega_rel_change_mean") is not None:
        lines.append(f"- Omega moved {100 * fn['omega_rel_change_mean']:.0f}% from its init (default recipe; "
                     "||Omega - Omega_init|| / ||Omega_init||, mean over layers and seeds).")
    lines += learned_against_fixed(summary)
    lines += window_targets(summary)
    seeds = min(s["seeds"] for s in summary)
    rule = ("better/worse = gap of the means > 2 standard errors over seeds" if seeds > 1
            else "one seed: no comparison is separated from seed noise")
    return f"## Verdict (computed from the means; {rule})\n\n" + "\n".join(lines) + "\n"


def learned_against_fixed(summary: list[dict[str, Any]]) -> list[str]:
    """The paper's first claim on equal terms (every kind under the study's one normalisation): does
    each learned kernel beat every fixed linear kernel beyond 2 standard errors?"""
    learned = [s for s in summary if s["label"] in LEARNED_KINDS]
    fixed = [s for s in summary if s["label"] in FIXED_KINDS]
    if not learned or not fixed:
        return []
    lines = []
    for metric, name in EVAL_SETS.items():
        for s in learned:
            results = {f["label"]: beats(s, f, metric) for f in fixed}
            worse_or_tied = [label for label, r in results.items() if r is not True]
            answer = "yes" if not worse_or_tied else "no"
            lines.append(f"- {name}: does {s['label']} ({s[f'{metric}_mean']:.1f}) beat every fixed kernel beyond 2 SE? "
                         f"{answer}" + ("" if not worse_or_tied else " (" + ", ".join(
                             f"{'worse than' if results[label] is False else 'not separated from'} {label} "
                             f"({next(f for f in fixed if f['label'] == label)[f'{metric}_mean']:.1f})"
                             for label in worse_or_tied) + ")") + ".")
    return lines


def long_context_table(rows: list[dict[str, Any]], metrics: list[str], train_metric: str) -> list[dict[str, Any]]:
    """Per kind/arm, over its runs that have the long-context columns (n of them): ppl at the
    training length of those same runs, each column (mean ± std), the longest stateful column over
    the training-length ppl (how it degrades or improves past its training length), and over
    softmax's."""
    stateful = [m for m in metrics if m.startswith(f"{train_metric}_stateful")]
    longest = stateful[-1] if stateful else metrics[-1]

    def runs_of(label: str) -> list[dict[str, Any]]:
        return [r for r in rows if r["label"] == label and r.get(longest) is not None]

    softmax = runs_of("softmax")
    softmax_longest = statistics.fmean(r[longest] for r in softmax) if softmax else None
    table = []
    for label in dict.fromkeys(r["label"] for r in rows):
        runs = runs_of(label)
        if not runs:
            continue
        row: dict[str, Any] = {"run": label, "n": len(runs),
                               "at training length": f"{statistics.fmean(r[train_metric] for r in runs):.2f}"}
        for metric in metrics:
            mean, std = mean_std([r[metric] for r in runs if r.get(metric) is not None] or [float("nan")])
            mode, length = LONG_CONTEXT.fullmatch(metric).groups()
            row[f"{mode} {length}"] = f"{mean:.2f}" + (f" ± {std:.2f}" if std is not None else "")
        name = longest.rsplit("_", 1)[1]
        row[f"{name} / training length"] = f"{statistics.fmean(r[longest] / r[train_metric] for r in runs):.3f}"
        if softmax_longest:
            row[f"{name} / softmax"] = f"{statistics.fmean(r[longest] for r in runs) / softmax_longest:.3f}"
        table.append(row)
    return table


def window_targets(summary: list[dict[str, Any]], within: float = 1.10) -> list[str]:
    """Verdict lines for each one-normaliser hybrid ``fn_window<W>`` (and its ``_capped`` arm) against
    the controls of the same W: its ratio to softmax (target <= ``within``), and whether the seeds
    separate it from the pure sliding window (``softmax_window<W>``), Performer with the window and
    the same normalisation (``performer_window<W>[_capped]``), the gated hybrid (``fn_gated<W>``) and,
    for the capped arm, the rms one (``fn_window<W>``)."""
    by = {s["label"]: s for s in summary}
    hybrids = [(s["label"], m) for s in summary if (m := re.fullmatch(r"fn_window(\d+)(_capped)?", s["label"]))]
    lines = []
    for label, match in sorted(hybrids, key=lambda h: (int(h[1][1]), h[0])):
        w, suffix, hybrid = match[1], match[2] or "", by[label]
        controls = [f"softmax_window{w}", f"performer_window{w}{suffix}", f"fn_gated{w}"] + ([f"fn_window{w}"] if suffix else [])
        for metric, name in EVAL_SETS.items():
            parts = []
            if "softmax" in by:
                ratio = hybrid[f"{metric}_mean"] / by["softmax"][f"{metric}_mean"]
                parts.append(f"{ratio:.2f}x softmax (target <= {within:.2f}: {'met' if ratio <= within else 'missed'})")
            for control in (c for c in controls if c in by):
                word = {True: "better than", False: "worse than", None: "not separated from"}[beats(hybrid, by[control], metric)]
                parts.append(f"{word} {control} ({by[control][f'{metric}_mean']:.1f})")
            lines.append(f"- {name}, {label} (W={w}) {hybrid[f'{metric}_mean']:.1f}: " + "; ".join(parts) + ".")
    return lines


def write_report(
    cfg: StudyConfig, rows: list[dict[str, Any]], command: str, seconds: float, missing: Sequence[str] = (),
) -> None:
    """``rows``: the runs available so far (stored by earlier sessions too); ``missing``: the
    study's runs without a row yet (``<label>_s<seed>``); ``seconds``: this session's wall time."""
    from dataclasses import asdict

    from megaflex.eval.plotting import markdown_table, write_json

    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    summary = aggregate(rows)
    plot_loss_bands(out / "loss_curves.png", rows, cfg)
    spectra = [r for r in rows if r.get("spectrum") and r["seed"] == cfg.seed]
    if spectra:
        plot_spectrum(out / "spectrum.png", spectra, cfg)
    if any(r.get("tau_curve") for r in rows):
        plot_tau(out / "tau.png", rows)
    runs = [{k: v for k, v in r.items() if k not in ("loss_curve", "spectrum", "tau_curve")} for r in rows]
    run_seconds = sum(r.get("seconds") or 0.0 for r in rows)  # train + evaluate, over all sessions
    write_json(out / "results.json", {
        "command": command, "config": asdict(cfg), "seconds": seconds, "run_seconds": run_seconds,
        "tokens_per_run": cfg.tokens_per_run, "complete": not missing, "missing": list(missing),
        "summary": summary, "runs": runs,
        "loss_curves": {f"{r['label']}_s{r['seed']}": r["loss_curve"] for r in rows},
        "tau_curves": {f"{r['label']}_s{r['seed']}": r["tau_curve"] for r in rows if r.get("tau_curve")},
    })
    table = []
    for s in summary:
        row = {"run": s["label"], "seeds": s["seeds"]}
        for metric in METRICS:
            std = s.get(f"{metric}_std")
            row[metric] = f"{s[f'{metric}_mean']:.2f}" + (f" ± {std:.2f}" if std is not None else "")
        for key in ("omega_rel_change", "negative_fraction", "effective_keys", "tau_per_layer"):
            row[key] = s.get(f"{key}_mean")
        shares = s.get("far_share_per_layer")
        row["far_share_per_layer"] = " / ".join(f"{v:.2f}" for v in shares) if shares else None
        table.append(row)
    columns = ["run", "seeds", *METRICS, "omega_rel_change", "tau_per_layer", "negative_fraction", "effective_keys"]
    if any(row["far_share_per_layer"] for row in table):
        columns.append("far_share_per_layer")
    arms = "".join(f"- `{a}` ({ARM_KINDS.get(a, 'flexformer_n')}): {ARMS[a][1]} ({', '.join(ARMS[a][0])})\n"
                   for a in cfg.arms)  # fmt: skip
    status = ("All runs of the study are in.\n" if not missing else
              f"**Partial report: {len(missing)} of {len(missing) + len(rows)} runs missing** (continue with the "
              "same command; stored runs are skipped): " + ", ".join(missing) + ".\n")
    md = [
        "# Kernel study results\n", f"Command (latest session): `{command}`\n", status,
        f"{len(summary)} kinds/arms x seeds {cfg.seed_list}, {cfg.tokens_per_run:,} training tokens per run "
        f"({cfg.steps} steps x {cfg.global_batch_size} x {cfg.seq_len}); {cfg.num_layers} layers, hidden "
        f"{cfg.hidden_size}, {cfg.num_heads} heads, feature_dim {cfg.feature_dim}, vocab {cfg.vocab_size}; "
        f"model.normalization {cfg.normalization} unless an arm sets it; "
        f"device {cfg.device}; compute time {run_seconds / 60:.1f} min (train + evaluate, summed over runs and sessions).\n",
        "Perplexity: mean ± sample std over seeds; windows of the training length, every target token once, "
        f"{'whole sets' if not cfg.eval_tokens else f'first {cfg.eval_tokens:,} tokens of each set'}. Kernel "
        "columns: last logged value, mean over layers and seeds: relative change of Omega since init, raw tau, "
        "fraction of negative causal attention weights and effective keys per query on a fixed probe batch; "
        "far_share_per_layer (window hybrids): the far field's share of each query's attention mass (queries "
        "t >= W), per layer, mean over seeds.\n",
        "Arms (one change to the default recipe of the kind in brackets):\n\n" + (arms or "- none\n"),
        markdown_table(table, columns), "\n", verdict(summary),
    ]
    long_metrics = long_context_metrics(rows)
    if long_metrics:
        long_table = long_context_table(rows, long_metrics, METRICS[0])
        md += ["## Long context: english-docs valid past the training length\n",
               f"Trained at {cfg.seq_len} tokens. `windows N`: disjoint windows of N tokens, each from an empty "
               "context; `stateful N`: each whole document in N-token chunks with the state (KV cache for softmax) "
               "carried, so every target sees its whole document prefix; independent of N up to rounding, so scored "
               "once, at the longest N. "
               "n: seeds with the columns (rows reused from an earlier study have none; the ratios use those seeds only). A kind that refuses a "
               "length (cosformer's reweighting is defined up to max_seq_len) has no value there.\n",
               markdown_table(long_table, list(dict.fromkeys(k for r in long_table for k in r))), "\n"]
    (out / "results.md").write_text("\n".join(md) + "\n")


def plot_loss_bands(path: Path, rows: list[dict[str, Any]], cfg: StudyConfig) -> None:
    """Training loss per label: mean over seeds with a +-1 std band (steps shared by all seeds)."""
    import megaflex.eval.plotting  # noqa: F401  (headless backend first)
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for label in dict.fromkeys(r["label"] for r in rows):
        curves = [dict(r["loss_curve"]) for r in rows if r["label"] == label]
        steps = sorted(set.intersection(*(set(c) for c in curves)))
        values = torch.tensor([[c[s] for s in steps] for c in curves], dtype=torch.float64)
        mean = values.mean(0)
        ax.plot(steps, mean.tolist(), label=label)
        if len(curves) > 1:
            std = values.std(0)
            ax.fill_between(steps, (mean - std).tolist(), (mean + std).tolist(), alpha=0.2)
    ax.set_title(f"Training loss, mean ± std over seeds ({cfg.tokens_per_run:,} tokens per run)")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_ylim(top=min(ax.get_ylim()[1], 8.0))
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_tau(path: Path, rows: list[dict[str, Any]]) -> None:
    """tau (mean over heads and layers) over training: mean over seeds per label."""
    from megaflex.eval.plotting import line_plot

    series = {}
    for label in dict.fromkeys(r["label"] for r in rows if r.get("tau_curve")):
        curves = [dict(r["tau_curve"]) for r in rows if r["label"] == label and r.get("tau_curve")]
        steps = sorted(set.intersection(*(set(c) for c in curves)))
        series[label] = [(s, statistics.fmean(c[s] for c in curves)) for s in steps]
    line_plot(path, series, title="Flexformer-N tau over training (mean over heads, layers, seeds)",
              xlabel="step", ylabel="tau")


def plot_spectrum(path: Path, rows: list[dict[str, Any]], cfg: StudyConfig) -> None:
    import megaflex.eval.plotting  # noqa: F401  (selects the headless Agg backend first)
    import matplotlib.pyplot as plt

    head_dim = cfg.hidden_size // cfg.num_heads
    layers = len(rows[0]["spectrum"]["learned"])
    fig, axes = plt.subplots(len(rows), layers, figsize=(3.2 * layers, 2.8 * len(rows)), squeeze=False)
    scale = head_dim ** -0.25  # init rows are N(0, I_d) * d^-1/4: ||omega|| ~ d^-1/4 chi_d
    for i, row in enumerate(rows):
        for layer in range(layers):
            ax = axes[i][layer]
            learned, init = row["spectrum"]["learned"][layer], row["spectrum"]["init"][layer]
            hi = max(max(learned), max(init)) * 1.05
            bins = torch.linspace(0, hi, 40).tolist()
            # stepfilled: one polygon per histogram, drawn like the bars but without 40 patches each
            ax.hist(init, bins=bins, density=True, alpha=0.5, label="init", histtype="stepfilled")
            ax.hist(learned, bins=bins, density=True, alpha=0.5, label="learned", histtype="stepfilled")
            xs = torch.linspace(1e-3, hi, 200)
            ax.plot(xs.tolist(), chi_density(xs / scale, head_dim).div(scale).tolist(), "k--", lw=1, label="Gaussian")
            ax.set_title(f"{row['label']} layer {layer}", fontsize=9)
            ax.set_xlabel("||omega||", fontsize=8)
            if i == 0 and layer == 0:
                ax.legend(fontsize=7)
    fig.suptitle(f"Learned frequency norms vs the initialisation (seed {cfg.seed}; kinds {sorted(LEARNED_SPECTRUM)})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def chi_density(x: torch.Tensor, k: int) -> torch.Tensor:
    """Density of the chi distribution with ``k`` degrees of freedom (norm of N(0, I_k))."""
    x = x.double()
    log_pdf = (k - 1) * x.log() - x.pow(2) / 2 - (k / 2 - 1) * math.log(2) - math.lgamma(k / 2)
    return log_pdf.exp()
