"""RateQueueCollector: a scripted run on a ManualClock, scraped with prometheus_client,
parsed back from the text exposition and checked exactly against the waits, decisions,
depths and capacity the script produced.

Every grant time of the script is known in advance (4 requests per second, burst 1:
one grant each 0.25 s), so the expected bucket counts are computed from first
principles, including values lying exactly on an ``le`` boundary (0.25, 0.5, 0.75, 1, 2).
"""

from __future__ import annotations

import asyncio
import math
import os
from collections.abc import Callable, Iterable
from typing import Any

import pytest

if os.environ.get("CI", "").lower() == "true":
    # In CI a missing optional dependency is a failure, never a silent skip.
    import prometheus_client  # noqa: F401
else:
    pytest.importorskip("prometheus_client")

import ratequeue as rq
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from ratequeue.prometheus import DEFAULT_BUCKETS, OUTCOMES, RateQueueCollector

INF = math.inf

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(registry: CollectorRegistry) -> tuple[Samples, dict[str, str]]:
    """The registry's text exposition parsed back: samples by (name, labels), and the
    type of each family."""
    text = generate_latest(registry).decode()
    samples: Samples = {}
    types: dict[str, str] = {}
    for fam in text_string_to_metric_families(text):
        types[fam.name] = fam.type
        for s in fam.samples:
            key = (s.name, frozenset(s.labels.items()))
            assert key not in samples, key
            samples[key] = s.value
    return samples, types


def get(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, frozenset(labels.items()))]


def select(samples: Samples, name: str, **labels: str) -> dict[frozenset[tuple[str, str]], float]:
    want = set(labels.items())
    return {k: v for (n, k), v in samples.items() if n == name and want <= k}


def le_label(le: float) -> str:
    return "+Inf" if le == INF else repr(float(le))


def check_histogram(
    samples: Samples,
    prefix: str,
    limiter: str,
    cls: str,
    waits_ns: Iterable[int],
    buckets: Iterable[float],
) -> None:
    """Bucket counts per le, _count and _sum exactly as the recorded waits give them."""
    waits_ns = list(waits_ns)
    name = f"{prefix}_queue_wait_seconds"
    les = [*buckets, INF]
    labels = {"limiter": limiter, "class": cls}
    got = {dict(k)["le"]: v for k, v in select(samples, f"{name}_bucket", **labels).items()}
    want = {
        le_label(le): float(sum(1 for w in waits_ns if le == INF or w <= round(le * 1e9)))
        for le in les
    }
    assert got == want, (limiter, cls)
    # Cumulative and ascending, as Prometheus requires.
    values = [got[le_label(le)] for le in les]
    assert values == sorted(values)
    assert get(samples, f"{name}_count", **labels) == float(len(waits_ns))
    assert get(samples, f"{name}_sum", **labels) == sum(waits_ns) / 1e9


def check_decisions(samples: Samples, prefix: str, limiter: str, **counts: int) -> None:
    got = {
        dict(k)["outcome"]: v
        for k, v in select(samples, f"{prefix}_decisions_total", limiter=limiter).items()
    }
    assert got == {o: float(counts.get(o, 0)) for o in OUTCOMES}, limiter


async def until(cond: Callable[[], bool]) -> None:
    for _ in range(10_000):
        if cond():
            return
        await asyncio.sleep(0)
    raise AssertionError("condition never held")


async def awaited(acq: Any) -> Any:
    return await acq


MS = 1_000_000
Q = 250 * MS  # one grant per 0.25 s


@pytest.mark.timeout(60)
def test_scripted_run_exported_exactly() -> None:
    clock = rq.ManualClock()
    lim = rq.Limiter(
        rq.Rate(4, burst=1),
        rq.Rate(1000, burst=1000, unit="tokens"),
        clock=clock,
        classes={"interactive": 3, "batch": 1},
        max_queue=10,
        name="api",
    )
    pool = rq.Concurrency(3, clock=clock, name="pool")
    anon = rq.Limiter(rq.Rate(5, burst=5), clock=clock)  # exported as "limiter2"

    registry = CollectorRegistry()
    RateQueueCollector(lim, pool, anon, registry=registry)
    custom = [0.3, 0.5, 1.25, 2.5, INF]
    registry2 = CollectorRegistry()
    RateQueueCollector(lim, buckets=custom, prefix="rq", registry=registry2)

    # Before anything: every series present, all zero.
    samples, types = scrape(registry)
    assert types == {
        "ratequeue_queue_wait_seconds": "histogram",
        "ratequeue_decisions": "counter",
        "ratequeue_queue_depth": "gauge",
        "ratequeue_available": "gauge",
        "ratequeue_in_use": "gauge",
        "ratequeue_limit": "gauge",
    }
    for cls in ("interactive", "batch"):
        check_histogram(samples, "ratequeue", "api", cls, [], DEFAULT_BUCKETS)
    check_decisions(samples, "ratequeue", "api")
    assert get(samples, "ratequeue_available", limiter="api", unit="requests") == 1.0
    assert get(samples, "ratequeue_available", limiter="api", unit="tokens") == 1000.0

    async def script() -> dict[str, Any]:
        out: dict[str, Any] = {}
        # t = 0: one admitted try, one refused.
        assert lim.try_acquire(tokens=10) is True
        assert lim.try_acquire(tokens=10) is False
        # Ten interactive waiters: granted at 0.25 k, k = 1..10.
        first = [
            asyncio.create_task(awaited(lim.acquire_async(priority="interactive", tokens=10)))
            for _ in range(10)
        ]
        await until(lambda: lim.waiting == 10)
        with pytest.raises(rq.Overloaded):  # the queue is full
            await lim.acquire_async(priority="batch", tokens=10)
        lim.run_until(1.0)
        await until(lambda: sum(t.done() for t in first) == 4)
        out["mid"] = scrape(registry)[0]
        out["mid_available"] = lim.available("requests")
        lim.run_until(2.5)
        out["first"] = [p.waited for p in await asyncio.gather(*first)]

        # t = 2.5 (the bucket is empty until 2.75).
        with pytest.raises(rq.Overloaded):  # predicted 0.25 s > 0.1 s
            await lim.acquire_async(priority="batch", tokens=10, timeout=0.1)
        batch = []
        for k in range(3):
            batch.append(
                asyncio.create_task(awaited(lim.acquire_async(priority="batch", tokens=10)))
            )
            await until(lambda k=k: lim.waiting == k + 1)
        # An interactive waiter: its own class is empty, so 0.25 s is predicted and it
        # queues; fair queuing then serves it after the first batch waiter (at 3.0),
        # past its deadline of 2.8.
        late = asyncio.create_task(
            awaited(lim.acquire_async(priority="interactive", tokens=10, timeout=0.3))
        )
        await until(lambda: lim.waiting == 4)
        gone = asyncio.create_task(awaited(lim.acquire_async(priority="batch", tokens=10)))
        await until(lambda: lim.waiting == 5)
        gone.cancel()
        with pytest.raises(asyncio.CancelledError):
            await gone
        lim.run_until(4.0)
        with pytest.raises(rq.WaitTimeout):
            await late
        out["batch"] = [p.waited for p in await asyncio.gather(*batch)]
        # t = 4: an immediate grant records 0.
        assert lim.acquire(priority="interactive", tokens=10).waited == 0.0
        lim.run_until(4.1)
        return out

    held = [pool.acquire(), pool.acquire()]
    out = asyncio.run(script())
    assert out["first"] == [0.25 * k for k in range(1, 11)]
    assert out["batch"] == [0.25, 0.5, 0.75]

    # Mid-run scrape: four grants done, six waiting.
    mid = out["mid"]
    check_histogram(
        mid, "ratequeue", "api", "interactive", [k * Q for k in range(1, 5)], DEFAULT_BUCKETS
    )
    check_histogram(mid, "ratequeue", "api", "batch", [], DEFAULT_BUCKETS)
    check_decisions(
        mid, "ratequeue", "api", tried_admitted=1, tried_refused=1, queued_grants=4, refused_full=1
    )
    assert get(mid, "ratequeue_queue_depth", limiter="api", **{"class": "interactive"}) == 6.0
    assert get(mid, "ratequeue_queue_depth", limiter="api", **{"class": "batch"}) == 0.0
    assert get(mid, "ratequeue_available", limiter="api", unit="requests") == out["mid_available"]
    assert out["mid_available"] == 0.0  # granted at 1.0 just now

    # Final scrape.
    samples, _ = scrape(registry)
    interactive = [k * Q for k in range(1, 11)] + [0]
    batch = [Q, 2 * Q, 3 * Q]
    check_histogram(samples, "ratequeue", "api", "interactive", interactive, DEFAULT_BUCKETS)
    check_histogram(samples, "ratequeue", "api", "batch", batch, DEFAULT_BUCKETS)
    check_decisions(
        samples,
        "ratequeue",
        "api",
        tried_admitted=1,
        tried_refused=1,
        immediate=1,
        queued_grants=13,
        refused_full=1,
        refused_deadline=1,
        timed_out=1,
        cancelled=1,
    )
    for cls in ("interactive", "batch"):
        assert get(samples, "ratequeue_queue_depth", limiter="api", **{"class": cls}) == 0.0
    # Last request granted at 4.0, read at 4.1: 0.4 of a request (the bucket reads the
    # clock in ticks of under 1 ns, i.e. 4e-9 of a 0.25 s interval); tokens refilled.
    requests = get(samples, "ratequeue_available", limiter="api", unit="requests")
    assert requests == lim.available("requests")
    assert requests == pytest.approx(0.4, abs=1e-8)
    assert get(samples, "ratequeue_available", limiter="api", unit="tokens") == 1000.0
    assert lim.available("tokens") == 1000.0

    # The same numbers agree with stats() and with the Histogram itself.
    st = lim.stats()
    for o in OUTCOMES:
        assert get(samples, "ratequeue_decisions_total", limiter="api", outcome=o) == st[o]
    h = st["wait"]["interactive"]
    for le, c in zip(DEFAULT_BUCKETS, h.cumulative(list(DEFAULT_BUCKETS)), strict=True):
        key = {"limiter": "api", "class": "interactive", "le": le_label(le)}
        assert get(samples, "ratequeue_queue_wait_seconds_bucket", **key) == c

    # The concurrency limit and the unnamed limiter.
    check_histogram(samples, "ratequeue", "pool", "default", [0, 0], DEFAULT_BUCKETS)
    check_decisions(samples, "ratequeue", "pool", immediate=2)
    assert get(samples, "ratequeue_in_use", limiter="pool") == 2.0
    assert get(samples, "ratequeue_limit", limiter="pool") == 3.0
    assert select(samples, "ratequeue_available", limiter="pool") == {}
    assert get(samples, "ratequeue_queue_depth", limiter="pool", **{"class": "default"}) == 0.0
    check_histogram(samples, "ratequeue", "limiter2", "default", [], DEFAULT_BUCKETS)
    check_decisions(samples, "ratequeue", "limiter2")
    assert get(samples, "ratequeue_available", limiter="limiter2", unit="requests") == 5.0
    assert select(samples, "ratequeue_in_use", limiter="limiter2") == {}
    for p in held:
        p.release()
    assert get(scrape(registry)[0], "ratequeue_in_use", limiter="pool") == 0.0

    # Custom buckets and prefix: le labels as given (the +Inf one not repeated).
    samples2, types2 = scrape(registry2)
    assert set(types2) == {
        "rq_queue_wait_seconds",
        "rq_decisions",
        "rq_queue_depth",
        "rq_available",
        "rq_in_use",
        "rq_limit",
    }
    les = {
        dict(k)["le"]
        for k in select(
            samples2, "rq_queue_wait_seconds_bucket", limiter="api", **{"class": "batch"}
        )
    }
    assert les == {"0.3", "0.5", "1.25", "2.5", "+Inf"}
    check_histogram(samples2, "rq", "api", "interactive", interactive, custom[:-1])
    check_histogram(samples2, "rq", "api", "batch", batch, custom[:-1])
    check_decisions(
        samples2,
        "rq",
        "api",
        tried_admitted=1,
        tried_refused=1,
        immediate=1,
        queued_grants=13,
        refused_full=1,
        refused_deadline=1,
        timed_out=1,
        cancelled=1,
    )
    assert select(samples2, "rq_in_use") == {}


def test_buckets_exact_on_three_significant_digits() -> None:
    """Boundaries with three significant digits (in ns) are bucket edges: a wait exactly
    on, just under and just over each is counted on the right side."""
    clock = rq.ManualClock()
    lim = rq.Limiter(rq.Rate(1, burst=1), clock=clock, name="edges")
    buckets = [1e-6, 0.00123, 0.0025, 0.0999, 4.56, 789.0]
    waits_ns = []
    h = lim.wait_histogram()
    for le in buckets:
        edge = round(le * 1e9)
        for w in (edge - 1, edge, edge + 1):
            h.record(w / 1e9)
            waits_ns.append(w)
    registry = CollectorRegistry()
    RateQueueCollector(lim, buckets=buckets, registry=registry)
    samples, _ = scrape(registry)
    check_histogram(samples, "ratequeue", "edges", "default", waits_ns, buckets)
    for le in buckets:
        key = {"limiter": "edges", "class": "default", "le": le_label(le)}
        want = sum(1 for w in waits_ns if w <= round(le * 1e9))
        assert get(samples, "ratequeue_queue_wait_seconds_bucket", **key) == want


def test_add_source_later() -> None:
    registry = CollectorRegistry()
    collector = RateQueueCollector(registry=registry)
    samples, _ = scrape(registry)
    assert select(samples, "ratequeue_decisions_total") == {}
    lim = rq.Limiter(rq.Rate(10), clock=rq.ManualClock(), name="late")
    assert lim.try_acquire()
    collector.add(lim)
    samples, _ = scrape(registry)
    check_decisions(samples, "ratequeue", "late", tried_admitted=1)


@pytest.mark.parametrize(
    "buckets",
    [
        [],
        [0.0],
        [-1.0],
        [0.1, -0.5],
        [math.nan],
        [0.1, math.nan],
        [1.0, 0.5],
        [0.5, 0.5],
        [0.1, 0.2, 0.2, 0.3],
        [-math.inf],
    ],
    ids=repr,
)
def test_invalid_buckets_raise_value_error(buckets: list[float]) -> None:
    lim = rq.Limiter(rq.Rate(1))
    with pytest.raises(ValueError):
        RateQueueCollector(lim, buckets=buckets)
    registry = CollectorRegistry()
    with pytest.raises(ValueError):
        RateQueueCollector(lim, buckets=buckets, registry=registry)
    assert scrape(registry)[0] == {}  # nothing was registered


def test_buckets_accept_ints_and_trailing_inf() -> None:
    lim = rq.Limiter(rq.Rate(1), clock=rq.ManualClock(), name="x")
    lim.acquire()
    registry = CollectorRegistry()
    RateQueueCollector(lim, buckets=(1, 2, INF), registry=registry)
    samples, _ = scrape(registry)
    got = {
        dict(k)["le"]: v
        for k, v in select(samples, "ratequeue_queue_wait_seconds_bucket", limiter="x").items()
    }
    assert got == {"1.0": 1.0, "2.0": 1.0, "+Inf": 1.0}
