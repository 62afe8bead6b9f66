"""Helpers of the training tests: a tiny config and a torchrun-like launcher of real processes.

``launch`` starts ``world_size`` separate ``python -m megaflex.train`` processes with the
torch.distributed env vars (gloo on localhost), so a test can let them ``kill -9`` themselves
(fault injection) and inspect exit codes, outputs and the run directory afterwards.

Each rank is a ``forked_python.ForkedProcess``: forked from a fork server that imported torch,
``torch._dynamo`` and DeepSpeed once (~7 of the ~9 CPU seconds a tiny rank costs; most launched
tests start 4-6 ranks), then run as ``python -m`` would. The launcher tests (``deepspeed`` runner,
launch scripts, the documented launch lines) and the signal tests start fresh interpreters, and
``MEGAFLEX_TEST_FRESH_PROCESSES=1`` makes ``launch`` do so too.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import yaml

from forked_python import ForkedProcess
from megaflex.parallel.rendezvous import free_port

REPO = Path(__file__).resolve().parents[2]
PYTHON = sys.executable

# 2 layers, hidden 64, seq 64, vocab 256: a few ms per step, all code paths of the real model.
TINY = {
    "model": {
        "vocab_size": 256, "num_layers": 2, "hidden_size": 64, "num_heads": 4, "ffn_hidden_size": 128,
        "attention": "flexformer_n", "feature_dim": 32, "chunk_size": 32, "max_seq_len": 64,
    },
    "data": {"source": "synthetic", "seq_len": 64},
    "train": {"train_iters": 20, "lr": 3e-3, "micro_batch_size": 2, "global_batch_size": 8, "seed": 7},
    "schedule": {"warmup_iters": 3, "decay_style": "cosine", "min_lr": 1e-4},
    "logging": {"progress_bar": False, "tensorboard": False, "kernel_stats_interval": 5},
    "checkpoint": {"save_interval": 10, "keep_last": 5},
}


def write_config(path: Path, data: dict | None = None) -> Path:
    path.write_text(yaml.safe_dump(data or TINY))
    return path


def base_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", DS_ACCELERATOR="cpu")
    env.setdefault("TORCH_EXTENSIONS_DIR", str(REPO / ".torch_extensions"))
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return env


@dataclass
class Result:
    returncodes: list[int]
    outputs: list[str]

    @property
    def output(self) -> str:
        return "\n".join(f"--- rank {i} (rc {rc}) ---\n{out[-6000:]}" for i, (rc, out) in enumerate(zip(self.returncodes, self.outputs)))


def launch(
    config: Path, overrides: list[str], world_size: int = 1, timeout: float = 900, module: str = "megaflex.train",
    grace: float = 15, fresh: bool = False,
) -> Result:
    """Run ``module`` (default ``megaflex.train``) on ``world_size`` local gloo ranks; wait for all of them.

    When a rank exits with an error the others are given ``grace`` seconds, then killed (they may
    be blocked in a collective with the dead rank). ``fresh``: new interpreters instead of ranks
    forked from the fork server (also ``MEGAFLEX_TEST_FRESH_PROCESSES=1``), e.g. to measure memory."""
    port = free_port()
    procs, logs = [], []
    for rank in range(world_size):
        env = base_env()
        env.update(
            RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size),
            LOCAL_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
        )
        log = open(config.parent / f"rank{rank}-{port}.log", "w+")
        argv = ["--config", str(config), *overrides]
        if fresh or os.environ.get("MEGAFLEX_TEST_FRESH_PROCESSES") == "1":
            procs.append(subprocess.Popen([PYTHON, "-m", module, *argv], cwd=REPO, env=env, stdout=log,
                                          stderr=subprocess.STDOUT))
        else:
            procs.append(ForkedProcess(module, argv, env, log.name))
        logs.append(log)
    deadline = time.time() + timeout
    failed_at = None
    while any(p.poll() is None for p in procs):
        if time.time() > deadline:
            break
        if failed_at is None and any(p.poll() not in (None, 0) for p in procs):
            failed_at = time.time()
        if failed_at is not None and time.time() - failed_at > grace:
            break
        time.sleep(0.1)
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()
    outputs = []
    for log in logs:
        log.seek(0)
        outputs.append(log.read())
        log.close()
    return Result([p.returncode for p in procs], outputs)


def launcher_env(local_ranks: int) -> dict[str, str]:
    """Environment for the real deepspeed launcher / launch scripts on ``local_ranks`` CPU ranks
    (the venv's bin first on PATH, no launch/setup_env.sh, a free master port)."""
    env = base_env()
    env.update(
        PATH=str(Path(PYTHON).parent) + os.pathsep + env["PATH"], LOCAL_SIZE=str(local_ranks), NPROC=str(local_ranks),
        MEGAFLEX_SKIP_SETUP="1", MASTER_PORT=str(free_port()),
    )
    return env


def deepspeed_launcher() -> str:
    return str(Path(PYTHON).parent / "deepspeed")


def tokenized_wikitext(data: Path, shared_data: Path, train_chars: int, tokenizer_type: str = "sentencepiece") -> Path:
    """A small WikiText-2 pair in ``data``: the first ``train_chars`` of raw valid as ``train`` and the
    whole lines of raw test up to ~6,000 characters as ``test``, a 512-piece tokenizer (``tok.model``;
    ``tok.json`` for ``tokenizer_type="bpe"``) trained on ``train``, and both splits preprocessed to
    ``.bin/.idx``. Returns ``data``."""
    data.mkdir(parents=True, exist_ok=True)
    raw = (shared_data / "wikitext-2-raw" / "wiki.valid.raw").read_text(encoding="utf-8")
    (data / "train.raw").write_text(raw[:train_chars], encoding="utf-8")
    test = (shared_data / "wikitext-2-raw" / "wiki.test.raw").read_text(encoding="utf-8")
    (data / "test.raw").write_text(test[: test.index("\n", 6_000) + 1], encoding="utf-8")  # whole lines
    subprocess.run([PYTHON, "-m", "data_prep.train_tokenizer", "--type", tokenizer_type, "--input", str(data / "train.raw"),
                    "--vocab-size", "512", "--output-prefix", str(data / "tok")], check=True, cwd=REPO, capture_output=True)
    tokenizer = data / ("tok.json" if tokenizer_type == "bpe" else "tok.model")
    for split in ("train", "test"):
        subprocess.run([PYTHON, "-m", "data_prep.preprocess", "--input", str(data / f"{split}.raw"), "--tokenizer",
                        str(tokenizer), "--output-prefix", str(data / split), "--no-progress"],
                       check=True, cwd=REPO, capture_output=True)
    return data


def logged_train_steps(run_dir: Path) -> list[int]:
    """Every train step record of ``run_dir/metrics.jsonl`` in file order (a resumed run appends its
    steps after the killed run's, so a step run by both appears twice)."""
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines if line.endswith("}")]  # not a torn last line
    return [r["step"] for r in records if r.get("kind", "train") == "train"]


def write_pattern_data(folder: Path) -> list[str]:
    """Indexed data the tiny model learns within a few steps (uniform synthetic tokens cannot fall
    below ln(vocab)): documents counting up mod 256 from a random start, in steps of 1 to 3. Returns
    the overrides that train on it."""
    import numpy as np

    from megaflex.data.indexed import IndexedDatasetBuilder

    prefix = folder / "pattern"
    rng = np.random.default_rng(0)
    with IndexedDatasetBuilder(prefix, dtype=np.uint16, vocab_size=256) as builder:
        for _ in range(300):
            start, stride = int(rng.integers(256)), int(rng.integers(1, 4))
            builder.add_document((start + stride * np.arange(200)) % 256)
    return ["data.source=indexed", f"data.train_path=[{prefix}]", "data.split=98,2,0", "train.eval_iters=1"]


def adam_steps_of(loaded: Any) -> tuple[list[float], tuple[float, float], float, Callable[[str], float]]:
    """(the learning rate of each of its steps, betas, eps, LR multiplier by parameter name) of the
    run a ``megaflex.eval.loading.load_for_eval`` checkpoint came from, from the run config it stores:
    the schedule (``lr_at``) and the kernel groups' multipliers of ``megaflex.training.optim``."""
    from megaflex.attention import named_kernel_parameters
    from megaflex.training.config import FLOAT_RANGES, Config
    from megaflex.training.config_loader import Source, load_dataclass
    from megaflex.training.optim import kernel_lr_multipliers, lr_at

    cfg, _ = load_dataclass(Config, [Source(loaded.config, "checkpoint")], FLOAT_RANGES)  # as run: no re-validation
    lrs = [lr_at(cfg, i) for i in range(loaded.meta.iteration)]
    roles = {name: kp.role for name, kp in named_kernel_parameters(loaded.model)}
    multipliers = kernel_lr_multipliers(cfg)
    betas = (cfg.optimizer.beta1, cfg.optimizer.beta2)
    return lrs, betas, cfg.optimizer.eps, lambda name: float(multipliers.get(roles.get(name, ""), 1.0))


def assert_train_losses_close(got: dict[int, float], want: dict[int, float], ranks: int, name: str = "") -> None:
    """Per-step training losses of two ``TINY`` runs that differ only in layout (process count,
    parallelism, ZeRO stage), the same global batches in the same steps: each within the rounding
    of a step's loss (tests/numerics.py: ``training_loss_steps``, which also says why later steps,
    after Adam's updates, stay within it)."""
    import torch

    from megaflex.model.config import ModelConfig
    from numerics import assert_close, training_loss_steps

    assert got.keys() == want.keys(), (sorted(got), sorted(want))
    seq = TINY["data"]["seq_len"]
    steps = training_loss_steps(ModelConfig(**TINY["model"]), seq, TINY["train"]["global_batch_size"] * seq, ranks)
    for step in want:
        assert_close(torch.tensor(got[step]), torch.tensor(want[step]), steps=steps, name=f"{name} loss at step {step}")


def first_step_gradients(run: Path) -> dict[str, Any]:
    """Each parameter's gradient of step 1 of a one-rank ZeRO 1 or 2 run, from its step-1 checkpoint:
    AdamW's first moment after one step is (1 - beta1) x the gradient (DeepSpeed keeps it flat per
    param group, in the order of the model states' ``param_shapes``)."""
    import math

    import torch

    tag = run / "checkpoints" / "step_00000001"
    shapes = torch.load(tag / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)["param_shapes"]
    optim = torch.load(tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt", map_location="cpu",
                       weights_only=False)["optimizer_state_dict"]["base_optimizer_state"]
    grads = {}
    for group, state, settings in zip(shapes, optim["state"].values(), optim["param_groups"]):
        assert int(state["step"]) == 1
        flat, offset = state["exp_avg"].double() / (1 - settings["betas"][0]), 0
        for name, shape in group.items():
            grads[name] = flat[offset : offset + math.prod(shape)].view(tuple(shape))
            offset += math.prod(shape)
    return grads


# The eval and export tests' tiny run: few steps at a tiny LR, so ZeRO/TP layouts of the same run
# stay within the drift bound of each other.
EVAL_LR = 1e-6
EVAL_STEPS = 2


def tiny_eval_train_args(data: Path, run_dir: Path, zero: int, tp: int) -> list[str]:
    return [
        "--config", str(REPO / "configs" / "tiny.yaml"),
        f"data.train_path=[{data / 'train'}]", f"data.valid_path=[{data / 'test'}]", f"data.tokenizer={data / 'tok.model'}",
        "data.seq_len=64", "model.vocab_size=512", "model.num_layers=2", "model.hidden_size=64",
        "model.ffn_hidden_size=128", "model.feature_dim=32", "model.max_seq_len=256",
        f"train.train_iters={EVAL_STEPS}", f"train.lr={EVAL_LR}", "schedule.warmup_iters=0", "schedule.min_lr=0",
        "train.eval_interval=0", "train.micro_batch_size=2", "train.global_batch_size=4",
        f"parallel.zero_stage={zero}", f"parallel.tensor_parallel_size={tp}",
        f"logging.run_dir={run_dir}", "logging.tensorboard=false", "logging.progress_bar=false",
    ]


def train_rank(rank: int, world_size: int, args: list[str]) -> int:
    from megaflex.training.train import main

    return main(args)
