"""The optional Prometheus endpoint of the middleware (needs prometheus_client)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric

from ..prometheus import DEFAULT_BUCKETS, RateQueueCollector

if TYPE_CHECKING:
    from ._middleware import RateLimitMiddleware

__all__ = ["metrics_endpoint"]


class _HTTPCollector:
    """Requests by rule and outcome, and the queue wait of admitted requests."""

    def __init__(self, mw: RateLimitMiddleware) -> None:
        self._mw = mw

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        requests = CounterMetricFamily(
            "ratequeue_http_requests",
            "HTTP requests by rule and outcome",
            labels=["rule", "outcome"],
        )
        for plan in self._mw.plans:
            for outcome, n in plan.counts.items():
                requests.add_metric([plan.rule.label, outcome], float(n))
        hist = self._mw.wait_histogram
        cum = hist.cumulative(DEFAULT_BUCKETS)
        buckets = [(f"{le:g}", float(c)) for le, c in zip(DEFAULT_BUCKETS, cum, strict=True)]
        buckets.append(("+Inf", float(hist.count)))
        wait = HistogramMetricFamily(
            "ratequeue_http_queue_wait_seconds",
            "Queue wait of admitted HTTP requests (arrival to grant)",
        )
        wait.add_metric([], buckets=buckets, sum_value=hist.sum)
        yield requests
        yield wait


def metrics_endpoint(mw: RateLimitMiddleware, registry: Any = None) -> Callable[[], bytes]:
    """Registers the middleware's levels, policies and HTTP counters; returns the scrape."""
    reg = registry if registry is not None else CollectorRegistry()
    RateQueueCollector(*(v.level for v in mw.views.values()), *mw.policies, registry=reg)
    reg.register(_HTTPCollector(mw))

    def scrape() -> bytes:
        return bytes(generate_latest(reg))

    return scrape
