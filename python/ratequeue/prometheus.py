"""Prometheus export: a collector for prometheus_client's registry (optional extra).

>>> from prometheus_client import CollectorRegistry, generate_latest
>>> registry = CollectorRegistry()
>>> collector = RateQueueCollector(limiter, registry=registry)    # doctest: +SKIP

Exports, labelled by limiter name and class:

- ``ratequeue_queue_wait_seconds`` (histogram): each grant's queue wait, arrival to grant,
  on ``le`` boundaries read exactly off the internal histogram (any boundary with at
  most three significant digits in nanoseconds is a bucket edge);
- ``ratequeue_decisions_total`` (counter) by ``outcome``: tried_admitted, tried_refused,
  immediate, queued_grants, refused_full, refused_deadline, timed_out, cancelled;
- ``ratequeue_queue_depth`` (gauge) per class; ``ratequeue_available`` (gauge) per unit
  for rate limiters; ``ratequeue_in_use`` and ``ratequeue_limit`` for concurrency limits.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any, Protocol

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import CollectorRegistry
from prometheus_client.utils import floatToGoString as _go_float

__all__ = ["DEFAULT_BUCKETS", "RateQueueCollector"]

#: Fine below one second, then doubling up to 300 s.
DEFAULT_BUCKETS: tuple[float, ...] = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.0,
    4.0,
    8.0,
    16.0,
    32.0,
    64.0,
    128.0,
    300.0,
)

OUTCOMES = (
    "tried_admitted",
    "tried_refused",
    "immediate",
    "queued_grants",
    "refused_full",
    "refused_deadline",
    "timed_out",
    "cancelled",
)


def _le(v: float) -> str:
    """The ``le`` label as prometheus_client writes it."""
    return str(_go_float(v))  # type: ignore[no-untyped-call]


class _Source(Protocol):
    @property
    def name(self) -> str | None: ...
    def stats(self) -> dict[str, Any]: ...


class RateQueueCollector:
    """Collects the stats of limiters and concurrency limits at each scrape."""

    def __init__(
        self,
        *sources: _Source,
        buckets: Sequence[float] = DEFAULT_BUCKETS,
        prefix: str = "ratequeue",
        registry: CollectorRegistry | None = None,
    ) -> None:
        les = [float(b) for b in buckets]
        if not les or any(b <= 0 or b != b for b in les) or sorted(set(les)) != les:
            raise ValueError(f"buckets={list(buckets)!r} must be positive, distinct and ascending")
        if les[-1] == float("inf"):
            les.pop()
        self._buckets = les
        self._prefix = prefix
        self._sources: list[_Source] = list(sources)
        if registry is not None:
            registry.register(self)

    def add(self, source: _Source) -> None:
        """Export one more limiter or concurrency limit."""
        self._sources.append(source)

    def _names(self) -> Iterable[tuple[str, _Source]]:
        for i, src in enumerate(self._sources):
            yield (src.name or f"limiter{i}"), src

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        p = self._prefix
        wait = HistogramMetricFamily(
            f"{p}_queue_wait_seconds",
            "Queue wait of each grant, arrival to grant (schedule time)",
            labels=["limiter", "class"],
        )
        decisions = CounterMetricFamily(
            f"{p}_decisions", "Decisions by outcome", labels=["limiter", "outcome"]
        )
        depth = GaugeMetricFamily(
            f"{p}_queue_depth", "Requests waiting now", labels=["limiter", "class"]
        )
        available = GaugeMetricFamily(
            f"{p}_available", "Capacity that could be admitted now", labels=["limiter", "unit"]
        )
        in_use = GaugeMetricFamily(f"{p}_in_use", "Permits held now", labels=["limiter"])
        limit = GaugeMetricFamily(f"{p}_limit", "Concurrency limit", labels=["limiter"])
        for name, src in self._names():
            st = src.stats()
            for cls, hist in st["wait"].items():
                cum = hist.cumulative(self._buckets)
                pairs = [(_le(le), float(c)) for le, c in zip(self._buckets, cum, strict=True)]
                pairs.append(("+Inf", float(hist.count)))
                wait.add_metric([name, cls], buckets=pairs, sum_value=hist.sum)
            for outcome in OUTCOMES:
                decisions.add_metric([name, outcome], float(st[outcome]))
            for cls, n in st["depths"].items():
                depth.add_metric([name, cls], float(n))
            for unit, v in st.get("available", {}).items():
                available.add_metric([name, unit], float(v))
            if "in_use" in st:
                in_use.add_metric([name], float(st["in_use"]))
                limit.add_metric([name], float(st["limit"]))
        yield from (wait, decisions, depth, available, in_use, limit)
