"""``megaflex-distill``: attention transfer and finetuning of a tiny softmax teacher (multi-process, CPU).

A tiny softmax teacher is trained on a slice of WikiText-2 (its own 512-piece tokenizer); the
distillation runs read data and model from its checkpoint. One straight stage-1 run (TP=1)
serves as the reference of the TP=2 and the kill -9 + resume runs.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megaflex.model.config import ModelConfig
from megaflex.model.gpt import GPT
from megaflex.checkpoint import complete_tags
from megaflex.training.config import ConfigError
from megaflex.training.distill.cli import distill_config
from megaflex.training.distill.objectives import AttentionTransfer
from megaflex.training.metrics import read_metrics
from megaflex.checkpoint import load_model_state, resolve_checkpoint
from megaflex.training.weights import init_from_checkpoint, linear_attention_parameter_names
from numerics import assert_close, gpt_steps
from training_harness import REPO, launch, tokenized_wikitext, write_config

pytestmark = pytest.mark.slow
DISTILL = "megaflex.distill"
STEPS = 6


def _teacher_config(data: Path) -> dict:
    return {
        "model": {"vocab_size": 512, "num_layers": 2, "hidden_size": 64, "num_heads": 4, "ffn_hidden_size": 128,
                  "attention": "softmax", "max_seq_len": 64},
        "data": {"train_path": [str(data / "train")], "valid_path": [str(data / "test")],
                 "tokenizer": str(data / "tok.model"), "seq_len": 64},
        "train": {"train_iters": 12, "lr": 3e-3, "micro_batch_size": 2, "global_batch_size": 4, "eval_iters": 2},
        "logging": {"progress_bar": False, "tensorboard": False},
        "checkpoint": {"save_interval": 0},
    }


# the distillation runs: model, data and init come from the teacher's checkpoint
DISTILL_CONFIG = {
    "model": {"feature_dim": 32, "chunk_size": 32},
    "train": {"train_iters": STEPS, "lr": 1e-2, "micro_batch_size": 2, "global_batch_size": 4, "seed": 5, "eval_iters": 2},
    "schedule": {"warmup_iters": 1, "decay_style": "cosine"},
    # Adam divides by sqrt(v) + eps: with the default 1e-8 a few Omega entries whose gradient is
    # rounding noise (~1e-10) move by ~lr at step 1 in a direction that differs between TP=1 and TP=2
    "optimizer": {"eps": 1e-5},
    "logging": {"progress_bar": False, "tensorboard": False, "kernel_stats_interval": 0},
    "checkpoint": {"save_interval": 3, "keep_last": 5},
    "distill": {"weights_ce_weight": 1.0, "weights_window": 32},
}


@pytest.fixture(scope="module")
def teacher(tmp_path_factory: pytest.TempPathFactory, shared_data: Path) -> Path:
    root = tmp_path_factory.mktemp("distill")
    data = tokenized_wikitext(root / "data", shared_data, train_chars=60_000)
    cfg = write_config(root / "teacher.yaml", _teacher_config(data))
    result = launch(cfg, [f"logging.run_dir={root / 'teacher'}"])
    assert result.returncodes == [0], result.output
    write_config(root / "distill.yaml", DISTILL_CONFIG)
    return root / "teacher"


def _distill(teacher: Path, run: Path, overrides: list[str], world: int = 1):
    return launch(teacher.parent / "distill.yaml", ["--teacher", str(teacher), f"logging.run_dir={run}", *overrides],
                  world, module=DISTILL)


@pytest.fixture(scope="module")
def stage1(teacher: Path) -> Path:
    run = teacher.parent / "stage1"
    result = _distill(teacher, run, [])
    assert result.returncodes == [0], result.output
    return run


def _terms(run: Path) -> dict[int, dict[str, float]]:
    return {s: {k: v for k, v in r.items() if k.startswith("layer_") or k in ("loss", "grad_norm")}
            for s, r in read_metrics(run / "metrics.jsonl").items()}


def test_attention_transfer_changes_only_kernel_parameters(teacher: Path, stage1: Path) -> None:
    source = load_model_state(teacher)
    ckpt = stage1 / "checkpoints"
    assert complete_tags(ckpt) == ["step_00000003", "step_00000006"]
    mid, end = load_model_state(ckpt / "step_00000003"), load_model_state(ckpt / "step_00000006")
    student = GPT(ModelConfig.from_dict(json.loads((ckpt / "step_00000006" / "megaflex.json").read_text())["config"]["model"]))
    trainable = linear_attention_parameter_names(student)
    # the student takes the default normaliser, not the softmax teacher's field (which softmax never used)
    assert student.config.normalization == "capped_denominator"
    assert any("omega1" in n for n in trainable) and not any("out_gain" in n for n in trainable)  # no rms gains
    for name, _ in student.named_parameters():
        if name in trainable:
            assert not torch.equal(mid[name], end[name]), name  # it trains
        else:
            assert torch.equal(mid[name], source[name]) and torch.equal(end[name], source[name]), name
    terms = _terms(stage1)
    assert set(terms[1]) >= {"layer_0_output_mse", "layer_1_output_mse", "layer_0_weights_kl", "layer_1_weights_kl"}
    assert all(v > 0 for v in terms[1].values())


def test_layer_losses_vanish_with_the_teachers_attention(teacher: Path, stage1: Path) -> None:
    cfg = distill_config([str(teacher.parent / "distill.yaml")], [f"distill.teacher={teacher}"])
    model = GPT(cfg.model)
    init_from_checkpoint(model, teacher, "all")
    objective = AttentionTransfer(cfg.distill)
    objective.prepare(model, cfg)
    ids = torch.randint(0, cfg.model.vocab_size, (2, 64), generator=torch.Generator().manual_seed(0))
    total, terms = objective.layer_losses(model, ids)
    assert total > 0 and all(v > 0 for v in terms.values())
    for mine, theirs in zip(model.blocks, objective.teacher.blocks):
        mine.attn.core, mine.attn.out_gain = theirs.attn.core, None
    total, terms = objective.layer_losses(model, ids)
    assert len(terms) == 4 and all(float(v) == 0.0 for v in terms.values()) and float(total) == 0.0


def test_tensor_parallel_distillation_equals_one_rank(teacher: Path, stage1: Path) -> None:
    run = teacher.parent / "stage1_tp2"
    result = _distill(teacher, run, ["parallel.tensor_parallel_size=2"], world=2)
    assert result.returncodes == [0, 0], result.output
    want, got = _terms(stage1), _terms(run)
    assert sorted(got) == sorted(want) == list(range(1, STEPS + 1))
    for step in want:
        for key, value in want[step].items():
            assert got[step][key] == pytest.approx(value, rel=1e-5, abs=1e-7), (step, key)
    ref, tp2 = load_model_state(stage1), load_model_state(run)
    for name, value in ref.items():
        torch.testing.assert_close(tp2[name], value, rtol=1e-5, atol=1e-5, msg=name)


def test_kill_and_resume_is_bit_exact(teacher: Path, stage1: Path) -> None:
    run = teacher.parent / "stage1_killed"
    killed = _distill(teacher, run, ["fault.sigkill_after_step=4"])
    assert killed.returncodes == [-9], killed.output
    assert complete_tags(run / "checkpoints") == ["step_00000003"]
    resumed = _distill(teacher, run, ["checkpoint.resume=auto"])
    assert resumed.returncodes == [0], resumed.output
    assert "resumed from" in resumed.outputs[0] and "at step 3" in resumed.outputs[0]
    want, got = _terms(stage1), _terms(run)
    assert [got[s] for s in range(4, STEPS + 1)] == [want[s] for s in range(4, STEPS + 1)]
    assert len({want[s]["loss"] for s in range(4, STEPS + 1)}) > 1
    assert all(torch.equal(v, load_model_state(stage1)[k]) for k, v in load_model_state(run).items())


def test_config_defaults_come_from_the_teacher(teacher: Path, tmp_path: Path) -> None:
    yaml_file = write_config(tmp_path / "with_model.yaml", {**DISTILL_CONFIG, "model": {"attention": "flexformer_n"}})
    cfg = distill_config([str(yaml_file)], [f"distill.teacher={teacher}", "distill.student_attention=performer"])
    teacher_tag = resolve_checkpoint(teacher)
    teacher_cfg = json.loads((teacher_tag / "megaflex.json").read_text())["config"]
    assert cfg.model.attention == "performer"  # the explicit student kind beats the YAML's model.attention
    assert (cfg.model.hidden_size, cfg.model.num_layers, cfg.model.vocab_size) == (64, 2, 512)
    assert cfg.data.train_path == teacher_cfg["data"]["train_path"] and cfg.data.tokenizer == teacher_cfg["data"]["tokenizer"]
    assert cfg.checkpoint.init_from == str(teacher_tag) and teacher_tag.name == "step_00000012"


@pytest.mark.usefixtures("forked_python")
def test_bad_input_is_named(teacher: Path, stage1: Path, tmp_path: Path) -> None:
    yaml_file = [str(teacher.parent / "distill.yaml")]
    with pytest.raises(ConfigError, match=f"distill.teacher: .*{tmp_path / 'missing'}"):
        distill_config(yaml_file, [f"distill.teacher={tmp_path / 'missing'}"])
    with pytest.raises(ConfigError, match=r"distill.teacher: .*is a model.attention='flexformer_n' model; expected a softmax teacher"):
        distill_config(yaml_file, [f"distill.teacher={stage1}"])
    with pytest.raises(ConfigError, match=r"model.num_layers: teacher 2, student 3"):
        distill_config(yaml_file, [f"distill.teacher={teacher}", "model.num_layers=3"])
    with pytest.raises(ConfigError, match="distill.student_attention: expected a linear attention kind"):
        distill_config(yaml_file, [f"distill.teacher={teacher}", "distill.student_attention=softmax"])
    with pytest.raises(ConfigError, match="distill.teacher: expected the softmax teacher's checkpoint"):
        distill_config(yaml_file, [])
    out = subprocess.run([sys.executable, "-m", DISTILL, "--config", *yaml_file, "--teacher", str(stage1)],
                         cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2 and "megaflex-distill: config error: distill.teacher:" in out.stderr, out.stderr


def test_finetune_lora_and_full_give_checkpoints_megaflex_eval_and_generate_read(
    teacher: Path, stage1: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from megaflex.eval.generate import main as megaflex_generate
    from megaflex.eval.loading import load_for_eval
    from megaflex.eval.perplexity import run_cli as megaflex_eval
    from megaflex.parallel.lora import add_lora

    data = teacher.parent / "data"
    common = ["--stage", "finetune", f"checkpoint.init_from={stage1}", "train.lr=1e-3", "train.train_iters=3",
              "distill.kl_weight=0.5"]
    lora = teacher.parent / "stage2_lora"
    result = _distill(teacher, lora, common + ["distill.lora_rank=4", "parallel.zero_stage=2"], world=2)
    assert result.returncodes == [0, 0], result.output
    assert {"lm_loss", "teacher_kl"} <= set(read_metrics(lora / "metrics.jsonl")[3])
    merged = load_for_eval(lora / "merged")
    assert merged.meta.lora_merged and not any("lora" in n for n, _ in merged.model.named_parameters())
    # the merged weights compute what the adapted model of the last checkpoint computes
    adapted = GPT(merged.model.config)
    add_lora(adapted, 4, 16.0, ("qkv", "proj"))
    adapted.load_state_dict(load_model_state(lora))
    ids = torch.randint(0, 512, (2, 64), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        # merging adds each rank-4 product B A into its weight: the model's steps plus 4 (tests/numerics.py)
        steps = gpt_steps(merged.model.config, ids.shape[-1]) + 4 + 2
        assert_close(merged.model(ids).logits, adapted.eval()(ids).logits, steps=steps)
    stage1_state = load_model_state(stage1)
    assert not torch.equal(merged.model.state_dict()["blocks.0.attn.qkv.weight"], stage1_state["blocks.0.attn.qkv.weight"])
    assert torch.equal(merged.model.state_dict()["blocks.0.mlp.fc_in.weight"], stage1_state["blocks.0.mlp.fc_in.weight"])

    full = teacher.parent / "stage2_full"
    result = _distill(teacher, full, common + ["parallel.zero_stage=0"])
    assert result.returncodes == [0], result.output
    assert not (full / "merged").exists()
    for checkpoint in (lora / "merged", full):
        scores = megaflex_eval(["--checkpoint", str(checkpoint), "--data", str(data / "test.raw"), "--context", "64"])
        assert 1.0 < scores["ppl"] < 512, scores
        capsys.readouterr()
        assert megaflex_generate(["--checkpoint", str(checkpoint), "--prompt", "The game", "--max-new-tokens", "8",
                                  "--temperature", "0"]) == 0
        printed = capsys.readouterr().out
        assert printed.startswith("The game") and len(printed) > len("The game\n"), repr(printed)  # + 8 tokens
