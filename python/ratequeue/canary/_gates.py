"""Gates: compare a KPI of the candidate with the stable arm's, with confidence bounds.

A gate says, for a KPI where higher is worse:

* ``rollback`` when the candidate's *lower* bound exceeds ``(1 + threshold)`` times the
  stable arm's *upper* bound plus ``slack`` (both arms having ``min_sample``): the
  candidate is worse by more than the threshold even under the most favourable reading
  of the noise;
* ``pass`` when both arms have ``min_sample`` and the candidate's lower bound is within
  ``(1 + threshold)`` times stable's point estimate plus ``slack``: nothing suggests the
  threshold is crossed (noise in a small candidate sample does not hold the rollout);
* ``hold`` otherwise: too few samples, or the candidate is likely worse by more than
  the threshold but not yet beyond stable's upper bound.

The bounds are in :mod:`._stats` (order statistics for quantiles, CLT for means, Wilson
for shares), each one-sided at ``confidence``. The gates are checked again and again as
data comes in; a rollback needs the candidate beyond the threshold *and* both bounds to
agree, a margin that noise around equal arms crosses far less often than a plain
difference test would (the lab checks it: no false rollback in 100 seeded rollouts).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any, Literal

from ._kpi import ArmStats
from ._stats import Estimate, mean_bounds, quantile_bounds, wilson_bounds, z_of

__all__ = ["DEFAULT_GATES", "KPIS", "Gate", "GateResult", "Verdict"]

Verdict = Literal["rollback", "pass", "hold"]

#: KPI name -> how it is estimated.
KPIS: dict[str, str] = {
    "tokens_per_valid_answer": "median (order-statistic bounds)",
    "tokens_per_valid_answer_mean": "mean (CLT bounds)",
    "calls_per_request": "mean (CLT bounds)",
    "latency_p50": "median (order-statistic bounds)",
    "latency_p99": "p99 (order-statistic bounds)",
    "error_share": "share of requests (Wilson bounds)",
    "rate_limited_share": "share of calls (Wilson bounds)",
}


def _estimate(kpi: str, s: ArmStats, z: float) -> Estimate:
    with s._lock:
        requests, errors, calls, rate_limited = s.requests, s.errors, s.calls, s.rate_limited
        valid, tok, tok_sq, calls_sq = s.valid, s.tokens_valid, s.tokens_valid_sq, s.calls_sq
    # A histogram may hold a record or two more than the counters read just before.
    if kpi == "tokens_per_valid_answer":
        return quantile_bounds(s.tokens, 0.5, z, valid)
    if kpi == "latency_p50":
        return quantile_bounds(s.latency, 0.5, z, requests)
    if kpi == "latency_p99":
        return quantile_bounds(s.latency, 0.99, z, requests)
    if kpi == "tokens_per_valid_answer_mean":
        return mean_bounds(valid, float(tok), tok_sq, z)
    if kpi == "calls_per_request":
        return mean_bounds(requests, float(calls), calls_sq, z)
    if kpi == "error_share":
        return wilson_bounds(errors, requests, z)
    return wilson_bounds(rate_limited, calls, z)


@dataclass(frozen=True)
class Gate:
    """Roll back when ``kpi`` of the candidate is provably worse than stable's by more
    than ``threshold`` (relative) plus ``slack`` (absolute, in the KPI's unit)."""

    kpi: str
    threshold: float = 0.2
    min_sample: int = 100
    confidence: float = 0.99
    slack: float = 0.0

    def __post_init__(self) -> None:
        if self.kpi not in KPIS:
            raise ValueError(f"unknown KPI {self.kpi!r}; one of {sorted(KPIS)}")
        for name in ("threshold", "confidence", "slack"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v):
                raise TypeError(f"Gate {name}={v!r} must be a finite number")
        if self.threshold < 0 or self.slack < 0:
            raise ValueError("Gate threshold and slack must be >= 0")
        if not 0.5 < self.confidence < 1.0:
            raise ValueError(f"Gate confidence={self.confidence!r} must be in (0.5, 1)")
        m = self.min_sample
        if isinstance(m, bool) or not isinstance(m, int) or m < 1:
            raise ValueError(f"Gate min_sample={m!r} must be an integer >= 1")

    def check(self, stable: ArmStats, candidate: ArmStats) -> GateResult:
        """The verdict on the arms' records now, with its evidence."""
        z = z_of(self.confidence)
        s = _estimate(self.kpi, stable, z)
        c = _estimate(self.kpi, candidate, z)
        factor = 1.0 + self.threshold
        verdict: Verdict
        if s.n < self.min_sample or c.n < self.min_sample:
            verdict = "hold"
            why = f"sample {c.n} candidate / {s.n} stable < {self.min_sample}"
        elif c.lo > factor * s.hi + self.slack:
            verdict = "rollback"
            why = (
                f"candidate lower bound {c.lo:.4g} > {factor:g} x stable upper bound "
                f"{s.hi:.4g}" + (f" + {self.slack:g}" if self.slack else "")
            )
        elif c.lo <= factor * s.value + self.slack:
            verdict = "pass"
            why = f"candidate lower bound {c.lo:.4g} within {factor:g} x stable {s.value:.4g}"
        else:
            verdict = "hold"
            why = (
                f"candidate lower bound {c.lo:.4g} > {factor:g} x stable {s.value:.4g}, "
                "not yet beyond its upper bound"
            )
        ratio = c.value / s.value if s.value and math.isfinite(s.value) else math.nan
        return GateResult(self.kpi, verdict, why, s, c, ratio, self.threshold)


@dataclass(frozen=True)
class GateResult:
    """A gate's verdict and its evidence: both arms' estimates with bounds."""

    kpi: str
    verdict: Verdict
    reason: str
    stable: Estimate
    candidate: Estimate
    ratio: float
    threshold: float

    def to_dict(self) -> dict[str, Any]:
        """As plain values."""
        return {
            "kpi": self.kpi,
            "verdict": self.verdict,
            "reason": self.reason,
            "stable": self.stable.to_dict(),
            "candidate": self.candidate.to_dict(),
            "ratio": self.ratio if math.isfinite(self.ratio) else None,
            "threshold": self.threshold,
        }


#: The default gates: every KPI at 20 %; shares with 1 point of absolute slack, the p99
#: latency with a larger sample.
DEFAULT_GATES: tuple[Gate, ...] = (
    Gate("tokens_per_valid_answer"),
    Gate("tokens_per_valid_answer_mean"),
    Gate("calls_per_request"),
    Gate("error_share", slack=0.01),
    Gate("rate_limited_share", slack=0.01),
    Gate("latency_p50"),
    Gate("latency_p99", min_sample=300),
)
