"""Cancel and settle in Redis follow the core's one undo rule (README "Undo and refunds"),
compared call by call with ``rq.Limiter`` on one ManualClock: exact while the debit is
the bucket's latest change, at any time; otherwise a refund only while no grant is
scheduled in the future, of at most what the debit still holds; otherwise nothing."""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator

import pytest
import ratequeue as rq
import redis
from ratequeue.redis import RedisLimiter
from redis_server import RedisServer

_ids = itertools.count()


@pytest.fixture(scope="module")
def client(redis_server: RedisServer) -> Iterator[redis.Redis]:
    c = redis_server.client()
    yield c
    c.close()


def pair(client: redis.Redis, rate: rq.Rate) -> tuple[rq.ManualClock, rq.Limiter, RedisLimiter]:
    clock = rq.ManualClock()
    red = RedisLimiter(client, rate, name=f"undo{next(_ids)}", clock=clock)
    return clock, rq.Limiter(rate, clock=clock), red


def ns(seconds: float) -> int:
    return round(seconds * 1e9)


def same_state(core: rq.Limiter, red: RedisLimiter, **costs: int) -> None:
    unit = core.units[0]
    assert red.available(unit) == pytest.approx(core.available(unit), abs=1e-6)
    assert ns(red.retry_after(**costs)) == ns(core.retry_after(**costs))


def test_a_reservation_granted_at_once_is_undone_exactly(client: redis.Redis) -> None:
    _clock, core, red = pair(client, rq.Rate(10, per=1, burst=2))
    a, ra = core.reserve(), red.reserve()
    assert a.cancel() is ra.cancel() is True
    same_state(core, red)
    assert ra.cancel() is False  # once


def test_a_reservation_cancelled_at_its_grant_time_is_undone_exactly(client: redis.Redis) -> None:
    clock, core, red = pair(client, rq.Rate(10, per=1, burst=2))
    for lim in (core, red):
        lim.try_acquire()
        lim.try_acquire()
    a, ra = core.reserve(), red.reserve()
    clock.advance(0.1)
    assert a.cancel() is ra.cancel() is True
    same_state(core, red)


def test_not_the_latest_refunds_what_it_still_holds_when_nothing_is_ahead(
    client: redis.Redis,
) -> None:
    clock, core, red = pair(client, rq.Rate(10, per=1, burst=4))
    a, ra = core.reserve(), red.reserve()
    assert core.try_acquire() and red.try_acquire()
    clock.advance(0.05)  # half of a's debit is restored by time already
    assert a.cancel() is ra.cancel() is True
    same_state(core, red)
    assert red.available() == pytest.approx(3.0)


def test_nothing_is_given_back_under_a_later_grant_scheduled_ahead(client: redis.Redis) -> None:
    _clock, core, red = pair(client, rq.Rate(10, per=1, burst=2))
    for lim in (core, red):
        lim.try_acquire()
        lim.try_acquire()
    a, ra = core.reserve(), red.reserve()
    b, rb = core.reserve(), red.reserve()
    assert a.cancel() is ra.cancel() is False
    same_state(core, red)
    assert b.cancel() is rb.cancel() is True
    same_state(core, red)


def test_a_settle_refund_under_a_later_grant_scheduled_ahead_is_kept(client: redis.Redis) -> None:
    rate = rq.Rate(10, per=1, burst=2, unit="tokens")
    _clock, core, red = pair(client, rate)
    assert core.try_acquire(tokens=1) and red.try_acquire(tokens=1)
    p, rp = core.acquire(tokens=1), red.acquire(tokens=1)
    b, rb = core.reserve(tokens=2), red.reserve(tokens=2)
    assert ns(b.delay) == ns(rb.delay) == 200_000_000
    p.settle(tokens=0)
    rp.settle(tokens=0)
    same_state(core, red, tokens=1)


def test_a_cancel_never_erases_a_debit_made_after_a_refund(client: redis.Redis) -> None:
    """After a refund the bucket can come back to the value a debit left by another route;
    an exact undo then would give back capacity that later debits hold (the bucket's
    generation tells)."""
    clock, _, red = pair(client, rq.Rate(10, per=1, burst=4, unit="tokens"))
    d, e, _f = (red.reserve(tokens=1) for _ in range(3))  # each granted at once
    d.permit.settle(tokens=0)  # not the latest: refunded, the bucket at e's value again
    assert red.available("tokens") == pytest.approx(2)
    clock.advance(0.15)
    assert e.cancel() is False  # time restored e's debit; undoing it would free f's
    assert red.available("tokens") == pytest.approx(3.5)


def test_cancel_after_settle_gives_back_the_settled_cost_and_settle_after_cancel_nothing(
    client: redis.Redis,
) -> None:
    _clock, _, red = pair(client, rq.Rate(10, per=1, burst=10, unit="tokens"))
    res = red.reserve(tokens=6)
    res.permit.settle(tokens=4)
    assert red.available("tokens") == pytest.approx(6)
    assert res.cancel() is True
    assert red.available("tokens") == pytest.approx(10)
    res.permit.settle(tokens=1)  # cancelled: nothing to settle
    assert red.available("tokens") == pytest.approx(10)


def test_a_partial_settle_of_a_grant_still_ahead_keeps_its_slot(client: redis.Redis) -> None:
    clock, _, red = pair(client, rq.Rate(10, per=1, burst=2, unit="tokens"))
    assert red.try_acquire(tokens=2)
    res = red.reserve(tokens=2)
    assert res.delay == pytest.approx(0.2)
    before = red.retry_after(tokens=1)
    res.permit.settle(tokens=1)  # ahead: a newcomer must not share its slot
    assert red.retry_after(tokens=1) == pytest.approx(before)
    clock.advance(0.2)
    assert red.retry_after(tokens=1) == pytest.approx(0.1)


def test_a_fast_path_permit_refunds_only_what_time_has_not_restored(r: redis.Redis) -> None:
    """A policy's try_acquire answers with its grant time only: a settle refunds what the
    debit still holds from then, never the part time restored (a later debit holds it).
    Real time (the fast path reads the server's clock): wide bounds."""
    from ratequeue.redis import RedisPolicy

    p = RedisPolicy(r, {"api": rq.Rate(10, per=1, burst=10, unit="tokens")}, name="fast")
    first = p.try_acquire(tokens=10)
    assert first is not None
    time.sleep(0.5)  # 5 tokens restored
    assert p.try_acquire(tokens=4) is not None  # the restored capacity, taken again
    first.settle(tokens=0)  # holds about 5 tokens more: those come back, not all 10
    peek = RedisLimiter(r, rq.Rate(10, per=1, burst=10, unit="tokens"), name="api", tag="fast")
    assert 4.0 <= peek.available("tokens") <= 8.0


def test_a_grant_served_from_a_lease_is_charged_never_refunded(client: redis.Redis) -> None:
    """Its lease gives back what it did not use: a refund to Redis would count it twice."""
    clock = rq.ManualClock()
    rate = rq.Rate(10, per=1, burst=10, unit="tokens")
    lim = RedisLimiter(client, rate, name=f"undo{next(_ids)}", lease=0.5, clock=clock)
    assert lim.try_acquire(tokens=1)  # takes a lease of 5 tokens
    before = lim.available("tokens")
    assert before == pytest.approx(5)
    p = lim.acquire(tokens=2)  # from the lease: no round trip
    p.settle(tokens=1)
    assert lim.available("tokens") == pytest.approx(before)
    p.settle(tokens=3)  # one more than the 2 the lease debited for it
    assert lim.available("tokens") == pytest.approx(before - 1)


def test_a_policy_gives_back_only_what_it_debited(client: redis.Redis) -> None:
    """A shadow level that would have refused was counted, not debited: a cancel or a
    settle leaves it alone and gives the enforced levels back."""
    from ratequeue.redis import RedisPolicy

    clock = rq.ManualClock()
    levels = {
        "user": rq.KeyedLimiter(rq.Rate(1, per=3600, burst=1)),
        "cluster": rq.Rate(10, per=1, burst=10, unit="tokens"),
    }
    name = f"undo{next(_ids)}"
    p = RedisPolicy(client, levels, name=name, shadow=["user"], clock=clock)
    assert p.try_acquire(user="a", tokens=1) is not None  # the user's only request
    user_key = f"rq:{{{name}}}:user:s:a".encode()
    user_tat = client.get(user_key)
    res = p.reserve(user="a", tokens=4)  # the shadow level would refuse: not debited
    assert client.get(user_key) == user_tat
    res.permit.settle(tokens=2)
    assert res.cancel() is True
    assert client.get(user_key) == user_tat
    peek = RedisLimiter(client, levels["cluster"], name="cluster", tag=name, clock=clock)
    assert peek.available("tokens") == pytest.approx(9)
