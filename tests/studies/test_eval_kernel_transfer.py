"""The kernel-transfer experiment at tiny settings: A, the three B arms, frozen kernels, report."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from forked_python import forking_process_pool

from studies.kernel_transfer import B_METRIC, initial_kernel_state, kernel_state, main, max_abs_diff

TINY = ["--steps-a", "4", "--steps-b", "3", "--max-train-docs", "40", "--vocab-size", "512", "--hidden-size", "32",
        "--num-layers", "2", "--num-heads", "2", "--feature-dim", "16", "--seq-len", "64", "--micro-batch-size", "2",
        "--global-batch-size", "2", "--eval-tokens", "600", "--tokenizer-sentences", "5000"]


@pytest.mark.slow
def test_kernel_transfer_arms_freeze_the_right_kernels_and_report_the_drops(
    shared_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import studies.kernel_transfer

    # the chains' worker processes and their training runs: forked, not fresh interpreters
    monkeypatch.setattr(studies.kernel_transfer, "ProcessPoolExecutor", forking_process_pool)
    work, out = tmp_path / "work", tmp_path / "out"
    places = ["--data-root", str(shared_data), "--data-work-dir", str(tmp_path / "data"), "--work-dir", str(work), "--out", str(out)]
    rows = main([*TINY, *places, "--jobs", "2"])  # the two kinds' chains in two processes
    assert sorted((r["kind"], r["arm"]) for r in rows) == sorted(
        (kind, arm) for kind in ("flexformer_n", "hedgehog") for arm in ("A", "transfer", "learned_b", "random"))
    runs = {(r["kind"], r["arm"]): work / "runs" / f"{r['label']}_s1234" for r in rows}
    for kind in ("flexformer_n", "hedgehog"):
        a = kernel_state(runs[kind, "A"])
        init = initial_kernel_state(runs[kind, "A"], 1234)
        assert max_abs_diff(a, init) > 0  # A learned its kernel
        assert max_abs_diff(kernel_state(runs[kind, "transfer"]), a) == 0  # A's kernel, frozen
        assert max_abs_diff(kernel_state(runs[kind, "random"]), init) == 0  # the untrained kernel, frozen
        assert max_abs_diff(kernel_state(runs[kind, "learned_b"]), init) > 0  # learned on B
    # the transfer run copied only the kernel: its other weights were trained from scratch on B
    import torch

    from megaflex.eval.loading import load_for_eval

    a_model, t_model = (load_for_eval(runs["hedgehog", arm] / "checkpoints").model for arm in ("A", "transfer"))
    assert not torch.equal(a_model.embed.weight, t_model.embed.weight)

    results = json.loads((out / "results.json").read_text())
    by = {(r["kind"], r["arm"]): r for r in results["runs"]}
    assert by["flexformer_n", "transfer"]["kernel_max_abs_diff_vs_A"] == 0
    assert by["hedgehog", "random"]["kernel_max_abs_diff_vs_init"] == 0
    for kind in ("flexformer_n", "hedgehog"):
        s = results["summary"][kind]
        learned = by[kind, "learned_b"]["wikitext2_test_ppl"]
        assert math.isfinite(learned) and 50 < learned < 5000  # near-uniform over a 512-token vocabulary
        for arm in ("transfer", "random"):
            assert s[f"{arm}_drop_mean"] == pytest.approx(by[kind, arm]["wikitext2_test_ppl"] / learned - 1)
    assert results["tokens_b"] == 3 * 2 * 64 and by["hedgehog", "A"]["wikitext2_test_tokens"] == 599
    md = (out / "results.md").read_text()
    assert "One seed: a pilot" in md and "| hedgehog | 1 |" in md and "valid** split to train on" in md
    assert (out / "transfer.png").stat().st_size > 5000

    # a second session reuses every stored run (no training: the checkpoints stay as they are)
    stamps = {p: p.stat().st_mtime_ns for p in work.glob("runs/*/checkpoints/latest")}
    assert len(stamps) == 8
    again = main([*TINY, *places, "--jobs", "1"])
    assert [r["wikitext2_test_ppl"] for r in again] == [r["wikitext2_test_ppl"] for r in rows]
    assert {p: p.stat().st_mtime_ns for p in stamps} == stamps

    # --a-runs: a kernel study's finished runs (named <kind>_s<seed>) are domain A, evaluated, not retrained.
    # In the same folders the B rows that do not depend on A (learned_b, random) are reused too; the
    # transfer arm starts from the reused A's checkpoint now (another fingerprint) and is retrained.
    ks_runs = tmp_path / "kernel_study_runs"
    ks_runs.mkdir()
    (ks_runs / "flexformer_n_s1234").symlink_to(runs["flexformer_n", "A"])
    reuse = [*TINY, "--kinds", "flexformer_n", "--a-runs", str(ks_runs), *places]
    reused = {r["arm"]: r for r in main(reuse)}
    assert reused["A"]["reused_from"] == str(ks_runs / "flexformer_n_s1234")
    assert reused["A"]["wikitext2_test_ppl"] == pytest.approx(by["flexformer_n", "A"]["wikitext2_test_ppl"], rel=1e-6)
    transfer_latest = runs["flexformer_n", "transfer"] / "checkpoints" / "latest"
    assert {p for p in stamps if p.stat().st_mtime_ns != stamps[p]} == {transfer_latest}  # A not retrained
    for arm in ("learned_b", "random"):  # the stored rows, timings included
        assert {k: reused[arm][k] for k in by["flexformer_n", arm]} == by["flexformer_n", arm]
    assert reused["transfer"]["kernel_max_abs_diff_vs_A"] == 0
    transferred = kernel_state(runs["flexformer_n", "transfer"])
    assert max_abs_diff(transferred, kernel_state(runs["flexformer_n", "A"])) == 0
    assert "not retrained" in (out / "results.md").read_text()
    # a reused run of another length, or one that is missing, is refused before any training
    with pytest.raises(ValueError, match=r"--a-runs: .*flexformer_n_s1234 does not match the study's shape "
                                         r"\(A run, study\): \{'steps': \(4, 5\)\}"):
        main([*reuse, "--steps-a", "5"])
    with pytest.raises(FileNotFoundError, match=r"--a-runs: .*hedgehog_s1234 is not a finished kernel-study run"):
        main([*reuse, "--kinds", "flexformer_n,hedgehog"])


def test_kinds_without_a_learnable_kernel_and_bad_counts_are_refused(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(ValueError, match="--kinds: 'performer' has no learnable kernel"):
        main(["--kinds", "flexformer_n,performer"])
    with pytest.raises(SystemExit) as stop:  # while the arguments are parsed
        main(["--steps-b", "0"])
    assert stop.value.code == 2 and "argument --steps-b: expected a positive integer, got 0" in capsys.readouterr().err


def test_findings_claim_only_what_the_seeds_separate() -> None:
    from studies.kernel_transfer_report import findings, summarize

    ppl = {  # B test ppl per (kind, arm): three seeds each
        ("flexformer_n", "transfer"): [300.0, 295.0, 340.0], ("flexformer_n", "learned_b"): [398.0, 331.0, 297.0],
        ("flexformer_n", "random"): [427.0, 431.0, 418.0], ("hedgehog", "transfer"): [337.0, 404.0, 395.0],
        ("hedgehog", "learned_b"): [428.0, 409.0, 361.0], ("hedgehog", "random"): [346.0, 422.0, 400.0],
    }
    rows = [{"kind": kind, "arm": arm, "seed": 1234 + i, B_METRIC: v, "english_docs_valid_ppl": 1.0}
            for (kind, arm), values in ppl.items() for i, v in enumerate(values)]
    lines = findings(summarize(rows, ("flexformer_n", "hedgehog")), rows)
    fn, hh, drops, absolute = lines
    # flexformer_n: transfer vs learned_b overlaps (seed 1236 reverses it); vs random it is 100+ ppl lower on every seed
    assert "vs the kernel learned on B (not separated by the seeds (" in fn
    assert "The A kernel against the untrained one: better (-31.29% ± 5.37%, paired n=3, t=-5.8 > 4.30)." in fn
    assert "against the untrained one: not separated by the seeds (" in hh
    assert "not separated from" not in drops and "not separated by the seeds" in drops
    # Flexformer-N is lower on every seed (-11.6%, -31.4%, -15.0%), but three paired seeds need |t| > 4.30: t = -3.2
    assert absolute.startswith("- B test ppl with the A kernel, Flexformer-N 311.7 vs Hedgehog 378.7: not separated by the "
                               "seeds (") and "paired n=3, t=-3.2 <= 4.30)" in absolute
    # one seed: nothing is separated
    one_seed = [r for r in rows if r["seed"] == 1234]
    one = findings(summarize(one_seed, ("flexformer_n", "hedgehog")), one_seed)
    assert all("separated by the seeds" in line and "(separated" not in line for line in one[2:])
    assert "better (" not in one[0] and "worse (" not in one[0]
