"""Issue 11, the core half: per-class predictions the Pool routes by, and histograms that
tell the truth about long waits."""

from __future__ import annotations

import ratequeue as rq
from ratequeue._ratequeue import Channel


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
    chosen, ticket = pool.submit(channel, priority="hi")
    assert chosen is provider and isinstance(ticket, int)
    provider.limiter.run_until(2.0)
    assert (ticket, True, 2_000_000_000) in channel.drain()
