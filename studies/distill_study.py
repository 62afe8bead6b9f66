"""Distillation study: convert a softmax teacher into Flexformer-N with <= 10% of its training tokens.

    python -m studies.distill_study                                   # 3 seeds, the kernel study's CPU scale
    python -m studies.distill_study --teacher-runs KSWORK/runs        # reuse kernel-study softmax runs

Per seed (seed-major: a stopped study still has whole seeds):

1. teacher: a softmax GPT with the kernel study's shape and recipe (``runner.train_run``,
   300 steps x 16 x 256 tokens), or that study's run ``softmax_s{seed}`` under ``--teacher-runs``;
2. per student kind (``flexformer_n`` and ``performer``, the paper's fixed-kernel baseline):
   stage 1 ``megaflex-distill distill.stage=attention_transfer`` (only the kernel parameters and
   gains train, per-layer attention-output MSE against the teacher's attention), then stage 2
   ``distill.stage=finetune`` from stage 1's checkpoint (all parameters, or LoRA with
   ``--lora-rank``; LM loss plus ``--kl-weight`` x KL to the teacher's logits);
3. Flexformer-N from scratch: the kernel study's recipe on the tokens of stage 1 + stage 2.

Stages 1 and 2 together may use at most ``--max-token-fraction`` (10%) of the teacher's tokens.
Every model is evaluated like the kernel study's runs (``runner.evaluate_run``: english-docs
valid and WikiText-2 test, windows of the training length). Output in ``--out`` (default
``$XDG_CACHE_HOME/megaflex/distill``; the committed ``docs/results/distill`` only when named): ``results.json``, ``results.md`` (mean +- std over seeds, tokens
as a fraction of the teacher's, the issue's targets checked) and ``ppl_vs_tokens.png``.
"""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from megaflex.attention.normalize import NORMALIZATIONS
from megaflex.checkpoint.layout import run_checkpoint_dir
from megaflex.cli_args import scratch_results

from megaflex.cli_args import available_device
from studies.kernel_study_config import RunSpec, StudyConfig, number_type, output_dir_option, path_option
from studies.runner import PLAIN_KIND_FIELDS, evaluate_run, prepare_data, reused_run_data, train_run

DISTILL_ENTRY = "megaflex.distill"  # megaflex-distill's module, run with python -m
STUDENTS = ("flexformer_n", "performer")
TEACHER = RunSpec("softmax", "softmax")  # label as in the kernel study: runs/softmax_s{seed}
SCRATCH = RunSpec("flexformer_n_scratch", "flexformer_n")
EVAL_SETS = {"english_docs_valid_ppl": "english-docs valid", "wikitext2_test_ppl": "WikiText-2 test"}
NOT_RUN = "not run"  # a target whose comparison run is not in the study
TARGET_PPL_RATIO = 1.10  # the issue: distilled Flexformer-N within 10% of the teacher's perplexity


@dataclass
class DistillStudyConfig(StudyConfig):
    """The kernel study's shape and data (``StudyConfig``: the teacher's recipe) plus the stages."""

    work_dir: str = "work_data/distill_study"
    out: str = field(default_factory=lambda: str(scratch_results("distill")))  # docs/results/...: only when named
    students: list[str] = field(default_factory=lambda: list(STUDENTS))
    teacher_runs: str | None = None  # a kernel study's runs/ folder holding softmax_s{seed}
    stage1_steps: int = 10
    stage1_lr: float = 1e-2  # LoLCATs' stage-1 LR: only the feature maps train
    stage2_steps: int = 20
    stage2_lr: float = 1e-3  # the single-seed pilot: 1e-3 beat 5e-4 on english-docs (364 vs 434 ppl), ~equal on WikiText-2
    # The stage LRs are already the kernel's (stage 1 trains nothing else), so the project's kernel
    # LR multiplier (x10, for pretraining from scratch) is not applied on top by default: seed 1234,
    # stage 2 english-docs / WikiText-2 ppl 364.2 / 786.1 at x1 against 393.9 / 858.6 at x10.
    stage_kernel_lr_multiplier: float = 1.0
    output_mse_weight: float = 1.0
    weights_ce_weight: float = 0.0
    lora_rank: int = 0  # 0: stage 2 trains all parameters
    lora_alpha: float = 16.0
    kl_weight: float = 0.0
    max_token_fraction: float = 0.1
    # W > 0: every student and the scratch run mix exact softmax over the last W tokens into their
    # linear attention (model.softmax_window, attention/hybrid.py; LoLCATs' sliding window)
    softmax_window: int = 0
    # (normalization, inherited from StudyConfig: the students' and scratch's model.normalization)

    def student_model_overrides(self) -> list[str]:
        """Model overrides every student (stage 1; stage 2 inherits its model) and the scratch run get."""
        window = [f"model.softmax_window={self.softmax_window}"] if self.softmax_window else []
        return window + [f"model.normalization={self.normalization}"]

    def stage_tokens(self) -> int:
        """Tokens of stage 1 + stage 2 (same batch and sequence length as the teacher)."""
        return (self.stage1_steps + self.stage2_steps) * self.global_batch_size * self.seq_len

    def with_schedule(self, steps: int, lr: float, min_lr: float, warmup: int, **changes: Any) -> "DistillStudyConfig":
        return dataclasses.replace(self, steps=steps, lr=lr, min_lr=min_lr, warmup=warmup, **changes)

    def stage_configs(self) -> dict[str, "DistillStudyConfig"]:
        """Training recipe per run type: the stages (warmup 10%, cosine to lr / 10) and the scratch run
        (the teacher's recipe, its warmup scaled to the shorter run)."""
        steps = self.stage1_steps + self.stage2_steps
        kernel_lr = {"kernel_frequency_lr_multiplier": self.stage_kernel_lr_multiplier,
                     "kernel_temperature_lr_multiplier": self.stage_kernel_lr_multiplier}
        return {
            "stage1": self.with_schedule(self.stage1_steps, self.stage1_lr, self.stage1_lr / 10,
                                         max(1, self.stage1_steps // 10), **kernel_lr),
            "stage2": self.with_schedule(self.stage2_steps, self.stage2_lr, self.stage2_lr / 10,
                                         max(1, self.stage2_steps // 10), **kernel_lr),
            "scratch": self.with_schedule(steps, self.lr, self.min_lr, max(1, round(self.warmup * steps / self.steps))),
        }


# ------------------------------------------------------------------------------- runs
def distill_overrides(cfg: DistillStudyConfig, student: str, stage: str, teacher: Path, init_from: Path | None) -> list[str]:
    """megaflex-distill settings of one stage (on top of the kernel study's training overrides)."""
    out = [f"distill.teacher={run_checkpoint_dir(teacher)}", f"distill.student_attention={student}"]
    if stage == "stage1":
        out += ["distill.stage=attention_transfer", f"distill.output_mse_weight={cfg.output_mse_weight}",
                f"distill.weights_ce_weight={cfg.weights_ce_weight}", *cfg.student_model_overrides()]
    else:
        out += ["distill.stage=finetune", f"checkpoint.init_from={run_checkpoint_dir(init_from)}",
                f"distill.lora_rank={cfg.lora_rank}", f"distill.lora_alpha={cfg.lora_alpha}",
                f"distill.kl_weight={cfg.kl_weight}",
                # stage 1's model is the default, but the base YAML's model keys (configs/tiny.yaml sets
                # model.normalization) would win over it: repeat what differs from the teacher's
                *cfg.student_model_overrides()]
    return out


def teacher_run(cfg: DistillStudyConfig, seed: int, data: dict[str, Path]) -> Path:
    """The seed's teacher run dir: reused from ``--teacher-runs`` (a finished softmax run of the
    study's shape, else an error) or trained here."""
    if cfg.teacher_runs is None:
        return train_run(cfg, TEACHER, seed, data)
    run_dir = Path(cfg.teacher_runs) / f"{TEACHER.label}_s{seed}"
    teacher_data(cfg, run_dir)
    return run_dir


def teacher_data(cfg: DistillStudyConfig, run_dir: Path) -> dict[str, Path]:
    """Tokenizer and data of a reused teacher (the students must see its tokenizer), after checking
    that it is a finished softmax run of the study's shape."""
    return reused_run_data(cfg, run_dir, "softmax", "--teacher-runs", "teacher")


def trained_tokens(run_dir: Path) -> int:
    """Training tokens of a finished run (the trainer's last "train" record)."""
    from megaflex.training.metrics import read_metrics

    train = read_metrics(run_dir / "metrics.jsonl", "train")
    return int(train[max(train)]["tokens"])


def evaluated(cfg: StudyConfig, run: RunSpec, seed: int, run_dir: Path, checkpoint: Path | None = None,
              **extra: Any) -> dict[str, Any]:
    """``runner.evaluate_run``'s row (the model in ``checkpoint``, default the run's
    checkpoint folder) plus this run's training tokens and ``extra`` fields."""
    row = evaluate_run(cfg, run, seed, run_dir, checkpoint)
    row.update(tokens=trained_tokens(run_dir), **extra)
    print(f"[distill_study] {run.label} seed {seed}: valid ppl {row['english_docs_valid_ppl']:.2f}, "
          f"WikiText-2 test ppl {row['wikitext2_test_ppl']:.2f}", flush=True)
    return row


def check_budget(cfg: DistillStudyConfig, teacher_tokens: int) -> None:
    """ValueError when stage 1 + stage 2 would exceed the token budget."""
    if cfg.stage_tokens() > cfg.max_token_fraction * teacher_tokens:
        raise ValueError(
            f"--stage1-steps + --stage2-steps: {cfg.stage_tokens():,} tokens exceed --max-token-fraction "
            f"{cfg.max_token_fraction:g} of the teacher's {teacher_tokens:,} tokens; use fewer steps")


def run_seed(cfg: DistillStudyConfig, seed: int, data: dict[str, Path]) -> list[dict[str, Any]]:
    """Teacher, both stages per student and the scratch run of one seed, evaluated."""
    from megaflex.checkpoint import merged_checkpoint_dir

    recipes = cfg.stage_configs()
    teacher = teacher_run(cfg, seed, data)
    teacher_tokens = trained_tokens(teacher)
    check_budget(cfg, teacher_tokens)
    rows = [evaluated(cfg, TEACHER, seed, teacher, stage="teacher", student="softmax", tokens_total=teacher_tokens)]
    for student in cfg.students:
        init_from, total = None, 0
        for stage in ("stage1", "stage2"):
            run = RunSpec(f"{student}_{stage}", student, distill_overrides(cfg, student, stage, teacher, init_from))
            run_dir = train_run(recipes[stage], run, seed, data, entry=DISTILL_ENTRY)
            merged = stage == "stage2" and cfg.lora_rank > 0  # a LoRA run's merged weights
            row = evaluated(recipes[stage], run, seed, run_dir, merged_checkpoint_dir(run_dir) if merged else None,
                            stage=stage, student=student)
            total += row["tokens"]
            row["tokens_total"] = total
            rows.append(row)
            init_from = run_dir
    scratch = RunSpec(SCRATCH.label, SCRATCH.kind, cfg.student_model_overrides())
    scratch_dir = train_run(recipes["scratch"], scratch, seed, data)
    rows.append(evaluated(recipes["scratch"], scratch, seed, scratch_dir, stage="scratch", student="flexformer_n"))
    rows[-1]["tokens_total"] = rows[-1]["tokens"]
    for row in rows:
        row["teacher_tokens"] = teacher_tokens
        row["token_fraction"] = row["tokens_total"] / teacher_tokens
    return rows


def run_study(cfg: DistillStudyConfig, command: str) -> list[dict[str, Any]]:
    """Every seed, then the report; returns the rows."""
    start = time.perf_counter()
    if cfg.teacher_runs is None:
        check_budget(cfg, cfg.tokens_per_run)  # fail before training anything
        data = prepare_data(cfg)
    else:
        data = teacher_data(cfg, teacher_run(cfg, cfg.seed, {}))
        Path(cfg.work_dir).mkdir(parents=True, exist_ok=True)  # the run logs' folder (prepare_data makes it otherwise)
    rows = [row for seed in cfg.seed_list for row in run_seed(cfg, seed, data)]
    write_report(cfg, rows, command, time.perf_counter() - start)
    print(f"[distill_study] results in {cfg.out}")
    return rows


# ------------------------------------------------------------------------------- report
def summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``kernel_study_report.aggregate`` per run label, plus its stage, tokens as a fraction of the
    teacher's and each perplexity as a ratio to the teacher's (means over seeds)."""
    import statistics

    from studies.kernel_study_report import aggregate

    summary = aggregate(rows)
    teacher = next(s for s in summary if s["label"] == TEACHER.label)
    for s in summary:
        runs = [r for r in rows if r["label"] == s["label"]]
        s.update(stage=runs[0]["stage"], student=runs[0]["student"],
                 token_fraction=statistics.fmean(r["token_fraction"] for r in runs),
                 tokens_total=statistics.fmean(r["tokens_total"] for r in runs))
        for metric in EVAL_SETS:
            s[f"{metric}_ratio"] = s[f"{metric}_mean"] / teacher[f"{metric}_mean"]
    return summary


def check_targets(
    cfg: DistillStudyConfig, summary: list[dict[str, Any]], rows: list[dict[str, Any]]
) -> dict[str, dict[str, Any]]:
    """The issue's targets per evaluation set, for Flexformer-N after stage 2: within 10% of the
    teacher's ppl on <= 10% of its tokens; better than scratch; better than distilled Performer.
    Comparisons are paired by seed (``studies.paired_stats``: None = not separated by the seeds);
    the Performer comparison is ``NOT_RUN`` when the study had no Performer student."""
    from studies.paired_stats import compare_runs

    def beats(a: str, b: str, metric: str) -> bool | None:
        return compare_runs(rows, a, b, metric).a_better

    by = {s["label"]: s for s in summary}
    fn = by.get("flexformer_n_stage2")
    if fn is None:
        return {}
    out = {}
    for metric in EVAL_SETS:
        out[metric] = {
            "ppl_ratio_to_teacher": fn[f"{metric}_ratio"], "token_fraction": fn["token_fraction"],
            "within_10pct_on_10pct_tokens": fn[f"{metric}_ratio"] <= TARGET_PPL_RATIO
            and fn["token_fraction"] <= cfg.max_token_fraction + 1e-9,  # a mean over seeds: rounding
            "beats_scratch": beats(fn["label"], SCRATCH.label, metric),
            "beats_distilled_performer": beats(fn["label"], "performer_stage2", metric) if "performer_stage2" in by else NOT_RUN,
        }
    return out


def targets_markdown(targets: dict[str, dict[str, Any]], seeds: int) -> str:
    word = {True: "yes", False: "no", None: "not separated by the seeds" if seeds > 1 else "one seed: not claimed",
            NOT_RUN: "not run (no performer student)"}
    lines = []
    for metric, t in targets.items():
        lines.append(
            f"- {EVAL_SETS[metric]}: distilled Flexformer-N ppl = {t['ppl_ratio_to_teacher']:.3f}x the teacher's on "
            f"{100 * t['token_fraction']:.1f}% of its tokens; within 10% on <= 10% tokens: "
            f"{word[t['within_10pct_on_10pct_tokens']]}; better than scratch at equal tokens: {word[t['beats_scratch']]}; "
            f"better than distilled Performer: {word[t['beats_distilled_performer']]}.")
    rule = "better = paired by seed, |t| of the per-seed log-ratios above the 95% t quantile (studies.paired_stats)"
    return f"## Targets (computed from the means; {rule})\n\n" + "\n".join(lines) + "\n"


def plot_ppl_vs_tokens(path: Path, summary: list[dict[str, Any]]) -> None:
    """Perplexity (mean +- std over seeds) against tokens spent as a fraction of the teacher's."""
    import megaflex.eval.plotting  # noqa: F401  (headless backend first)
    import matplotlib.pyplot as plt

    teacher = next(s for s in summary if s["label"] == TEACHER.label)
    fig, axes = plt.subplots(1, len(EVAL_SETS), figsize=(6 * len(EVAL_SETS), 4.5), squeeze=False)
    for ax, (metric, name) in zip(axes[0], EVAL_SETS.items()):
        ax.axhline(TARGET_PPL_RATIO * teacher[f"{metric}_mean"], color="gray", ls=":",
                   label=f"teacher x {TARGET_PPL_RATIO:g} (target)")
        for group in dict.fromkeys((s["student"], s["stage"] in ("stage1", "stage2")) for s in summary):
            points = [s for s in summary if (s["student"], s["stage"] in ("stage1", "stage2")) == group]
            label = {"teacher": "softmax teacher", "scratch": "flexformer_n from scratch"}.get(
                points[0]["stage"], f"{group[0]} distilled (stage 1, 2)")
            ax.errorbar([s["token_fraction"] for s in points], [s[f"{metric}_mean"] for s in points],
                        yerr=[s.get(f"{metric}_std") or 0.0 for s in points], marker="o", capsize=3, label=label)
        ax.set_xscale("log")
        ax.set_title(name)
        ax.set_xlabel("training tokens / teacher's")
        ax.set_ylabel("perplexity")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("Distillation: perplexity vs tokens spent (mean ± std over seeds)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(cfg: DistillStudyConfig, rows: list[dict[str, Any]], command: str, seconds: float) -> None:
    """results.json, results.md and ppl_vs_tokens.png under ``cfg.out``."""
    from megaflex.eval.plotting import markdown_table, write_json

    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    summary = summarize(rows)
    targets = check_targets(cfg, summary, rows)
    plot_ppl_vs_tokens(out / "ppl_vs_tokens.png", summary)
    runs = [{k: v for k, v in r.items() if k not in ("loss_curve", "spectrum", "tau_curve")} for r in rows]
    write_json(out / "results.json", {"command": command, "config": dataclasses.asdict(cfg), "seconds": seconds,
                                      "summary": summary, "targets": targets, "runs": runs})
    table = []
    for s in summary:
        row = {"run": s["label"], "stage": s["stage"], "seeds": s["seeds"],
               "tokens / teacher's": f"{s['token_fraction']:.3f} ({s['tokens_total']:,.0f})"}
        for metric, name in EVAL_SETS.items():
            std = s.get(f"{metric}_std")
            row[f"{name} ppl"] = f"{s[f'{metric}_mean']:.2f}" + (f" ± {std:.2f}" if std is not None else "")
            row[f"{name} / teacher"] = f"{s[f'{metric}_ratio']:.3f}"
        table.append(row)
    stage2 = "all parameters" if cfg.lora_rank == 0 else f"LoRA rank {cfg.lora_rank} on q/k/v/o"
    md = [
        "# Distillation study results\n", f"Command: `{command}`\n",
        f"Seeds {cfg.seed_list}; teacher: softmax, {cfg.num_layers} layers, hidden {cfg.hidden_size}, {cfg.num_heads} heads, "
        f"vocab {cfg.vocab_size}, {cfg.steps} steps x {cfg.global_batch_size} x {cfg.seq_len} tokens"
        f"{f' (reused from {cfg.teacher_runs})' if cfg.teacher_runs else ''}; students {cfg.students}"
        f"{f' with model.softmax_window={cfg.softmax_window} (scratch too)' if cfg.softmax_window else ''}"
        f", model.normalization={cfg.normalization}, feature_dim "
        f"{cfg.feature_dim}; device {cfg.device}; wall time {seconds / 60:.1f} min.\n",
        f"Stage 1 (attention transfer, kernel parameters + gains only; output MSE weight {cfg.output_mse_weight:g}, "
        f"weights CE weight {cfg.weights_ce_weight:g}): {cfg.stage1_steps} steps, lr {cfg.stage1_lr:g}. Stage 2 "
        f"(finetune, {stage2}, KL weight {cfg.kl_weight:g}): {cfg.stage2_steps} steps, lr {cfg.stage2_lr:g}. Kernel "
        f"parameters' LR multiplier in both stages: {cfg.stage_kernel_lr_multiplier:g}. "
        f"Scratch: the teacher's recipe for {cfg.stage1_steps + cfg.stage2_steps} steps. Tokens: cumulative over "
        "the stages, as a fraction of the teacher's.\n",
        "Perplexity: mean ± sample std over seeds; windows of the training length, every target token once, "
        f"{'whole sets' if not cfg.eval_tokens else f'first {cfg.eval_tokens:,} tokens of each set'}.\n",
        markdown_table(table, ["run", "stage", "seeds", "tokens / teacher's", *(f"{n} {c}" for n in EVAL_SETS.values()
                                                                             for c in ("ppl", "/ teacher"))]),
        "\n", targets_markdown(targets, min(s["seeds"] for s in summary)) if targets else "",
    ]
    (out / "results.md").write_text("\n".join(md) + "\n")


# ------------------------------------------------------------------------------- CLI
INT_FLAGS = ("vocab_size", "num_layers", "hidden_size", "num_heads", "feature_dim", "steps", "seq_len",
             "micro_batch_size", "global_batch_size", "warmup", "seed", "seeds", "tokenizer_sentences",
             "eval_batch_size", "eval_tokens", "max_train_docs", "stage1_steps", "stage2_steps", "lora_rank", "softmax_window")
FLOAT_FLAGS = ("lr", "min_lr", "stage1_lr", "stage2_lr", "stage_kernel_lr_multiplier", "output_mse_weight", "weights_ce_weight", "kl_weight",
               "lora_alpha", "max_token_fraction")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m studies.distill_study", description=__doc__.split("\n\n")[0])
    defaults = DistillStudyConfig()
    p.add_argument("--students", default=None,
                   help=f"comma-separated student attention kinds (default {','.join(defaults.students)}, less those with "
                        "nothing to train in stage 1 under --normalization: a fixed map has only the rms gains)")
    p.add_argument("--teacher-runs", type=path_option, default=None,
                   help="a kernel study's runs/ folder: reuse its softmax_s{seed} runs")
    p.add_argument("--device", type=available_device, default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--normalization", default=defaults.normalization, choices=list(NORMALIZATIONS),
                   help="the students' (and scratch's) output normalisation (model.normalization)")
    p.add_argument("--data-root", type=path_option, default=defaults.data_root)
    for name in ("work_dir", "out"):
        p.add_argument("--" + name.replace("_", "-"), type=output_dir_option, default=getattr(defaults, name))
    for name in INT_FLAGS + FLOAT_FLAGS:
        p.add_argument("--" + name.replace("_", "-"), type=number_type(name), default=None,
                       help=f"default {getattr(defaults, name)}")
    return p


def untrainable_students(students: list[str], normalization: str) -> list[str]:
    """The student kinds with no parameter for stage 1 (attention transfer) to train under ``normalization``."""
    from megaflex.model import GPT, ModelConfig
    from megaflex.training.weights import linear_attention_parameter_names

    def trainable(kind: str) -> bool:
        probe = ModelConfig(vocab_size=8, num_layers=1, hidden_size=8, num_heads=1, feature_dim=4, chunk_size=4,
                            max_seq_len=8, attention=kind, normalization=normalization, **PLAIN_KIND_FIELDS)
        return bool(linear_attention_parameter_names(GPT(probe)))

    return [s for s in students if not trainable(s)]


def config_from_args(args: argparse.Namespace) -> DistillStudyConfig:
    """DistillStudyConfig from parsed arguments (unset flags keep the defaults), validated."""
    from megaflex.model.config import ATTENTION_KINDS

    values = {k: v for k, v in vars(args).items() if v is not None}
    explicit = args.students is not None
    values["students"] = [s for s in args.students.split(",") if s] if explicit else list(DistillStudyConfig().students)
    linear = [k for k in ATTENTION_KINDS if k != "softmax"]
    if not values["students"] or set(values["students"]) - set(linear):
        raise ValueError(f"--students: expected linear attention kinds of {linear}, got {values['students']}")
    normalization = values.get("normalization", DistillStudyConfig.normalization)
    idle = untrainable_students(values["students"], normalization)
    if idle and explicit:
        raise ValueError(f"--students: {idle} have nothing to train in stage 1 (attention transfer) with "
                         f"--normalization {normalization}: a fixed feature map's only learnable part is the rms gains; "
                         "use --normalization rms or other students")
    if idle:
        print(f"[distill_study] students {idle} left out: nothing to train in stage 1 with model.normalization "
              f"{normalization} (pass --normalization rms to distill them)", flush=True)
        values["students"] = [s for s in values["students"] if s not in idle]
    if values.get("softmax_window", 0) > 0 and values.get("weights_ce_weight", DistillStudyConfig.weights_ce_weight) > 0:
        raise ValueError("--softmax-window: the attention-weights loss (--weights-ce-weight) needs students without a "
                         "window; set one of them to 0")
    return DistillStudyConfig(**values)


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    cfg = config_from_args(build_parser().parse_args(argv))
    args = argv if argv is not None else sys.argv[1:]
    return run_study(cfg, ("python -m studies.distill_study " + " ".join(shlex.quote(a) for a in args)).strip())


if __name__ == "__main__":
    main()
