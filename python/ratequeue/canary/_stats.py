"""Confidence bounds that the gates compare: quantiles, means and shares.

* A quantile (the median, p99) gets a distribution-free bound from order statistics:
  among n samples, the number below the true q-quantile is Binomial(n, q), so the
  k-th smallest value X_(k) lies below the true quantile with probability
  P(Binomial(n, q) >= k); :func:`order_ranks` picks the ranks from the exact binomial
  up to n = 2000 (at least ``confidence``) and its normal approximation beyond
  (k = floor(nq -+ z*sqrt(nq(1-q)))). No assumption on the shape of the distribution;
  when the sample is too small for a rank the bound is 0 (lower) or +inf (upper), so a
  small sample can never trip a gate. The samples are read from a ``Histogram``
  (1 % relative error).
* A mean gets the normal (CLT) bound ``mean -+ z * s / sqrt(n)`` from exact sums.
* A share gets the Wilson score interval.

``z`` is the one-sided normal quantile of ``confidence``. Everything is deterministic:
the same records give the same bounds.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from statistics import NormalDist

from .._ratequeue import Histogram

__all__ = [
    "Estimate",
    "mean_bounds",
    "order_ranks",
    "quantile_bounds",
    "wilson_bounds",
    "z_of",
]


@dataclass(frozen=True)
class Estimate:
    """A point estimate with its confidence bounds (``lo <= value <= hi``) over ``n``."""

    value: float
    lo: float
    hi: float
    n: int

    def to_dict(self) -> dict[str, float | int | None]:
        """As plain numbers (infinite bounds as None)."""
        return {
            "value": _finite(self.value),
            "lo": _finite(self.lo),
            "hi": _finite(self.hi),
            "n": self.n,
        }


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


def z_of(confidence: float) -> float:
    """The one-sided standard normal quantile of ``confidence`` (0.5 < c < 1)."""
    return NormalDist().inv_cdf(confidence)


#: Up to this sample size the ranks come from the exact binomial distribution.
EXACT_UP_TO = 2000


@functools.lru_cache(maxsize=4096)
def order_ranks(n: int, q: float, z: float) -> tuple[int, int]:
    """Ranks (1-based) of the order statistics bounding the q-quantile of n samples.

    X_(k) <= the quantile when at least k samples fall below it: Binomial(n, q) >= k.
    With c = Phi(z): the lower rank is the largest k with P(Bin <= k - 1) <= 1 - c, the
    upper the smallest k with P(Bin <= k - 1) >= c, so each bound holds with probability
    at least c (exact for n <= EXACT_UP_TO, the normal approximation beyond). A rank
    below 1 or above n means no bound (0 or +inf).
    """
    if n > EXACT_UP_TO:
        spread = z * math.sqrt(n * q * (1.0 - q))
        return math.floor(n * q - spread), math.ceil(n * q + spread) + 1
    c = NormalDist().cdf(z)
    alpha = 1.0 - c
    lq, lp = math.log(q), math.log1p(-q)
    base = math.lgamma(n + 1)
    cdf = 0.0
    k_lo, k_hi = 0, n + 1
    for j in range(n + 1):  # cdf = P(Bin <= j) after the step
        cdf += math.exp(base - math.lgamma(j + 1) - math.lgamma(n - j + 1) + j * lq + (n - j) * lp)
        if cdf <= alpha:
            k_lo = j + 1
        if cdf >= c:
            k_hi = j + 1
            break
    return k_lo, k_hi


def quantile_bounds(h: Histogram, q: float, z: float, n: int | None = None) -> Estimate:
    """The q-quantile of the recorded values with order-statistic bounds.

    ``n`` is the histogram's count when the caller knows it (reading it scans the
    histogram); the three values are read in one pass.
    """
    if n is None:
        n = h.count
    if n == 0:
        return Estimate(math.nan, 0.0, math.inf, 0)
    k_lo, k_hi = order_ranks(n, q, z)
    # percentile(p) is the value of nearest rank ceil(p/100 * n): aim at k - 0.5 so
    # that rounding of p can never move the rank.
    qs = [100.0 * q]
    if k_lo >= 1:
        qs.append(100.0 * (k_lo - 0.5) / n)
    if k_hi <= n:
        qs.append(100.0 * (k_hi - 0.5) / n)
    values = h.percentiles(qs)
    value = values[0]
    lo = values[1] if k_lo >= 1 else 0.0
    hi = values[-1] if k_hi <= n else math.inf
    return Estimate(value, min(lo, value), max(hi, value), n)


def mean_bounds(n: int, total: float, total_sq: float, z: float) -> Estimate:
    """The mean of n values (their sum and sum of squares) with CLT bounds."""
    if n == 0:
        return Estimate(math.nan, 0.0, math.inf, 0)
    mean = total / n
    if n < 2:
        return Estimate(mean, 0.0, math.inf, n)
    var = max(0.0, (total_sq - n * mean * mean) / (n - 1))
    half = z * math.sqrt(var / n)
    return Estimate(mean, max(0.0, mean - half), mean + half, n)


def wilson_bounds(hits: int, n: int, z: float) -> Estimate:
    """The share hits/n with its Wilson score interval."""
    if n == 0:
        return Estimate(math.nan, 0.0, 1.0, 0)
    p = hits / n
    z2 = z * z
    denom = 1.0 + z2 / n
    centre = (p + z2 / (2 * n)) / denom
    half = z * math.sqrt(p * (1.0 - p) / n + z2 / (4 * n * n)) / denom
    # Clamped around p: rounding must not put a bound on the wrong side of it.
    return Estimate(p, min(p, max(0.0, centre - half)), max(p, min(1.0, centre + half)), n)
