"""A settle gives back by the one undo rule whatever kind of permit it settles: a
blocking acquire's permit whose debit is no longer the bucket's latest change refunds
what the debit still holds, as a reservation's cancel does (it once gave nothing back
and counted nothing dropped)."""

from __future__ import annotations

import ratequeue as rq


def test_settle_below_estimate_after_a_later_grant_refunds_what_the_debit_holds() -> None:
    clock = rq.ManualClock()
    lim = rq.Limiter(rq.Rate(10, burst=10, unit="tokens"), clock=clock)
    p = lim.acquire(tokens=5)
    assert lim.try_acquire(tokens=1)
    assert lim.available() == 4.0
    p.settle(tokens=1)
    assert lim.available() == 8.0


def test_multi_rate_settle_after_a_later_grant_refunds_each_rate() -> None:
    clock = rq.ManualClock()
    lim = rq.Limiter(rq.Rate(100, burst=100), rq.Rate(10, burst=10, unit="tokens"), clock=clock)
    p = lim.acquire(requests=1, tokens=5)
    assert lim.try_acquire(requests=1, tokens=1)
    p.settle(tokens=1)
    assert lim.available("tokens") == 8.0


def test_refund_never_frees_what_time_already_restored() -> None:
    clock = rq.ManualClock()
    lim = rq.Limiter(rq.Rate(10, burst=10, unit="tokens"), clock=clock)
    p = lim.acquire(tokens=5)
    assert lim.try_acquire(tokens=1)
    clock.advance(0.3)  # time restored 3 of the 5 units the debit held: 2 are left
    assert lim.available() == 7.0
    p.settle(tokens=1)  # 4 asked back, 2 still held
    assert lim.available() == 9.0


def test_keyed_settle_after_a_later_grant_refunds() -> None:
    clock = rq.ManualClock()
    kl = rq.KeyedLimiter(rq.Rate(10, burst=10), clock=clock)
    p = kl.acquire("a", 5)
    assert kl.try_acquire("a", 1)
    p.settle(requests=1)
    assert kl.available("a") == 8.0
