"""One control interval's signals, as every controller sees them."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

__all__ = ["Window"]


@dataclass(frozen=True)
class Window:
    """What the level saw during one control interval ``[start, end)``.

    ``kind`` says what the limit counts: ``"rate"`` (a Limiter's rate: units per ``per``
    seconds, its own period) or ``"concurrency"`` (a Concurrency's holders; ``per`` 1).
    Latency figures are NaN when no sample arrived. ``inflight`` is the load in the
    limit's units: the peak number of holders for a concurrency limit; admissions per
    period for a rate, raised to the limit when requests waited or were refused (the
    limit, not the demand, bound it).
    ``gauges`` holds the backend's last readings (``queue_depth``, ``queue_capacity``,
    ``kv_cache``, ...), pushed or scraped.
    """

    start: float
    end: float
    kind: Literal["rate", "concurrency"]
    limit: float
    per: float = 1.0
    samples: int = 0
    rtt_mean: float = math.nan
    rtt_min: float = math.nan
    rtt_max: float = math.nan
    drops: int = 0
    inflight: float = 0.0
    arrivals: int = 0
    waiting: int = 0
    gauges: Mapping[str, float] = field(default_factory=dict)

    @property
    def duration(self) -> float:
        """Seconds covered (at least a nanosecond, so rates stay finite)."""
        return max(self.end - self.start, 1e-9)

    @property
    def throughput(self) -> float:
        """Completions (latency samples) per second."""
        return self.samples / self.duration

    @property
    def demand(self) -> float:
        """Arrivals seen by the Adaptive's acquire wrappers, per second."""
        return self.arrivals / self.duration

    @property
    def queue_fraction(self) -> float | None:
        """Backend queue depth over its capacity (``queue_depth / queue_capacity``, or the
        ``queue_fraction`` gauge), or None when the gauges do not say."""
        g = self.gauges
        if "queue_fraction" in g:
            return g["queue_fraction"]
        depth, cap = g.get("queue_depth"), g.get("queue_capacity")
        if depth is None or cap is None or not cap > 0:
            return None
        return depth / cap
