"""Confidence bounds that the gates compare: quantiles, means and shares.

* A quantile (the median, p99) gets a distribution-free bound from order statistics:
  among n samples, the number below the true q-quantile is Binomial(n, q), so the
  k-th smallest value X_(k) with k = floor(nq - z*sqrt(nq(1-q))) lies below the true
  quantile with probability about ``confidence`` (upper bound: k = ceil(nq +
  z*sqrt(nq(1-q))) + 1). No assumption on the shape of the distribution; when the
  sample is too small for a rank the bound is 0 (lower) or +inf (upper), so a small
  sample can never trip a gate. The samples are read from a ``Histogram``
  (1 % relative error).
* A mean gets the normal (CLT) bound ``mean -+ z * s / sqrt(n)`` from exact sums.
* A share gets the Wilson score interval.

``z`` is the one-sided normal quantile of ``confidence``. Everything is deterministic:
the same records give the same bounds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist

from .._ratequeue import Histogram

__all__ = ["Estimate", "mean_bounds", "quantile_bounds", "wilson_bounds", "z_of"]


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


def quantile_bounds(h: Histogram, q: float, z: float, n: int | None = None) -> Estimate:
    """The q-quantile of the recorded values with order-statistic bounds.

    ``n`` is the histogram's count when the caller knows it (reading it scans the
    histogram); the three values are read in one pass.
    """
    if n is None:
        n = h.count
    if n == 0:
        return Estimate(math.nan, 0.0, math.inf, 0)
    spread = z * math.sqrt(n * q * (1.0 - q))
    k_lo = math.floor(n * q - spread)
    k_hi = math.ceil(n * q + spread) + 1
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
