"""Generate the LRA ListOps task (Nangia & Bowman 2018, as configured by Tay et al. 2020's LRA).

    python -m data_prep.listops --out work_data/listops [--train 96000 --valid 2000 --test 2000]
        [--seed 0] [--min-length 500 --max-length 2000] [--max-depth 10] [--max-args 10] [--form lra]

writes ``OUT/basic_train.tsv``, ``basic_val.tsv``, ``basic_test.tsv`` (LRA's names and format:
header ``Source<TAB>Target``, one expression and its value 0-9 per line) and ``basic_meta.json``
(arguments, counts, timing, length statistics). ``megaflex.data.lra`` reads these and LRA's files alike.

The distribution is LRA's:

* a node at depth ``d`` (root: 1) is, while ``d < max_depth``, an operator with probability 0.25
  (LRA's ``VALUE_P = 0.25`` is tested as ``r > VALUE_P -> digit``, so 0.25 is the *operator*
  probability, constant in depth), else a uniform digit 0-9; at ``max_depth`` always a digit;
* an operator is uniform over MIN, MAX, MED, SM (sum mod 10) with ``randint(2, max_args)`` arguments;
* a tree's *length* is LRA's count: 2 per operator (``[OP`` and ``]``) + 1 per digit, i.e. the
  tokens other than parentheses; only trees with ``min_length < length < max_length`` (strict, as
  LRA) are kept -- the rest are discarded, as soon as they grow past ``max_length``;
* values: MIN, MAX; MED = ``int(numpy.median(args))``, so for an even count the mean of the two
  middle values rounded down (digits are non-negative: ``int`` truncation is floor); SM = sum % 10.

Surface forms (``--form``): ``lra`` (default) is LRA's file form, where an operator with ``k``
arguments opens ``k + 1`` parentheses and every argument closes one, e.g. MAX(2, 9) is
``( ( ( [MAX 2 ) 9 ) ] )``; ``compact`` wraps each operator in one pair: ``( [MAX 2 9 ] )``. Both
keep ``]``, so the expression is recoverable from the non-parenthesis tokens alone.

Interrupted (Ctrl-C: exit 130) or failed, it leaves neither ``.tmp`` files nor some splits without
the others: the three files are renamed into place together once all are written.

Splits and duplicates: examples are drawn i.i.d. from one ``random.Random(seed)`` stream; the first
``train`` distinct accepted expressions go to train, the next ``valid`` to val, the next ``test``
to test. An expression whose token string (its 16-byte BLAKE2b digest) was already accepted is
skipped, so no expression occurs twice in or across splits (LRA dedups with a set of trees, then
splits in set order). Output is identical for the same arguments on every machine.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Union

from megaflex.cli_args import nonnegative_int, positive_int, writable_dir
from megaflex.data.lra import (
    LISTOPS_CLOSE,
    LISTOPS_END,
    LISTOPS_OPEN,
    LISTOPS_OPERATORS,
    listops_path,
)

OPERATOR_P = 0.25  # probability that a node above max_depth is an operator (LRA: 1 - P(digit) = 0.25)
FORMS = ("lra", "compact")
_MAX_FRUITLESS = 2_000_000  # trees without a new accepted one before the bounds are called impossible

Tree = Union[int, tuple[str, tuple["Tree", ...]]]  # a digit, or (operator token, arguments)


class _TooLong(Exception):
    """Raised inside generation once a tree's length reaches the bound: it can only be rejected."""


@dataclass
class ListOpsConfig:
    out: str
    train: int = 96000
    valid: int = 2000
    test: int = 2000
    seed: int = 0
    min_length: int = 500
    max_length: int = 2000
    max_depth: int = 10
    max_args: int = 10
    form: str = "lra"
    task: str = "basic"
    progress: bool = True
    overwrite: bool = False

    def __post_init__(self) -> None:
        for name in ("train", "valid", "test"):
            if getattr(self, name) < 0:
                raise ValueError(f"--{name}: expected >= 0, got {getattr(self, name)}")
        if self.train + self.valid + self.test == 0:
            raise ValueError("--train/--valid/--test: nothing to generate")
        if self.min_length < 0 or self.max_length <= self.min_length + 1:
            raise ValueError(f"--min-length/--max-length: need 0 <= min < max - 1 (kept: min < length < max), "
                             f"got {self.min_length}, {self.max_length}")
        if self.max_depth < 1:
            raise ValueError(f"--max-depth: expected >= 1, got {self.max_depth}")
        if self.max_args < 2:
            raise ValueError(f"--max-args: expected >= 2, got {self.max_args}")
        if self.form not in FORMS:
            raise ValueError(f"--form: expected one of {FORMS}, got {self.form!r}")


def generate_tree(rng: random.Random, max_depth: int = 10, max_args: int = 10, max_length: int | None = None) -> Tree:
    """One random expression tree (LRA's distribution). With ``max_length``, raises ``_TooLong`` as
    soon as the length reaches it (the tree would be rejected anyway; this bounds the work)."""
    budget = [max_length if max_length is not None else sys.maxsize]
    rand, randint, choice = rng.random, rng.randint, rng.choice

    def grow(depth: int) -> Tree:
        if depth < max_depth and rand() < OPERATOR_P:
            budget[0] -= 2
            if budget[0] <= 0:
                raise _TooLong
            k = randint(2, max_args)
            op = choice(LISTOPS_OPERATORS)
            return op, tuple(grow(depth + 1) for _ in range(k))
        budget[0] -= 1
        if budget[0] <= 0:
            raise _TooLong
        return randint(0, 9)

    return grow(1)


def evaluate(tree: Tree) -> int:
    """The value 0-9 of ``tree``."""
    if isinstance(tree, int):
        return tree
    op, args = tree
    values = sorted(evaluate(a) for a in args)
    if op == "[MIN":
        return values[0]
    if op == "[MAX":
        return values[-1]
    if op == "[MED":  # int(np.median(values)): mean of the middle two for an even count, floored
        n = len(values)
        return values[n // 2] if n % 2 else (values[n // 2 - 1] + values[n // 2]) // 2
    if op == "[SM":
        return sum(values) % 10
    raise ValueError(f"unknown operator {op!r}")


def tree_length(tree: Tree) -> int:
    """LRA's length: 2 per operator + 1 per digit (the non-parenthesis tokens)."""
    if isinstance(tree, int):
        return 1
    return 2 + sum(tree_length(a) for a in tree[1])


def tree_depth(tree: Tree) -> int:
    """1 for a digit, 1 + the deepest argument for an operator."""
    return 1 if isinstance(tree, int) else 1 + max(tree_depth(a) for a in tree[1])


def to_tokens(tree: Tree, form: str = "lra") -> list[str]:
    """The tokens of ``tree`` in ``form`` (see the module docstring)."""
    out: list[str] = []

    def emit(t: Tree) -> None:
        if isinstance(t, int):
            out.append(str(t))
            return
        op, args = t
        if form == "lra":  # LRA nests (((op a0) a1) ... ]): k + 1 opens, a close after each argument
            out.extend([LISTOPS_OPEN] * (len(args) + 1))
            out.append(op)
            for a in args:
                emit(a)
                out.append(LISTOPS_CLOSE)
            out.extend([LISTOPS_END, LISTOPS_CLOSE])
        elif form == "compact":
            out.extend([LISTOPS_OPEN, op])
            for a in args:
                emit(a)
            out.extend([LISTOPS_END, LISTOPS_CLOSE])
        else:
            raise ValueError(f"form: expected one of {FORMS}, got {form!r}")

    emit(tree)
    return out


def _accepted(cfg: ListOpsConfig, stats: dict[str, int]) -> Iterator[tuple[Tree, int, str]]:
    rng = random.Random(cfg.seed)
    seen: set[bytes] = set()
    last_new = 0
    while True:
        stats["tried"] += 1
        if stats["tried"] - last_new > _MAX_FRUITLESS:
            raise ValueError(f"no new expression in the length range after {_MAX_FRUITLESS} trees: "
                             "widen --min-length/--max-length or raise --max-depth/--max-args")
        try:
            tree = generate_tree(rng, cfg.max_depth, cfg.max_args, cfg.max_length)
        except _TooLong:
            stats["too_long"] += 1
            continue
        length = tree_length(tree)
        if length <= cfg.min_length:
            stats["too_short"] += 1
            continue
        source = " ".join(to_tokens(tree, cfg.form))
        digest = hashlib.blake2b(source.encode("ascii"), digest_size=16).digest()
        if digest in seen:
            stats["duplicates"] += 1
            continue
        seen.add(digest)
        last_new = stats["tried"]
        yield tree, length, source


def _summary(values: list[int]) -> dict[str, float]:
    if not values:
        return {}
    s = sorted(values)
    return {"min": s[0], "mean": round(sum(s) / len(s), 1), "median": s[len(s) // 2], "max": s[-1]}


def generate(cfg: ListOpsConfig) -> dict:
    """Write the three split files and the meta file; return the meta record."""
    out = Path(cfg.out)
    paths = {split: listops_path(out, split, cfg.task) for split in ("train", "valid", "test")}
    meta_path = out / f"{cfg.task}_meta.json"
    existing = [str(p) for p in [*paths.values(), meta_path] if p.exists()]
    if existing and not cfg.overwrite:
        raise FileExistsError(f"{', '.join(existing)} exist(s); pass --overwrite to replace")
    out.mkdir(parents=True, exist_ok=True)
    sizes = {"train": cfg.train, "valid": cfg.valid, "test": cfg.test}
    total = sum(sizes.values())
    stats = {"tried": 0, "too_long": 0, "too_short": 0, "duplicates": 0}
    lengths: dict[str, list[int]] = {s: [] for s in sizes}
    tokens: dict[str, list[int]] = {s: [] for s in sizes}
    labels: dict[str, list[int]] = {s: [0] * 10 for s in sizes}
    bar = None
    if cfg.progress:
        from tqdm import tqdm

        bar = tqdm(total=total, unit="ex", desc="listops", file=sys.stderr)
    t0 = time.perf_counter()
    stream = _accepted(cfg, stats)
    tmps = {split: Path(f"{path}.tmp") for split, path in paths.items()}
    try:
        for split, n in sizes.items():
            with open(tmps[split], "w", encoding="ascii", newline="\n") as f:
                f.write("Source\tTarget\n")
                for _ in range(n):
                    tree, length, source = next(stream)
                    label = evaluate(tree)
                    f.write(f"{source}\t{label}\n")
                    lengths[split].append(length)
                    tokens[split].append(source.count(" ") + 1)
                    labels[split][label] += 1
                    if bar is not None:
                        bar.update(1)
        for split, tmp in tmps.items():  # the splits appear together, each complete, once all are written
            os.replace(tmp, paths[split])
    finally:  # Ctrl-C or an error: no .tmp is left behind (nor a split without its siblings)
        for tmp in tmps.values():
            tmp.unlink(missing_ok=True)
        if bar is not None:
            bar.close()
    seconds = time.perf_counter() - t0
    meta = {
        "config": {k: v for k, v in asdict(cfg).items() if k not in ("out", "progress", "overwrite")},
        "files": {s: p.name for s, p in paths.items()},
        "sizes": sizes,
        "generation": {**stats, "accepted": total, "seconds": round(seconds, 2)},
        "lra_length": {s: _summary(v) for s, v in lengths.items()},
        "tokens_in_file": {s: _summary(v) for s, v in tokens.items()},
        "label_counts": labels,
    }
    meta_path.write_text(json.dumps(meta, indent=1) + "\n")
    return meta


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, type=writable_dir, help="output directory (created)")
    ap.add_argument("--train", type=nonnegative_int, default=96000)
    ap.add_argument("--valid", type=nonnegative_int, default=2000)
    ap.add_argument("--test", type=nonnegative_int, default=2000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--min-length", type=nonnegative_int, default=500, help="keep length > this (LRA count, no parentheses)")
    ap.add_argument("--max-length", type=positive_int, default=2000, help="keep length < this")
    ap.add_argument("--max-depth", type=positive_int, default=10)
    ap.add_argument("--max-args", type=positive_int, default=10)
    ap.add_argument("--form", choices=FORMS, default="lra", help="parenthesisation (default: LRA's file form)")
    ap.add_argument("--task", default="basic", help="file prefix: TASK_train.tsv ... (LRA: basic)")
    ap.add_argument("--no-progress", dest="progress", action="store_false")
    ap.add_argument("--overwrite", action="store_true", help="replace existing split files")
    a = ap.parse_args(argv)
    try:
        cfg = ListOpsConfig(out=str(a.out), train=a.train, valid=a.valid, test=a.test, seed=a.seed,
                            min_length=a.min_length, max_length=a.max_length, max_depth=a.max_depth,
                            max_args=a.max_args, form=a.form, task=a.task, progress=a.progress,
                            overwrite=a.overwrite)
        meta = generate(cfg)
    except (ValueError, FileExistsError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"listops: interrupted; no split file written in {a.out}; exit 130", file=sys.stderr)
        return 130
    g = meta["generation"]
    print(f"wrote {sum(meta['sizes'].values())} examples to {cfg.out} in {g['seconds']} s "
          f"({g['tried']} trees tried)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
