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
  for rate limiters; ``ratequeue_in_use`` and ``ratequeue_limit`` for concurrency limits;
- keyed limits: their wait histogram (class ``default``), ``tried_*`` decisions,
  ``ratequeue_keys``, ``ratequeue_waiting_keys`` and ``ratequeue_evicted_keys_total`` by
  ``kind`` (full, live);
- policies: ``ratequeue_policy_admitted_total`` and ``ratequeue_policy_refused_total``
  per ``level`` (``shadow="true"``: refusals a shadow level would have made).

Any other object is refused with a TypeError when added, so a scrape never fails.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import CollectorRegistry
from prometheus_client.utils import floatToGoString as _go_float

from ._ratequeue import Concurrency, KeyedConcurrency, KeyedLimiter, Limiter, Policy

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


_Source = Limiter | Concurrency | KeyedLimiter | KeyedConcurrency | Policy
_SOURCE_TYPES = (Limiter, Concurrency, KeyedLimiter, KeyedConcurrency, Policy)


def _check_source(src: object) -> None:
    if not isinstance(src, _SOURCE_TYPES):
        names = ", ".join(t.__name__ for t in _SOURCE_TYPES)
        raise TypeError(f"RateQueueCollector exports {names}; got {type(src).__name__}")


class RateQueueCollector:
    """Collects the stats of limiters, concurrency limits, keyed limits and policies at
    each scrape. Sources are checked when added, so a scrape never fails on one."""

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
        for src in sources:
            _check_source(src)
        self._buckets = les
        self._prefix = prefix
        self._sources: list[_Source] = list(sources)
        if registry is not None:
            registry.register(self)

    def add(self, source: _Source) -> None:
        """Export one more limiter, concurrency limit, keyed limit or policy."""
        _check_source(source)
        self._sources.append(source)

    def _names(self) -> Iterable[tuple[str, _Source]]:
        for i, src in enumerate(self._sources):
            name = getattr(src, "name", None)
            yield (name or f"{'policy' if isinstance(src, Policy) else 'limiter'}{i}"), src

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
        keys = GaugeMetricFamily(f"{p}_keys", "Keys held by a keyed limit", labels=["limiter"])
        waiting_keys = GaugeMetricFamily(
            f"{p}_waiting_keys", "Keys with requests waiting", labels=["limiter"]
        )
        evicted = CounterMetricFamily(
            f"{p}_evicted_keys", "Keys evicted by kind", labels=["limiter", "kind"]
        )
        admitted = CounterMetricFamily(
            f"{p}_policy_admitted", "Requests a policy admitted", labels=["policy"]
        )
        refused = CounterMetricFamily(
            f"{p}_policy_refused",
            "Requests refused by each level of a policy (shadow: would have refused)",
            labels=["policy", "level", "shadow"],
        )
        for name, src in self._names():
            st = src.stats()
            if isinstance(src, Policy):
                admitted.add_metric([name], float(st["admitted"]))
                for level, c in st["levels"].items():
                    shadow = "true" if c["shadow"] else "false"
                    count = c["shadow_refused"] if c["shadow"] else c["refused"]
                    refused.add_metric([name, level, shadow], float(count))
                continue
            hists = st["wait"] if isinstance(st["wait"], dict) else {"default": st["wait"]}
            for cls, hist in hists.items():
                cum = hist.cumulative(self._buckets)
                pairs = [(_le(le), float(c)) for le, c in zip(self._buckets, cum, strict=True)]
                pairs.append(("+Inf", float(hist.count)))
                wait.add_metric([name, cls], buckets=pairs, sum_value=hist.sum)
            for outcome in OUTCOMES:
                if outcome in st:
                    decisions.add_metric([name, outcome], float(st[outcome]))
            for cls, n in st.get("depths", {}).items():
                depth.add_metric([name, cls], float(n))
            for unit, v in st.get("available", {}).items():
                available.add_metric([name, unit], float(v))
            if "in_use" in st:
                in_use.add_metric([name], float(st["in_use"]))
            if "limit" in st:
                limit.add_metric([name], float(st["limit"]))
            if "keys" in st:
                keys.add_metric([name], float(st["keys"]))
                waiting_keys.add_metric([name], float(st["waiting_keys"]))
                for kind in ("evicted_full", "evicted_live"):
                    if kind in st:
                        evicted.add_metric([name, kind.removeprefix("evicted_")], float(st[kind]))
        yield from (wait, decisions, depth, available, in_use, limit)
        # The keyed and policy families only when such a source is exported.
        yield from (m for m in (keys, waiting_keys, evicted, admitted, refused) if m.samples)
