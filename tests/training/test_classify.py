"""``python -m megaflex.training.classify``: the LRA entry point trains an encoder classifier on
ListOps, Text (JSONL) and Retrieval (AAN TSV) files in their real formats, learns a task a linear
probe can solve, is deterministic for a seed, and refuses bad data in one line."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from megaflex.training.classify import ClassifyConfig, lr_at, main, train

REPO = Path(__file__).resolve().parents[2]
TINY = dict(num_layers=1, hidden_size=16, num_heads=2, ffn_hidden_size=32, feature_dim=8, batch_size=8, warmup=2)


@pytest.fixture(scope="module")
def listops(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("listops")
    proc = subprocess.run([sys.executable, "-m", "data_prep.listops", "--out", str(out), "--train", "64", "--valid",
                           "16", "--test", "16", "--min-length", "10", "--max-length", "40", "--no-progress"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return out


def _text_jsonl(folder: Path, seed: int) -> Path:
    """A task mean pooling over byte embeddings solves: label 1 iff the text holds 'zzzz'."""
    rng = random.Random(seed)
    folder.mkdir(parents=True, exist_ok=True)
    for split, n in (("train", 128), ("test", 64)):
        with open(folder / f"{split}.jsonl", "w") as f:
            for i in range(n):
                label = i % 2
                words = [rng.choice(["abc", "de", "fgh", "ij"]) for _ in range(rng.randint(3, 8))]
                words.insert(rng.randint(0, len(words)), "zzzz" if label else "yyyy")
                f.write(json.dumps({"text": " ".join(words), "label": label}) + "\n")
    return folder


def test_listops_runs_are_deterministic_and_report_what_they_did(listops, tmp_path):
    cfg = ClassifyConfig(task="listops", data=str(listops), attention="flexformer_n", steps=6, eval_every=3, **TINY)
    first, second = train(cfg, log=lambda _: None), train(cfg, log=lambda _: None)
    assert first["history"] == [dict(h, seconds=first["history"][i]["seconds"]) for i, h in enumerate(second["history"])]
    assert first["test_accuracy"] == second["test_accuracy"]
    assert [h["step"] for h in first["history"]] == [3, 6] and first["examples"] == {"train": 64, "valid": 16, "test": 16}
    assert 0 <= first["test_accuracy"] <= 1 and first["best_step"] in (3, 6) and first["config"]["attention"] == "flexformer_n"
    other = train(ClassifyConfig(**{**cfg.__dict__, "seed": 7}), log=lambda _: None)
    assert other["history"][0]["train_loss"] != first["history"][0]["train_loss"]


@pytest.mark.parametrize("kind", ["softmax", "flexformer_n", "cosformer"])
def test_an_encoder_learns_a_task_a_linear_probe_solves(kind, tmp_path):
    data = _text_jsonl(tmp_path / "text", seed=3)
    cfg = ClassifyConfig(task="text", data=str(data), attention=kind, steps=60, eval_every=60, lr=3e-3, max_len=64,
                         **{**TINY, "batch_size": 16})  # fmt: skip
    result = train(cfg, log=lambda _: None)
    assert result["majority_test_accuracy"] == 0.5
    assert result["test_accuracy"] >= 0.9, result["history"]


def test_retrieval_pairs_train_through_two_towers(tmp_path):
    rows = [f"{i % 2}.0\tid{i}a\tid{i}b\t{'x' * (5 + i)} doc\tdoc {'y' * (3 + i)}" for i in range(12)]
    for split in ("train", "eval", "test"):
        (tmp_path / f"new_aan_pairs.{split}.tsv").write_text("\n".join(rows) + "\n")
    cfg = ClassifyConfig(task="retrieval", data=str(tmp_path), attention="performer", steps=3, eval_every=3,
                         max_len=24, **TINY)  # fmt: skip
    result = train(cfg, log=lambda _: None)
    assert result["examples"] == {"train": 12, "valid": 12, "test": 12} and len(result["history"]) == 1


def test_the_schedule_warms_up_then_decays_to_min_lr():
    cfg = ClassifyConfig(lr=1.0, min_lr=0.1, warmup=4, steps=14)
    assert [lr_at(cfg, s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_at(cfg, 4) == 1.0 and abs(lr_at(cfg, 9) - 0.55) < 1e-12 and abs(lr_at(cfg, 14) - 0.1) < 1e-12


def test_missing_data_is_one_line_and_exit_2(tmp_path, capsys):
    assert main(["--task", "listops", "--data", str(tmp_path / "absent"), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("classify: ") and "data_prep.listops" in err[0]
    with pytest.raises(SystemExit) as stop:  # an unknown task: refused while parsing
        main(["--task", "nope", "--data", str(tmp_path), "--out", str(tmp_path / "out")])
    assert stop.value.code == 2
