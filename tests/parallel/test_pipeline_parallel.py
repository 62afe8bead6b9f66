"""Pipeline parallelism (DeepSpeed's pipeline engine) trains exactly what one device trains.

Real ``megaflex.train`` runs under the deepspeed launcher on CPU gloo ranks, fp32, ZeRO-1, tied
embeddings (the tiny config's default): the per-step losses, the first step's gradient norm
(clipping is active: the norms are about 1) and the validation loss of PP=2 (with activation
checkpointing) and of TP=2 x PP=2 with sequence parallelism (and the training of PP=2 x DP=2) equal
the 1 x 1 run's within rounding (tests/numerics.py); their checkpoints, read on one process by the
evaluation loader, are the 1 x 1 model's: after step 1 every weight within rounding unless its
gradient is, after the last within what Adam's steps allow, with the same perplexity; a PP=2 run
killed with kill -9 resumes (``checkpoint.resume: auto``) bit-exactly. The stage split itself is
tested in test_model.py.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

from megaflex.model.config import ModelConfig
from megaflex.parallel.pipeline import gpt_parameter_name, stage_bounds
from numerics import (
    assert_close, assert_params_close_after_adam, grad_norm_steps, training_grad_steps, training_loss_steps,
)
from training_harness import (
    REPO, TINY, adam_steps_of, deepspeed_launcher, first_step_gradients, launcher_env, write_config,
)

STEPS = 5
COMMON = [
    f"train.train_iters={STEPS}", "logging.log_interval=1", "logging.kernel_stats_interval=0",
    "checkpoint.save_interval=0", f"train.eval_interval={STEPS}", "train.eval_iters=2",
]


def _launch(run: Path, ranks: int, overrides: list[str]) -> subprocess.CompletedProcess:
    cfg = write_config(run.parent / "cfg.yaml")
    env = launcher_env(ranks)
    cmd = [deepspeed_launcher(), "--num_gpus", str(ranks), "--master_port", env["MASTER_PORT"], "--module",
           "megaflex.train", "--config", str(cfg), f"logging.run_dir={run}", *COMMON, *overrides]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=800)


def _records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _train(run: Path, ranks: int, overrides: list[str]) -> list[dict]:
    proc = _launch(run, ranks, overrides)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    records = _records(run)
    assert [r["step"] for r in records if r["kind"] == "train"] == list(range(1, STEPS + 1))
    return records


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict]]:
    run = tmp_path_factory.mktemp("ref") / "run"
    return run, _train(run, 1, ["checkpoint.save_interval=1"])  # its step-1 gradients: Adam's first moment


def _assert_same_run(records: list[dict], reference: list[dict], numel: int, ranks: int, data_parallel: int = 1) -> None:
    """Losses within the rounding of a step's loss, at every step (tests/numerics.py:
    ``training_loss_steps``); the gradient norm of step 1, before any update, within its rounding."""
    config, seq = ModelConfig(**TINY["model"]), TINY["data"]["seq_len"]
    tokens = {"train": TINY["train"]["global_batch_size"] * seq, "valid": 2 * TINY["train"]["micro_batch_size"] * seq}
    assert len(records) == len(reference)
    for got, want in zip(records, reference):
        assert got["kind"] == want["kind"] and got["step"] == want["step"]
        if got["kind"] == "valid" and data_parallel > 1:
            continue  # validation reads eval_iters x micro x DP samples: more of them at DP 2
        steps = training_loss_steps(config, seq, tokens[got["kind"]], ranks)
        assert_close(torch.tensor(got["loss"]), torch.tensor(want["loss"]), steps=steps,
                     name=f"{got['kind']} loss {got['step']}")
    first = next(r for r in reference if r["kind"] == "train" and r["step"] == 1)
    got = next(r for r in records if r["kind"] == "train" and r["step"] == 1)
    assert_close(torch.tensor(got["grad_norm"]), torch.tensor(first["grad_norm"]),
                 steps=grad_norm_steps(config, seq, tokens["train"], numel, ranks), name="grad norm 1")


@pytest.mark.slow
@pytest.mark.numerics
@pytest.mark.parametrize(
    ("ranks", "overrides"),
    [
        (2, ["parallel.pipeline_parallel_size=2", "model.activation_checkpointing=true"]),
        # with sequence parallelism: the stages pass sequence-sharded hidden states between TP peers
        (4, ["parallel.pipeline_parallel_size=2", "parallel.tensor_parallel_size=2", "parallel.sequence_parallel=true"]),
        (4, ["parallel.pipeline_parallel_size=2"]),  # x DP 2: the pipeline engine averages over DP
    ],
    ids=["pp2", "tp2xpp2_sp", "pp2xdp2"],
)
def test_pipeline_parallel_run_equals_one_device(tmp_path: Path, reference: tuple[Path, list[dict]], ranks: int,
                                                 overrides: list[str]) -> None:
    from megaflex.eval.loading import load_for_eval
    from megaflex.eval.perplexity import run_eval

    ref_run, ref_records = reference
    records = _train(tmp_path / "run", ranks, overrides + ["checkpoint.save_interval=1"])
    tp = 2 if "parallel.tensor_parallel_size=2" in overrides else 1
    mine, ref = load_for_eval(tmp_path / "run"), load_for_eval(ref_run)
    numel = sum(p.numel() for p in ref.model.parameters())
    _assert_same_run(records, ref_records, numel, ranks, data_parallel=ranks // (2 * tp))
    assert any(r["kind"] == "valid" for r in records)  # eval_batch through the pipeline

    # The checkpoints (per stage and TP rank) read on one process are the 1 x 1 model's. After step
    # 1 every element is within rounding unless its gradient is (Adam's first step is lr g / (|g| +
    # eps): only a gradient within rounding of 0 can step either way) ...
    assert mine.meta.pipeline_parallel_size == 2
    lrs, betas, eps, multiplier = adam_steps_of(ref)
    assert lrs == [r["lr"] for r in ref_records if r["kind"] == "train"]
    seq, tokens = TINY["data"]["seq_len"], TINY["train"]["global_batch_size"] * TINY["data"]["seq_len"]
    first_step = (first_step_gradients(ref_run), training_grad_steps(ref.model.config, seq, tokens, ranks), eps)
    after_1 = [load_for_eval(run, tag="step_00000001").model.state_dict() for run in (tmp_path / "run", ref_run)]
    assert_params_close_after_adam(*after_1, lrs=lrs[:1], betas=betas, lr_multiplier=multiplier, first_step=first_step,
                                   name="weights after step 1")
    # ... and after the last step within what STEPS Adam steps can part any two runs ...
    a, b = mine.model.state_dict(), ref.model.state_dict()
    drift = assert_params_close_after_adam(a, b, lrs=lrs, betas=betas, lr_multiplier=multiplier, name="weights")
    # ... which a tensor from the wrong stage, block or TP rank would exceed: two matrices' elements
    # differ by up to their value range (0.08-0.16 here), at least twice that bound (0.021)
    assert drift < min(float(v.max() - v.min()) for k, v in b.items() if v.dim() == 2 and multiplier(k) == 1) / 2
    # ... and so is its reshard CLI output (a plain TP checkpoint)
    from megaflex.checkpoint.reshard import main as reshard
    from megaflex.checkpoint.weights import load_model_state, resolve_checkpoint

    reshard([str(resolve_checkpoint(tmp_path / "run")), str(tmp_path / "tp1"), "--tp", "1"])
    resharded, direct = load_model_state(tmp_path / "tp1"), load_model_state(tmp_path / "run")
    assert resharded.keys() == direct.keys()
    for name in direct:
        torch.testing.assert_close(resharded[name], direct[name], atol=0, rtol=0, msg=name)
    docs = [torch.randint(0, 256, (150,), generator=torch.Generator().manual_seed(i)) for i in range(3)]
    ppl = [run_eval(m.model, docs, "windows", 64)["ppl"] for m in (mine, ref)]
    steps = training_loss_steps(ModelConfig(**TINY["model"]), 64, sum(len(d) for d in docs))  # a loss, as above
    assert_close(torch.tensor(ppl[0]).log(), torch.tensor(ppl[1]).log(), steps=steps, name="log perplexity")


@pytest.mark.slow
def test_pipeline_parallel_bf16_tracks_the_fp32_run(tmp_path: Path, reference: tuple[Path, list[dict]]) -> None:
    # bf16 weights and activations, fp32 gradient accumulation and master weights (ZeRO 1): a few
    # steps stay within bf16 rounding of the fp32 run (measured: 6e-5 in loss, 5e-4 relative in norm)
    records = _train(tmp_path / "run", 2, ["parallel.pipeline_parallel_size=2", "train.precision=bf16",
                                           "checkpoint.save_at_end=false"])
    for got, want in zip(records, reference[1]):
        assert got["loss"] == pytest.approx(want["loss"], abs=1e-3), (got, want)
        if want.get("grad_norm") is not None:
            assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-2), (got, want)


@pytest.mark.slow
def test_pipeline_parallel_resume_after_kill_is_bit_exact(tmp_path: Path) -> None:
    run = tmp_path / "run"
    common = ["parallel.pipeline_parallel_size=2", "checkpoint.save_interval=3", "train.train_iters=6"]
    killed = _launch(run, 2, common + ["fault.sigkill_after_step=5"])  # saved at 3, killed after 5
    assert killed.returncode != 0 and "step 5/6" in killed.stdout + killed.stderr
    want = {r["step"]: r for r in _records(run) if r["kind"] == "train"}
    assert max(want) == 5
    resumed = _launch(run, 2, common)  # checkpoint.resume: auto -> step 3
    out = resumed.stdout + resumed.stderr
    assert resumed.returncode == 0, out[-6000:]
    assert "resumed from" in out and "at step 3" in out, out[-4000:]
    again = [r for r in _records(run) if r["kind"] == "train"][5:]
    assert [r["step"] for r in again] == [4, 5, 6]
    for r in again[:2]:  # bit for bit: the same floats in the log
        assert (r["loss"], r["grad_norm"]) == (want[r["step"]]["loss"], want[r["step"]]["grad_norm"])


def test_stage_bounds_put_embedding_first_and_head_last() -> None:
    # items: embedding, blocks 0..4, final norm, logits; stages of 3 + 2 blocks
    assert stage_bounds(5, 2) == [0, 4, 8]
    assert stage_bounds(2, 2) == [0, 2, 5]
    assert stage_bounds(3, 3) == [0, 2, 3, 6]


def test_pipeline_parameter_names_map_to_the_gpt() -> None:
    assert gpt_parameter_name("tied_modules.embedding.embed.weight", 4) == "embed.weight"
    assert gpt_parameter_name("0.pos_embed.weight", 4) == "pos_embed.weight"
    assert gpt_parameter_name("3.block.attn.qkv.weight", 4) == "blocks.2.attn.qkv.weight"
    assert gpt_parameter_name("5.final_norm.weight", 4) == "final_norm.weight"
    assert gpt_parameter_name("6.lm_head.weight", 4) == "lm_head.weight"
