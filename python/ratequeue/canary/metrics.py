"""Prometheus export of canary rollouts (needs ``ratequeue[prometheus]``).

Labelled by the Canary's ``name`` (and ``arm``: stable, candidate):

- ``ratequeue_canary_fraction`` (gauge): the candidate's share of users now;
- ``ratequeue_canary_stage`` (gauge): index of the current stage;
- ``ratequeue_canary_state`` (gauge, 1 for the current one) by ``state``;
- ``ratequeue_canary_decisions_total`` (counter) by ``action``;
- ``ratequeue_canary_requests_total``, ``..._errors_total``, ``..._valid_total``,
  ``..._calls_total``, ``..._rate_limited_calls_total``, ``..._tokens_total`` (counters)
  by ``arm``;
- ``ratequeue_canary_kpi`` (gauge) by ``arm`` and ``kpi``: every KPI that has a value;
- ``ratequeue_canary_shadow_dropped_total`` (counter): copies dropped, the queue full.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import CollectorRegistry

from ._canary import Canary

__all__ = ["CanaryCollector"]

_COUNTERS = (
    ("requests", "requests", "User requests by arm"),
    ("errors", "errors", "User requests that failed, by arm"),
    ("valid", "valid", "Valid answers by arm"),
    ("calls", "calls", "Upstream calls by arm"),
    ("rate_limited_calls", "rate_limited_calls", "Upstream calls rate limited, by arm"),
    ("tokens", "tokens", "Tokens used by arm"),
)
_KPIS = (
    "rate_limited_share",
    "error_share",
    "latency_p50",
    "latency_p99",
    "tokens_per_valid_answer",
    "tokens_per_valid_answer_mean",
    "quota_per_valid_answer",
    "calls_per_request",
)
_STATES = ("running", "rolled_back", "complete")


class CanaryCollector:
    """A prometheus_client collector over canaries; a scrape never raises for them."""

    def __init__(self, *canaries: Canary, registry: CollectorRegistry | None = None) -> None:
        self._items: list[Canary] = []
        for c in canaries:
            self.add(c)
        if registry is not None:
            registry.register(self)

    def add(self, canary: Canary) -> None:
        """Export one more Canary (TypeError for anything else)."""
        if not isinstance(canary, Canary):
            raise TypeError(f"expected a Canary, got {type(canary).__name__}")
        self._items.append(canary)

    def describe(self) -> Iterable[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        fraction = GaugeMetricFamily(
            "ratequeue_canary_fraction", "Candidate share of users", labels=["name"]
        )
        stage = GaugeMetricFamily("ratequeue_canary_stage", "Current stage index", labels=["name"])
        state = GaugeMetricFamily(
            "ratequeue_canary_state", "1 for the rollout's state", labels=["name", "state"]
        )
        decisions = CounterMetricFamily(
            "ratequeue_canary_decisions", "Rollout decisions by action", labels=["name", "action"]
        )
        dropped = CounterMetricFamily(
            "ratequeue_canary_shadow_dropped", "Shadow copies dropped", labels=["name"]
        )
        counters = {
            attr: CounterMetricFamily(f"ratequeue_canary_{metric}", doc, labels=["name", "arm"])
            for attr, metric, doc in _COUNTERS
        }
        kpi = GaugeMetricFamily(
            "ratequeue_canary_kpi", "KPI per arm", labels=["name", "arm", "kpi"]
        )
        for c in self._items:
            fraction.add_metric([c.name], c.fraction)
            stage.add_metric([c.name], c.stage)
            for s in _STATES:
                state.add_metric([c.name, s], float(c.state == s))
            for action, n in sorted(c.decision_counts.items()):
                decisions.add_metric([c.name, action], n)
            dropped.add_metric([c.name], c.shadow_dropped)
            for arm, k in c.kpis().items():
                for attr, family in counters.items():
                    family.add_metric([c.name, arm], getattr(k, attr))
                for name in _KPIS:
                    v = getattr(k, name)
                    if math.isfinite(v):
                        kpi.add_metric([c.name, arm, name], v)
        yield fraction
        yield stage
        yield state
        yield decisions
        yield dropped
        yield from counters.values()
        yield kpi
