"""Prometheus export of Adaptive limits (needs ``ratequeue[prometheus]``).

Labelled by the Adaptive's ``name``:

- ``ratequeue_adaptive_limit`` (gauge) and its bounds ``ratequeue_adaptive_min_limit``,
  ``ratequeue_adaptive_max_limit`` (max omitted when unbounded);
- ``ratequeue_adaptive_changes_total`` (counter) by ``reason``;
- ``ratequeue_adaptive_refused_total`` (counter) by ``class``: refused before the level
  (a shed class) or by it (queue full, deadline);
- ``ratequeue_adaptive_shed`` (gauge, 1 while shed) by ``class``;
- ``ratequeue_adaptive_signal`` (gauge) by ``signal``: the last interval's samples,
  mean and min latency, drops, load, throughput, demand, waiting and every gauge;
- ``ratequeue_adaptive_scale_out_total`` (counter) by ``outcome`` (queue-depth policy).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import CollectorRegistry

from ._adaptive import Adaptive
from .controllers import QueueDepth

__all__ = ["AdaptiveCollector"]


class AdaptiveCollector:
    """A prometheus_client collector over Adaptive limits; a scrape never raises for them."""

    def __init__(self, *adaptives: Adaptive, registry: CollectorRegistry | None = None) -> None:
        self._items: list[Adaptive] = []
        for a in adaptives:
            self.add(a)
        if registry is not None:
            registry.register(self)

    def add(self, adaptive: Adaptive) -> None:
        """Export one more Adaptive (TypeError for anything else)."""
        if not isinstance(adaptive, Adaptive):
            raise TypeError(f"expected an Adaptive, got {type(adaptive).__name__}")
        self._items.append(adaptive)

    def describe(self) -> Iterable[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        limit = GaugeMetricFamily("ratequeue_adaptive_limit", "Current limit", labels=["name"])
        lo = GaugeMetricFamily("ratequeue_adaptive_min_limit", "Lowest limit", labels=["name"])
        hi = GaugeMetricFamily("ratequeue_adaptive_max_limit", "Highest limit", labels=["name"])
        changes = CounterMetricFamily(
            "ratequeue_adaptive_changes", "Limit changes by reason", labels=["name", "reason"]
        )
        refused = CounterMetricFamily(
            "ratequeue_adaptive_refused", "Requests refused by class", labels=["name", "class"]
        )
        shed = GaugeMetricFamily(
            "ratequeue_adaptive_shed", "1 while a class is shed", labels=["name", "class"]
        )
        signal = GaugeMetricFamily(
            "ratequeue_adaptive_signal", "Last interval's signals", labels=["name", "signal"]
        )
        scale = CounterMetricFamily(
            "ratequeue_adaptive_scale_out",
            "Scale-out requests by outcome",
            labels=["name", "outcome"],
        )
        for a in self._items:
            s = a.stats()
            name = str(s["name"])
            limit.add_metric([name], float(s["limit"]))
            lo.add_metric([name], float(s["min_limit"]))
            if math.isfinite(float(s["max_limit"])):
                hi.add_metric([name], float(s["max_limit"]))
            for reason, n in sorted(s["reasons"].items()):
                changes.add_metric([name, reason], float(n))
            for cls, n in sorted(s["refused"].items()):
                refused.add_metric([name, cls], float(n))
            shed_now = set(s["shed"])
            for cls in a.shed_order:
                shed.add_metric([name, cls], 1.0 if cls in shed_now else 0.0)
            for key, v in sorted(s["signals"].items()):
                if isinstance(v, (int, float)) and math.isfinite(v):
                    signal.add_metric([name, key], float(v))
            if isinstance(a.controller, QueueDepth):
                for outcome in ("requested", "failed", "error", "timed_out"):
                    scale.add_metric([name, outcome], float(a.controller.counts[outcome]))
        yield from (limit, lo, hi, changes, refused, shed, signal, scale)
