"""One undo rule (issue 10, defects 2 and 3).

Every give-back — Reservation.cancel, a queue's give-back of an abandoned grant,
PolicyPermit cancel / release / settle, Permit.settle — goes through one rule in the
core: an exact compare-and-swap back from the state the take produced, else a refund
only while no grant is scheduled in the future on that bucket (never past full), else
nothing (counted in ``stats()["refunds_dropped"]``). Each undo happens at most once, and
a release or refund wakes the queue of its level. Timing on a ManualClock; the few
real-clock tests only check that a waiter is granted long before its deadline.
"""

from __future__ import annotations

import random
import threading
import time

import pytest
import ratequeue as rq
from ratequeue._ratequeue import Channel, _wait_give_back, _wait_granted, _wait_submit


def one_per_second(clock: rq.ManualClock) -> rq.Limiter:
    return rq.Limiter(rq.Rate(1, per="second", burst=1), clock=clock)


# ---------------------------------------------------------------------------------------
# defect 3: Policy cancel over-admits


def test_policy_cancel_under_a_later_reservation_gives_nothing_back(clock):
    lim = one_per_second(clock)
    policy = rq.Policy({"r": lim})
    p1 = policy.reserve()
    p2 = policy.reserve()
    p1.cancel()
    p3 = policy.reserve()
    assert (p1.delay, p2.delay, p3.delay) == (0.0, 1.0, 2.0)
    assert lim.stats()["refunds_dropped"] == 1


def test_policy_cancel_of_the_latest_is_exact(clock):
    lim = one_per_second(clock)
    policy = rq.Policy({"r": lim})
    policy.reserve()
    p2 = policy.reserve()
    p2.cancel()
    assert policy.reserve().delay == 1.0
    assert lim.stats()["refunds_dropped"] == 0


def test_policy_settle_after_cancel_refunds_nothing_more(clock):
    lim = rq.Limiter(rq.Rate(10, per="second", burst=10, unit="tokens"), clock=clock)
    policy = rq.Policy({"cluster": lim})
    p1 = policy.try_acquire(tokens=5)
    policy.try_acquire(tokens=3)
    p1.cancel()  # not the latest, nothing scheduled ahead: refunded by the rule
    assert lim.available() == 7.0
    p1.settle(tokens=0)
    assert lim.available() == 7.0
    p1.cancel()
    assert lim.available() == 7.0


def test_policy_double_cancel_and_cancel_after_settle_give_back_once(clock):
    lim = rq.Limiter(rq.Rate(10, per="second", burst=10, unit="tokens"), clock=clock)
    policy = rq.Policy({"cluster": lim})
    p = policy.try_acquire(tokens=2)
    p.settle(tokens=6)
    assert lim.available() == 4.0
    p.cancel()
    assert lim.available() == 10.0
    assert lim.try_acquire(tokens=4)
    p.cancel()
    assert lim.available() == 6.0


def test_keyed_policy_cancel_under_a_later_reservation_gives_nothing_back(clock):
    kl = rq.KeyedLimiter(rq.Rate(1, per="second", burst=1), clock=clock)
    policy = rq.Policy({"user": kl})
    p1 = policy.reserve(user="u")
    p2 = policy.reserve(user="u")
    p1.cancel()
    p3 = policy.reserve(user="u")
    assert (p1.delay, p2.delay, p3.delay) == (0.0, 1.0, 2.0)
    assert kl.stats()["refunds_dropped"] == 1


def test_multi_rate_give_back_covers_every_rate(clock):
    """A grant given back after a later reservation stands on its second rate only: the
    second rate keeps it (before, only the first rate's word was checked)."""
    lim = rq.Limiter(
        rq.Rate(1, per="second", burst=10),
        rq.Rate(1, per="second", burst=1, unit="tokens"),
        clock=clock,
    )
    assert lim.try_acquire(tokens=1)
    acq = lim.acquire_async(tokens=1)  # must queue: due at 1.0
    ch = Channel()
    ticket = _wait_submit(acq, ch)
    assert isinstance(ticket, int)
    lim.run_until(1.0)
    [(t, granted, _, token)] = ch.drain_tokens()
    assert (t, granted) == (ticket, True)
    later = lim.reserve(0, tokens=1)  # the requests word is unchanged; tokens at 2.0
    assert later.delay == 1.0
    _wait_give_back(acq, token)
    assert lim.reserve(0, tokens=1).delay == 2.0  # not 1.0: two grants in one slot


# ---------------------------------------------------------------------------------------
# Reservation.cancel: the same rule


def test_reservation_cancel_exact_at_any_time(clock):
    lim = one_per_second(clock)
    r = lim.reserve()
    assert r.delay == 0.0
    assert r.cancel() is True  # latest: exact, even at its own time
    assert lim.available() == 1.0
    assert r.cancel() is False
    assert lim.available() == 1.0


def test_reservation_cancel_refunds_when_nothing_is_scheduled_ahead(clock):
    lim = rq.Limiter(rq.Rate(1, per="second", burst=4), clock=clock)
    r1 = lim.reserve(2)
    lim.reserve(1)
    assert lim.available() == 1.0
    assert r1.cancel() is True  # not the latest, but every grant is at or before now
    assert lim.available() == 3.0
    assert lim.stats()["refunds_dropped"] == 0


def test_reservation_cancel_refund_is_capped_by_what_it_still_holds(clock):
    """A debit whose capacity time has already restored cannot be refunded again: 3 s
    after a grant of 1 on an idle bucket of burst 2, another grant takes 1; refunding
    the first would leave 3 admissions possible at one instant."""
    lim = rq.Limiter(rq.Rate(1, per="second", burst=2), clock=clock)
    r1 = lim.reserve()
    clock.advance(3)
    assert lim.try_acquire()
    assert r1.cancel() is False
    assert lim.available() == 1.0


def test_reservation_cancel_under_a_future_grant_is_dropped_and_counted(clock):
    lim = one_per_second(clock)
    r1 = lim.reserve()
    r2 = lim.reserve()
    assert r1.cancel() is False
    assert lim.stats()["refunds_dropped"] == 1
    assert lim.reserve().delay == 2.0
    assert r2.cancel() is False  # no longer the latest either
    clock.advance(2.5)
    assert lim.available() == pytest.approx(0.5)


# ---------------------------------------------------------------------------------------
# defect 2: a release or refund wakes the level's queue


def test_policy_release_wakes_a_concurrency_waiter(clock):
    c = rq.Concurrency(1, clock=clock)
    p = rq.Policy({"c": c}).try_acquire()
    assert p is not None
    ch = Channel()
    ticket = c.submit(ch)
    assert isinstance(ticket, int)
    assert ch.drain() == []
    assert p.release() is True
    assert ch.drain() == [(ticket, True, 0)]
    assert c.in_use == 1


def test_policy_cancel_wakes_a_rate_waiter(clock):
    lim = one_per_second(clock)
    p = rq.Policy({"r": lim}).try_acquire()
    ch = Channel()
    ticket = lim.submit(ch)
    assert isinstance(ticket, int)
    p.cancel()
    assert ch.drain() == [(ticket, True, 0)]


def test_policy_settle_refund_wakes_a_rate_waiter(clock):
    lim = rq.Limiter(rq.Rate(10, per="second", burst=10, unit="tokens"), clock=clock)
    p = rq.Policy({"r": lim}).try_acquire(tokens=8)
    ch = Channel()
    ticket = lim.submit(ch, tokens=5)
    assert isinstance(ticket, int)
    p.settle(tokens=2)
    assert ch.drain() == [(ticket, True, 0)]


def test_policy_release_wakes_a_real_clock_concurrency_waiter():
    c = rq.Concurrency(1)
    p = rq.Policy({"c": c}).try_acquire()
    got: list[object] = []
    t = threading.Thread(target=lambda: got.append(c.acquire(timeout=20)))
    t.start()
    for _ in range(500):
        if c.waiting:
            break
        time.sleep(0.01)
    assert c.waiting == 1
    p.release()
    t.join(10)  # granted at once; before the fix only at its 20 s deadline
    assert not t.is_alive()
    assert len(got) == 1
    got[0].release()


def test_policy_release_wakes_keyed_concurrency_waiters():
    kc = rq.KeyedConcurrency(1)
    policy = rq.Policy({"tenant": kc})
    p = policy.try_acquire(tenant="acme")
    got: list[object] = []
    t = threading.Thread(target=lambda: got.append(kc.acquire("acme", timeout=20)))
    t.start()
    for _ in range(500):
        if kc.stats()["waiting_keys"]:
            break
        time.sleep(0.01)
    time.sleep(0.05)
    p.release()
    t.join(10)
    assert not t.is_alive()
    assert len(got) == 1
    assert kc.in_use("acme") == 1
    got[0].release()
    assert kc.in_use("acme") == 0


# ---------------------------------------------------------------------------------------
# a threaded race of cancel vs grant on a multi-rate limiter


def _check_window(grants: list[tuple[float, int]], rate: float, burst: int) -> None:
    grants = sorted(grants)
    for i in range(len(grants)):
        total = 0
        for j in range(i, len(grants)):
            total += grants[j][1]
            span = grants[j][0] - grants[i][0]
            assert total <= burst + rate * span + 1e-6, (grants[i], grants[j], total)


def test_cancel_races_grants_without_sharing_a_slot():
    """Threads reserve and cancel on a two-rate limiter, directly and through a Policy,
    while one thread advances the clock: the grants that were kept never exceed either
    rate in any window (a slot given back under a later grant would be used twice)."""
    clock = rq.ManualClock()
    lim = rq.Limiter(
        rq.Rate(100, per="second", burst=1),
        rq.Rate(1_000, per="second", burst=20, unit="tokens"),
        clock=clock,
    )
    policy = rq.Policy({"lim": lim})
    kept: list[tuple[float, int]] = []
    lock = threading.Lock()
    clock_lock = threading.Lock()  # a policy reservation's time: now + delay
    stop = threading.Event()

    def worker(seed: int, via_policy: bool) -> None:
        rng = random.Random(seed)
        mine: list[tuple[object, float, int]] = []
        for _ in range(150):
            tokens = rng.randint(0, 12)
            if via_policy:
                with clock_lock:
                    p = policy.reserve(tokens=tokens)
                    mine.append((p, clock.now() + p.delay, tokens))
            else:
                r = lim.reserve(tokens=tokens)
                mine.append((r, r.at, tokens))
            if mine and rng.random() < 0.5:
                x = mine.pop(rng.randrange(len(mine)))
                x[0].cancel()
        with lock:
            kept.extend((at, tokens) for _, at, tokens in mine)

    def ticker() -> None:
        while not stop.is_set():
            with clock_lock:
                clock.advance(0.003)
            time.sleep(0)

    tick = threading.Thread(target=ticker)
    tick.start()
    threads = [threading.Thread(target=worker, args=(s, s % 2 == 0)) for s in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stop.set()
    tick.join()
    requests = [(round(at, 9), 1) for at, _ in kept]
    tokens = [(round(at, 9), n) for at, n in kept]
    _check_window(requests, 100, 1)
    _check_window(tokens, 1_000, 20)


# ---------------------------------------------------------------------------------------
# Permit.settle: the same rule, with the grant's own record


def test_permit_settle_does_not_refund_what_time_already_restored(clock):
    """A permit of 1 granted on an idle bucket holds nothing 5 s later: settling it to 0
    then, after another grant, must not make room for a third grant at one instant."""
    lim = rq.Limiter(rq.Rate(1, per="second", burst=2), clock=clock)
    p = lim.acquire()
    clock.advance(5)
    assert lim.try_acquire()
    p.settle(requests=0)
    assert lim.available() == 1.0


def test_keyed_permit_settle_does_not_refund_what_time_already_restored(clock):
    kl = rq.KeyedLimiter(rq.Rate(1, per="second", burst=2), clock=clock)
    p = kl.acquire("k")
    clock.advance(5)
    assert kl.try_acquire("k")
    p.settle(requests=0)
    assert kl.available("k") == 1.0


def test_permit_settle_is_exact_while_latest_even_in_debt(clock):
    lim = rq.Limiter(rq.Rate(10, per="second", burst=10, unit="tokens"), clock=clock)
    p = lim.acquire(tokens=5)
    p.settle(tokens=25)
    assert lim.available() == -15.0
    p.settle(tokens=5)  # the latest change: exact, although the bucket is in debt
    assert lim.available() == 5.0


def test_queued_permit_settle_refund_under_a_later_grant_is_dropped(clock):
    lim = rq.Limiter(rq.Rate(10, per="second", burst=10, unit="tokens"), clock=clock)
    assert lim.try_acquire(tokens=10)
    acq = lim.acquire_async(tokens=5)
    ch = Channel()
    ticket = _wait_submit(acq, ch)
    lim.run_until(0.5)
    [(t, granted, _, token)] = ch.drain_tokens()
    assert (t, granted) == (ticket, True)
    permit = _wait_granted(acq, 0, token)
    later = lim.reserve(tokens=10)  # scheduled at 1.5 s, on top of the grant
    assert later.delay == 1.0
    permit.settle(tokens=0)
    assert lim.stats()["refunds_dropped"] == 1
    assert lim.reserve(tokens=1).delay == pytest.approx(1.1)


def test_multi_rate_permit_settle_does_not_refund_what_time_already_restored(clock):
    lim = rq.Limiter(
        rq.Rate(10, per="second", burst=10),
        rq.Rate(1, per="second", burst=2, unit="tokens"),
        clock=clock,
    )
    p = lim.acquire(tokens=1)
    clock.advance(5)
    assert lim.try_acquire(tokens=1)
    p.settle(tokens=0)
    assert lim.available("tokens") == 1.0
