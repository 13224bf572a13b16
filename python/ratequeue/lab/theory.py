"""Queueing theory to set beside the measurements.

Units: ``mu`` is the service rate of the queue in requests per **second** (a limit of
100 requests/minute is ``mu = 100/60``), ``rho = lambda/mu`` the utilisation, waits are
in seconds. The wait is the time in the queue (arrival to grant), not counting the
service (generation) time.

* M/M/1 (Poisson arrivals, exponential service): ``P(W > t) = rho*exp(-mu(1-rho)t)``, so
  the p-quantile is ``max(0, ln(rho/(1-p)) / (mu(1-rho)))`` and the mean
  ``rho/(mu(1-rho))``. This is the usual back-of-envelope model.
* M/D/1 (Poisson arrivals, deterministic service ``D = 1/mu``): the exact model of a
  token bucket of burst 1 fed by a queue. Mean ``rho/(2 mu (1-rho))``; the distribution
  is Erlang's (Crommelin's) formula, evaluated here in exact decimal arithmetic because
  the alternating series cancels catastrophically in floating point:
  ``P(W <= t) = (1-rho) sum_{k=0}^{floor(t/D)} e^{lambda(t-kD)} (lambda(kD-t))^k / k!``.
* A GCRA bucket of burst ``B`` grants request n at ``max(a_n, TAT - (B-1)D)`` while its
  TAT follows the M/D/1 recursion unchanged, so its wait is *exactly*
  ``max(0, W_MD1 - (B-1)D)``: the quantiles shift down by ``(B-1)/mu``.
"""

from __future__ import annotations

import functools
import math
from decimal import Decimal, localcontext

__all__ = [
    "md1_mean_wait",
    "md1_wait_cdf",
    "md1_wait_quantile",
    "mm1_mean_wait",
    "mm1_wait_quantile",
]


def _check(rho: float, mu: float) -> None:
    if not (0.0 <= rho < 1.0):
        raise ValueError(f"rho must be in [0, 1), got {rho!r}")
    if not (math.isfinite(mu) and mu > 0):
        raise ValueError(f"mu must be finite and > 0, got {mu!r}")


def _check_p(p: float) -> None:
    if not (0.0 <= p < 1.0):
        raise ValueError(f"p must be in [0, 1) (a quantile, e.g. 0.99), got {p!r}")


def mm1_wait_quantile(rho: float, mu: float, p: float) -> float:
    """M/M/1 queue wait p-quantile (seconds): ``max(0, ln(rho/(1-p)) / (mu(1-rho)))``."""
    _check(rho, mu)
    _check_p(p)
    if rho == 0.0:
        return 0.0
    return max(0.0, math.log(rho / (1.0 - p)) / (mu * (1.0 - rho)))


def mm1_mean_wait(rho: float, mu: float) -> float:
    """M/M/1 mean queue wait (seconds): ``rho / (mu (1-rho))``."""
    _check(rho, mu)
    return rho / (mu * (1.0 - rho))


def _md1_cdf_units(x: float, rho: float) -> float:
    """P(W <= x D) for M/D/1 with D = 1 and arrival rate rho (exact decimal sum)."""
    if x < 0:
        return 0.0
    if rho == 0.0:
        return 1.0
    n = math.floor(x)
    # Terms reach about e^(2 rho x); keep enough digits for ~20 significant in the sum.
    digits = int(2.0 * rho * x / math.log(10.0)) + 30
    with localcontext() as ctx:
        ctx.prec = digits
        r = Decimal(repr(rho))
        xd = Decimal(repr(x))
        total = Decimal(0)
        fact = Decimal(1)
        for k in range(n + 1):
            if k:
                fact *= k
            u = r * (xd - k)  # lambda (t - kD) >= 0
            term = u.exp() if k == 0 else u.exp() * (u**k) / fact
            total += -term if k % 2 else term
        value = (1 - r) * total
    return min(1.0, max(0.0, float(value)))


def md1_wait_cdf(t: float, rho: float, mu: float, burst: int = 1) -> float:
    """P(wait <= t) for M/D/1 (``burst=1``), or a GCRA bucket of burst ``burst``."""
    _check(rho, mu)
    if burst < 1:
        raise ValueError(f"burst must be >= 1, got {burst!r}")
    shift = (burst - 1) / mu
    if t < 0:
        return 0.0
    return _md1_cdf_units((t + shift) * mu, rho)


@functools.lru_cache(maxsize=4096)
def md1_wait_quantile(rho: float, mu: float, p: float, burst: int = 1) -> float:
    """M/D/1 queue wait p-quantile in seconds (bisection on the exact CDF).

    With ``burst > 1``, the wait of a GCRA bucket of that burst fed by a FIFO queue:
    the M/D/1 quantile less ``(burst-1)/mu`` (never below 0).
    """
    _check(rho, mu)
    _check_p(p)
    if burst < 1:
        raise ValueError(f"burst must be >= 1, got {burst!r}")
    if p <= 1.0 - rho:
        return 0.0  # P(W = 0) = 1 - rho
    lo, hi = 0.0, 1.0
    while _md1_cdf_units(hi, rho) < p:
        lo, hi = hi, hi * 2.0
        if hi > 1e7:
            return math.inf
    for _ in range(60):
        mid = (lo + hi) / 2.0
        if _md1_cdf_units(mid, rho) < p:
            lo = mid
        else:
            hi = mid
        if hi - lo <= 1e-7 * max(1.0, hi):
            break
    return max(0.0, hi / mu - (burst - 1) / mu)


def md1_mean_wait(rho: float, mu: float, burst: int = 1) -> float:
    """M/D/1 mean queue wait ``rho / (2 mu (1-rho))`` (seconds).

    With ``burst > 1``: ``E[max(0, W - s)] = E[W] - integral_0^s P(W > t) dt`` with
    ``s = (burst-1)/mu``, the integral by Gauss-Legendre on each unit of D.
    """
    _check(rho, mu)
    if burst < 1:
        raise ValueError(f"burst must be >= 1, got {burst!r}")
    mean_units = rho / (2.0 * (1.0 - rho))
    s = burst - 1
    if s == 0 or rho == 0.0:
        return mean_units / mu
    # 5-point Gauss-Legendre on [k, k+1]: the CDF is smooth between integers.
    nodes = (-0.9061798459386640, -0.5384693101056831, 0.0, 0.5384693101056831, 0.9061798459386640)
    weights = (
        0.2369268850561891,
        0.4786286704993665,
        0.5688888888888889,
        0.4786286704993665,
        0.2369268850561891,
    )
    integral = 0.0
    for k in range(s):
        for x, w in zip(nodes, weights, strict=True):
            t = k + 0.5 + 0.5 * x
            integral += 0.5 * w * (1.0 - _md1_cdf_units(t, rho))
    return max(0.0, mean_units - integral) / mu
