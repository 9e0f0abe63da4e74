"""The significance tests behind ``compare``'s verdicts, in plain Python (no SciPy).

An expected ordering ``better > worse`` is judged from the final metric of each seed:

* **held**: both entries have at least :data:`MIN_SEEDS` seeds, Welch's two-sample t-test finds the means different
  (two-sided ``p <`` :data:`ALPHA`) with ``better`` ahead, and ``better`` is above chance (a two-sided one-sample
  t-test of its seeds against the task's chance level, ``p <`` :data:`ALPHA`, on the right side);
* **did not hold**: the same, with ``worse`` significantly ahead and above chance;
* **inconclusive (...)** otherwise, with every reason that applies: ``one seed``, ``fewer than 3 seeds``,
  ``both at chance`` (whichever entry is ahead is not above chance; tested from 3 seeds on), ``within noise``
  (Welch's ``p >=`` 0.05; tested from 2 seeds on).

>>> judge([0.9, 0.92, 0.91], [0.5, 0.52, 0.49], higher_is_better=True, chance=0.1).verdict
'held'
>>> judge([0.073, 0.055], [0.055, 0.06], higher_is_better=True, chance=0.063).verdict
'inconclusive (fewer than 3 seeds, within noise)'
>>> judge([0.073, 0.055, 0.07], [0.055, 0.06, 0.058], higher_is_better=True, chance=0.063).verdict
'inconclusive (both at chance, within noise)'
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

__all__ = ["ALPHA", "MIN_SEEDS", "Judgement", "judge", "mean_var", "one_sample_t_test", "student_t_two_sided_p",
           "welch_t_test"]

#: significance level of both tests (two-sided)
ALPHA = 0.05
#: seeds each entry needs before an ordering can be called held (or not held)
MIN_SEEDS = 3


def _betacf(a: float, b: float, x: float) -> float:
    """The continued fraction of the regularized incomplete beta function (modified Lentz's method)."""
    tiny, eps = 1e-300, 1e-15
    qab, qap, qam = a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 500):
        m2 = 2 * m
        for numerator in (m * (b - m) * x / ((qam + m2) * (a + m2)),
                          -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))):
            d = 1.0 + numerator * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + numerator / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < eps:
            break
    return h


def _betainc(a: float, b: float, x: float) -> float:
    """The regularized incomplete beta function ``I_x(a, b)``."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _betacf(a, b, x) / a
    return 1.0 - front * _betacf(b, a, 1.0 - x) / b


def student_t_two_sided_p(t: float, df: float) -> float:
    """``P(|T| >= |t|)`` for Student's t distribution with ``df`` (real, > 0) degrees of freedom."""
    if math.isinf(t):
        return 0.0
    return _betainc(df / 2.0, 0.5, df / (df + t * t))


def mean_var(values: Sequence[float]) -> tuple[float, float]:
    """The mean and the sample variance (``n - 1``; 0 for a single value)."""
    mean = sum(values) / len(values)
    return mean, sum((v - mean) ** 2 for v in values) / max(1, len(values) - 1)


def welch_t_test(a: Sequence[float], b: Sequence[float]) -> tuple[float, float]:
    """Welch's two-sample t-test: ``(mean(a) - mean(b), two-sided p)``. Each sample needs two values or more.

    With no spread in either sample, ``p`` is 0 when the means differ and 1 when they are equal."""
    if len(a) < 2 or len(b) < 2:
        raise ValueError("Welch's t-test needs at least two values in each sample")
    (ma, va), (mb, vb) = mean_var(a), mean_var(b)
    diff = ma - mb
    sa, sb = va / len(a), vb / len(b)
    if sa + sb == 0.0:
        return diff, 0.0 if diff != 0.0 else 1.0
    df = (sa + sb) ** 2 / (sa ** 2 / (len(a) - 1) + sb ** 2 / (len(b) - 1))
    return diff, student_t_two_sided_p(diff / math.sqrt(sa + sb), df)


def one_sample_t_test(values: Sequence[float], mu: float) -> tuple[float, float]:
    """Student's one-sample t-test: ``(mean(values) - mu, two-sided p)``; at least two values."""
    if len(values) < 2:
        raise ValueError("a one-sample t-test needs at least two values")
    mean, var = mean_var(values)
    diff = mean - mu
    if var == 0.0:
        return diff, 0.0 if diff != 0.0 else 1.0
    return diff, student_t_two_sided_p(diff / math.sqrt(var / len(values)), len(values) - 1)


@dataclasses.dataclass(frozen=True)
class Judgement:
    """A verdict on ``better > worse``, Welch's ``p`` (None with fewer than two seeds) and the reasons it is
    inconclusive (empty when it is not)."""

    verdict: str
    p_value: float | None
    reasons: tuple[str, ...] = ()


def _above_chance(values: Sequence[float], chance: float | None, sign: float) -> bool | None:
    """Whether ``values`` are significantly on the good side of ``chance``; None when that is not tested (no chance
    level, or fewer than :data:`MIN_SEEDS` values: with two, the test is too weak to call a model at chance)."""
    if chance is None or len(values) < MIN_SEEDS:
        return None
    diff, p = one_sample_t_test(values, chance)
    return sign * diff > 0 and p < ALPHA


def judge(better: Sequence[float], worse: Sequence[float], *, higher_is_better: bool,
          chance: float | None = None) -> Judgement:
    """The verdict on the expected ordering ``better > worse`` from each entry's final metric per seed (see the
    module's docstring for the rule). ``chance`` is the metric of a model that ignores its input (None: not
    checked)."""
    if not better or not worse:
        raise ValueError("each entry needs at least one seed")
    sign = 1.0 if higher_is_better else -1.0
    seeds = min(len(better), len(worse))
    reasons: list[str] = []
    if seeds < 2:
        reasons.append("one seed")
    elif seeds < MIN_SEEDS:
        reasons.append(f"fewer than {MIN_SEEDS} seeds")
    p_value = None
    ahead = better if sign * (sum(better) / len(better) - sum(worse) / len(worse)) >= 0 else worse
    if _above_chance(ahead, chance, sign) is False:
        reasons.append("both at chance")
    if seeds >= 2:
        diff, p_value = welch_t_test(better, worse)
        if p_value >= ALPHA:
            reasons.append("within noise")
    if reasons:
        return Judgement(f"inconclusive ({', '.join(reasons)})", p_value, tuple(reasons))
    assert p_value is not None
    return Judgement("held" if sign * diff > 0 else "did not hold", p_value)
