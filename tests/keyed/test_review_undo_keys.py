"""Adversarial review of the one undo rule (defects 2 and 3) and the one key identity
(defect 12): each test shows a way the landed changes could break a guarantee.

Timing on a ManualClock. A test here fails when the defect it names is present.
"""

from __future__ import annotations

import asyncio
import itertools

import pytest
import ratequeue as rq


def grants_at_once(lim: rq.Limiter, most: int = 10) -> int:
    """How many single grants the limiter gives at this instant (at most ``most``)."""
    n = 0
    while n < most and lim.try_acquire():
        n += 1
    return n


# ---------------------------------------------------------------------------------------
# A rate change between take and undo: the refund must stay capped by what the debit
# still holds (the cap was only applied while the bucket kept its generation).


def test_cancel_after_a_rate_change_refunds_nothing_time_already_restored(clock):
    # r's debit at 0 s is fully restored by time at 5 s. A set_rate (even to the same
    # rate) moves the bucket to a new generation; the cancel must still refund nothing,
    # else one try_acquire and two more at 5 s make three grants in one instant (burst 2).
    lim = rq.Limiter(rq.Rate(1, per="second", burst=2), clock=clock)
    r = lim.reserve()
    clock.set(5.0)
    lim.set_rate(1, per="second")
    assert lim.try_acquire()
    r.cancel()
    assert grants_at_once(lim) == 1


def test_permit_settle_after_a_rate_change_refunds_nothing_time_already_restored(clock):
    # The same through Permit.settle (a fast-path grant carries its word as a token).
    lim = rq.Limiter(rq.Rate(1, per="second", burst=2), clock=clock)
    p = lim.acquire()
    clock.set(5.0)
    lim.set_burst(2)
    assert lim.try_acquire()
    p.settle(requests=0)
    assert grants_at_once(lim) == 1


# ---------------------------------------------------------------------------------------
# A multi-rate limiter's queue give-back after any later change refunds uncapped.


def test_multi_rate_abandoned_grant_given_back_late_refunds_nothing_time_restored(clock):
    # A waiter is granted at 1 s; its task is cancelled before it resumes, and the loop
    # gives the grant back only after the clock moved to 5 s and another grant was taken
    # (so the multi-rate token no longer matches). By then time has restored everything
    # the grant took: giving back anything lets three requests through at 5 s (burst 2).
    lim = rq.Limiter(
        rq.Rate(1, per="second", burst=2),
        rq.Rate(1000, per="second", unit="tokens"),
        clock=clock,
    )

    async def main() -> int:
        assert lim.try_acquire(tokens=1) and lim.try_acquire(tokens=1)
        task = asyncio.ensure_future(lim.acquire_async(tokens=1))
        for _ in range(3):
            await asyncio.sleep(0)
        assert lim.waiting == 1
        lim.run_until(1.0)  # granted at 1 s; the outcome waits in the loop's channel
        task.cancel()
        clock.set(5.0)
        assert lim.try_acquire(tokens=1)
        for _ in range(10):  # the loop drains the channel and gives the grant back
            await asyncio.sleep(0)
        assert task.cancelled()
        n = 0
        while n < 10 and lim.try_acquire(tokens=1):
            n += 1
        return n

    assert asyncio.run(main()) == 1


# ---------------------------------------------------------------------------------------
# Keyed eviction between take and undo: the key's new bucket is not the old one.


def test_keyed_settle_after_the_key_was_evicted_and_recreated_keeps_the_new_debit(clock):
    # max_keys=1: taking "b" evicts "a" (live). "a" is taken again at the same instant,
    # leaving the very TAT the first permit's token names; settling the first permit to
    # zero must not erase the second grant's debit (burst 1: two more grants at 0 s).
    k = rq.KeyedLimiter(rq.Rate(1, per="second", burst=1), max_keys=1, clock=clock)
    p = k.acquire("a")
    assert k.try_acquire("b")
    assert k.try_acquire("a")
    p.settle(requests=0)
    assert not k.try_acquire("a")


def test_keyed_policy_cancel_after_the_key_was_evicted_and_recreated_keeps_the_new_debit(clock):
    k = rq.KeyedLimiter(rq.Rate(1, per="second", burst=1), max_keys=1, clock=clock)
    policy = rq.Policy({"user": k})
    p1 = policy.try_acquire(user="a")
    assert p1 is not None
    assert k.try_acquire("b")
    assert policy.try_acquire(user="a") is not None
    p1.cancel()
    assert not k.try_acquire("a")


# ---------------------------------------------------------------------------------------
# The refund cap ignores refunds of the debits beneath a debit.


def test_cancel_of_a_reservation_whose_predecessor_was_refunded_is_capped(clock):
    # b sits on a; a's cancel refunds a, which moves b's units down: at 3 s b (2 units at
    # 0 s) holds nothing. After one grant at 3 s, b's cancel must give nothing back, else
    # ten more pass at 3 s (eleven at one instant, burst 10).
    lim = rq.Limiter(rq.Rate(1, per="second", burst=10), clock=clock)
    a = lim.reserve(5)
    b = lim.reserve(2)
    a.cancel()
    clock.set(3.0)
    assert lim.try_acquire()
    b.cancel()
    assert grants_at_once(lim, 20) == 9


# ---------------------------------------------------------------------------------------
# Redis key names: a keyed level's key and another level's name must never meet.

_names = itertools.count()


# ---------------------------------------------------------------------------------------
# Policies whose levels share a limiter.


def test_policy_levels_sharing_a_limiter_reserve_behind_each_other(clock):
    # Both levels debit one bucket (1/s, burst 2): the first reservation fills it; the
    # second needs two more units, so it is due at 2 s. Each level's delay alone (1 s)
    # is too early for the pair: the take of the second level is refused, and reserve
    # gave up after its retries with Overloaded and retry_after 0 (no max_wait set).
    lim = rq.Limiter(rq.Rate(1, per="second", burst=2), clock=clock)
    policy = rq.Policy({"a": lim, "b": lim})
    assert policy.reserve().delay == 0.0
    assert policy.reserve().delay == 2.0


def test_policy_refused_by_a_later_level_consumes_nothing_on_a_shared_limiter(clock):
    # Levels a and b share a limiter (1/s, burst 2), c is a full Concurrency. The
    # reservation takes a and b for a grant at 2 s, then c refuses: the undo must give
    # both back. Undone first, a is not the latest change (b sits on it) and a grant is
    # scheduled ahead, so a's unit was kept: a refused request consumed capacity.
    lim = rq.Limiter(rq.Rate(1, per="second", burst=2), clock=clock)
    conc = rq.Concurrency(1)
    policy = rq.Policy({"a": lim, "b": lim, "c": conc})
    held = policy.try_acquire()
    assert held is not None
    with pytest.raises(rq.Overloaded):
        policy.reserve()
    assert lim.reserve().delay == 1.0
    assert lim.stats()["refunds_dropped"] == 0


def test_policy_cancel_of_levels_sharing_a_limiter_gives_both_back(clock):
    # The same through PolicyPermit.cancel of a reservation due at 2 s.
    lim = rq.Limiter(rq.Rate(1, per="second", burst=2), clock=clock)
    policy = rq.Policy({"a": lim, "b": lim})
    assert policy.reserve().delay == 0.0
    p = policy.reserve()
    p.cancel()
    assert lim.reserve().delay == 1.0
    assert lim.stats()["refunds_dropped"] == 0


# ---------------------------------------------------------------------------------------
# A settle without an exact token is capped from the grant time at the *current* rate:
# after the rate slowed down, that overstates what the grant still holds.


def test_multi_rate_settle_after_the_rate_slowed_refunds_only_what_the_grant_holds(clock):
    # p (1 request at 0 s, 1/s) holds 0.1 of it at 0.9 s, when the rate drops to 0.1/s.
    # B is granted at 0.9 s and p settles to 0 requests. Only p's 0.1 may come back: one
    # more grant at 0.9 s (C), then the next is due at 10.9 s. The cap counted p's unit
    # from 0 s at the new rate (held until 10 s), refunding 0.91, so a grant at 3 s
    # passed: three grants in [0.9 s, 3 s] where burst 2 + 0.1/s * 2.1 s allows 2.21.
    lim = rq.Limiter(
        rq.Rate(1, per="second", burst=2),
        rq.Rate(1000, per="second", unit="tokens"),
        clock=clock,
    )
    p = lim.acquire(tokens=1)
    clock.set(0.9)
    lim.set_rate(0.1, per=1, which=0)
    assert lim.try_acquire(tokens=1)
    p.settle(requests=0)
    assert lim.try_acquire(tokens=1)
    clock.set(3.0)
    assert not lim.try_acquire(tokens=1)
