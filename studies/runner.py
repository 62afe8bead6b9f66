"""One run of a study, shared by every study in this folder (the kernel study, its pilot, the
kernel transfer and the distillation study): the data (tokenizer and ``.bin/.idx`` of english-docs),
training one run in a fresh ``megaflex-train`` process, scoring it (``megaflex.eval.scoring`` in
``windows`` mode at the training length, long contexts, the trainer's kernel statistics, the
learned spectrum), and its stored row (``runs/<label>_s<seed>.json``, keyed by a fingerprint of
what the result depends on, so a resumed study skips it).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any, Sequence

import torch

from studies.kernel_study_config import (
    LEARNED_SPECTRUM, LEGACY_NORMALIZATION, NOT_FINGERPRINTED, REPO, RunSpec, StudyConfig,
)


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
# The kinds are the plain maps, as their stored rows were trained before the decay became the default
# (issue 46); the decay is an arm's override. Probes of what a kind trains build it with these too.
PLAIN_KIND_FIELDS = {"kernel_decay": "none"}


def train_overrides(cfg: StudyConfig, run: RunSpec, seed: int, data: dict[str, Path], run_dir: Path) -> list[str]:
    """megaflex-train overrides of ``configs/tiny.yaml``: only the kind, the arm and the seed differ."""
    gpu = cfg.device == "cuda"
    return [
        f"model.attention={run.kind}", f"model.vocab_size={cfg.vocab_size}", f"model.num_layers={cfg.num_layers}",
        f"model.hidden_size={cfg.hidden_size}", f"model.num_heads={cfg.num_heads}",
        f"model.ffn_hidden_size={4 * cfg.hidden_size}", f"model.feature_dim={cfg.feature_dim}",
        f"model.max_seq_len={cfg.seq_len}",
        "data.source=indexed", f"data.train_path=[{data['train']}]", f"data.valid_path=[{data['valid']}]",
        f"data.tokenizer={data['tokenizer']}", f"data.seq_len={cfg.seq_len}",
        f"data.document_boundaries={cfg.document_boundaries}",
        f"train.train_iters={cfg.steps}", f"train.lr={cfg.lr}", f"train.seed={seed}",
        f"train.micro_batch_size={cfg.micro_batch_size}", f"train.global_batch_size={cfg.global_batch_size}",
        "train.eval_interval=0", "train.eval_iters=2", f"train.precision={'bf16' if gpu else 'fp32'}",
        f"train.device={cfg.device}",
        f"schedule.warmup_iters={min(cfg.warmup, cfg.steps)}", "schedule.decay_style=cosine",
        f"schedule.min_lr={cfg.min_lr}",
        f"optimizer.kernel_frequency_lr_multiplier={cfg.kernel_frequency_lr_multiplier}",
        f"optimizer.kernel_temperature_lr_multiplier={cfg.kernel_temperature_lr_multiplier}",
        "parallel.zero_stage=0", "parallel.tensor_parallel_size=1",
        "checkpoint.save_interval=0", "checkpoint.keep_last=1", "checkpoint.resume=none",
        f"logging.run_dir={run_dir}", "logging.log_interval=5", "logging.tensorboard=false",
        "logging.progress_bar=false", f"logging.kernel_stats_interval={cfg.kernel_stats_interval}",
        f"model.normalization={cfg.normalization}",
        *(f"model.{key}={value}" for key, value in PLAIN_KIND_FIELDS.items()),
        *run.overrides,  # an arm's own model.normalization (or kernel_decay) comes later and wins
    ]


def train_run(
    cfg: StudyConfig, run: RunSpec, seed: int, data: dict[str, Path], entry: str = "megaflex.training.train"
) -> Path:
    """Train one run in a fresh process (clean RNG and process-group state); returns its run dir.
    ``entry``: the module run with ``python -m`` (another trainer front end, e.g. megaflex-distill's)."""
    name = f"{run.label}_s{seed}"
    run_dir = Path(cfg.work_dir) / "runs" / name
    shutil.rmtree(run_dir, ignore_errors=True)  # a stale run's metrics/checkpoints must not mix in
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", entry, "--config", str(REPO / "configs" / "tiny.yaml"),
           *train_overrides(cfg, run, seed, data, run_dir)]
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", str(os.cpu_count() or 1)))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    with open(Path(cfg.work_dir) / f"train_{name}.log", "w") as log:
        proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        raise RuntimeError(f"training {name} failed (exit {proc.returncode}); see {log.name}")
    return run_dir


def reused_run_data(
    cfg: StudyConfig, run_dir: Path, attention: str, flag: str, role: str, steps: int | None = None
) -> dict[str, Path]:
    """Tokenizer and data paths of a finished kernel-study run that another experiment reuses
    (``flag``: the option that named its folder, ``role``: what it is there, for the errors), after
    checking that its model (and, given ``steps``, its training length) has the experiment's shape."""
    from megaflex.checkpoint import CheckpointMeta, resolve_checkpoint, run_checkpoint_dir

    ckpt_dir = run_checkpoint_dir(run_dir)
    if not (run_dir / "metrics.jsonl").is_file() or not ckpt_dir.is_dir():
        raise FileNotFoundError(f"{flag}: {run_dir} is not a finished kernel-study run "
                                f"(expected metrics.jsonl and {ckpt_dir.name}/)")
    config = CheckpointMeta.read(resolve_checkpoint(ckpt_dir)).config
    model = config["model"]
    wanted = {"attention": attention, "vocab_size": cfg.vocab_size, "num_layers": cfg.num_layers,
              "hidden_size": cfg.hidden_size, "num_heads": cfg.num_heads}
    if attention != "softmax":
        wanted["feature_dim"] = cfg.feature_dim
    wrong = {k: (model.get(k), v) for k, v in wanted.items() if model.get(k) != v}
    if config["data"]["seq_len"] != cfg.seq_len:
        wrong["seq_len"] = (config["data"]["seq_len"], cfg.seq_len)
    if steps is not None and config["train"]["train_iters"] != steps:
        wrong["steps"] = (config["train"]["train_iters"], steps)
    if wrong:
        raise ValueError(f"{flag}: {run_dir} does not match the study's shape ({role}, study): {wrong}; "
                         "pass matching flags (--vocab-size, --hidden-size, ..., --steps-a)")
    data = config["data"]
    return {"tokenizer": Path(data["tokenizer"]), "train": Path(data["train_path"][0]), "valid": Path(data["valid_path"][0])}


# ------------------------------------------------------------------------------- evaluation
# (set path, its size and mtime, tokenizer sha256, token cap) -> token documents: every run of a
# study is scored on the same two sets with the same tokenizer, and tokenizing them (~4 MB of
# text, whole even when capped) costs more than scoring a capped set
_EVAL_DOCS: dict[tuple[str, int, int, str, int | None], list[torch.Tensor]] = {}


def eval_documents(path: str, tokenizer: Any, max_tokens: int | None) -> list[torch.Tensor]:
    """``load_eval_set(path, tokenizer, max_tokens=...)``'s documents, tokenized once per process."""
    from megaflex.eval.eval_data import load_eval_set

    stat = os.stat(path)
    key = (path, stat.st_size, stat.st_mtime_ns, tokenizer.record["sha256"], max_tokens)
    if key not in _EVAL_DOCS:
        _EVAL_DOCS[key] = load_eval_set(path, tokenizer, max_tokens=max_tokens).docs
    return _EVAL_DOCS[key]


def evaluate_run(
    cfg: StudyConfig, run: RunSpec, seed: int, run_dir: Path, checkpoint: Path | None = None
) -> dict[str, Any]:
    """Perplexities, throughput, kernel statistics and the learned spectrum of one trained run
    (its model from ``checkpoint``, default the run's checkpoint folder)."""
    from megaflex.eval.loading import load_for_eval
    from megaflex.eval.scoring import evaluate
    from megaflex.checkpoint import run_checkpoint_dir
    from megaflex.training.metrics import read_metrics

    loaded = load_for_eval(checkpoint or run_checkpoint_dir(run_dir), device=cfg.device)
    model, tok = loaded.model, loaded.tokenizer
    token_bytes = torch.from_numpy(tok.piece_byte_lengths)
    root = Path(cfg.data_root)
    sets = {
        "english_docs_valid": str(root / "english-docs" / "valid.jsonl"),
        "wikitext2_test": str(root / "wikitext-2-raw" / "wiki.test.raw"),
    }
    row: dict[str, Any] = {"label": run.label, "kind": run.kind, "seed": seed, "overrides": run.overrides,
                           "num_parameters": loaded.meta.num_parameters}
    for name, path in sets.items():
        docs = eval_documents(path, tok, cfg.eval_tokens or None)
        r = evaluate(model, docs, "windows", cfg.seq_len, batch_size=cfg.eval_batch_size, token_bytes=token_bytes)
        row[f"{name}_ppl"], row[f"{name}_bpb"], row[f"{name}_tokens"] = r.ppl, r.bits_per_byte, r.tokens
    row.update(long_context_scores(cfg, model, tok, token_bytes))
    train = read_metrics(run_dir / "metrics.jsonl", "train")
    steps = sorted(train)
    row["loss_curve"] = [(s, train[s]["loss"]) for s in steps]
    row["final_train_loss"] = train[steps[-1]]["loss"]
    # the first record includes start-up (graph warm-up); skip it unless it is the only one
    speeds = [train[s]["tokens_per_s"] for s in (steps[1:] or steps) if train[s].get("tokens_per_s")]
    row["train_tokens_per_s"] = sum(speeds) / len(speeds) if speeds else None
    row.update(kernel_summary(read_metrics(run_dir / "metrics.jsonl", "kernel"), cfg.num_layers))
    row["spectrum"] = spectrum(model, run.kind, seed) if run.kind in LEARNED_SPECTRUM else None
    return row


def long_context_scores(cfg: StudyConfig, model: torch.nn.Module, tok: Any, token_bytes: torch.Tensor) -> dict[str, Any]:
    """english-docs valid perplexity at each of ``cfg.long_contexts`` (past the training length) in
    windows mode (disjoint windows of N tokens), ``english_docs_valid_ppl_windows<N>``, and once in
    stateful mode (state carried through each whole document, in chunks of the longest N),
    ``english_docs_valid_ppl_stateful<N>``. A context the
    model refuses gives None and its message under ``long_context_errors``."""
    from megaflex.eval.scoring import evaluate

    if not cfg.long_contexts:
        return {}
    docs = eval_documents(str(Path(cfg.data_root) / "english-docs" / "valid.jsonl"), tok, cfg.eval_tokens or None)
    out: dict[str, Any] = {}
    errors: dict[str, str] = {}
    # Stateful scoring carries the state through each whole document, so its chunk length changes
    # only rounding: score it once, at the longest context (fewest chunks).
    longest = max(cfg.long_contexts)
    for context in cfg.long_contexts:
        for mode in ("windows", "stateful") if context == longest else ("windows",):
            key = f"english_docs_valid_ppl_{mode}{context}"
            # batches of about eval_batch_size training-length windows' tokens
            batch = max(1, cfg.eval_batch_size * cfg.seq_len // context)
            try:
                out[key] = evaluate(model, docs, mode, context, batch_size=batch, token_bytes=token_bytes).ppl
            except ValueError as e:
                out[key], errors[key] = None, str(e)
    out["long_context_errors"] = errors
    return out


QK_NORM_STATS = ("q_norm_mean", "q_norm_p90", "k_norm_mean", "k_norm_p90")


def kernel_summary(records: dict[int, dict[str, Any]], num_layers: int) -> dict[str, Any]:
    """Final per-layer kernel statistics and tau over time from the trainer's "kernel" records."""
    if not records:
        return {"tau_per_layer": None, "omega_rel_change": None, "negative_fraction": None, "effective_keys": None,
                "far_share": None, "tau_curve": [], **{key: None for key in QK_NORM_STATS}}
    last = records[max(records)]

    def per_layer(key: str) -> list[float] | None:
        values = [last.get(f"layer{i:02d}/{key}") for i in range(num_layers)]
        return None if any(v is None for v in values) else values

    changes = [per_layer(k) for k in ("omega1_rel_change", "omega2_rel_change", "omega_rel_change")]
    changes = [c for c in changes if c]
    taus = per_layer("tau_mean")
    curve = [(s, sum(r[f"layer{i:02d}/tau_mean"] for i in range(num_layers)) / num_layers)
             for s, r in sorted(records.items()) if taus]
    return {
        "tau_per_layer": taus,
        # mean over the frequency sets, per layer
        "omega_rel_change": [sum(c[i] for c in changes) / len(changes) for i in range(num_layers)] if changes else None,
        "negative_fraction": per_layer("negative_fraction"),
        "effective_keys": per_layer("effective_keys"),
        "far_share": per_layer("far_share"),  # one-normaliser window hybrids: the far field's share of the mass
        "tau_curve": curve,
        # ||q||, ||k|| entering the feature map on the probe batch: mean and 90th percentile per layer
        **{key: per_layer(key) for key in QK_NORM_STATS},
    }


def initial_model(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """A fresh model of ``model``'s config as the trainer initialised it for ``seed``."""
    from megaflex.model.gpt import GPT

    torch.manual_seed(seed)  # the trainer seeds the default RNG like this before building the model
    return GPT(model.config).to(next(model.parameters()).device)


def spectrum(model: torch.nn.Module, kind: str, seed: int) -> dict[str, list[list[float]]]:
    """Per layer: ||omega|| of every frequency row, learned and at init (same seed as training)."""
    out: dict[str, list[list[float]]] = {"learned": [], "init": []}
    for which, m in (("learned", model), ("init", initial_model(model, seed))):
        for block in m.blocks:
            fm = block.attn.core.feature_map
            norms = torch.cat([getattr(fm, name).detach().float().norm(dim=-1).flatten() for name in LEARNED_SPECTRUM[kind]])
            out[which].append(norms.tolist())
    return out



# ------------------------------------------------------------------------------- stored runs (resume)
def run_fingerprint(cfg: StudyConfig, run: RunSpec, seed: int) -> dict[str, Any]:
    """What a run's result depends on: the study's settings, the kind, the overrides and the seed,
    with ``digest`` (sha256 prefix) to compare. Run selection and paths are left out."""
    settings = {k: v for k, v in asdict(cfg).items() if k not in NOT_FINGERPRINTED}
    if settings["document_boundaries"] == "none":  # added later: its default keeps earlier rows' fingerprints
        del settings["document_boundaries"]
    # Added later: left out where it cannot change the run (an arm sets its own, or plain softmax
    # has no output normaliser) and where it is v1-v3's implicit "rms", so their rows still match.
    if settings["normalization"] == LEGACY_NORMALIZATION or _normalization_override(run.overrides) or not _normalizes(run):
        del settings["normalization"]
    inputs = {"settings": settings, "label": run.label, "kind": run.kind, "overrides": list(run.overrides), "seed": seed}
    digest = hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:16]
    return {"digest": digest, **inputs}


def _normalization_override(overrides: Sequence[str]) -> str | None:
    values = [o.split("=", 1)[1] for o in overrides if o.startswith("model.normalization=")]
    return values[-1] if values else None


def _normalizes(run: RunSpec) -> bool:
    """Whether model.normalization reaches the run's attention: linear kinds, and softmax through a window."""
    return run.kind != "softmax" or any(o.startswith("model.softmax_window=") for o in run.overrides)


def recipe(settings: dict[str, Any], run: RunSpec, seed: int) -> str:
    """What a run computes, independent of its label and of how the normalisation was set (a base
    setting or an arm's override): two runs with the same recipe give the same row."""
    settings = dict(settings)
    base = settings.pop("normalization", LEGACY_NORMALIZATION)
    normalization = (_normalization_override(run.overrides) or base) if _normalizes(run) else None
    overrides = sorted(o for o in run.overrides if not o.startswith("model.normalization="))
    return json.dumps({"settings": settings, "kind": run.kind, "overrides": overrides,
                       "normalization": normalization, "seed": seed}, sort_keys=True)


def reuse_rows(cfg: StudyConfig, runs: list[RunSpec], source: Path) -> list[str]:
    """Copy into this study each row of study folder ``source`` (e.g. an earlier version) whose
    recipe equals that of a run here without a stored row (``recipe``): another label, the same
    training. The copy records where it came from. Returns the labels_seeds copied."""
    settings = run_fingerprint(cfg, RunSpec("probe", "flexformer_n"), 0)["settings"]
    wanted = {recipe(settings, run, seed): (run, seed) for run in runs for seed in cfg.seed_list
              if load_row(cfg, run, seed) is None}
    copied = []
    for path in sorted((source / "runs").glob("*.json")):
        stored = json.loads(path.read_text())
        fp = stored.get("fingerprint", {})
        if "settings" not in fp:
            continue
        key = recipe(fp["settings"], RunSpec(fp["label"], fp["kind"], fp["overrides"]), fp["seed"])
        if key not in wanted:
            continue
        run, seed = wanted.pop(key)
        row = {**stored["row"], "label": run.label, "reused_from": str(path)}
        save_row(cfg, run, seed, row, stored.get("command", ""))
        copied.append(f"{run.label}_s{seed}")
    return copied


def row_path(cfg: StudyConfig, run: RunSpec, seed: int) -> Path:
    return Path(cfg.out) / "runs" / f"{run.label}_s{seed}.json"


def load_row(cfg: StudyConfig, run: RunSpec, seed: int) -> dict[str, Any] | None:
    """The stored row of this run if its fingerprint matches the current settings, else None."""
    path = row_path(cfg, run, seed)
    if not path.is_file():
        return None
    stored = json.loads(path.read_text())
    if stored.get("fingerprint", {}).get("digest") != run_fingerprint(cfg, run, seed)["digest"]:
        print(f"[kernel_study] {path}: stored with other settings (fingerprint differs); it will be retrained", flush=True)
        return None
    return stored["row"]


def save_row(cfg: StudyConfig, run: RunSpec, seed: int, row: dict[str, Any], command: str) -> Path:
    path = row_path(cfg, run, seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    stored = {"fingerprint": run_fingerprint(cfg, run, seed), "command": command, "row": row}
    path.write_text(json.dumps(stored, indent=1) + "\n")
    return path
