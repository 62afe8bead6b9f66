"""The ListOps generator (issue 41): LRA's distribution, bounds, values checked by independent
evaluators, brackets kept, distinct deterministic splits, files the LRA reader accepts."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from data_prep.listops import (
    ListOpsConfig,
    evaluate,
    generate,
    generate_tree,
    main,
    to_tokens,
    tree_depth,
    tree_length,
)
from megaflex.data.lra import decode_listops, listops_path, read_listops_tsv

REPO = Path(__file__).resolve().parents[2]
OPS = ("[MIN", "[MAX", "[MED", "[SM")
SPLITS = ("train", "valid", "test")


# ---- independent evaluators (written against the token strings, not the generator's trees)

def stack_eval(tokens: list[str]) -> tuple[int, int, int]:
    """Evaluate prefix tokens with ``]`` closers, ignoring parentheses; return (value, depth, max args).
    Checks arity >= 2 and that exactly one value remains."""
    stack: list[list] = []  # frames [op, args]
    result = None
    max_depth = max_args = 0
    for t in tokens:
        if t in ("(", ")"):
            continue
        if t in OPS:
            stack.append([t, []])
            max_depth = max(max_depth, len(stack))
            continue
        if t == "]":
            op, args = stack.pop()
            assert len(args) >= 2, f"{op} with {len(args)} arguments"
            max_args = max(max_args, len(args))
            if op == "[MIN":
                v = min(args)
            elif op == "[MAX":
                v = max(args)
            elif op == "[MED":
                v = int(np.median(args))  # LRA's definition, verbatim
            else:
                v = int(np.sum(args)) % 10
        else:
            v = int(t)
            assert 0 <= v <= 9 and t == str(v)
            max_depth = max(max_depth, len(stack) + 1)
        if stack:
            stack[-1][1].append(v)
        else:
            assert result is None, "more than one top-level expression"
            result = v
    assert not stack and result is not None
    return result, max_depth, max_args


def paren_eval(tokens: list[str]) -> int:
    """Evaluate LRA's file form through its parenthesised pair structure: ``( X Y )`` is the pair (X, Y);
    (op, a) starts a function, (f, a) adds an argument, (f, ]) applies it."""
    pos = 0

    def parse():
        nonlocal pos
        t = tokens[pos]
        pos += 1
        if t != "(":
            return t
        left, right = parse(), parse()
        assert tokens[pos] == ")", f"expected ) at {pos}"
        pos += 1
        return (left, right)

    def value(node):
        if isinstance(node, str):
            return int(node) if node.isdigit() else node
        left, right = value(node[0]), value(node[1])
        if isinstance(left, str):  # an operator meets its first argument
            return (left, [right])
        if right == "]":
            op, args = left
            if op == "[MIN":
                return min(args)
            if op == "[MAX":
                return max(args)
            return int(np.median(args)) if op == "[MED" else sum(args) % 10
        return (left[0], left[1] + [right])

    tree = parse()
    assert pos == len(tokens), "tokens after the expression"
    return value(tree)


# ---- fixtures

def small_cfg(out: Path, **kw) -> ListOpsConfig:
    base = {"out": str(out), "train": 40, "valid": 8, "test": 8, "seed": 3, "min_length": 40, "max_length": 300,
            "progress": False}
    return ListOpsConfig(**{**base, **kw})


def read_rows(path: Path) -> list[tuple[str, int]]:
    lines = path.read_text().splitlines()
    assert lines[0] == "Source\tTarget"
    return [(s, int(t)) for s, t in (ln.split("\t") for ln in lines[1:])]


@pytest.fixture(scope="module")
def lra_dir(tmp_path_factory) -> Path:
    """LRA's default bounds (500 < length < 2000, depth 10, 10 args), a few examples."""
    out = tmp_path_factory.mktemp("listops")
    generate(ListOpsConfig(out=str(out), train=24, valid=4, test=4, seed=1, progress=False))
    return out


# ---- tests

def test_values_med_and_sum_mod():
    assert evaluate(("[MED", (3, 9, 4, 8))) == 6 == int(np.median([3, 9, 4, 8]))  # (4 + 8) // 2
    assert evaluate(("[MED", (1, 2))) == 1 == int(np.median([1, 2]))  # 1.5 floors
    assert evaluate(("[MED", (7, 1, 5))) == 5
    assert evaluate(("[SM", (9, 8, 7))) == 4
    assert evaluate(("[MIN", (4, ("[MAX", (2, 9)), 5))) == 4
    rng = random.Random(0)
    for _ in range(300):  # MED against numpy on random even and odd argument lists
        args = tuple(rng.randint(0, 9) for _ in range(rng.randint(2, 10)))
        assert evaluate(("[MED", args)) == int(np.median(args))


def test_token_forms():
    tree = ("[MAX", (2, 9, ("[MIN", (4, 7)), 0))
    assert " ".join(to_tokens(tree, "compact")) == "( [MAX 2 9 ( [MIN 4 7 ] ) 0 ] )"
    assert " ".join(to_tokens(tree, "lra")) == "( ( ( ( ( [MAX 2 ) 9 ) ( ( ( [MIN 4 ) 7 ) ] ) ) 0 ) ] )"
    for form in ("lra", "compact"):
        assert stack_eval(to_tokens(tree, form)) == (9, 3, 4)  # digits under MIN are at depth 3
    assert paren_eval(to_tokens(tree, "lra")) == 9
    assert tree_length(tree) == 9 and tree_depth(tree) == 3  # 2 operators x 2 + 5 digits


def test_tree_bounds_and_distribution():
    rng = random.Random(5)
    trees = [generate_tree(rng, max_depth=4, max_args=5) for _ in range(3000)]
    assert max(tree_depth(t) for t in trees) == 4  # the bound is reached, never passed
    ops = [t for t in trees if not isinstance(t, int)]
    assert 0.2 < len(ops) / len(trees) < 0.3  # the root is an operator with probability 0.25
    assert {len(t[1]) for t in ops} == {2, 3, 4, 5}
    assert {t[0] for t in ops} == set(OPS)


def test_lra_defaults_bounds_values_brackets(lra_dir: Path):
    for split in SPLITS:
        for source, label in read_rows(listops_path(lra_dir, split)):
            tokens = source.split()
            body = [t for t in tokens if t not in ("(", ")")]
            assert 500 < len(body) < 2000
            value, depth, max_args = stack_eval(tokens)
            assert value == label == paren_eval(tokens)
            assert depth <= 10 and max_args <= 10
            n_ops = sum(t in OPS for t in tokens)
            assert n_ops == tokens.count("]") > 0
            # LRA form: an operator with k arguments has k + 1 pairs; summed over operators that is
            # (every node but the root) + n_ops = (len(body) - n_ops - 1) + n_ops
            assert tokens.count("(") == tokens.count(")") == len(body) - 1


def test_split_sizes_distinct_and_meta(tmp_path: Path):
    meta = generate(small_cfg(tmp_path))
    sources = {s: [src for src, _ in read_rows(listops_path(tmp_path, s))] for s in SPLITS}
    assert [len(sources[s]) for s in SPLITS] == [40, 8, 8]
    everything = [x for s in SPLITS for x in sources[s]]
    assert len(set(everything)) == len(everything)  # no duplicates within or across splits
    assert meta["sizes"] == {"train": 40, "valid": 8, "test": 8}
    assert sum(meta["label_counts"]["train"]) == 40
    assert meta["generation"]["tried"] >= 56 and meta["lra_length"]["train"]["min"] > 40


def test_deterministic(tmp_path: Path):
    for name, seed in (("a", 3), ("b", 3), ("c", 4)):
        generate(small_cfg(tmp_path / name, seed=seed))
    for s in SPLITS:
        a, b, c = (listops_path(tmp_path / n, s).read_bytes() for n in "abc")
        assert a == b and a != c


def test_compact_form_and_tsv_round_trip(tmp_path: Path):
    generate(small_cfg(tmp_path, form="compact"))
    for s in SPLITS:
        rows = read_rows(listops_path(tmp_path, s))
        read = read_listops_tsv(listops_path(tmp_path, s), keep_parens=True)
        assert [(decode_listops(ids), label) for ids, label in read] == rows
        for source, label in rows:
            tokens = source.split()
            assert tokens.count("(") == tokens.count("]") == sum(t in OPS for t in tokens)
            assert stack_eval(tokens)[0] == label


def test_cli_errors_and_overwrite(tmp_path: Path, capsys, monkeypatch):
    args = ["--out", str(tmp_path), "--train", "3", "--valid", "1", "--test", "1",
            "--min-length", "20", "--max-length", "200", "--no-progress"]
    assert main(args) == 0
    assert main(args) == 2 and "--overwrite" in capsys.readouterr().err
    assert main(args + ["--overwrite"]) == 0
    assert main(args + ["--overwrite", "--max-args", "1"]) == 2 and "--max-args" in capsys.readouterr().err
    assert main(args + ["--overwrite", "--min-length", "300"]) == 2
    # bounds no tree can meet: a clear error, not an endless loop
    monkeypatch.setattr("data_prep.listops._MAX_FRUITLESS", 2000)
    assert main(args + ["--overwrite", "--max-depth", "2", "--max-args", "2", "--min-length", "5",
                        "--max-length", "9"]) == 2
    assert "no new expression" in capsys.readouterr().err


def test_ctrl_c_leaves_no_tmp_file_and_no_partial_split(tmp_path: Path):
    """SIGINT while the training split is written: exit 130, one line, no traceback, nothing in OUT."""
    out = tmp_path / "listops"
    cmd = [sys.executable, "-m", "data_prep.listops", "--out", str(out), "--train", "1000000", "--no-progress"]
    proc = subprocess.Popen(cmd, cwd=REPO, stderr=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONPATH=str(REPO)))
    try:
        deadline = time.monotonic() + 120
        while not (out / "basic_train.tsv.tmp").is_file() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    assert "Traceback" not in err and err.strip().splitlines() == [f"listops: interrupted; no split file written in {out}; exit 130"]
    assert sorted(p.name for p in out.iterdir()) == []


def test_counts_and_bounds_are_checked_while_parsing(tmp_path: Path, capsys):
    for flag, value in (("--train", "-1"), ("--max-depth", "0"), ("--max-length", "x")):
        with pytest.raises(SystemExit) as stop:
            main(["--out", str(tmp_path), flag, value])
        assert stop.value.code == 2 and f"argument {flag}" in capsys.readouterr().err
    (tmp_path / "file").write_text("x")
    with pytest.raises(SystemExit):
        main(["--out", str(tmp_path / "file")])
    assert "argument --out" in capsys.readouterr().err
