"""Issue 11, the core half: per-class predictions the Pool routes by, and histograms that
tell the truth about long waits."""

from __future__ import annotations

import pytest
import ratequeue as rq
from prometheus_client import CollectorRegistry, generate_latest
from ratequeue._ratequeue import Channel
from ratequeue.prometheus import RateQueueCollector


def _backlogged(clock: rq.ManualClock) -> tuple[rq.Provider, Channel]:
    provider = rq.Provider("x", rpm=60, burst=1, classes={"hi": 9, "lo": 1}, clock=clock)
    channel = Channel()
    assert provider.limiter.try_acquire()
    for _ in range(10):
        assert isinstance(provider.limiter.submit(channel, priority="lo"), int)
    return provider, channel


def test_predicted_wait_per_class_is_the_wait_the_queue_gives() -> None:
    clock = rq.ManualClock()
    provider, channel = _backlogged(clock)
    lim = provider.limiter
    assert lim.predicted_wait(priority="hi") == 2.0
    assert lim.predicted_wait(priority="lo") == 11.0
    hi = lim.submit(channel, priority="hi")
    lo = lim.submit(channel, priority="lo")
    lim.run_until(30.0)
    waited = {t: w / 1e9 for t, granted, w in channel.drain() if granted}
    assert waited[hi] == 2.0
    assert waited[lo] == 12.0


def test_pool_serves_a_priority_request_the_provider_grants_in_time() -> None:
    clock = rq.ManualClock()
    provider, channel = _backlogged(clock)
    pool = rq.Pool([provider], max_wait=5.0)
    assert pool.waits(priority="hi") == {"x": 2.0}
    assert pool.waits(priority="lo") == {"x": 11.0}
    chosen, wait = pool.choose(max_wait=5.0, priority="hi")
    assert chosen is provider and wait == 2.0
    chosen, ticket = pool.acquire_async(priority="hi")._submit(channel)
    assert chosen is provider and isinstance(ticket, int)
    provider.limiter.run_until(2.0)
    assert (ticket, True, 2_000_000_000) in channel.drain()


def test_histogram_sum_min_max_are_exact_beyond_hours() -> None:
    h = rq.Histogram()
    h.record(86400.0)
    assert h.max == h.sum == h.mean == 86400.0
    assert h.percentile(50) == pytest.approx(86400.0, rel=0.01)
    years = 2**63 / 1e9  # about 292 years: the longest wait a 1/day rate can give
    h.record(years)
    assert h.max == years
    assert h.sum == pytest.approx(86400.0 + years, rel=1e-12)
    assert h.percentile(100) == pytest.approx(years, rel=0.01)
    assert h.overflow == 0
    copy = rq.Histogram.from_bytes(h.to_bytes())
    assert (copy.count, copy.sum, copy.max) == (h.count, h.sum, h.max)
    # A 1/day limiter's thousand waiters: 500,500 days in all, past 2**64 ns.
    days = rq.Histogram()
    days.record_many([k * 86400.0 for k in range(1, 1001)])
    assert days.sum == 500_500 * 86400.0
    assert rq.Histogram.from_bytes(days.to_bytes()).sum == days.sum


def test_a_slow_limiter_reports_its_real_waits() -> None:
    clock = rq.ManualClock()
    lim = rq.Limiter(rq.Rate(1, per="hour", burst=1), clock=clock, name="slow")
    channel = Channel()
    outcomes = [lim.submit(channel) for _ in range(5)]
    assert isinstance(outcomes[0], rq.Permit)
    lim.run_until(5 * 3600.0)
    assert len([g for _, g, _ in channel.drain() if g]) == 4
    waits = lim.wait_histogram()
    assert waits.count == 5
    assert waits.max == 14400.0
    assert waits.sum == 36000.0
    assert waits.percentile(100) == pytest.approx(14400.0, rel=0.01)
    registry = CollectorRegistry()
    RateQueueCollector(lim, registry=registry)
    text = generate_latest(registry).decode()
    assert 'ratequeue_queue_wait_seconds_sum{class="default",limiter="slow"} 36000.0' in text
