"""Kernel transfer across domains (issue 12, item 2): does a kernel learned on one domain still
serve on another, and better for Flexformer-N than for Hedgehog (the paper's comparison)?

    python -m studies.kernel_transfer --steps-a 300 --steps-b 150 --seeds 1 --jobs 2
    python -m studies.kernel_transfer --a-runs KS_WORK/runs --steps-b 200 --seeds 3 --jobs 2   # A: the kernel study's runs

Per kernel kind (``--kinds``, default flexformer_n and hedgehog) and seed:

* **A**: a GPT trained on domain A, the english-docs train shards (the kernel study's model, data,
  tokenizer and recipe: ``studies.runner``), ``--steps-a`` steps; or, with ``--a-runs``,
  the kernel study's own finished run ``<kind>_s<seed>`` (checked to have this shape and length);
* on domain B, WikiText-2, ``--steps-b`` steps each, three arms that differ only in the kernel:
  1. ``transfer``: A's kernel parameters, frozen (``checkpoint.init_from`` = A's checkpoint with
     ``checkpoint.init_parameters=kernel``, ``optimizer.freeze_kernel=true``); the rest trained
     from scratch on B;
  2. ``learned_b``: the kernel learned on B directly (ordinary training on B);
  3. ``random``: the untrained kernel (the map's fresh init), frozen; the rest trained on B.
  For Flexformer-N that init is Gaussian Omega with tau = log(2 sqrt d); hedgehog's init is the
  identity W (deterministic: its "random" kernel is the untrained one, not a random draw).

B's data: WikiText-2 has no train split in ``/work/shared/data`` (see its README), so the B runs
*train on the raw validation split* (``wiki.valid.raw``, ~250k tokens with the A tokenizer) and are
evaluated on the raw test split (``wiki.test.raw``), which no run ever trains on. The A tokenizer is
kept for B (the kernel study's vocab 4096 BPE): a kernel transfer, not a tokenizer transfer. All B
arms of one seed share the seed: the same non-kernel init and the same data order.

Reported per kind: B test perplexity of each arm (mean +- std over seeds) and the drop of
``transfer`` and ``random`` relative to ``learned_b`` (ppl ratio - 1); A's own numbers; and a check
that the frozen kernels stayed what they should be (max |diff| to A's kernel / to the init).
Output in ``--out`` (default ``$XDG_CACHE_HOME/megaflex/kernel_transfer``): ``results.json``,
``results.md``, ``transfer.png`` (bars). Rows are stored per run like the kernel study's
(``<out>/runs``, fingerprinted), so an interrupted experiment continues where it stopped.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from multiprocessing import get_context
from pathlib import Path
from typing import Any, Sequence

import torch

from studies.kernel_study_config import RunSpec, StudyConfig, number_type, output_dir_option, path_option
from studies.runner import (
    PLAIN_KIND_FIELDS, evaluate_run, initial_model, load_row, prepare_data, reused_run_data, save_row, train_run,
)
from studies.kernel_transfer_config import ARMS, B_METRIC, FROZEN, TransferConfig
from studies.kernel_transfer_report import write_report
from megaflex.checkpoint.layout import run_checkpoint_dir
from megaflex.cli_args import positive_int, scratch_results
from megaflex.hashing import sha256_file


# ------------------------------------------------------------------------------- data
def reused_a_dir(cfg: TransferConfig, kind: str, seed: int) -> Path:
    """The kernel-study run that is domain A of (kind, seed) under ``--a-runs``."""
    assert cfg.a_runs is not None
    return Path(cfg.a_runs) / f"{kind}_s{seed}"


def domain_a_data(cfg: TransferConfig) -> dict[str, Path]:
    """A's tokenizer and data: prepared here, or those of the reused runs (which must share one
    tokenizer: B is tokenized once with it)."""
    if cfg.a_runs is None:
        return prepare_data(replace(cfg.study, work_dir=cfg.data_work_dir))
    found = {(kind, seed): reused_run_data(cfg.config_a(), reused_a_dir(cfg, kind, seed), kind, "--a-runs", "A run",
                                           steps=cfg.steps_a)
             for kind in cfg.kinds for seed in cfg.study.seed_list}
    tokenizers = {run: sha256_file(d["tokenizer"]) for run, d in found.items()}
    if len(set(tokenizers.values())) > 1:
        raise ValueError(f"--a-runs: the runs were trained with different tokenizers: {sorted(tokenizers.items())}")
    return next(iter(found.values()))


def prepare_domains(cfg: TransferConfig) -> tuple[dict[str, Path], dict[str, Path]]:
    """Domain A (the kernel study's data) and domain B: WikiText-2 raw valid, tokenized with A's
    tokenizer, to train on (its "valid" for the trainer's end-of-run loss is the same split: the
    test split is kept for the evaluation only)."""
    from data_prep.preprocess import PreprocessConfig, preprocess

    data_a = domain_a_data(cfg)
    tokenizer_digest = sha256_file(data_a["tokenizer"])[:12]
    prefix = Path(cfg.data_work_dir) / f"wikitext2_raw_valid_tok{tokenizer_digest}"
    prefix.parent.mkdir(parents=True, exist_ok=True)
    if not Path(str(prefix) + ".idx").is_file():
        source = Path(cfg.study.data_root) / "wikitext-2-raw" / "wiki.valid.raw"
        preprocess(PreprocessConfig(inputs=[str(source)], tokenizer=str(data_a["tokenizer"]), output_prefix=str(prefix),
                                    num_proc=1, progress=False))
    return data_a, {"tokenizer": data_a["tokenizer"], "train": prefix, "valid": prefix}


# ------------------------------------------------------------------------------- runs
def a_run(kind: str) -> RunSpec:
    return RunSpec(f"{kind}_A", kind)


def b_run(kind: str, arm: str, a_checkpoint: Path) -> RunSpec:
    overrides = {
        "transfer": [f"checkpoint.init_from={a_checkpoint}", "checkpoint.init_parameters=kernel", *FROZEN],
        "learned_b": [],
        "random": list(FROZEN),
    }[arm]
    return RunSpec(f"{kind}_B_{arm}", kind, overrides)


def kernel_state(run_dir: Path) -> dict[str, torch.Tensor]:
    """The trained model's kernel parameters (qualified name -> tensor)."""
    from megaflex.eval.loading import load_for_eval
    from megaflex.attention import named_kernel_parameters

    model = load_for_eval(run_checkpoint_dir(run_dir)).model
    return {name: kp.param.detach().clone() for name, kp in named_kernel_parameters(model)}


def initial_kernel_state(run_dir: Path, seed: int) -> dict[str, torch.Tensor]:
    """The kernel parameters the run started from if nothing was loaded: the seed's fresh init."""
    from megaflex.eval.loading import load_for_eval
    from megaflex.attention import named_kernel_parameters

    fresh = initial_model(load_for_eval(run_checkpoint_dir(run_dir)).model, seed)
    return {name: kp.param.detach().clone() for name, kp in named_kernel_parameters(fresh)}


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    if a.keys() != b.keys():
        raise ValueError(f"kernel parameters differ: {sorted(a)} vs {sorted(b)}")
    return max((float((a[n] - b[n]).abs().max()) for n in a), default=0.0)


def one_run(cfg: StudyConfig, run: RunSpec, seed: int, data: dict[str, Path], retrain: bool) -> tuple[dict[str, Any], bool]:
    """The run's stored row (same fingerprint, checkpoint still there) or a fresh one; also
    whether it was trained now."""
    run_dir = Path(cfg.work_dir) / "runs" / f"{run.label}_s{seed}"
    stored = None if retrain else load_row(cfg, run, seed)
    if stored is not None and run_checkpoint_dir(run_dir).is_dir():
        return stored, False
    t0 = time.perf_counter()
    row = evaluate_run(cfg, run, seed, train_run(cfg, run, seed, data))
    row["seconds"] = time.perf_counter() - t0
    return row, True


def reused_a_run(cfg: StudyConfig, kind: str, seed: int, a_dir: Path, fresh: bool) -> dict[str, Any]:
    """The row of a reused A run: stored if it was evaluated from the same folder, else evaluated now."""
    stored = None if fresh else load_row(cfg, a_run(kind), seed)
    if stored is not None and stored.get("reused_from") == str(a_dir):
        return stored
    t0 = time.perf_counter()
    row = {**evaluate_run(cfg, a_run(kind), seed, a_dir), "reused_from": str(a_dir)}
    row["seconds"] = time.perf_counter() - t0  # evaluation only: the training was the kernel study's
    return row


def run_chain(cfg: TransferConfig, kind: str, seed: int, data_a: dict[str, Path], data_b: dict[str, Path],
              command: str, fresh: bool) -> list[dict[str, Any]]:
    """A, then the three B arms of one (kind, seed); one process, each run a training subprocess."""
    cfg_a, cfg_b = cfg.config_a(), cfg.config_b()
    rows = []
    if cfg.a_runs is None:
        row, trained_a = one_run(cfg_a, a_run(kind), seed, data_a, fresh)
        a_dir = Path(cfg_a.work_dir) / "runs" / f"{a_run(kind).label}_s{seed}"
    else:
        a_dir = reused_a_dir(cfg, kind, seed)
        row, trained_a = reused_a_run(cfg_a, kind, seed, a_dir, fresh), False
    save_row(cfg_a, a_run(kind), seed, {**row, "domain": "A", "arm": "A"}, command)
    rows.append({**row, "domain": "A", "arm": "A"})
    for arm in ARMS:
        run = b_run(kind, arm, run_checkpoint_dir(a_dir))
        # a transfer run stands on A's checkpoint: retrained whenever A was
        row, trained = one_run(cfg_b, run, seed, data_b, fresh or (trained_a and arm == "transfer"))
        if trained:
            run_dir = Path(cfg_b.work_dir) / "runs" / f"{run.label}_s{seed}"
            if arm == "transfer":
                row["kernel_max_abs_diff_vs_A"] = max_abs_diff(kernel_state(run_dir), kernel_state(a_dir))
            if arm == "random":
                row["kernel_max_abs_diff_vs_init"] = max_abs_diff(kernel_state(run_dir), initial_kernel_state(run_dir, seed))
        row = {**row, "domain": "B", "arm": arm}
        save_row(cfg_b, run, seed, row, command)
        rows.append(row)
        print(f"[kernel_transfer] {run.label} seed {seed}: WikiText-2 test ppl {row[B_METRIC]:.2f}", flush=True)
    return rows


def run_transfer(cfg: TransferConfig, command: str, fresh: bool = False) -> list[dict[str, Any]]:
    """Every (kind, seed) chain, ``cfg.jobs`` at once; writes the report; returns the rows."""
    start = time.perf_counter()
    data_a, data_b = prepare_domains(cfg)
    chains = [(kind, seed) for seed in cfg.study.seed_list for kind in cfg.kinds]
    if cfg.jobs == 1:
        results = [run_chain(cfg, kind, seed, data_a, data_b, command, fresh) for kind, seed in chains]
    else:  # spawned workers: a clean torch/RNG state per chain, no threads sharing the default RNG
        with ProcessPoolExecutor(cfg.jobs, mp_context=get_context("spawn")) as pool:
            futures = [pool.submit(run_chain, cfg, kind, seed, data_a, data_b, command, fresh) for kind, seed in chains]
            results = [f.result() for f in futures]
    rows = [row for chain in results for row in chain]
    write_report(cfg, rows, command, time.perf_counter() - start)
    print(f"[kernel_transfer] results in {cfg.study.out}")
    return rows


# ------------------------------------------------------------------------------- CLI
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m studies.kernel_transfer", description=__doc__.split("\n\n")[0])
    defaults = TransferConfig(StudyConfig())
    p.add_argument("--kinds", default=",".join(defaults.kinds), help="comma-separated kernel kinds with learnable maps")
    p.add_argument("--seeds", type=positive_int, default=1, help="seeds seed, seed + 1, ... (default 1: a pilot)")
    p.add_argument("--steps-a", type=positive_int, default=defaults.steps_a, help="training steps on domain A (english-docs)")
    p.add_argument("--steps-b", type=positive_int, default=defaults.steps_b, help="training steps of every arm on B (WikiText-2)")
    p.add_argument("--jobs", type=positive_int, default=1, help="(kind, seed) chains at once (each one process)")
    p.add_argument("--data-work-dir", type=output_dir_option, default=defaults.data_work_dir,
                   help="tokenizer/data cache, shared with the study")
    p.add_argument("--a-runs", type=path_option, default=None, help="a kernel study's runs/ folder: its <kind>_s<seed> runs are domain A "
                                                  "(not retrained; --steps-a and the shape flags must match them)")
    p.add_argument("--work-dir", type=output_dir_option, default="work_data/kernel_transfer",
                   help="run folders and checkpoints")
    p.add_argument("--out", type=output_dir_option, default=str(scratch_results("kernel_transfer")))
    p.add_argument("--data-root", type=path_option, default=defaults.study.data_root)
    p.add_argument("--fresh", action="store_true", help="retrain runs whose row is stored with the same fingerprint")
    for name in ("vocab_size", "num_layers", "hidden_size", "num_heads", "feature_dim", "seq_len", "micro_batch_size",
                 "global_batch_size", "warmup", "seed", "tokenizer_sentences", "eval_batch_size", "eval_tokens",
                 "max_train_docs", "lr", "min_lr"):
        p.add_argument("--" + name.replace("_", "-"), type=number_type(name), default=None,
                       help=f"default {getattr(defaults.study, name)}")
    return p


def config_from_args(args: argparse.Namespace) -> TransferConfig:
    from megaflex.attention import named_kernel_parameters
    from megaflex.model import GPT, ModelConfig

    kinds = tuple(k for k in args.kinds.split(",") if k)
    for kind in kinds:  # the experiment needs a kernel that can be learned and frozen
        probe = GPT(ModelConfig(vocab_size=8, num_layers=1, hidden_size=8, num_heads=1, ffn_hidden_size=8,
                                attention=kind, feature_dim=4, max_seq_len=8, **PLAIN_KIND_FIELDS))
        if not any(True for _ in named_kernel_parameters(probe)):
            raise ValueError(f"--kinds: {kind!r} has no learnable kernel parameters to transfer")
    fields = set(StudyConfig.__dataclass_fields__)
    given = {k: v for k, v in vars(args).items() if v is not None and k in fields}
    study = StudyConfig(**{**given, "kinds": list(kinds), "arms": [], "work_dir": args.work_dir, "out": args.out})
    return TransferConfig(study, kinds, args.steps_a, args.steps_b, args.data_work_dir, args.jobs, args.a_runs)


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    args = build_parser().parse_args(argv)
    cfg = config_from_args(args)
    command = "python -m studies.kernel_transfer " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    return run_transfer(cfg, command.strip(), fresh=args.fresh)


if __name__ == "__main__":
    main()
