"""The shared argparse types refuse what cannot work, while the arguments are parsed."""

from __future__ import annotations

import argparse
import os

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


def test_output_paths(tmp_path):
    (tmp_path / "a_file").write_text("x")
    with pytest.raises(argparse.ArgumentTypeError, match="not a directory"):
        cli_args.writable_dir(str(tmp_path / "a_file"))
    with pytest.raises(argparse.ArgumentTypeError, match="cannot create"):
        cli_args.writable_dir(str(tmp_path / "a_file" / "below"))
    with pytest.raises(argparse.ArgumentTypeError, match="is a directory"):
        cli_args.writable_file(str(tmp_path))
    made = cli_args.writable_file(str(tmp_path / "new" / "result.json"))
    assert made.parent.is_dir() and not made.exists()
    assert cli_args.writable_dir(str(tmp_path / "d1" / "d2")).is_dir()
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
