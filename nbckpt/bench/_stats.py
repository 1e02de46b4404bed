"""The statistics behind every overhead nbckpt reports: 95 % intervals and the words for them.

Across repeats the interval is Student's t (:func:`t_interval`); with a single repeat it is a
seeded percentile bootstrap over that repeat's steps (:func:`bootstrap_overhead`), which sees
step-to-step noise only. An interval that contains 0 is "no measurable difference".
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from .._util import check_count

__all__ = [
    "BOOTSTRAP_RESAMPLES",
    "CONFIDENCE",
    "OVERHEAD_DEFINITION",
    "bootstrap_overhead",
    "interval_text",
    "measurable",
    "overhead_text",
    "t_interval",
    "t_quantile",
]

#: Confidence of every interval nbckpt reports.
CONFIDENCE = 0.95
BOOTSTRAP_RESAMPLES = 2000
#: The one definition of overhead: printed under every table nbckpt shows.
OVERHEAD_DEFINITION = (
    "Overhead: how much longer the training loop took than the `none` run of the same repeat, "
    "100 x (loop time / baseline loop time - 1), over the same steps and batches; save stalls "
    "(waits for an earlier write included) and steps slowed by background writes count, the "
    "final wait for the last checkpoint does not. Shown: the mean over repeats with its 95 % "
    "t-interval across repeats (one repeat: a bootstrap over steps, blind to drift between "
    "runs). An interval that contains 0 reads 'no measurable difference'."
)

# Two-sided 95 % quantiles of Student's t for 1 to 30 degrees of freedom.
_T975 = (
    12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
    2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086,
    2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042,
)
_Z975 = 1.959964


def t_quantile(df: int) -> float:
    """The 97.5 % quantile of Student's t with ``df`` degrees of freedom (a 95 % interval).

    Tabulated up to 30; beyond, the Cornish-Fisher expansion, within 1e-3 of the exact value.
    """
    check_count(df, "degrees of freedom")
    if df <= len(_T975):
        return _T975[df - 1]
    z = _Z975
    return z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)


def t_interval(values: Sequence[float]) -> tuple[float, float, float]:
    """``(mean, lo, hi)``: the mean of ``values`` and its 95 % t-interval (NaNs below 2 values)."""
    data = np.asarray([float(v) for v in values], dtype=float)
    if data.size == 0:
        return math.nan, math.nan, math.nan
    mean = float(data.mean())
    if data.size < 2:
        return mean, math.nan, math.nan
    half = t_quantile(int(data.size) - 1) * float(data.std(ddof=1)) / math.sqrt(data.size)
    return mean, mean - half, mean + half


def bootstrap_overhead(
    strategy_steps: Sequence[float],
    baseline_steps: Sequence[float],
    *,
    resamples: int = BOOTSTRAP_RESAMPLES,
    seed: int = 0,
) -> tuple[float, float, float]:
    """``(overhead, lo, hi)`` in % from the per-step times of one run and of its baseline.

    The point is ``100 * (mean(strategy) / mean(baseline) - 1)``; the interval is the 2.5th and
    97.5th percentile of that ratio over ``resamples`` resamplings (with replacement, each run's
    steps separately, seeded so that the same numbers give the same interval).
    """
    ours = np.asarray([float(v) for v in strategy_steps], dtype=float)
    theirs = np.asarray([float(v) for v in baseline_steps], dtype=float)
    if ours.size == 0 or theirs.size == 0 or not theirs.mean() > 0:
        return math.nan, math.nan, math.nan
    point = 100.0 * (float(ours.mean()) / float(theirs.mean()) - 1.0)
    rng = np.random.default_rng(seed)
    ours_means = ours[rng.integers(0, ours.size, (resamples, ours.size))].mean(axis=1)
    theirs_means = theirs[rng.integers(0, theirs.size, (resamples, theirs.size))].mean(axis=1)
    ratios = 100.0 * (ours_means / theirs_means - 1.0)
    lo, hi = np.percentile(ratios, [2.5, 97.5])
    return point, float(lo), float(hi)


def measurable(interval: Sequence[float] | None) -> bool:
    """True when a 95 % interval excludes 0: the difference it bounds was measured."""
    if interval is None or len(interval) != 2:
        return False
    lo, hi = (float(v) for v in interval)
    return math.isfinite(lo) and math.isfinite(hi) and (lo > 0 or hi < 0)


def interval_text(interval: Sequence[float] | None, unit: str = "%") -> str:
    """``[-3.1, +4.2] %`` style, or ``-`` where there is no interval."""
    if interval is None or len(interval) != 2:
        return "-"
    lo, hi = (float(v) for v in interval)
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return "-"
    return f"[{lo:+.1f}, {hi:+.1f}] {unit}".rstrip()


def overhead_text(row: Any) -> str:
    """A results row's overhead in words: ``+12.3 %``, ``no measurable difference``, ``baseline``,
    ``partial (left out)`` or ``-`` (no baseline measured)."""
    get = row.get if hasattr(row, "get") else lambda key, default=None: getattr(row, key, default)
    if bool(get("partial", False)):
        return "partial (left out)"
    if str(get("strategy", "")) == "none":
        return "baseline"
    pct = get("overhead_pct", math.nan)
    if pct is None or not math.isfinite(float(pct)):
        return "-"
    interval = get("overhead_ci_pct", None)
    if not measurable(interval):
        return "no measurable difference"
    return f"{float(pct):+.1f} %"
