"""Comparing two study runs over seeds: paired per-seed log-ratios, Welch only where seeds differ.

Every run of a study with the same seed shares its data order and the initialisation of every
shared weight, so two kinds rank their seeds the same way and most of the seed-to-seed spread is
common to both. Comparing the means (an unpaired test) keeps that common spread in the error and
hides real gaps; the per-seed differences remove it. So ``compare`` measures

    r_s = log x_a(s) - log x_b(s)     for every seed s both runs have (x: a perplexity, > 0)

and reports the mean of r_s (100 x mean reads as "a is +2.5% over b"), its standard error
SE = std(r) / sqrt(n), t = mean / SE, and calls a and b separated when |t| exceeds the two-sided 95%
quantile of Student's t with n - 1 degrees of freedom (4.303 at n = 3: with three seeds "2 SE" is
far too lax). Where the runs share fewer than two seeds (other seed lists, rows without a seed)
it falls back to Welch's unpaired t on the log values of each run (Welch-Satterthwaite degrees of
freedom) and says so; with fewer than two values on a side nothing is claimed.

The t quantile is computed here (the regularised incomplete beta function by its continued
fraction, inverted by bisection), so the studies need no scipy.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Any, Hashable, Mapping, Sequence

CONFIDENCE = 0.95  # two-sided


# ------------------------------------------------------------------------------- Student's t
def _incomplete_beta(a: float, b: float, x: float) -> float:
    """The regularised incomplete beta function I_x(a, b) (continued fraction, modified Lentz)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    if x > (a + 1.0) / (a + b + 2.0):  # the fraction converges fast on this side only: use the symmetry
        return 1.0 - _incomplete_beta(b, a, 1.0 - x)
    log_front = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    tiny, c, d = 1e-300, 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    fraction = d
    for m in range(1, 500):
        for numerator in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
                          -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):
            d = 1.0 + numerator * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + numerator / c
            c = c if abs(c) > tiny else tiny
            fraction *= c * d
        if abs(c * d - 1.0) < 1e-15:
            break
    return math.exp(log_front) * fraction / a


def t_cdf(t: float, df: float) -> float:
    """P(T <= t) for Student's t with ``df`` (> 0, not necessarily whole) degrees of freedom."""
    if not df > 0:
        raise ValueError(f"df: expected > 0, got {df!r}")
    tail = 0.5 * _incomplete_beta(df / 2.0, 0.5, df / (df + t * t))  # P(T > |t|)
    return 1.0 - tail if t > 0 else tail


def t_quantile(p: float, df: float) -> float:
    """The ``p`` quantile of Student's t with ``df`` degrees of freedom (bisection on ``t_cdf``)."""
    if not 0.0 < p < 1.0:
        raise ValueError(f"p: expected in (0, 1), got {p!r}")
    if p < 0.5:
        return -t_quantile(1.0 - p, df)
    lo, hi = 0.0, 1.0
    while t_cdf(hi, df) < p:
        hi *= 2.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if t_cdf(mid, df) < p:
            lo = mid
        else:
            hi = mid
        if hi - lo <= 1e-12 * hi:
            break
    return 0.5 * (lo + hi)


def t_critical(df: float, confidence: float = CONFIDENCE) -> float:
    """Two-sided critical value: |T| exceeds it with probability 1 - ``confidence`` (df = 2: 4.303)."""
    return t_quantile(0.5 + confidence / 2.0, df)


# ------------------------------------------------------------------------------- comparisons
@dataclass(frozen=True)
class Comparison:
    """a against b on one metric (lower is better). ``method``: "paired" (the seeds both have),
    "welch" (seeds that do not match) or "none" (fewer than two values on a side)."""

    method: str
    n: int  # paired: shared seeds; welch: the smaller run's seed count; none: values available
    mean: float  # mean log(a / b): paired, the mean per-seed log-ratio; welch, the gap of the mean logs
    se: float | None = None
    df: float | None = None

    @property
    def t(self) -> float | None:
        if self.se is None:
            return None
        if self.se == 0.0:
            return 0.0 if self.mean == 0.0 else math.copysign(math.inf, self.mean)
        return self.mean / self.se

    @property
    def t_crit(self) -> float | None:
        return None if self.df is None else t_critical(self.df)

    @property
    def separated(self) -> bool:
        return self.t is not None and abs(self.t) > self.t_crit

    @property
    def a_better(self) -> bool | None:
        """True/False when the seeds separate a from b (a lower / higher), None when they do not."""
        return (self.mean < 0) if self.separated else None

    def word(self) -> str:
        """'better than' / 'worse than' / 'not separated from' / 'not tested against' (a against b)."""
        if self.method == "none":
            return "not tested against"
        return {True: "better than", False: "worse than", None: "not separated from"}[self.a_better]

    def describe(self) -> str:
        """E.g. '+2.50% ± 0.19%, paired n=3, t=13.0 > 4.30' (100 x log-ratio, its SE, the test)."""
        if self.method == "none":
            return f"{100 * self.mean:+.2f}%, n={self.n}"
        test = f"t={self.t:.1f} {'>' if self.separated else '<='} {self.t_crit:.2f}"
        df = f", df={self.df:.1f}" if self.method == "welch" else ""
        return f"{100 * self.mean:+.2f}% ± {100 * self.se:.2f}%, {self.method} n={self.n}{df}, {test}"


def compare(a: Mapping[Hashable, float], b: Mapping[Hashable, float]) -> Comparison:
    """a against b from their values per seed (``{seed: perplexity}``, every value > 0): paired on
    the seeds both have when there are at least two, else Welch on each run's own values."""
    if not a or not b:
        raise ValueError(f"compare: expected values on both sides, got {len(a)} and {len(b)}")
    if any(not v > 0 for v in (*a.values(), *b.values())):
        raise ValueError("compare: expected positive values (log-ratios)")
    shared = [s for s in a if s in b]
    if len(shared) >= 2:
        diffs = [math.log(a[s]) - math.log(b[s]) for s in shared]
        n = len(diffs)
        return Comparison("paired", n, statistics.fmean(diffs), statistics.stdev(diffs) / math.sqrt(n), n - 1)
    la, lb = [math.log(v) for v in a.values()], [math.log(v) for v in b.values()]
    gap = statistics.fmean(la) - statistics.fmean(lb)
    if len(la) < 2 or len(lb) < 2:
        return Comparison("none", min(len(la), len(lb)), gap)
    va, vb = statistics.variance(la) / len(la), statistics.variance(lb) / len(lb)
    se = math.sqrt(va + vb)
    if se == 0.0:  # no spread on either side: nothing for Welch's df to weigh; the smaller run's n - 1
        return Comparison("welch", min(len(la), len(lb)), gap, 0.0, min(len(la), len(lb)) - 1)
    df = (va + vb) ** 2 / (va**2 / (len(la) - 1) + vb**2 / (len(lb) - 1))
    return Comparison("welch", min(len(la), len(lb)), gap, se, df)


def per_seed(rows: Sequence[Mapping[str, Any]], label: str, metric: str) -> dict[Hashable, float]:
    """``{seed: row[metric]}`` of ``label``'s rows that have the metric; a row without a seed gets a
    key no other run shares (it can only be compared unpaired)."""
    out: dict[Hashable, float] = {}
    for i, row in enumerate(rows):
        if row.get("label") == label and row.get(metric) is not None:
            out[row["seed"] if row.get("seed") is not None else ("unseeded", label, i)] = row[metric]
    return out


def compare_runs(rows: Sequence[Mapping[str, Any]], a: str, b: str, metric: str) -> Comparison | None:
    """``compare`` of the runs labelled ``a`` and ``b`` in ``rows`` on ``metric``; None when one has no value."""
    va, vb = per_seed(rows, a, metric), per_seed(rows, b, metric)
    return compare(va, vb) if va and vb else None


RULE = ("paired by seed: mean ± SE of the per-seed log-ratio (x 100, in %), separated when |t| exceeds the "
        f"two-sided {100 * CONFIDENCE:.0f}% t quantile for n - 1 degrees of freedom (4.30 at n = 3); Welch's "
        "unpaired t on the log values only where the seeds do not match (marked welch); fewer than two values "
        "on a side: not tested")
