"""Stages that run the real trainer (``python -m megaflex.train`` subprocesses, one rank):

* ``trainer_247m``: configs/flexformer_n_247m.yaml at its production shape (seq 1024, micro-batch 8,
  bf16, ZeRO-1, synthetic tokens), 12 steps with a save at 10, then a resume that runs 11-12 again:
  tokens/s, MFU, peak memory, skipped steps, the resumed losses against the first run's, and a
  torch.profiler summary of steps 6-8.
  With the stage option ``compile`` (off by default; ``options["compile"] = True`` from the command line
  that starts the stages), a third run at the same shape with ``train.compile=true``: tokens/s against
  the eager run's and the compile time apart (``compiled``).
* ``softmax_247m``: configs/softmax_247m.yaml at the same shape: tokens/s and the ratio.
* ``precision_41m``: configs/flexformer_n_41m.yaml for 100 steps on learnable synthetic tokens in
  fp32 storage with tf32 matmuls, bf16 and bf16 with fp32 gradient accumulation (the three runs at
  once: one GPU holds them): final-loss gaps and tau trajectories; meanwhile, whether bf16 storage
  of Omega and tau matters (``bf16_storage.py``). The "fp32" arm is fp32 storage and arithmetic with
  tf32 matmul inputs everywhere: the Triton attention kernels take fp32 dot operands as tf32
  (``PREC="tf32"``, triton/linear.py) and ``TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=1`` makes torch's
  cuBLAS matmuls do the same, so the arm is one precision, not a mix.

Under ``--dry-run`` the same code runs configs/tiny.yaml on CPU at seq 64 for a few steps (the
trainer stage keeps its 12-step plan, softmax runs 4 steps; the precision stage trains fp32 and
bf16 for 6 steps of batch 2; the fp32-accumulation run only checks its config).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from benchmarks.gpu_check.common import (
    REPO,
    Stage,
    base_overrides,
    finish_trainer,
    learnable_tokens,
    run_trainer,
    start_trainer,
    throughput,
)
from benchmarks.gpu_check.profile_summary import summarize
from megaflex.checkpoint.layout import complete_tags, run_checkpoint_dir

ZERO1 = str(REPO / "configs" / "zero" / "zero1.yaml")


def _shape(stage: Stage, config_name: str, dry_steps: int = 12) -> tuple[str, list[str], list[str]]:
    """(config path, extra --config files, overrides) of a 247M-shape run (tiny, ``dry_steps`` steps
    on a dry run)."""
    if stage.dry_run:
        attention = "softmax" if config_name.startswith("softmax") else "flexformer_n"
        over = base_overrides(64, 2, 4, dry_steps, "fp32", True) + [f"model.attention={attention}"]
        return str(REPO / "configs" / "tiny.yaml"), [ZERO1], over
    return str(REPO / "configs" / f"{config_name}.yaml"), [ZERO1], base_overrides(1024, 8, 32, 12, "bf16", False)


def trainer_247m(stage: Stage) -> dict[str, Any]:
    config, extra, over = _shape(stage, "flexformer_n_247m")
    run_dir = stage.work_dir / "flexformer_247m"
    ckpt = [f"checkpoint.dir={run_checkpoint_dir(run_dir)}", "checkpoint.save_interval=10", "checkpoint.keep_last=1"]
    profile = ["logging.profile.start=6", "logging.profile.steps=3"]  # the trainer's profiler: steps 6-8
    timeout = 900 if stage.dry_run else 150
    first = run_trainer(["--config", config, *extra, *over, *ckpt, *profile, "checkpoint.resume=none"], run_dir,
                        stage, timeout)  # fmt: skip
    result: dict[str, Any] = {"config": Path(config).name, "overrides": over}
    if "error" in first:
        return {**result, **first}
    result.update(throughput(first["train"], skip={1, 2, 6, 7, 8}), wall_s=first["wall_s"])
    ops = run_dir / "profile" / "rank0.steps6-8.ops.json"
    result["profile_steps_6_8"] = summarize(ops) if ops.exists() else None
    stage.emit(result)
    if stage.options.get("compile"):  # off unless the run's options switch it on (a third trainer run)
        result["compiled"] = compiled_against_eager(stage, config, extra, over, result["tokens_per_s"])
        stage.emit(result)
    saved = complete_tags(run_checkpoint_dir(run_dir))
    result["checkpoints"] = saved
    resumed_dir = stage.work_dir / "flexformer_247m_resumed"
    resumed = run_trainer(["--config", config, *extra, *over, *ckpt, "checkpoint.resume=auto"], resumed_dir,
                          stage, 900 if stage.dry_run else 90)  # fmt: skip
    if "error" in resumed:
        return {**result, "resume": resumed}
    steps = sorted(resumed["train"])
    gaps = [abs(resumed["train"][s]["loss"] - first["train"][s]["loss"]) for s in steps if s in first["train"]]
    result["resume"] = {
        "steps_run": steps,
        "resumed_from": steps[0] - 1 if steps else None,
        "max_loss_diff_vs_first_run": max(gaps) if gaps else None,
        "passed": steps == [11, 12] and bool(gaps) and max(gaps) < 1e-2,
    }
    return result


def compiled_against_eager(stage: Stage, config: str, extra: list[str], over: list[str],
                           eager_tokens_per_s: float | None) -> dict[str, Any]:
    """The same shape with ``train.compile=true`` (no saves, no profiler): steady tokens/s against the
    eager run's, and the compile time apart: what steps 1-2 took beyond two steady steps."""
    run = run_trainer(["--config", config, *extra, *over, "train.compile=true", "checkpoint.resume=none"],
                      stage.work_dir / "flexformer_247m_compiled", stage, 900 if stage.dry_run else 150)  # fmt: skip
    if "error" in run:
        return run
    train = run["train"]
    result: dict[str, Any] = {**throughput(train, skip={1, 2}), "wall_s": run["wall_s"]}
    step_s = {s: (r["tokens"] - train.get(s - 1, {"tokens": 0})["tokens"]) / r["tokens_per_s"] for s, r in train.items()}
    steady = sorted(t for s, t in step_s.items() if s > 2)
    if steady and 1 in step_s and 2 in step_s:
        result["compile_s"] = round(step_s[1] + step_s[2] - 2 * steady[len(steady) // 2], 1)
    if eager_tokens_per_s and result["tokens_per_s"]:
        result["compiled_over_eager_tokens_per_s"] = round(result["tokens_per_s"] / eager_tokens_per_s, 4)
    return result


def softmax_247m(stage: Stage) -> dict[str, Any]:
    config, extra, over = _shape(stage, "softmax_247m", dry_steps=4)  # tokens/s: steps 3-4 past the warm-up
    run = run_trainer(["--config", config, *extra, *over, "checkpoint.resume=none"], stage.work_dir / "softmax_247m",
                      stage, 900 if stage.dry_run else 90)  # fmt: skip
    if "error" in run:
        return {"config": Path(config).name, **run}
    result = {"config": Path(config).name, **throughput(run["train"], skip={1, 2}), "wall_s": run["wall_s"]}
    flex = stage.options.get("previous", {}).get("trainer_247m", {})
    if flex.get("tokens_per_s") and result["tokens_per_s"]:
        result["flexformer_over_softmax_tokens_per_s"] = round(flex["tokens_per_s"] / result["tokens_per_s"], 4)
    return result


def _tau_trajectory(kernel: dict[int, dict[str, Any]]) -> dict[int, float]:
    """step -> mean over layers of the per-layer mean temperature (kernel statistics records)."""
    out = {}
    for step, rec in sorted(kernel.items()):
        taus = [v for k, v in rec.items() if re.fullmatch(r"layer\d+/tau_mean", k)]
        if taus:
            out[step] = round(sum(taus) / len(taus), 6)
    return out


def precision_41m(stage: Stage) -> dict[str, Any]:
    from benchmarks.gpu_check.bf16_storage import bf16_storage_effect
    from megaflex.training.config import ConfigError, load_config

    if stage.dry_run:
        config, seq, micro, gbs, steps, vocab = str(REPO / "configs" / "tiny.yaml"), 64, 2, 2, 6, 256
    else:
        config, seq, micro, gbs, steps, vocab = str(REPO / "configs" / "flexformer_n_41m.yaml"), 1024, 8, 32, 100, 32000
    tokens_needed = steps * gbs * (seq + 1)
    prefix = learnable_tokens(stage.work_dir / "tokens" / "learnable", vocab, tokens_needed // 128 + 64, 128)
    data = ["data.source=indexed", f"data.train_path=[{prefix}]", "data.valid_path=[]", "data.split=98,2,0",
            f"logging.kernel_stats_interval={max(1, steps // 10)}"]  # fmt: skip
    variants = {"fp32": ["train.precision=fp32"], "bf16": ["train.precision=bf16", "train.grad_accum_dtype=bf16"],
                "bf16_fp32_accum": ["train.precision=bf16", "train.grad_accum_dtype=fp32"]}  # fmt: skip
    result: dict[str, Any] = {"config": Path(config).name, "steps": steps, "global_batch": gbs, "runs": {},
                              "fp32_arm": "fp32 storage, tf32 matmul inputs in torch (TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=1) "
                                          "and in the Triton kernels (PREC=tf32)"}  # fmt: skip
    started = {}
    for name, extra in variants.items():
        over = base_overrides(seq, micro, gbs, steps, "bf16", stage.dry_run) + data + extra  # later keys win
        try:
            load_config([config, ZERO1], over)
        except ConfigError as err:  # e.g. no fp32-accumulation key in this trainer yet
            result["runs"][name] = {"skipped": f"config refused: {err}"}
            continue
        if stage.dry_run and name == "bf16_fp32_accum":  # the bf16 run's code path with one other key (checked above)
            result["runs"][name] = {"skipped": "dry run: config checked, not trained"}
            continue
        env = {"TORCH_ALLOW_TF32_CUBLAS_OVERRIDE": "1"} if name == "fp32" else {}
        args = ["--config", config, ZERO1, *over, "checkpoint.resume=none"]
        started[name] = start_trainer(args, stage.work_dir / f"precision_{name}", stage.dry_run, env)
    timeout = stage.inner_timeout(600 if stage.dry_run else 120)
    try:  # a few seconds, while the runs start up
        result["bf16_storage"] = bf16_storage_effect(Path(config), seq, 2 if stage.dry_run else micro, stage.device)
    except Exception as err:  # noqa: BLE001  (recorded: a failure of the stage)
        result["bf16_storage"] = {"error": repr(err)[:500]}
    stage.emit(result)
    for name, running in started.items():  # all at once: the startup and compiles overlap
        run = finish_trainer(running, timeout)
        if "error" in run:
            result["runs"][name] = run
        else:
            losses = [r["loss"] for _, r in sorted(run["train"].items())]
            tail = losses[-max(1, len(losses) // 10) :]
            result["runs"][name] = {
                "final_loss": sum(tail) / len(tail), "first_loss": losses[0], "steps_logged": len(losses),
                "skipped_steps": sum(1 for r in run["train"].values() if r.get("skipped")),
                "tau_mean_by_step": _tau_trajectory(run["kernel"]), "wall_s": run["wall_s"],
            }  # fmt: skip
        stage.emit(result)
    ref = result["runs"].get("fp32", {}).get("final_loss")
    for name, run in result["runs"].items():
        if ref is not None and "final_loss" in run and name != "fp32":
            result[f"final_loss_gap_{name}_minus_fp32"] = run["final_loss"] - ref
    return result
