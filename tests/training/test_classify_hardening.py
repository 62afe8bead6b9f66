"""``python -m megaflex.training.classify`` as a new user meets it (issue 45): one file never serves as
every split, arguments that cannot work are refused while parsing (before any data is read), the
run says what it truncated, where it is (ETA) and which split it selected on, and Ctrl-C keeps
what it had (exit 130, no traceback)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megaflex.training.classify import ClassifyConfig, ClassifyInterrupted, main, train

REPO = Path(__file__).resolve().parents[2]
TINY = dict(num_layers=1, hidden_size=16, num_heads=2, ffn_hidden_size=32, feature_dim=8, batch_size=4, warmup=1)
TINY_FLAGS = [f"--{k.replace('_', '-')}={v}" for k, v in TINY.items()]
ROWS = ["[MAX 2 9 ]\t9", "[MIN 4 7 ]\t4", "[SM 3 8 ]\t1", "[MED 1 5 9 ]\t5", "[MAX 0 [MIN 3 6 ] ]\t3"]


def listops(folder: Path, rows: int = 12) -> Path:
    """basic_{train,val,test}.tsv of short expressions (the 5-token row is the longest)."""
    folder.mkdir(parents=True, exist_ok=True)
    for split in ("train", "val", "test"):
        body = "".join(ROWS[i % len(ROWS)] + "\n" for i in range(rows))
        (folder / f"basic_{split}.tsv").write_text("Source\tTarget\n" + body)
    return folder


def text_jsonl(folder: Path, splits=("train", "test")) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for split in splits:
        lines = [json.dumps({"text": ("zzzz " if i % 2 else "yy ") * (1 + i % 3), "label": i % 2}) for i in range(8)]
        (folder / f"{split}.jsonl").write_text("\n".join(lines) + "\n")
    return folder


def one_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


# ------------------------------------------------------------------ one file is never every split
def test_one_file_is_refused_not_used_as_train_valid_and_test(tmp_path, capsys):
    folder = text_jsonl(tmp_path / "text")
    aan = tmp_path / "new_aan_pairs.train.tsv"
    aan.write_text("1.0\ta\tb\tdoc one\tdoc two\n")
    for task, data in (("text", folder / "train.jsonl"), ("retrieval", aan)):
        assert main(["--task", task, "--data", str(data), "--out", str(tmp_path / "out"), *TINY_FLAGS]) == 2
        line = one_line(capsys)
        assert line.startswith("classify: error: --data") and "one file would serve as train, valid and test" in line
    assert not (tmp_path / "out" / "result.json").exists()


def test_text_selects_on_valid_jsonl_or_says_it_selects_on_test(tmp_path):
    lines: list[str] = []
    cfg = ClassifyConfig(task="text", data=str(text_jsonl(tmp_path / "lra")), steps=2, eval_every=2, max_len=16, **TINY)
    result = train(cfg, log=lines.append)
    assert result["selected_on"] == "test" and result["files"]["valid"] == result["files"]["test"]
    assert any("selected on the TEST split" in line and "not held out" in line for line in lines)
    assert "selected on test" in lines[-1]
    with_valid = text_jsonl(tmp_path / "three", ("train", "valid", "test"))
    result = train(ClassifyConfig(**{**cfg.__dict__, "data": str(with_valid)}), log=lambda _: None)
    assert result["selected_on"] == "valid" and result["files"]["valid"].endswith("valid.jsonl")


# ------------------------------------------------------------------ arguments checked while parsing
def test_an_unusable_out_fails_while_parsing_before_any_data_is_read(tmp_path, capsys):
    (tmp_path / "a_file").write_text("x")
    for out in (tmp_path / "a_file", tmp_path / "a_file" / "below"):
        with pytest.raises(SystemExit) as stop:  # --data does not exist: reading it would fail differently
            main(["--task", "listops", "--data", str(tmp_path / "absent"), "--out", str(out)])
        assert stop.value.code == 2 and "argument --out" in capsys.readouterr().err


@pytest.mark.parametrize("flag,value", [
    ("--steps", "0"), ("--eval-every", "0"), ("--log-interval", "0"), ("--batch-size", "-2"), ("--lr", "nan"),
    ("--lr", "inf"), ("--lr", "0"), ("--weight-decay", "-0.1"), ("--max-len", "-1"), ("--num-heads", "0"),
    ("--task", "nope"), ("--attention", "nope"), ("--feature-kwargs", "[1]"), ("--device", "nope"),
])  # fmt: skip
def test_values_that_cannot_work_are_refused_while_parsing(tmp_path, capsys, flag, value):
    with pytest.raises(SystemExit) as stop:
        main(["--task", "listops", "--data", str(listops(tmp_path / "d")), "--out", str(tmp_path / "out"), flag, value])
    err = capsys.readouterr().err.strip().splitlines()
    assert stop.value.code == 2 and f"argument {flag}" in err[-1]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA machine has the device")
def test_a_cuda_device_on_a_cpu_machine_is_refused_in_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        main(["--data", str(listops(tmp_path / "d")), "--out", str(tmp_path / "out"), "--device", "cuda"])
    assert stop.value.code == 2
    assert "argument --device: cuda: no CUDA device is available on this machine" in capsys.readouterr().err


def test_a_bad_model_setting_fails_before_the_data_is_read(tmp_path, capsys):
    """hidden 10 over 4 heads: refused naming the setting, not after loading (absent) data."""
    argv = ["--data", str(tmp_path / "absent"), "--out", str(tmp_path / "out"), "--hidden-size", "10", "--num-heads", "4"]
    assert main(argv) == 2 and "divisible by num_heads" in one_line(capsys)


# ------------------------------------------------------------------ what a long run says
def test_progress_with_an_eta_between_evaluations_and_truncation_per_split(tmp_path):
    lines: list[str] = []
    cfg = ClassifyConfig(task="listops", data=str(listops(tmp_path / "d")), steps=6, eval_every=6, log_interval=2,
                         max_len=4, **TINY)  # fmt: skip
    result = train(cfg, log=lines.append)
    progress = [line for line in lines if "ETA" in line and "loss" in line]
    assert [line.split(":")[0] for line in progress] == [f"[classify] step {s}/6" for s in (2, 4, 6)]
    # rows of 5 tokens ([MAX 0 [MIN 3 6 ] ]: 7, [MED 1 5 9 ]: 5) are cut at 4: rows 3 and 4 of every 5
    cut = sum(len(ROWS[i % 5].split("\t")[0].split()) > 4 for i in range(12))
    assert cut == 4 and result["truncated"] == {"train": cut, "valid": cut, "test": cut}
    assert f"train {cut} of 12, valid {cut} of 12, test {cut} of 12" in "\n".join(lines)
    assert result["partial"] is False and result["step"] == 6 and result["selected_on"] == "valid"


def test_ctrl_c_in_the_loop_keeps_the_partial_result(tmp_path):
    """In process: KeyboardInterrupt at step 3 (the log callback is where it lands) -> the result so far."""

    def log(line: str) -> None:
        if line.startswith("[classify] step 3/"):
            raise KeyboardInterrupt

    cfg = ClassifyConfig(task="listops", data=str(listops(tmp_path / "d")), steps=50, eval_every=2, log_interval=1, **TINY)
    with pytest.raises(ClassifyInterrupted) as stop:
        train(cfg, log=log)
    partial = stop.value.result
    assert partial["partial"] is True and partial["step"] == 3 and partial["test_accuracy"] is None
    assert [h["step"] for h in partial["history"]] == [2] and partial["best_step"] == 2


def test_sigint_writes_a_partial_result_and_exits_130_without_a_traceback(tmp_path):
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "megaflex.training.classify", "--data", str(listops(tmp_path / "d")), "--out", str(out),
           "--steps", "100000", "--eval-every", "3", "--log-interval", "1", *TINY_FLAGS]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONPATH=str(REPO)))  # fmt: skip
    try:
        for line in proc.stdout:
            if line.startswith("[classify] step 4/"):
                proc.send_signal(signal.SIGINT)
                break
        rest, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1 and "partial results" in err
    partial = json.loads((out / "result.json").read_text())
    assert partial["partial"] is True and partial["step"] >= 4 and partial["history"][0]["step"] == 3
