"""The kernel study: does a learnable kernel (Flexformer) beat fixed linear kernels, and how close
does it come to softmax?

    python -m evaluation.kernel_study            # defaults: 7 kinds, ~90 min on 2 CPU cores

trains one small GPT per attention kind — identical in everything else: data, token budget,
seed (hence data order and the initialisation of every shared weight), optimizer, schedule —
then evaluates each on the english-docs valid split and on WikiText-2 test, and writes to
``--out`` (default ``evaluation/results/kernel_study``):

* ``results.json`` / ``results.md``: validation perplexity and bits per byte on both sets,
  training tokens/s, parameters, final tau per layer, and the exact command;
* ``loss_curves.png``: training loss of every run on one plot;
* ``spectrum.png``: the learned frequencies — histogram of ||omega|| per layer for Flexformer-N
  (Omega1 and Omega2 pooled) and Flexformer-S — against the Gaussian they started from (the
  same-seed initial values, and the d^-1/4 * chi_d density of N(0, I) d^-1/4 rows).

Training uses the project's trainer (``megaflex-train``, DeepSpeed ZeRO-0, one process, one
subprocess per kind) with only ``model.attention`` changing between runs. Data: a sentencepiece
BPE tokenizer trained on the english-docs train shards, which are then preprocessed to
``.bin/.idx`` (cached under ``--work-dir``). Evaluation: ``evaluation.scoring`` in ``windows``
mode with the training sequence length, every target token counted once.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch

REPO = Path(__file__).resolve().parents[1]
KINDS = ("softmax", "flexformer_n", "flexformer_s", "performer", "elu", "cosformer", "hedgehog")
LEARNED_SPECTRUM = {"flexformer_n": ("omega1", "omega2"), "flexformer_s": ("omega",)}


@dataclass
class StudyConfig:
    """Everything that defines the study; all runs share it except the attention kind."""

    kinds: list[str] = field(default_factory=lambda: list(KINDS))
    data_root: str = os.environ.get("MEGAFLEX_DATA", str(REPO.parent / "shared" / "data"))
    work_dir: str = "work_data/kernel_study"
    out: str = "evaluation/results/kernel_study"
    # model (equal for every kind; linear kinds add their small feature-map parameters)
    vocab_size: int = 4096
    num_layers: int = 4
    hidden_size: int = 128
    num_heads: int = 4
    feature_dim: int = 64
    # training
    steps: int = 300
    seq_len: int = 256
    micro_batch_size: int = 8
    global_batch_size: int = 16
    lr: float = 2e-3
    min_lr: float = 2e-4
    warmup: int = 50
    seed: int = 1234
    # data / evaluation
    max_train_docs: int | None = None  # None: both english-docs train shards
    tokenizer_sentences: int = 200_000
    eval_tokens: int = 200_000  # cap per evaluation set (first N tokens; 0: the whole set)
    eval_batch_size: int = 16

    @property
    def tokens_per_run(self) -> int:
        return self.steps * self.global_batch_size * self.seq_len


# ------------------------------------------------------------------------------- data
def prepare_data(cfg: StudyConfig) -> dict[str, Path]:
    """Tokenizer + train/valid ``.bin/.idx`` under ``work_dir`` (reused when present)."""
    from data_prep.preprocess import PreprocessConfig, preprocess
    from data_prep.train_tokenizer import TokenizerTrainConfig, train_tokenizer

    root = Path(cfg.data_root) / "english-docs"
    work = Path(cfg.work_dir) / f"data_v{cfg.vocab_size}_docs{cfg.max_train_docs or 'all'}"
    work.mkdir(parents=True, exist_ok=True)
    train_inputs = [str(root / "train-00.jsonl"), str(root / "train-01.jsonl")]
    if cfg.max_train_docs is not None:
        subset = work / "train_subset.jsonl"
        if not subset.is_file():
            with open(root / "train-00.jsonl", encoding="utf-8") as src, open(subset, "w", encoding="utf-8") as dst:
                for i, line in enumerate(src):
                    if i >= cfg.max_train_docs:
                        break
                    dst.write(line)
        train_inputs = [str(subset)]
    tok = work / "tokenizer.model"
    if not tok.is_file():
        train_tokenizer(TokenizerTrainConfig(inputs=train_inputs, vocab_size=cfg.vocab_size,
                                             output_prefix=str(work / "tokenizer"),
                                             max_sentences=cfg.tokenizer_sentences, seed=cfg.seed))
    out = {"tokenizer": tok, "train": work / "train", "valid": work / "valid"}
    for name, inputs in (("train", train_inputs), ("valid", [str(root / "valid.jsonl")])):
        if not Path(str(out[name]) + ".idx").is_file():
            preprocess(PreprocessConfig(inputs=inputs, tokenizer=str(tok), output_prefix=str(out[name]),
                                        num_proc=1, progress=False))
    return out


# ------------------------------------------------------------------------------- training
def train_overrides(cfg: StudyConfig, kind: str, data: dict[str, Path], run_dir: Path) -> list[str]:
    """megaflex-train overrides of ``configs/tiny.yaml``: only ``model.attention`` depends on ``kind``."""
    return [
        f"model.attention={kind}", f"model.vocab_size={cfg.vocab_size}", f"model.num_layers={cfg.num_layers}",
        f"model.hidden_size={cfg.hidden_size}", f"model.num_heads={cfg.num_heads}",
        f"model.ffn_hidden_size={4 * cfg.hidden_size}", f"model.feature_dim={cfg.feature_dim}",
        f"model.max_seq_len={cfg.seq_len}",
        "data.source=indexed", f"data.train_path=[{data['train']}]", f"data.valid_path=[{data['valid']}]",
        f"data.tokenizer={data['tokenizer']}", f"data.seq_len={cfg.seq_len}",
        f"train.train_iters={cfg.steps}", f"train.lr={cfg.lr}", f"train.seed={cfg.seed}",
        f"train.micro_batch_size={cfg.micro_batch_size}", f"train.global_batch_size={cfg.global_batch_size}",
        "train.eval_interval=0", "train.eval_iters=2", "train.precision=fp32", "train.device=cpu",
        f"schedule.warmup_iters={min(cfg.warmup, cfg.steps)}", "schedule.decay_style=cosine",
        f"schedule.min_lr={cfg.min_lr}",
        "parallel.zero_stage=0", "parallel.tensor_parallel_size=1",
        "checkpoint.save_interval=0", "checkpoint.keep_last=1", "checkpoint.resume=none",
        f"logging.run_dir={run_dir}", "logging.log_interval=5", "logging.tensorboard=false",
        "logging.progress_bar=false", "logging.kernel_stats_interval=0",
    ]


def train_kind(cfg: StudyConfig, kind: str, data: dict[str, Path]) -> Path:
    """Train one kind in a fresh process (clean RNG and process-group state); returns its run dir."""
    run_dir = Path(cfg.work_dir) / "runs" / kind
    shutil.rmtree(run_dir, ignore_errors=True)  # a stale run's metrics/checkpoints must not mix in
    cmd = [sys.executable, "-m", "megaflex.training.train", "--config", str(REPO / "configs" / "tiny.yaml"),
           *train_overrides(cfg, kind, data, run_dir)]
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", str(os.cpu_count() or 1)))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    with open(Path(cfg.work_dir) / f"train_{kind}.log", "w") as log:
        proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        raise RuntimeError(f"training {kind} failed (exit {proc.returncode}); see {log.name}")
    return run_dir


# ------------------------------------------------------------------------------- evaluation
def evaluate_run(cfg: StudyConfig, kind: str, run_dir: Path, data: dict[str, Path]) -> dict[str, Any]:
    """Perplexities, throughput, tau and the learned spectrum of one trained run."""
    from evaluation.eval_data import load_eval_set
    from evaluation.loading import load_for_eval
    from evaluation.scoring import evaluate
    from megaflex.training.metrics import read_metrics

    loaded = load_for_eval(run_dir / "checkpoints")
    model, tok = loaded.model, loaded.tokenizer
    token_bytes = torch.from_numpy(tok.piece_byte_lengths)
    root = Path(cfg.data_root)
    sets = {
        "english_docs_valid": str(root / "english-docs" / "valid.jsonl"),
        "wikitext2_test": str(root / "wikitext-2-raw" / "wiki.test.raw"),
    }
    row: dict[str, Any] = {"kind": kind, "num_parameters": loaded.meta.get("num_parameters")}
    for name, path in sets.items():
        eval_set = load_eval_set(path, tok, max_tokens=cfg.eval_tokens or None)
        r = evaluate(model, eval_set.docs, "windows", cfg.seq_len, batch_size=cfg.eval_batch_size, token_bytes=token_bytes)
        row[f"{name}_ppl"], row[f"{name}_bpb"], row[f"{name}_tokens"] = r.ppl, r.bits_per_byte, r.tokens
    train = read_metrics(run_dir / "metrics.jsonl", "train")
    steps = sorted(train)
    row["loss_curve"] = [(s, train[s]["loss"]) for s in steps]
    row["final_train_loss"] = train[steps[-1]]["loss"]
    # the first record includes start-up (graph warm-up); skip it unless it is the only one
    speeds = [train[s]["tokens_per_s"] for s in (steps[1:] or steps) if train[s].get("tokens_per_s")]
    row["train_tokens_per_s"] = sum(speeds) / len(speeds) if speeds else None
    stats = model.kernel_statistics()
    taus = [stats[f"layer{i:02d}/tau_mean"] for i in range(cfg.num_layers) if f"layer{i:02d}/tau_mean" in stats]
    row["tau_per_layer"] = taus or None
    row["spectrum"] = spectrum(model, kind, cfg.seed) if kind in LEARNED_SPECTRUM else None
    return row


def spectrum(model: torch.nn.Module, kind: str, seed: int) -> dict[str, list[list[float]]]:
    """Per layer: ||omega|| of every frequency row, learned and at init (same seed as training)."""
    from megaflex.model.gpt import GPT

    torch.manual_seed(seed)  # the trainer seeds the default RNG like this before building the model
    init_model = GPT(model.config)
    out: dict[str, list[list[float]]] = {"learned": [], "init": []}
    for which, m in (("learned", model), ("init", init_model)):
        for block in m.blocks:
            fm = block.attn.core.feature_map
            norms = torch.cat([getattr(fm, name).detach().float().norm(dim=-1).flatten() for name in LEARNED_SPECTRUM[kind]])
            out[which].append(norms.tolist())
    return out


# ------------------------------------------------------------------------------- reporting
def write_report(cfg: StudyConfig, rows: list[dict[str, Any]], command: str, seconds: float) -> None:
    from evaluation.plotting import line_plot, markdown_table, write_json

    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    line_plot(out / "loss_curves.png", {r["kind"]: r["loss_curve"] for r in rows},
              title=f"Training loss ({cfg.tokens_per_run:,} tokens per run)", xlabel="step", ylabel="loss")
    spectra = [r for r in rows if r.get("spectrum")]
    if spectra:
        plot_spectrum(out / "spectrum.png", spectra, cfg)
    summary = [{k: v for k, v in r.items() if k not in ("loss_curve", "spectrum")} for r in rows]
    write_json(out / "results.json", {"command": command, "config": asdict(cfg), "seconds": seconds,
                                      "tokens_per_run": cfg.tokens_per_run, "runs": summary,
                                      "loss_curves": {r["kind"]: r["loss_curve"] for r in rows}})
    table_rows = []
    for r in summary:
        taus = r.get("tau_per_layer")
        table_rows.append({**r, "tau_per_layer": ", ".join(f"{t:.2f}" for t in taus) if taus else "",
                           "train_tokens_per_s": round(r["train_tokens_per_s"]) if r.get("train_tokens_per_s") else None})
    columns = ["kind", "english_docs_valid_ppl", "english_docs_valid_bpb", "wikitext2_test_ppl", "wikitext2_test_bpb",
               "final_train_loss", "train_tokens_per_s", "num_parameters", "tau_per_layer"]
    md = [f"# Kernel study results\n", f"Command: `{command}`\n",
          f"{len(rows)} runs x {cfg.tokens_per_run:,} training tokens ({cfg.steps} steps x {cfg.global_batch_size} x "
          f"{cfg.seq_len}); {cfg.num_layers} layers, hidden {cfg.hidden_size}, {cfg.num_heads} heads, feature_dim "
          f"{cfg.feature_dim}, vocab {cfg.vocab_size}; wall time {seconds / 60:.1f} min.\n",
          "Perplexity: windows of the training length, every target token once (`evaluation/scoring.py`), "
          f"{'whole sets' if not cfg.eval_tokens else f'first {cfg.eval_tokens:,} tokens of each set'}; "
          "bpb = bits per UTF-8 byte. tau: raw tau parameter, mean over heads, per layer (Flexformer-N).\n",
          markdown_table(table_rows, columns), "\n", verdict(summary)]
    (out / "results.md").write_text("\n".join(md) + "\n")


def verdict(rows: list[dict[str, Any]]) -> str:
    """The study's question answered from the numbers (whichever way they fall)."""
    by = {r["kind"]: r for r in rows}
    if "flexformer_n" not in by:
        return ""
    lines = []
    for metric, label in (("english_docs_valid_ppl", "english-docs valid"), ("wikitext2_test_ppl", "WikiText-2 test")):
        linear = {k: r[metric] for k, r in by.items() if k != "softmax"}
        best = min(linear, key=linear.get)
        fn = by["flexformer_n"][metric]
        others = {k: v for k, v in linear.items() if k != "flexformer_n"}
        beats = all(fn < v for v in others.values())
        line = f"- {label}: Flexformer_n ppl {fn:.2f}; "
        if beats and others:
            runner = min(others, key=others.get)
            line += f"it beats every other linear kernel (next best: {runner} {others[runner]:.2f})"
        elif others:
            line += f"it does NOT beat every linear kernel: best linear is {best} ({linear[best]:.2f})"
        if "softmax" in by:
            sm = by["softmax"][metric]
            line += f"; softmax {sm:.2f}, gap {fn - sm:+.2f} ppl ({100 * (fn / sm - 1):+.1f}%)"
        lines.append(line + ".")
    return "## Verdict (computed from the table)\n\n" + "\n".join(lines) + "\n"


def plot_spectrum(path: Path, rows: list[dict[str, Any]], cfg: StudyConfig) -> None:
    import evaluation.plotting  # noqa: F401  (selects the headless Agg backend first)
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
            ax.hist(init, bins=bins, density=True, alpha=0.5, label="init")
            ax.hist(learned, bins=bins, density=True, alpha=0.5, label="learned")
            xs = torch.linspace(1e-3, hi, 200)
            ax.plot(xs.tolist(), chi_density(xs / scale, head_dim).div(scale).tolist(), "k--", lw=1, label="Gaussian")
            ax.set_title(f"{row['kind']} layer {layer}", fontsize=9)
            ax.set_xlabel("||omega||", fontsize=8)
            if i == 0 and layer == 0:
                ax.legend(fontsize=7)
    fig.suptitle("Learned frequency norms vs the Gaussian initialisation")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def chi_density(x: torch.Tensor, k: int) -> torch.Tensor:
    """Density of the chi distribution with ``k`` degrees of freedom (norm of N(0, I_k))."""
    x = x.double()
    log_pdf = (k - 1) * x.log() - x.pow(2) / 2 - (k / 2 - 1) * math.log(2) - math.lgamma(k / 2)
    return log_pdf.exp()


# ------------------------------------------------------------------------------- CLI
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m evaluation.kernel_study", description=__doc__.split("\n\n")[0])
    defaults = StudyConfig()
    p.add_argument("--kinds", default=",".join(defaults.kinds), help="comma-separated attention kinds")
    for name in ("data_root", "work_dir", "out"):
        p.add_argument("--" + name.replace("_", "-"), default=getattr(defaults, name))
    for name in ("vocab_size", "num_layers", "hidden_size", "num_heads", "feature_dim", "steps", "seq_len",
                 "micro_batch_size", "global_batch_size", "warmup", "seed", "tokenizer_sentences", "eval_batch_size"):
        p.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(defaults, name))
    for name in ("lr", "min_lr"):
        p.add_argument("--" + name.replace("_", "-"), type=float, default=getattr(defaults, name))
    p.add_argument("--max-train-docs", type=int, default=None, help="use only the first N train-00 documents")
    p.add_argument("--eval-tokens", type=int, default=defaults.eval_tokens,
                   help="evaluate the first N tokens of each set (0: the whole set)")
    return p


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    args = build_parser().parse_args(argv)
    values = {k: v for k, v in vars(args).items()}
    values["kinds"] = [k for k in args.kinds.split(",") if k]
    unknown = sorted(set(values["kinds"]) - set(KINDS))
    if unknown:
        raise ValueError(f"--kinds: expected a subset of {list(KINDS)}, got unknown {unknown}")
    cfg = StudyConfig(**values)
    command = "python -m evaluation.kernel_study " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    start = time.perf_counter()
    data = prepare_data(cfg)
    rows = []
    for kind in cfg.kinds:
        t0 = time.perf_counter()
        run_dir = train_kind(cfg, kind, data)
        rows.append(evaluate_run(cfg, kind, run_dir, data))
        print(f"[kernel_study] {kind}: valid ppl {rows[-1]['english_docs_valid_ppl']:.2f}, WikiText-2 test ppl "
              f"{rows[-1]['wikitext2_test_ppl']:.2f} ({time.perf_counter() - t0:.0f}s)", flush=True)
    write_report(cfg, rows, command.strip(), time.perf_counter() - start)
    print(f"[kernel_study] results in {cfg.out}")
    return rows


if __name__ == "__main__":
    main()
