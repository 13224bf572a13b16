"""Measurements of one strategy at one load level, kept in ratequeue Histograms."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from .._ratequeue import Histogram

__all__ = ["HISTOGRAM_TOP", "QUANTILES", "Request", "Row", "StrategyRun", "Workload"]

QUANTILES = (50.0, 95.0, 99.0)
HISTOGRAM_TOP = 10_000.0  # seconds: the top of ratequeue.Histogram's range


@dataclass(frozen=True, slots=True)
class Request:
    """One arrival: its time, its service (generation) time and its class."""

    index: int
    t: float
    service: float
    cls: str = "batch"


@dataclass(frozen=True)
class Workload:
    """The arrivals of one run, shared by every strategy compared on it.

    ``duration`` is the span of the arrivals (the last one's time). Requests arriving
    before ``warmup_until`` are simulated but not measured (the queue starts empty;
    measuring from a warm queue compares with steady-state theory).
    """

    requests: tuple[Request, ...]
    rate: float  # mean arrivals per second asked for
    duration: float
    warmup_until: float = 0.0

    def measured(self, req: Request) -> bool:
        return req.t >= self.warmup_until


@dataclass
class Row:
    """One line of a table: a strategy (or one class of it) at one load level."""

    strategy: str
    label: str
    requests: int = 0
    served: int = 0
    shed: int = 0
    calls: int = 0
    rejected_calls: int = 0
    wait: Histogram = field(default_factory=Histogram)
    latency: Histogram = field(default_factory=Histogram)
    # Exact extremes and sums: the histogram's range ends at HISTOGRAM_TOP seconds, and a
    # naive retry loop can keep a request waiting longer than that.
    wait_max: float = 0.0
    wait_sum: float = 0.0
    latency_max: float = 0.0
    latency_sum: float = 0.0

    def record_served(self, wait: float, latency: float, calls: int, rejected: int) -> None:
        wait = max(0.0, wait)
        latency = max(0.0, latency)
        self.requests += 1
        self.served += 1
        self.calls += calls
        self.rejected_calls += rejected
        self.wait.record(wait)
        self.latency.record(latency)
        self.wait_max = max(self.wait_max, wait)
        self.wait_sum += wait
        self.latency_max = max(self.latency_max, latency)
        self.latency_sum += latency

    def record_shed(self, calls: int, rejected: int) -> None:
        self.requests += 1
        self.shed += 1
        self.calls += calls
        self.rejected_calls += rejected

    @property
    def shed_share(self) -> float:
        return self.shed / self.requests if self.requests else 0.0

    @property
    def calls_per_request(self) -> float:
        return self.calls / self.requests if self.requests else 0.0

    def summary(self) -> dict[str, Any]:
        """Plain numbers (seconds, shares) for tables, JSON and CSV."""
        out: dict[str, Any] = {
            "strategy": self.strategy,
            "label": self.label,
            "requests": self.requests,
            "served": self.served,
            "shed": self.shed,
            "shed_share": self.shed_share,
            "calls": self.calls,
            "rejected_calls": self.rejected_calls,
            "calls_per_request": self.calls_per_request,
        }
        for name, h, top, total in (
            ("wait", self.wait, self.wait_max, self.wait_sum),
            ("latency", self.latency, self.latency_max, self.latency_sum),
        ):
            if h.count:
                ps = h.percentiles(list(QUANTILES))
                # A percentile in the histogram's overflow is only known to be >= the top.
                ps = [math.inf if v >= HISTOGRAM_TOP * 0.99 and h.overflow else v for v in ps]
                out.update({f"{name}_p{q:g}": v for q, v in zip(QUANTILES, ps, strict=True)})
                out[f"{name}_max"] = top
                out[f"{name}_mean"] = total / h.count
            else:
                out.update({f"{name}_p{q:g}": math.nan for q in QUANTILES})
                out[f"{name}_max"] = math.nan
                out[f"{name}_mean"] = math.nan
        return out


@dataclass
class StrategyRun:
    """What one strategy did on one workload: its rows and anything else worth keeping."""

    rows: list[Row]
    info: dict[str, Any] = field(default_factory=dict)
