"""studies.paired_stats: Student's t against closed forms and tables, and the paired / Welch choice."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from studies.paired_stats import compare, compare_runs, t_cdf, t_critical, t_quantile

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("t", [-7.5, -1.0, -0.2, 0.0, 0.3, 2.0, 40.0])
def test_t_cdf_matches_the_closed_forms_of_one_and_two_degrees_of_freedom(t: float) -> None:
    assert t_cdf(t, 1) == pytest.approx(0.5 + math.atan(t) / math.pi, abs=1e-12)  # Cauchy
    assert t_cdf(t, 2) == pytest.approx(0.5 + t / (2 * math.sqrt(2 + t * t)), abs=1e-12)


def test_two_sided_95_quantiles_match_the_table() -> None:
    # Student's t table, two-sided 95% (t_{0.975, df}), three decimals
    table = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
             12: 2.179, 15: 2.131, 20: 2.086, 25: 2.060, 30: 2.042}
    for df, value in table.items():
        assert t_critical(df) == pytest.approx(value, abs=5e-4), df
    assert t_critical(1e6) == pytest.approx(1.960, abs=5e-4)  # the normal limit
    # df = 2 in closed form: t = sqrt(2) (2p - 1) / sqrt(1 - (2p - 1)^2) at p = 0.975
    assert t_critical(2) == pytest.approx(math.sqrt(2) * 0.95 / math.sqrt(1 - 0.95**2), rel=1e-10)
    assert t_quantile(0.025, 7) == pytest.approx(-t_critical(7), rel=1e-12)
    # Welch's degrees of freedom are not whole: monotone between the neighbours
    assert t_critical(3) < t_critical(2.5) < t_critical(2)


def test_matching_seeds_are_paired_and_the_seed_effect_cancels() -> None:
    # b = a x 1.02 on every seed, over a 20% seed-to-seed spread: the means are far inside each other's
    # spread, the per-seed log-ratio is exactly log 1.02 each time
    a = {1234: 200.0, 1235: 240.0, 1236: 220.0}
    b = {s: v * 1.02 for s, v in a.items()}
    c = compare(b, a)
    assert c.method == "paired" and c.n == 3 and c.df == 2
    assert c.mean == pytest.approx(math.log(1.02)) and c.se == pytest.approx(0.0, abs=1e-15)
    assert c.separated and c.a_better is False and compare(a, b).a_better is True
    # paired, the known values of a small sample: log-ratios 0.01, 0.03, 0.02 -> mean 0.02, SE 0.01 / sqrt(3)
    b = {s: v * math.exp(r) for (s, v), r in zip(a.items(), (0.01, 0.03, 0.02))}
    c = compare(b, a)
    assert c.mean == pytest.approx(0.02) and c.se == pytest.approx(0.01 / math.sqrt(3))
    assert c.t == pytest.approx(2 * math.sqrt(3)) and not c.separated  # 3.46 <= 4.30 at 2 degrees of freedom
    assert c.describe() == "+2.00% ± 0.58%, paired n=3, t=3.5 <= 4.30"


def test_seeds_that_do_not_match_fall_back_to_welch_on_the_log_values() -> None:
    # logs 1, 2, 3, 4 against 2, 4, 6: Welch by hand: SE^2 = 1.6667/4 + 4/3 = 1.75,
    # df = 1.75^2 / ((1.6667/4)^2 / 3 + (4/3)^2 / 2) = 3.2347, t = -1.5 / sqrt(1.75)
    a = {s: math.exp(x) for s, x in zip((1, 2, 3, 4), (1.0, 2.0, 3.0, 4.0))}
    b = {s: math.exp(x) for s, x in zip((5, 6, 7), (2.0, 4.0, 6.0))}
    c = compare(a, b)
    assert c.method == "welch" and c.n == 3
    assert c.mean == pytest.approx(-1.5) and c.se == pytest.approx(math.sqrt(1.75))
    assert c.df == pytest.approx(1.75**2 / ((5 / 12) ** 2 / 3 + (4 / 3) ** 2 / 2))
    assert c.a_better is None and "welch n=3, df=3.2" in c.describe()
    # one shared seed is not a pairing: Welch on every value
    assert compare({1: 10.0, 2: 11.0, 3: 12.0}, {3: 13.0, 4: 14.0, 5: 15.0}).method == "welch"
    # two shared seeds are: paired on those two, the unmatched ones left out
    paired = compare({1: 10.0, 2: 11.0, 3: 12.0}, {2: 12.0, 3: 13.0, 4: 99.0})
    assert paired.method == "paired" and paired.n == 2 and paired.df == 1
    # a single value on a side: nothing to test
    single = compare({1: 10.0}, {2: 12.0, 3: 13.0})
    assert single.method == "none" and single.a_better is None and single.word() == "not tested against"
    with pytest.raises(ValueError, match="positive"):
        compare({1: 0.0, 2: 1.0}, {1: 1.0, 2: 1.0})


def test_rows_without_a_seed_are_never_paired() -> None:
    rows = [{"label": "a", "english_docs_valid_ppl": v} for v in (10.0, 12.0)]
    rows += [{"label": "b", "english_docs_valid_ppl": v} for v in (11.0, 13.0)]
    assert compare_runs(rows, "a", "b", "english_docs_valid_ppl").method == "welch"
    assert compare_runs(rows, "a", "missing", "english_docs_valid_ppl") is None


def test_study_v4_reproduces_the_issue_table() -> None:
    """Issue 46's table, from the stored v4 runs: Flexformer_n +2.50% ± 0.19% over Performer (t = 13),
    +8.9% ± 0.2% over softmax; the W=16 hybrid +1.82% ± 0.61% over Performer with the same window."""
    runs = REPO / "docs" / "results" / "kernel_study_v4" / "runs"
    rows = [json.loads(p.read_text())["row"] for p in sorted(runs.glob("*.json"))]
    metric = "english_docs_valid_ppl"
    c = compare_runs(rows, "flexformer_n", "performer", metric)
    assert (c.method, c.n) == ("paired", 3)
    assert round(100 * c.mean, 2) == 2.50 and round(100 * c.se, 2) == 0.19 and round(c.t) == 13 and c.a_better is False
    c = compare_runs(rows, "flexformer_n", "softmax", metric)
    assert round(100 * c.mean, 1) == 8.9 and round(100 * c.se, 1) == 0.2
    c = compare_runs(rows, "fn_window16_capped", "performer_window16_capped", metric)
    assert round(100 * c.mean, 2) == 1.82 and round(100 * c.se, 2) == 0.61 and c.a_better is None  # t = 3.0 < 4.30
