"""The shared argparse types refuse what cannot work, while the arguments are parsed."""

from __future__ import annotations

import argparse
import ast
import os
from pathlib import Path

import pytest
import torch

from megaflex import cli_args


@pytest.mark.parametrize("parse,good,bad", [
    (cli_args.positive_int, ["1", "7"], ["0", "-3", "1.5", "x"]),
    (cli_args.nonnegative_int, ["0", "4"], ["-1", "a"]),
    (cli_args.finite_float, ["0", "-2.5", "1e3"], ["nan", "inf", "-inf", "x"]),
    (cli_args.positive_float, ["0.1", "3"], ["0", "-1", "nan", "inf"]),
    (cli_args.nonnegative_float, ["0", "2.5"], ["-0.1", "nan", "inf", "x"]),
    (cli_args.unit_interval, ["0", "0.5", "1"], ["-0.1", "1.01", "nan"]),
])  # fmt: skip
def test_numbers(parse, good, bad):
    for text in good:
        assert parse(text) == float(text)
    for text in bad:
        with pytest.raises(argparse.ArgumentTypeError):
            parse(text)


def test_positive_int_list():
    assert cli_args.positive_int_list("512, 1024,") == [512, 1024]
    for text in ("", ",", "512,0", "1,x", "-3"):
        with pytest.raises(argparse.ArgumentTypeError):
            cli_args.positive_int_list(text)


def test_output_paths(tmp_path):
    (tmp_path / "a_file").write_text("x")
    with pytest.raises(argparse.ArgumentTypeError, match="not a directory"):
        cli_args.writable_dir(str(tmp_path / "a_file"))
    with pytest.raises(argparse.ArgumentTypeError, match="cannot be created here"):
        cli_args.writable_dir(str(tmp_path / "a_file" / "below"))
    with pytest.raises(argparse.ArgumentTypeError, match="is a directory"):
        cli_args.writable_file(str(tmp_path))
    made = cli_args.writable_file(str(tmp_path / "new" / "result.json"))
    assert made.parent.is_dir() and not made.exists()
    assert cli_args.writable_dir(str(tmp_path / "d1" / "d2")).is_dir()
    assert cli_args.creatable_dir(str(tmp_path / "c1" / "c2")) == tmp_path / "c1" / "c2"
    assert not (tmp_path / "c1").exists()  # checked, not made
    with pytest.raises(argparse.ArgumentTypeError, match="cannot be created here .*a_file is not a directory"):
        cli_args.creatable_dir(str(tmp_path / "a_file" / "below"))
    if os.geteuid() != 0:  # root writes anywhere
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o500)
        with pytest.raises(argparse.ArgumentTypeError, match="not writable"):
            cli_args.writable_dir(str(ro))


def test_existing_file(tmp_path):
    with pytest.raises(argparse.ArgumentTypeError, match="no such file"):
        cli_args.existing_file(str(tmp_path / "missing.txt"))
    (tmp_path / "there.txt").write_text("x")
    assert cli_args.existing_file(str(tmp_path / "there.txt")).is_file()
    with pytest.raises(argparse.ArgumentTypeError, match="no such directory"):
        cli_args.existing_dir(str(tmp_path / "there.txt"))
    assert cli_args.existing_dir(str(tmp_path)) == tmp_path


def test_relative_paths_are_taken_from_the_starting_directory(tmp_path, monkeypatch):
    """Issue 45: a relative path given to a command that runs its work elsewhere (a subprocess with
    cwd=REPO) named another file there; it is made absolute while the arguments are parsed."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "in.txt").write_text("x")
    assert cli_args.existing_file("in.txt") == tmp_path / "in.txt"
    assert cli_args.existing_dir(".") == tmp_path
    assert cli_args.writable_file("out/r.json") == tmp_path / "out" / "r.json"
    assert cli_args.writable_dir("work") == tmp_path / "work"


def test_available_device():
    assert cli_args.available_device("cpu") == "cpu"
    for text, message in (("gpu", "expected a device"), ("meta", "not a device to compute on")):
        with pytest.raises(argparse.ArgumentTypeError, match=message):
            cli_args.available_device(text)
    if torch.cuda.is_available():  # a GPU machine: only a device number it lacks is refused
        count = torch.cuda.device_count()
        assert cli_args.available_device("cuda:0") == "cuda:0"
        with pytest.raises(argparse.ArgumentTypeError, match=f"has {count} CUDA device"):
            cli_args.available_device(f"cuda:{count}")
    else:
        for text in ("cuda", "cuda:1"):
            with pytest.raises(argparse.ArgumentTypeError, match="no CUDA device is available on this machine"):
                cli_args.available_device(text)


def test_scratch_results_is_outside_the_repository(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cli_args.scratch_results("lra_listops") == tmp_path / "megaflex" / "lra_listops"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert cli_args.scratch_results("x") == Path.home() / ".cache" / "megaflex" / "x"


def _out_defaults(path: Path) -> list[tuple[int, ast.expr | None]]:
    """(line, default) of every --out/--json option and every dataclass field ``out`` in ``path``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument" and node.args \
                and isinstance(node.args[0], ast.Constant) and node.args[0].value in ("--out", "--json"):
            keywords = {k.arg: k.value for k in node.keywords}
            if not (isinstance(keywords.get("required"), ast.Constant) and keywords["required"].value):
                found.append((node.lineno, keywords.get("default")))
        elif isinstance(node, ast.ClassDef):
            found += [(f.lineno, f.value) for f in node.body
                      if isinstance(f, ast.AnnAssign) and getattr(f.target, "id", "") == "out" and f.value is not None]
    return found


def test_no_benchmark_or_study_writes_a_committed_folder_by_default():
    """Their default --out is ``scratch_results`` (or none: a folder the run makes outside the
    repository); docs/results/... is written only when named."""
    repo = Path(__file__).resolve().parents[1]
    checked = 0
    for path in sorted([*repo.glob("benchmarks/**/*.py"), *repo.glob("studies/*.py")]):
        for line, default in _out_defaults(path):
            checked += 1
            text = "" if default is None else ast.unparse(default)
            assert text in ("", "None") or "scratch_results(" in text, f"{path.relative_to(repo)}:{line}: default {text}"
    assert checked >= 12
