"""Issue 45: every entry point refuses an argument value that cannot work while it parses its
arguments (one ``argument --flag:`` line, exit 2), before any checkpoint, data or model is read:
zero or negative counts, non-finite numbers, a device this machine lacks or that does not exist,
an output path that is an existing file or cannot be created. The types' own tests:
tests/test_cli_args.py."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest
import torch

ABSENT = "/nonexistent/megaflex-checkpoint"  # never read: the arguments fail first
NO_DEVICE = "cuda" if not torch.cuda.is_available() else f"cuda:{torch.cuda.device_count()}"

# (module whose main(argv) or main() parses sys.argv, the arguments before the bad one, flag, bad value)
CASES = [
    ("megaflex.eval.perplexity", ["--checkpoint", ABSENT, "--data", "x"], "--max-docs", "0"),
    ("megaflex.eval.perplexity", ["--checkpoint", ABSENT, "--data", "x"], "--tensor-parallel-size", "-1"),
    ("megaflex.eval.perplexity", ["--checkpoint", ABSENT, "--data", "x"], "--contexts", "512,0"),
    ("megaflex.eval.perplexity", ["--checkpoint", ABSENT, "--data", "x"], "--device", "foo"),
    ("megaflex.eval.perplexity", ["--checkpoint", ABSENT, "--data", "x"], "--device", NO_DEVICE),
    ("megaflex.eval.perplexity", ["--checkpoint", ABSENT, "--data", "x"], "--json", "{dir}"),
    ("megaflex.eval.generate", ["--checkpoint", ABSENT, "--prompt", "a"], "--max-new-tokens", "0"),
    ("megaflex.eval.generate", ["--checkpoint", ABSENT, "--prompt", "a"], "--temperature", "nan"),
    ("megaflex.eval.generate", ["--checkpoint", ABSENT, "--prompt", "a"], "--top-p", "inf"),
    ("megaflex.eval.generate", ["--checkpoint", ABSENT, "--prompt", "a"], "--top-k", "0"),
    ("megaflex.eval.generate", ["--checkpoint", ABSENT, "--prompt", "a"], "--device", NO_DEVICE),
    ("megaflex.hf.export", ["--checkpoint", ABSENT, "--hf-out", "{dir}/hf"], "--eval-json", "{dir}/missing.json"),
    ("megaflex.hf.lm_eval_tasks", ["--out", "{dir}/task"], "--max-docs", "0"),
    ("megaflex.checkpoint.reshard", ["{dir}", "{dir}/out"], "--tp", "0"),
    ("benchmarks.attention", [], "--repeats", "0"),
    ("benchmarks.attention", [], "--timeout", "nan"),
    ("benchmarks.attention", [], "--json", "{file}/below.json"),
    ("benchmarks.context_parallel", [], "--steps", "0"),
    ("benchmarks.data", [], "--seq-len", "-8"),
    ("benchmarks.decode", [], "--batch-sizes", "1,0"),
    ("benchmarks.decode", [], "--device", NO_DEVICE),
    ("benchmarks.decode", [], "--out", "{file}"),
    ("benchmarks.memory_plan", [], "--config", "{dir}/missing.yaml"),
    ("benchmarks.model", [], "--steps", "0"),
    ("benchmarks.model", [], "--device", "foo"),
    ("benchmarks.sequence_parallel", [], "--tp", "0"),
    ("benchmarks.training", [], "--world-size", "0"),
    ("benchmarks.triton_aot", [], "--jobs", "0"),
    ("studies.kernel_study", [], "--steps", "0"),
    ("studies.kernel_study", [], "--lr", "inf"),
    ("studies.kernel_study", [], "--device", NO_DEVICE),
    ("studies.kernel_study", [], "--work-dir", "{file}"),
    ("studies.kernel_transfer", [], "--jobs", "0"),
    ("studies.distill_study", [], "--seeds", "0"),
    ("studies.kernel_pilot", [], "--eval-tokens", "-1"),
    ("studies.normalizer_diagnosis", ["--checkpoint", ABSENT, "--out", "{dir}/o"], "--windows", "0"),
]


@pytest.mark.parametrize("module,before,flag,value", CASES, ids=[f"{m}-{f}={v}" for m, _, f, v in CASES])
def test_a_value_that_cannot_work_is_refused_while_parsing(module: str, before: list[str], flag: str, value: str,
                                                           tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture) -> None:
    (tmp_path / "a_file").write_text("x")
    fill = lambda text: text.format(dir=tmp_path, file=tmp_path / "a_file")  # noqa: E731
    argv = [fill(a) for a in [*before, flag, value]]
    monkeypatch.setattr(sys, "argv", [module, *argv])  # for the mains that read sys.argv
    main = importlib.import_module(module).main
    with pytest.raises(SystemExit) as stop:
        main(argv) if main.__code__.co_argcount else main()
    lines = capsys.readouterr().err.strip().splitlines()
    assert stop.value.code == 2 and lines[-1].split(": error: ", 1)[1].startswith(f"argument {flag}: "), lines[-3:]


def test_an_existing_file_as_the_export_directory_is_refused_before_the_checkpoint_is_read(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from megaflex.hf.export import main

    (tmp_path / "a_file").write_text("x")
    assert main(["--checkpoint", ABSENT, "--hf-out", str(tmp_path / "a_file")]) == 2
    assert capsys.readouterr().err == f"megaflex-export: error: --hf-out {tmp_path / 'a_file'}: exists and is not a directory\n"
    assert main(["--checkpoint", ABSENT, "--hf-out", str(tmp_path / "a_file" / "hf")]) == 2
    err = capsys.readouterr().err  # not about the (absent) checkpoint: it was never read
    assert err.startswith(f"megaflex-export: error: --hf-out {tmp_path / 'a_file' / 'hf'}: cannot be created here (")
