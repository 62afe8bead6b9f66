"""Report of the kernel study: mean +- std over seeds, verdicts the seeds support, and plots.

``write_report(cfg, rows, command, seconds, missing)`` writes ``results.json`` (every available
run and the aggregates), ``results.md`` (a partial report first lists the ``missing`` runs), ``loss_curves.png`` (mean over seeds, +-1 std band), ``spectrum.png``
(learned ||omega|| vs init, first seed) and ``tau.png`` (tau over training, mean over seeds).

Verdict rule (``studies.paired_stats``): two runs are compared by their per-seed log-ratios of
perplexity (every run with one seed shares its data order and initialisation), mean +- SE, and
called separated only when |t| exceeds the two-sided 95% t quantile for n - 1 degrees of freedom;
Welch's unpaired t where the seeds do not match (marked), nothing claimed with one seed. Every
verdict uses it: Flexformer-N against every other run and softmax, each learned kernel against
every fixed one, each arm against its control (``kernel_study_config.control_of``), each window
hybrid against its window-only and Performer controls.
"""

from __future__ import annotations

import math
import re
import statistics
from pathlib import Path
from typing import Any, Sequence

import torch

from studies.kernel_study_config import ARM_KINDS, ARMS, LEARNED_SPECTRUM, StudyConfig, control_of
from studies.paired_stats import RULE, Comparison, compare_runs

METRICS = ("english_docs_valid_ppl", "wikitext2_test_ppl")
EVAL_SETS = {"english_docs_valid_ppl": "english-docs valid", "wikitext2_test_ppl": "WikiText-2 test"}
PER_LAYER = ("omega_rel_change", "negative_fraction", "effective_keys", "tau_per_layer", "far_share",
             "q_norm_mean", "q_norm_p90", "k_norm_mean", "k_norm_p90")
# probe statistics tabulated per layer (``per_layer_table``)
PROBE_PER_LAYER = ("effective_keys", "q_norm_mean", "q_norm_p90", "k_norm_mean", "k_norm_p90")
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
        for key in ("far_share", *PROBE_PER_LAYER):  # per layer, mean over seeds
            lists = [r[key] for r in runs if r.get(key)]
            agg[f"{key}_per_layer"] = [statistics.fmean(layer) for layer in zip(*lists)] if lists else None
        out.append(agg)
    return out


def separation(rows: list[dict[str, Any]], a: str, b: str, metric: str) -> str:
    """'better than b (..)' / 'worse than ..' / 'not separated from ..': a against b, paired by seed."""
    c = compare_runs(rows, a, b, metric)
    if c is None:
        return f"not compared with {b} (no values)"
    return f"{c.word()} {b} ({c.describe()})"


def verdict(summary: list[dict[str, Any]], rows: list[dict[str, Any]]) -> str:
    """The study's questions answered from the runs, claiming only what the seeds support."""
    by = {s["label"]: s for s in summary}
    if "flexformer_n" not in by:
        return ""
    fn = by["flexformer_n"]
    lines = []
    for metric, name in EVAL_SETS.items():
        others = [s for s in summary if s["kind"] not in ("softmax",) and s["label"] != "flexformer_n"]
        parts = [f"Flexformer-N (default recipe) {fn[f'{metric}_mean']:.1f}"]
        parts += [separation(rows, "flexformer_n", other["label"], metric) for other in others]
        lines.append(f"- {name}: " + "; ".join(parts) + ".")
        if "softmax" in by:
            against = [f"{s['label']} {compare_runs(rows, s['label'], 'softmax', metric).describe()}"
                       for s in summary if s["label"] != "softmax"]
            lines.append(f"  - {name} against softmax ({by['softmax'][f'{metric}_mean']:.1f}): " + "; ".join(against) + ".")
    if fn.get("omega_rel_change_mean") is not None:
        lines.append(f"- Omega moved {100 * fn['omega_rel_change_mean']:.0f}% from its init (default recipe; "
                     "||Omega - Omega_init|| / ||Omega_init||, mean over layers and seeds).")
    lines += learned_against_fixed(summary, rows)
    lines += learned_against_its_fixed_kernel(summary, rows)
    lines += window_targets(summary, rows)
    return f"## Verdict (every comparison {RULE})\n\n" + "\n".join(lines) + "\n"


def learned_against_fixed(summary: list[dict[str, Any]], rows: list[dict[str, Any]]) -> list[str]:
    """The paper's first claim on equal terms (every kind under the study's one normalisation): does
    each learned kernel beat every fixed linear kernel, separated by the paired t test?"""
    learned = [s for s in summary if s["label"] in LEARNED_KINDS]
    fixed = [s for s in summary if s["label"] in FIXED_KINDS]
    if not learned or not fixed:
        return []
    lines = []
    for metric, name in EVAL_SETS.items():
        for s in learned:
            results = {f["label"]: compare_runs(rows, s["label"], f["label"], metric) for f in fixed}
            worse_or_tied = [label for label, c in results.items() if c.a_better is not True]
            answer = "yes" if not worse_or_tied else "no"
            lines.append(f"- {name}: does {s['label']} ({s[f'{metric}_mean']:.1f}) beat every fixed kernel (paired t)? "
                         f"{answer}" + ("" if not worse_or_tied else " (" + "; ".join(
                             f"{results[label].word()} {label} ({results[label].describe()})"
                             for label in worse_or_tied) + ")") + ".")
    return lines


def fixed_counterpart(label: str, labels: set[str]) -> str:
    """The Performer run a (window-free) Flexformer_n recipe is one kernel away from: ``performer_decay``
    for a recipe with the learned decay (where the study has it), else plain ``performer``."""
    decayed = "model.kernel_decay=learned" in ARMS.get(label, ((), ""))[0]
    return "performer_decay" if decayed and "performer_decay" in labels else "performer"


def learned_against_its_fixed_kernel(summary: list[dict[str, Any]], rows: list[dict[str, Any]]) -> list[str]:
    """Issue 46's first target, the paper's claim: each window-free Flexformer_n recipe against the fixed
    kernel it starts from under the same setting (``fixed_counterpart``), paired by seed; the hybrids
    meet Performer with their window in ``window_targets``."""
    labels = {s["label"] for s in summary}
    recipes = [s for s in summary if s["kind"] == "flexformer_n" and not window_only(s["label"])]
    lines = []
    for metric, name in EVAL_SETS.items():
        for s in recipes:
            fixed = fixed_counterpart(s["label"], labels)
            if fixed in labels:
                lines.append(f"- {name}: learned kernel against the fixed one, same setting: {s['label']} "
                             f"{s[f'{metric}_mean']:.1f} {separation(rows, s['label'], fixed, metric)}.")
    return lines


def arm_comparisons(summary: list[dict[str, Any]], rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One table row per arm whose control (``control_of``) is in the study: the paired log-ratio
    against it on each evaluation set and what the seeds say."""
    labels = {s["label"] for s in summary}
    table = []
    for s in summary:
        control = control_of(s["label"])
        if control is None or control not in labels or control == s["label"]:
            continue
        row: dict[str, Any] = {"arm": s["label"], "control": control}
        for metric, name in EVAL_SETS.items():
            c: Comparison | None = compare_runs(rows, s["label"], control, metric)
            row[name] = "-" if c is None else f"{c.describe()}: {c.word()} control"
        table.append(row)
    return table


def long_context_table(rows: list[dict[str, Any]], metrics: list[str], train_metric: str) -> list[dict[str, Any]]:
    """Per kind/arm, over its runs that have the long-context columns (n of them): ppl at the
    training length of those same runs, each column (mean ± std), the longest stateful column over
    the training-length ppl (how it degrades or improves past its training length), over softmax's,
    and on that column the paired comparison with softmax and, for a window hybrid, with the window
    alone (``softmax_window<W>``)."""
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
        long_rows = [r for r in rows if r.get(longest) is not None]
        for column, control in ((f"{name} vs softmax", "softmax"), (f"{name} vs the window alone", window_only(label))):
            c = compare_runs(long_rows, label, control, longest) if control and label != control else None
            row[column] = "-" if c is None else f"{c.describe()}: {c.word()}"
        table.append(row)
    return table


def per_layer_table(summary: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per run: effective keys per layer and the mean (90th percentile) of ||q|| and ||k|| entering the
    feature map per layer, mean over seeds; runs without the norms (stored before they were logged) show -."""

    def layers(values: list[float] | None, digits: int = 1) -> str:
        return " / ".join(f"{v:.{digits}f}" for v in values) if values else "-"

    def with_p90(s: dict[str, Any], name: str) -> str:
        mean, p90 = s.get(f"{name}_norm_mean_per_layer"), s.get(f"{name}_norm_p90_per_layer")
        return " / ".join(f"{m:.2f} ({p:.2f})" for m, p in zip(mean, p90)) if mean and p90 else "-"

    return [{"run": s["label"], "effective keys": layers(s.get("effective_keys_per_layer")),
             "‖q‖ mean (p90)": with_p90(s, "q"), "‖k‖ mean (p90)": with_p90(s, "k")} for s in summary]


def window_only(label: str) -> str | None:
    """``softmax_window<W>`` of a window hybrid ``fn_window<W>...`` / ``performer_window<W>...``, else None."""
    match = re.fullmatch(r"(?:fn|performer)_window(\d+)(_\w+)?", label)
    return f"softmax_window{match[1]}" if match else None


def window_controls(label: str, w: str, suffix: str) -> list[str]:
    """The controls of hybrid ``label`` (``fn_window<W><suffix>``): the window alone
    (``softmax_window<W>``, the control that says what the window is worth), Performer with the window
    and the same normalisation, the gated hybrid (rms arm) or the rms hybrid (capped arm), and for a
    remedy arm on a hybrid the hybrid it changes (``control_of``)."""
    capped = suffix.startswith("_capped")
    controls = [f"softmax_window{w}", f"performer_window{w}{'_capped' if capped else ''}"]
    controls += [f"fn_window{w}"] if suffix == "_capped" else ([f"fn_gated{w}"] if not suffix else [])
    base = control_of(label)
    if suffix not in ("", "_capped") and base is not None and base not in controls:
        controls.append(base)
    return controls


def window_targets(summary: list[dict[str, Any]], rows: list[dict[str, Any]], within: float = 1.10) -> list[str]:
    """Verdict lines for each one-normaliser hybrid ``fn_window<W>[...]`` against the controls of the
    same W (``window_controls``), paired by seed, and its ratio to softmax (target <= ``within``)."""
    by = {s["label"]: s for s in summary}
    hybrids = [(s["label"], m) for s in summary if (m := re.fullmatch(r"fn_window(\d+)(_\w+)?", s["label"]))]
    lines = []
    for label, match in sorted(hybrids, key=lambda h: (int(h[1][1]), h[0])):
        w, suffix, hybrid = match[1], match[2] or "", by[label]
        for metric, name in EVAL_SETS.items():
            parts = []
            if "softmax" in by:
                ratio = hybrid[f"{metric}_mean"] / by["softmax"][f"{metric}_mean"]
                parts.append(f"{ratio:.2f}x softmax (target <= {within:.2f}: {'met' if ratio <= within else 'missed'}; "
                             f"{separation(rows, label, 'softmax', metric)})")
            parts += [separation(rows, label, control, metric) for control in window_controls(label, w, suffix) if control in by]
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
        markdown_table(table, columns), "\n", verdict(summary, rows),
    ]
    layer_table = per_layer_table(summary)
    md += ["## Per layer (probe batch, last logged values, mean over seeds)\n",
           f"Effective keys per query (uniform attention over the probe's {cfg.seq_len}-token sequences: "
           f"{(cfg.seq_len + 1) / 2:g}) and the norms of the queries "
           "and keys entering the feature map, per head over the head dim: mean (90th percentile) over heads and tokens; "
           "layers first to last.\n",
           markdown_table(layer_table, list(layer_table[0])), "\n"]
    arms_table = arm_comparisons(summary, rows)
    if arms_table:
        md += ["## Each arm against its control\n",
               "Log-ratio of perplexity, arm over control (100 x mean ± SE over the shared seeds; the rule above).\n",
               markdown_table(arms_table, list(arms_table[0])), "\n"]
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
