"""The dispatch table (``megaflex/attention/dispatch.py``) against the code before it existed.

Every row of ``ROWS`` is reached by a case of the grid (``attention_dispatch_cases.py``) and gives
bit-identical outputs and gradients to the package at ``BEFORE_DISPATCH`` (extracted from git and run
in a subprocess), or, for the rows that only run on CUDA, is checked by selection: a CUDA request picks
the implementation the old code picked there. The bidirectional rows (issue 41), which that package did
not have, are reached by ``cases.bidirectional_cases()`` and checked against their reference forms within
rounding (tests/numerics.py) instead.
"""

from __future__ import annotations

import inspect
import io
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are first imported (CPU tensors need it)

from megaflex.attention import dispatch  # noqa: E402
from megaflex.attention.base import LinearAttentionFn  # noqa: E402
from megaflex.attention.dispatch import ROWS, NoAttentionImplementation, Request, select  # noqa: E402
import attention_dispatch_cases as cases  # noqa: E402
from attention_helpers import form_steps  # noqa: E402
from numerics import assert_close, normwise_scale  # noqa: E402

pytest.importorskip("triton")

# main before the dispatch table (issue 40): the reference every row is compared with
BEFORE_DISPATCH = "a9f5843"
REPO = Path(__file__).resolve().parents[2]

# rows that need CUDA tensors, with the implementation the old code chose for the same request
# (core._chunked_impl("fla", on_cuda=True); shared_window._uses_triton with "auto" on CUDA, not fp64)
SELECTION_ONLY = {
    "linear.chunk.fla": (Request("linear", backend="fla", device="cuda"), "fla_linear_attention"),
    "window.chunk.triton_auto": (Request("window", backend="auto", device="cuda", window=3), "TritonWindowNumerator"),
}
# CUDA requests whose row the CPU grid reaches with backend="triton" ("auto" on CUDA is "triton" in the old
# core.chunked_backend): (request, the row, the old implementation's name)
AUTO_ON_CUDA = [
    (Request("linear", device="cuda", trig=True), "linear.chunk.triton_trig", "trig_linear_attention"),
    (Request("linear", device="cuda"), "linear.chunk.triton", "triton_linear_attention"),
    (Request("linear", device="cuda", trig=True, padded=True), "linear.chunk.triton", "triton_linear_attention"),
    (Request("linear", device="cuda", backend="torch", trig=True), "linear.chunk.torch", "chunked_linear_attention"),
    (Request("window", device="cuda", window=3, dtype=torch.float64), "window.chunk.torch", "ChunkedWindowNumerator"),
    (Request("window", device="cuda", backend="fla", window=3), "window.chunk.torch", "ChunkedWindowNumerator"),
]


def _git_available() -> bool:
    try:
        subprocess.run(["git", "-C", str(REPO), "cat-file", "-e", f"{BEFORE_DISPATCH}^{{commit}}"], check=True,
                       capture_output=True)  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return False
    return True


@pytest.fixture(scope="module")
def before(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, torch.Tensor]]:
    """The grid computed by the package at ``BEFORE_DISPATCH``."""
    if not _git_available():
        pytest.skip(f"commit {BEFORE_DISPATCH} is not in this checkout's git history")
    tree = tmp_path_factory.mktemp("before_dispatch")
    archive = subprocess.run(["git", "-C", str(REPO), "archive", BEFORE_DISPATCH, "megaflex"], check=True,
                             capture_output=True).stdout  # fmt: skip
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(tree, filter="data")
    out = tree / "grid.pt"
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1", "TRITON_INTERPRET": "1"}
    script = Path(cases.__file__)
    run = subprocess.run([sys.executable, str(script), str(out)], env=env, cwd=tree, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-4000:]
    saved = torch.load(out)
    assert Path(saved["package"]).is_relative_to(tree), saved["package"]  # the old package ran, not this one
    assert not (tree / "megaflex/attention/dispatch.py").exists()
    return saved["grid"]


@pytest.fixture(scope="module")
def after() -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, set[str]]]:
    """The grid computed in-process by the current package, and the rows each case selected."""
    threads = torch.get_num_threads()
    results, rows = {}, {}
    try:
        torch.set_num_threads(1)
        for name, (_, fn) in cases.CASES.items():
            with dispatch.recording() as seen:
                results[name] = fn()
            rows[name] = {row.name for _, row in seen}
    finally:
        torch.set_num_threads(threads)
    return results, rows


@pytest.fixture(scope="module")
def bidirectional() -> tuple[dict, dict[str, tuple[dict, dict | None]], dict[str, set[str]]]:
    """The bidirectional cases, their results and their references' results, and the rows each selected."""
    found = cases.bidirectional_cases()
    results, rows = {}, {}
    for name, (_, fn, reference, _) in found.items():
        with dispatch.recording() as seen:
            results[name] = (fn(), None if reference is None else reference())
        rows[name] = {row.name for _, row in seen}
    return found, results, rows


def test_every_row_is_reached_by_the_grid_or_checked_by_selection(after, bidirectional) -> None:
    _, rows = after
    reached = set().union(*rows.values(), *bidirectional[2].values())
    names = [row.name for row in ROWS]
    assert len(names) == len(set(names)), "row names are unique"
    missing = set(names) - reached - set(SELECTION_ONLY)
    assert not missing, f"rows no grid case reaches (add a case to attention_dispatch_cases.py): {sorted(missing)}"
    assert not (reached & set(SELECTION_ONLY)), "a row the grid runs is compared bit for bit, not by selection"


@pytest.mark.parametrize("name", sorted(cases.CASES))
def test_case_reaches_its_rows(name: str, after) -> None:
    _, rows = after
    expected = set(cases.CASES[name][0])
    assert expected <= rows[name], (name, sorted(rows[name]))


@pytest.mark.parametrize("name", sorted(cases.CASES))
def test_outputs_and_gradients_are_bit_identical_to_before(name: str, before, after) -> None:
    old, new = before[name], after[0][name]
    assert sorted(old) == sorted(new), name
    for key in old:
        assert old[key].dtype == new[key].dtype and old[key].shape == new[key].shape, (name, key)
        assert torch.equal(old[key], new[key]), (name, key, (old[key] - new[key]).abs().max().item())


@pytest.mark.parametrize("row_name", sorted(SELECTION_ONLY))
def test_cuda_only_rows_pick_the_old_implementation(row_name: str) -> None:
    request, old_name = SELECTION_ONLY[row_name]
    row = select(request)
    assert row.name == row_name
    assert row.target.rsplit(":", 1)[1].rsplit(".", 1)[-1] == old_name


@pytest.mark.parametrize("request_, row_name, old_name", AUTO_ON_CUDA)
def test_auto_on_cuda_picks_the_old_implementation(request_: Request, row_name: str, old_name: str) -> None:
    row = select(request_)
    assert (row.name, row.target.rsplit(":", 1)[1]) == (row_name, old_name)


def test_bidirectional_cases_reach_their_rows_and_match_their_references(bidirectional) -> None:
    found, results, rows = bidirectional
    for name, (expected, _, _, module) in found.items():
        assert set(expected) <= rows[name], (name, sorted(rows[name]))
        got, want = results[name]
        assert all(torch.isfinite(t).all() for t in got.values()), name
        if want is None:
            continue
        # the error growth of the kernel (if any) plus the window's / softmax's exact part, and the
        # weighted sum of every output the gradients are taken of (``cases._result``)
        q, k, v = cases._qkv(12, 1)
        scores = (q.double() @ k.double().transpose(-1, -2)).abs().max().item() / cases.D ** 0.5
        steps = 2 * (12 + cases.D + 2 * scores + 4) + 2 * v[0, 0].numel()
        feature_map = getattr(module, "feature_map", None)
        if feature_map is not None:
            steps += form_steps(feature_map, q, k, v)
        assert sorted(got) == sorted(want), name
        terms = max(normwise_scale(t) for key, t in want.items() if key.startswith("grad"))
        for key in want:
            floor = terms if key.startswith("grad") else 0.0
            assert_close(got[key], want[key], steps=2 * steps if floor else steps, floor=floor, name=f"{name} {key}")


def test_no_row_raises_naming_the_request() -> None:
    with pytest.raises(NoAttentionImplementation, match="op='linear'.*form='bidirectional'"):
        select(Request("linear", form="bidirectional", algorithm="unknown"))


def test_feature_rows_meet_the_one_contract() -> None:
    """Every row fed features takes the keywords of ``base.LinearAttentionFn``."""
    contract = inspect.signature(LinearAttentionFn.__call__).parameters
    keywords = {name for name, p in contract.items() if p.kind is inspect.Parameter.KEYWORD_ONLY}
    feature_rows = [row for row in ROWS if row.adapter == "features"]
    assert len(feature_rows) >= 5
    for row in feature_rows:
        parameters = inspect.signature(row.implementation()).parameters
        assert keywords <= set(parameters), (row.name, sorted(keywords - set(parameters)))
