"""Smoke run of the kernel study v2: real data, a kind and an arm, two seeds, a few steps."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from evaluation.kernel_study import main
from evaluation.kernel_study_report import aggregate, beats, chi_density


@pytest.mark.slow
def test_kernel_study_smoke_writes_seed_aggregates_curves_and_spectrum(shared_data: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    argv = ["--steps", "3", "--kinds", "flexformer_n", "--arms", "fn_hybrid", "--seeds", "2",
            "--max-train-docs", "40", "--vocab-size", "512", "--hidden-size", "32", "--num-layers", "2",
            "--num-heads", "2", "--feature-dim", "16", "--seq-len", "64", "--micro-batch-size", "2",
            "--global-batch-size", "2", "--eval-tokens", "600", "--tokenizer-sentences", "5000",
            "--data-root", str(shared_data), "--work-dir", str(tmp_path / "work"), "--out", str(out)]
    rows = main(argv)
    assert [(r["label"], r["seed"]) for r in rows] == [
        (label, seed) for seed in (1234, 1235) for label in ("flexformer_n", "fn_hybrid")
    ]
    results = json.loads((out / "results.json").read_text())
    assert results["tokens_per_run"] == 3 * 2 * 64
    for run in results["runs"]:
        for key in ("english_docs_valid_ppl", "wikitext2_test_ppl", "english_docs_valid_bpb", "train_tokens_per_s"):
            assert math.isfinite(run[key]) and run[key] > 0, (run["label"], key)
        assert run["english_docs_valid_tokens"] == run["wikitext2_test_tokens"] == 599  # capped sets, EOD first
        # an untrained model over a 512-token vocabulary is near-uniform, never better than ~e^4
        assert 50 < run["english_docs_valid_ppl"] < 5000
        assert len(run["effective_keys"]) == 2  # the trainer's probe statistics, per layer
    by_label = {s["label"]: s for s in results["summary"]}
    assert by_label["fn_hybrid"]["seeds"] == 2 and by_label["fn_hybrid"]["english_docs_valid_ppl_std"] > 0
    runs = {(r["label"], r["seed"]): r for r in results["runs"]}
    assert len(runs["flexformer_n", 1234]["tau_per_layer"]) == 2
    assert runs["flexformer_n", 1235]["omega_rel_change"][0] > 0  # Omega trained
    assert "model.softmax_window=64" in runs["fn_hybrid", 1234]["overrides"]
    md = (out / "results.md").read_text()
    assert "--seeds 2" in md and "| fn_hybrid | 2 |" in md and "± " in md and "## Verdict" in md
    for png in ("loss_curves.png", "spectrum.png", "tau.png"):
        assert (out / png).stat().st_size > 5000


def test_aggregate_and_the_seed_noise_rule() -> None:
    rows = [{"label": "a", "kind": "elu", "english_docs_valid_ppl": v, "wikitext2_test_ppl": v + 1} for v in (10, 12, 14)]
    rows += [{"label": "b", "kind": "elu", "english_docs_valid_ppl": v, "wikitext2_test_ppl": v} for v in (20, 21, 22)]
    a, b = aggregate(rows)
    assert a["english_docs_valid_ppl_mean"] == pytest.approx(12.0) and a["english_docs_valid_ppl_std"] == pytest.approx(2.0)
    assert beats(a, b, "english_docs_valid_ppl") is True and beats(b, a, "english_docs_valid_ppl") is False
    close = aggregate([{**r, "label": "c", "english_docs_valid_ppl": r["english_docs_valid_ppl"] - 7} for r in rows[3:]])[0]
    assert beats(a, close, "english_docs_valid_ppl") is None  # 12 +- 2 vs 14 +- 1 over 3 seeds: noise
    single = aggregate(rows[:1])[0]
    assert single["english_docs_valid_ppl_std"] is None and beats(single, b, "english_docs_valid_ppl") is None


def test_chi_density_integrates_to_one_with_the_right_mean() -> None:
    import torch

    x = torch.linspace(1e-4, 20, 200001)
    dx = float(x[1] - x[0])
    for k in (1, 4, 32):
        pdf = chi_density(x, k)
        assert float(pdf.sum() * dx) == pytest.approx(1.0, abs=1e-3)
        mean = float((x.double() * pdf).sum() * dx)
        expected = math.sqrt(2) * math.exp(math.lgamma((k + 1) / 2) - math.lgamma(k / 2))
        assert mean == pytest.approx(expected, rel=1e-3)
