"""How nbckpt turns loop times into an overhead with a 95 % interval: the one statement of the method.

Every table, figure, log line and sentence that shows an overhead or a drag computes it here.

**Pairs.** In a repeat every strategy is open at once and they take turns every checkpoint
cycle: the checkpoint due at its start, ``every`` training steps, and the wait for that
checkpoint's write before the next strategy's turn. A *cycle pair* is one cycle of a strategy
and the same cycle (same steps, same batches) of the ``none`` baseline of the same repeat,
trained seconds apart, so that a burst of other work falls on both. The first cycle (no
checkpoint before step 1) and the final one (the last checkpoint and its write, no steps) are
joined into one pair, so that every pair holds one checkpoint and its write.

**Overhead.** Each pair gives ``d = ln(loop time / baseline loop time)``; the overhead is
``100 * (exp(mean d) - 1) %``. The interval is computed for the mean of ``d`` and transformed:
it never reaches below -100 %, and is as wide for a 10x slowdown as for a 10x speed-up.

**Cycles and repeats.** Cycles of one repeat share its objects, files and moment on the
machine: counting them as independent makes an interval too narrow. ``d`` is read as
``mu + a(repeat) + e(cycle)`` (:func:`clustered_mean`):

- when the repeats' means differ no more than their cycles would make them (between-repeat mean
  square at most the within-repeat one), every cycle counts: t with ``cycles - 1`` degrees of
  freedom (11 for 3 repeats of 4 cycles), which makes 3 repeats enough on a busy machine;
- when they differ more, the interval rests on the repeats: the cluster-robust variance of the
  mean, t with ``repeats - 1`` degrees of freedom (wide, as it must be);
- when they differ although every repeat shows the change on its own (its mean more than a
  t-quantile of standard errors from 0, on the same side, the within-repeat variance pooled: an
  intersection-union test at the 5 % level), the cost varies by a factor between repeats, and
  the interval is the t-interval (``repeats - 1`` df) of the repeats' ln extra time,
  ``ln(exp(d) - 1)``, read back as an overhead. Beside a spinning core torch-save's repeats were
  2.6x, 14.5x and 4.9x slower than ``none``: +469 % [+31, +6232] %, where a t over the repeats
  says [-34, +4805] %.

For equal cycles per repeat the first two are what a REML fit of that model gives. In simulated
runs of 3 repeats of 4 cycles with this project's measured noise, the interval covered the true
overhead in 89-93 % or more of them and found a 2x slowdown in 86-99 %. A stopped cycle is left
out; the run's other cycles count.

**One repeat** cannot show how much repeats disagree. Its interval allows for a between-repeat
spread at least as large as one cycle's and as repeats were seen to disagree on a busy 2-core
machine (torch-save 7, 12 and 21 times slower than ``none``: 0.55 in ``d``,
:data:`ONE_REPEAT_SPREAD`): ``var = max(s^2, 0.55^2) + s^2/cycles``, t with ``cycles - 1`` df.
Fewer data never give a firmer verdict: one repeat is never firmer than three.

**Verdict.** An overhead is measurable when its 95 % interval excludes 0. Tables show the
estimate and its interval always, "no measurable difference" only beside an interval that
contains 0, each repeat's overhead and what the row rests on.

**Drag** is the loop time a cycle with a checkpoint lost beyond its stall, against the
baseline's same cycle: ``(loop - baseline loop) - stall`` per checkpoint, in seconds, with the
same interval. Background work can only slow steps down: where the interval contains 0 the
table says "noise", where it is all below 0 "below 0", a measurement problem.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .._util import check_count

__all__ = [
    "CONFIDENCE",
    "ONE_REPEAT_SPREAD",
    "OVERHEAD_DEFINITION",
    "OVERHEAD_METHOD",
    "Clustered",
    "clustered_mean",
    "drag_text",
    "interval_text",
    "measurable",
    "overhead_text",
    "per_repeat_text",
    "t_interval",
    "t_quantile",
]

#: Confidence of every interval nbckpt reports.
CONFIDENCE = 0.95
#: The least between-repeat standard deviation (of ln loop-time ratios) a single repeat's
#: interval allows for: the spread of torch-save's three repeats (7x, 12x, 21x slower than
#: ``none``) on a busy shared 2-core machine (issue 21).
ONE_REPEAT_SPREAD = 0.55
#: The method in full: this module's docstring (``print(nbckpt.bench.OVERHEAD_METHOD)``).
OVERHEAD_METHOD: str = __doc__ or ""
#: The definition printed under every table nbckpt shows.
OVERHEAD_DEFINITION = (
    "Overhead: the ratio of the training loop's time to that of the `none` baseline trained beside "
    "it, 100 x (ratio - 1) %, paired per checkpoint cycle (same steps and batches, the strategies "
    "taking turns every cycle) and averaged in log space. Stalls, steps slowed by background "
    "writes and the wait for the last write count. 95 % interval: the cycles of all repeats count "
    "when the repeats agree, the repeats alone when they do not; one repeat is never firmer than "
    "three. 'no measurable difference': the interval contains 0 (where every repeat fell on one "
    "side of 0, further from it than the interval reaches past it, the table says so instead). Method: "
    "print(nbckpt.bench.OVERHEAD_METHOD)."
)

# Two-sided 95 % quantiles of Student's t for 1 to 30 degrees of freedom.
_T975 = (
    12.706,
    4.303,
    3.182,
    2.776,
    2.571,
    2.447,
    2.365,
    2.306,
    2.262,
    2.228,
    2.201,
    2.179,
    2.160,
    2.145,
    2.131,
    2.120,
    2.110,
    2.101,
    2.093,
    2.086,
    2.080,
    2.074,
    2.069,
    2.064,
    2.060,
    2.056,
    2.052,
    2.048,
    2.045,
    2.042,
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


@dataclass(frozen=True)
class Clustered:
    """The mean of values grouped by repeat, with its 95 % interval (see the module doc)."""

    mean: float
    lo: float
    hi: float
    repeats: int
    cycles: int
    df: int
    """Degrees of freedom of the t quantile (0: no interval)."""
    basis: str
    """``pooled`` (repeats agree), ``repeats`` (they disagree), ``every repeat`` (they disagree,
    but each shows the change on its own), ``one repeat`` or ``none``."""
    repeat_means: tuple[float, ...]

    @property
    def method(self) -> str:
        """How the interval was made, in words (the ``overhead_method`` column)."""
        text = _METHODS.get(self.basis, "no interval: fewer than 2 cycle pairs")
        return text.format(repeats=self.repeats, df=self.df)


_METHODS = {
    "pooled": "cycles pooled: the {repeats} repeats agree (they differ no more than their cycles "
    "do); t with {df} df",
    "repeats": "{repeats} repeats: they disagree more than their cycles do; cluster-robust t with {df} df",
    "one repeat": "one repeat: its cycles, widened for the disagreement between repeats that one "
    "repeat cannot show; t with {df} df",
    "every repeat": "every one of the {repeats} repeats shows it on its own cycles, but they "
    "disagree on its size: t with {df} df on the log of their extra time",
}


def clustered_mean(
    groups: Sequence[Sequence[float]],
    *,
    one_repeat_spread: float = ONE_REPEAT_SPREAD,
    log_ratios: bool = False,
) -> Clustered:
    """The mean of all values of ``groups`` (one group per repeat, one value per cycle) and its
    95 % interval, cycles clustered by repeat as this module's doc states.

    ``one_repeat_spread`` is the least between-repeat standard deviation a single group's
    interval allows for, in the values' units (drag, in seconds, passes 0: its allowance is
    then its cycles' own spread). ``log_ratios``: the values are ln loop-time ratios, and
    repeats that each show the same change on their own but disagree on its size get the
    interval of their extra time (see the module doc). Non-finite values and empty groups are
    dropped. Fewer than two values give no interval.
    """
    kept = [np.asarray([float(v) for v in group if math.isfinite(float(v))], dtype=float) for group in groups]
    kept = [group for group in kept if group.size]
    sizes = np.asarray([group.size for group in kept], dtype=float)
    total = int(sizes.sum())
    means = tuple(float(group.mean()) for group in kept)
    if total == 0:
        return Clustered(math.nan, math.nan, math.nan, 0, 0, 0, "none", ())
    values = np.concatenate(kept)
    mean = float(values.mean())
    repeats = len(kept)
    if total < 2:
        return Clustered(mean, math.nan, math.nan, repeats, total, 0, "none", means)
    if repeats == 1:
        cycle_variance = float(values.var(ddof=1))
        variance = max(cycle_variance, one_repeat_spread**2) + cycle_variance / total
        return _interval(mean, variance, total - 1, repeats, total, "one repeat", means)
    between = float(np.sum(sizes * (np.asarray(means) - mean) ** 2)) / (repeats - 1)
    within_df = total - repeats
    within = (
        float(sum(np.sum((group - group.mean()) ** 2) for group in kept)) / within_df
        if within_df > 0
        else math.inf
    )
    if within_df > 0 and between <= within:
        variance = float(values.var(ddof=1)) / total
        return _interval(mean, variance, total - 1, repeats, total, "pooled", means)
    # Cluster-robust (CR1) variance of the mean: each repeat's summed deviation counts once.
    spread = float(np.sum((sizes * (np.asarray(means) - mean)) ** 2))
    variance = spread / total**2 * repeats / (repeats - 1)
    clustered = _interval(mean, variance, repeats - 1, repeats, total, "repeats", means)
    if log_ratios and not (clustered.lo > 0 or clustered.hi < 0):
        return _every_repeat(kept, clustered) or clustered
    return clustered


def _every_repeat(groups: list[np.ndarray], clustered: Clustered) -> Clustered | None:
    """Where each repeat's own cycles show the same change (its mean is more than a t-quantile
    of standard errors from 0, on the same side, the within-repeat variance pooled: an
    intersection-union test, level 5 %) but the repeats disagree on its size: the interval of
    the mean of the repeats' ln |extra time| (exp(d) - 1), t with repeats - 1 df, read back as
    ln ratios. None where some repeat does not show it on its own."""
    total = sum(group.size for group in groups)
    within_df = total - len(groups)
    if within_df < 1:
        return None
    within = float(sum(np.sum((group - group.mean()) ** 2) for group in groups)) / within_df
    sides = set()
    for group in groups:
        half = t_quantile(within_df) * math.sqrt(within / group.size)
        if abs(float(group.mean())) <= half:
            return None
        sides.add(math.copysign(1.0, float(group.mean())))
    if len(sides) != 1:
        return None
    (sign,) = sides
    extra = [math.log(abs(math.expm1(float(group.mean())))) for group in groups]
    _, low, high = t_interval(extra)
    if sign > 0:
        lo, hi = math.log1p(math.exp(low)), math.log1p(math.exp(high))
    else:  # a speed-up: the extra time is negative, at most the whole loop
        lo = math.log1p(-math.exp(high)) if math.exp(high) < 1 else -math.inf
        hi = math.log1p(-math.exp(low)) if math.exp(low) < 1 else -math.inf
    lo, hi = min(lo, clustered.mean), max(hi, clustered.mean)  # the estimate lies within
    return Clustered(
        clustered.mean,
        lo,
        hi,
        clustered.repeats,
        clustered.cycles,
        clustered.repeats - 1,
        "every repeat",
        clustered.repeat_means,
    )


def _interval(
    mean: float, variance: float, df: int, repeats: int, cycles: int, basis: str, means: tuple[float, ...]
) -> Clustered:
    half = t_quantile(df) * math.sqrt(max(variance, 0.0))
    return Clustered(mean, mean - half, mean + half, repeats, cycles, df, basis, means)


def measurable(interval: Sequence[float] | None) -> bool:
    """True when a 95 % interval excludes 0: the difference it bounds was measured."""
    if interval is None or len(interval) != 2:
        return False
    lo, hi = (float(v) for v in interval)
    return math.isfinite(lo) and math.isfinite(hi) and (lo > 0 or hi < 0)


def interval_text(interval: Sequence[float] | None, unit: str = "%", digits: int = 1) -> str:
    """``[-3.1, +4.2] %`` style, or ``-`` where there is no interval."""
    if interval is None or len(interval) != 2:
        return "-"
    lo, hi = (float(v) for v in interval)
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return "-"
    return f"[{lo:+.{digits}f}, {hi:+.{digits}f}] {unit}".rstrip()


def _number(value: Any) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


def overhead_text(row: Mapping[Any, Any]) -> str:
    """A results row's overhead: ``+12.3 %``, ``+1.5 % (no measurable difference)`` where the
    interval contains 0, ``baseline`` for ``none``, ``-`` where nothing could be paired."""
    if str(row.get("strategy", "")) == "none":
        return "baseline"
    pct = _number(row.get("overhead_pct", math.nan))
    if not math.isfinite(pct):
        return "-"
    text = f"{pct:+.1f} %"
    if not measurable(row.get("overhead_ci_pct")):
        text += f" ({_unmeasured(row)})"
    return text


def _unmeasured(row: Mapping[Any, Any]) -> str:
    """Why an interval containing 0 was not a measured difference. Where every repeat fell on one
    side of 0, each further from 0 than the interval reaches past it (a wide interval on a busy
    machine: [-20.5, +1127] % with every repeat +66 % or more), that is said; else no difference."""
    repeats = [_number(v) for v in (row.get("overhead_by_repeat_pct") or [])]
    repeats = [v for v in repeats if math.isfinite(v)]
    interval = row.get("overhead_ci_pct")
    if len(repeats) >= 2 and interval is not None and len(interval) == 2:
        lo, hi = (_number(v) for v in interval)
        if all(v > max(-lo, 0.0) for v in repeats) or all(v < min(-hi, 0.0) for v in repeats):
            side = "above" if repeats[0] > 0 else "below"
            return f"every repeat {side} 0; the interval is too wide to say how far"
    return "no measurable difference"


def per_repeat_text(row: Mapping[Any, Any]) -> str:
    """Each repeat's overhead, ``+10.1, +12.0, +14.2 %``, so a reader sees whether they agree."""
    values = [_number(v) for v in (row.get("overhead_by_repeat_pct") or [])]
    shown = [f"{v:+.1f}" for v in values if math.isfinite(v)]
    return ", ".join(shown) + " %" if shown else "-"


def drag_text(row: Mapping[Any, Any]) -> str:
    """A row's drag per checkpoint: ``+0.0123 s`` where measurable, ``noise`` (with the point
    and interval) where its interval contains 0, ``below 0: measurement problem`` where the
    whole interval is below 0, ``-`` where not measured."""
    drag = _number(row.get("drag_s", math.nan))
    if not math.isfinite(drag):
        return "-"
    interval = row.get("drag_ci_s")
    span = interval_text(interval, "s", digits=4)
    if interval is None or not measurable(interval):
        return f"noise ({drag:+.4f} s, {span})" if span != "-" else f"{drag:+.4f} s (no interval)"
    if _number(interval[1]) < 0:
        return f"below 0: measurement problem ({drag:+.4f} s, {span})"
    return f"{drag:+.4f} s"
