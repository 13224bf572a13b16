"""Behaviour of the installed package's core surface: Rate, ManualClock, Limiter,
Reservation and the error hierarchy. Every timing test runs on a ManualClock."""

from __future__ import annotations

import math
import re
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import pytest
import ratequeue as rq
from hypothesis import assume, given
from hypothesis import strategies as st

NS = 1_000_000_000


def ns(seconds: float) -> int:
    """Whole nanoseconds of a duration the library reported in seconds."""
    return round(seconds * 1e9)


# ---------------------------------------------------------------------------------------
# Rate validation
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "exc", "name"),
    [
        ({"amount": 0}, ValueError, "amount"),
        ({"amount": -1}, ValueError, "amount"),
        ({"amount": -0.5}, ValueError, "amount"),
        ({"amount": math.nan}, ValueError, "amount"),
        ({"amount": math.inf}, ValueError, "amount"),
        ({"amount": -math.inf}, ValueError, "amount"),
        ({"amount": 2e9}, ValueError, "amount"),  # faster than 1e9 per second
        ({"amount": "10"}, TypeError, "amount"),
        ({"amount": True}, TypeError, "amount"),
        ({"amount": None}, TypeError, "amount"),
        ({"amount": 1, "burst": 0}, ValueError, "burst"),
        ({"amount": 1, "burst": -1}, ValueError, "burst"),
        ({"amount": 1, "burst": 1.5}, TypeError, "burst"),
        ({"amount": 1, "burst": "2"}, TypeError, "burst"),
        ({"amount": 1, "burst": True}, TypeError, "burst"),
        # burst / rate longer than 2**56 ns (about 2.3 years)
        ({"amount": 1, "per": "day", "burst": 10**6}, ValueError, "burst"),
        ({"amount": 1, "per": "fortnight"}, ValueError, "per"),
        ({"amount": 1, "per": ""}, ValueError, "per"),
        ({"amount": 1, "per": "Minute"}, ValueError, "per"),
        ({"amount": 1, "per": 0}, ValueError, "per"),
        ({"amount": 1, "per": -60}, ValueError, "per"),
        ({"amount": 1, "per": math.nan}, ValueError, "per"),
        ({"amount": 1, "per": math.inf}, ValueError, "per"),
        ({"amount": 1, "per": [60]}, TypeError, "per"),
        ({"amount": 1, "unit": ""}, ValueError, "unit"),
        ({"amount": 1, "unit": "max_wait"}, ValueError, "unit"),
        ({"amount": 1, "unit": "timeout"}, ValueError, "unit"),
        ({"amount": 1, "unit": "two words"}, ValueError, "unit"),
    ],
)
def test_rate_rejects_bad_arguments(kwargs: dict[str, object], exc: type, name: str) -> None:
    with pytest.raises(exc, match=name):
        rq.Rate(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("per", "seconds"),
    [
        (None, 1.0),
        ("second", 1.0),
        ("seconds", 1.0),
        ("sec", 1.0),
        ("minute", 60.0),
        ("minutes", 60.0),
        ("min", 60.0),
        ("hour", 3600.0),
        ("hours", 3600.0),
        ("day", 86400.0),
        ("days", 86400.0),
        (2, 2.0),
        (0.25, 0.25),
    ],
)
def test_rate_periods(per: str | float | None, seconds: float) -> None:
    r = rq.Rate(120, per=per)
    assert r.per == seconds
    assert r.amount == 120
    assert r.per_second == pytest.approx(120 / seconds)


def test_rate_defaults_and_value_semantics() -> None:
    assert rq.Rate(10).burst == 10
    assert rq.Rate(2.7).burst == 2
    assert rq.Rate(0.5).burst == 1
    assert rq.Rate(100, per="minute").burst == 100
    assert rq.Rate(1, burst=7).burst == 7
    assert rq.Rate(1).unit == "requests"
    assert rq.Rate(5, unit="tokens").unit == "tokens"
    assert rq.Rate(5, per=60, burst=3) == rq.Rate(5, per="minute", burst=3)
    assert rq.Rate(5, burst=3) != rq.Rate(5, burst=4)
    assert rq.Rate(5, unit="tokens") != rq.Rate(5)
    assert "tokens" in repr(rq.Rate(5, unit="tokens"))


# ---------------------------------------------------------------------------------------
# Cost validation on the Limiter
# ---------------------------------------------------------------------------------------


@pytest.fixture
def single(clock: rq.ManualClock) -> rq.Limiter:
    return rq.Limiter(rq.Rate(10, burst=3), clock=clock)


@pytest.fixture
def multi(clock: rq.ManualClock) -> rq.Limiter:
    return rq.Limiter(rq.Rate(10, burst=5), rq.Rate(100, unit="tokens", burst=100), clock=clock)


CALLS = ["try_acquire", "reserve", "retry_after"]


@pytest.mark.parametrize("call", CALLS)
@pytest.mark.parametrize(
    ("args", "kwargs", "exc", "name"),
    [
        ((1.5,), {}, TypeError, "requests"),
        (("1",), {}, TypeError, "requests"),
        ((True,), {}, TypeError, "requests"),
        ((-1,), {}, ValueError, "requests"),
        ((-(2**70),), {}, ValueError, "requests"),
        ((), {"requests": 2.0}, TypeError, "requests"),
        ((), {"requests": -3}, ValueError, "requests"),
        ((), {"tokens": 1}, TypeError, "tokens"),  # a unit this limiter does not count
        ((1,), {"requests": 1}, TypeError, "requests"),  # given twice
    ],
)
def test_bad_costs_are_rejected_naming_the_unit(
    single: rq.Limiter,
    call: str,
    args: tuple[object, ...],
    kwargs: dict[str, object],
    exc: type,
    name: str,
) -> None:
    with pytest.raises(exc, match=name):
        getattr(single, call)(*args, **kwargs)
    assert single.available() == 3.0


@pytest.mark.parametrize("call", CALLS)
@pytest.mark.parametrize("cost", [4, 1000, 2**64 - 1, 2**70])
def test_cost_above_burst_is_cost_too_large(single: rq.Limiter, call: str, cost: int) -> None:
    with pytest.raises(rq.CostTooLarge) as info:
        getattr(single, call)(cost)
    err = info.value
    assert isinstance(err, ValueError)
    assert isinstance(err, rq.RateQueueError)
    assert err.retry_after == math.inf
    assert "burst of 3" in str(err)
    assert single.available() == 3.0


def test_cost_too_large_even_with_max_wait_and_names_the_unit(multi: rq.Limiter) -> None:
    with pytest.raises(rq.CostTooLarge, match="tokens") as info:
        multi.reserve(tokens=101, max_wait=1000)
    assert info.value.retry_after == math.inf
    with pytest.raises(rq.CostTooLarge, match="requests"):
        multi.try_acquire(6, tokens=1)
    assert (multi.available(), multi.available("tokens")) == (5.0, 100.0)


def test_zero_cost_is_accepted_and_consumes_nothing(single: rq.Limiter) -> None:
    assert single.try_acquire(0)
    assert single.available() == 3.0
    assert single.reserve(0).delay == 0.0
    assert single.available() == 3.0


def test_limiter_rejects_bad_construction(clock: rq.ManualClock) -> None:
    with pytest.raises(ValueError, match="rates"):
        rq.Limiter(clock=clock)
    with pytest.raises(TypeError, match="rates"):
        rq.Limiter(10, clock=clock)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="clock"):
        rq.Limiter(rq.Rate(1), clock=1.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_wait"):
        rq.Limiter(rq.Rate(1), clock=clock, max_wait=-1)


# ---------------------------------------------------------------------------------------
# ManualClock
# ---------------------------------------------------------------------------------------


def test_manual_clock_advance_and_set() -> None:
    c = rq.ManualClock()
    assert c.now() == 0.0
    assert c.now_ns() == 0
    assert c.advance(1.5) == 1.5
    assert c.now_ns() == 1_500_000_000
    assert isinstance(c.now_ns(), int)
    assert c.advance(0) == 1.5
    assert c.advance(2) == 3.5
    assert c.advance(1e-9) == pytest.approx(3.5 + 1e-9)
    assert c.now_ns() == 3_500_000_001
    assert c.set(10) == 10.0
    assert c.set(10) == 10.0  # the same time is not going back
    assert c.now_ns() == 10 * NS
    assert "10" in repr(c)


def test_manual_clock_start() -> None:
    assert rq.ManualClock(5).now_ns() == 5 * NS
    assert rq.ManualClock(0.25).now() == 0.25
    with pytest.raises(ValueError, match="start"):
        rq.ManualClock(-1)


def test_manual_clock_refuses_to_go_back() -> None:
    c = rq.ManualClock(10)
    with pytest.raises(ValueError, match="seconds"):
        c.set(9.999)
    with pytest.raises(ValueError, match="seconds"):
        c.advance(-1)
    assert c.now_ns() == 10 * NS


@pytest.mark.parametrize(
    ("value", "exc"),
    [(math.nan, ValueError), (math.inf, ValueError), ("1", TypeError), (None, TypeError)],
)
def test_manual_clock_rejects_bad_seconds(value: object, exc: type) -> None:
    c = rq.ManualClock(1)
    with pytest.raises(exc, match="seconds"):
        c.advance(value)  # type: ignore[arg-type]
    with pytest.raises(exc, match="seconds"):
        c.set(value)  # type: ignore[arg-type]
    assert c.now_ns() == NS


def test_manual_clock_refuses_to_leave_its_range() -> None:
    c = rq.ManualClock()
    with pytest.raises(ValueError):
        c.advance(1e12)  # ~31,700 years, beyond 2**62 ns
    assert c.now_ns() == 0


def test_monotonic_clock_never_goes_back() -> None:
    c = rq.MonotonicClock()
    a = c.now_ns()
    b = c.now_ns()
    assert b >= a
    assert rq.Limiter(rq.Rate(1)).clock.now_ns() >= 0


def test_limiter_reads_its_clock(clock: rq.ManualClock) -> None:
    lim = rq.Limiter(rq.Rate(1, burst=1), clock=clock)
    assert lim.clock is clock
    assert lim.try_acquire()
    assert not lim.try_acquire()
    clock.advance(1)
    assert lim.try_acquire()


# ---------------------------------------------------------------------------------------
# try_acquire, available, retry_after
# ---------------------------------------------------------------------------------------


def test_try_acquire_burst_then_refusal_then_refill(
    single: rq.Limiter, clock: rq.ManualClock
) -> None:
    assert [single.try_acquire() for _ in range(4)] == [True, True, True, False]
    assert single.available() == 0.0
    assert single.retry_after() == pytest.approx(0.1, abs=1e-9)
    clock.advance(0.05)
    assert single.available() == pytest.approx(0.5)
    assert not single.try_acquire()
    clock.advance(0.05)
    assert single.try_acquire()
    assert not single.try_acquire()
    clock.advance(0.25)
    assert single.try_acquire(2)
    assert not single.try_acquire()
    # A long idle spell fills the bucket to its burst, never beyond.
    clock.advance(3600)
    assert single.available() == 3.0
    assert [single.try_acquire() for _ in range(4)] == [True, True, True, False]


def test_available_by_unit(multi: rq.Limiter, clock: rq.ManualClock) -> None:
    assert multi.available() == 5.0
    assert multi.available("requests") == 5.0
    assert multi.available("tokens") == 100.0
    assert multi.try_acquire(2, tokens=30)
    assert multi.available() == 3.0
    assert multi.available("tokens") == 70.0
    clock.advance(0.1)
    assert multi.available() == pytest.approx(4.0)
    assert multi.available("tokens") == pytest.approx(80.0)
    with pytest.raises(ValueError, match="bytes"):
        multi.available("bytes")


# From 1 per 10 minutes to 1e5 per second: an interval of at most 600 s keeps every
# schedule below ~1e15 ns, where seconds as floats still hold whole nanoseconds.
rate_amounts = st.one_of(
    st.integers(1, 10_000).map(float),
    st.floats(0.1, 50_000.0, allow_nan=False, allow_infinity=False),
)
periods = st.sampled_from([1, 60, "second", "minute", 0.5, 7.25])


@st.composite
def rates(draw: st.DrawFn, max_burst: int = 40) -> rq.Rate:
    amount = draw(rate_amounts)
    per = draw(periods)
    burst = draw(st.integers(1, max_burst))
    return rq.Rate(amount, per=per, burst=burst)


@given(
    rate=rates(),
    start=st.integers(0, 10**6),
    drain=st.lists(st.integers(0, 40), max_size=8),
    cost=st.integers(0, 40),
)
def test_retry_after_is_exact(rate: rq.Rate, start: int, drain: list[int], cost: int) -> None:
    """Advancing by exactly retry_after() admits; one nanosecond less does not."""
    cost = min(cost, rate.burst)
    clock = rq.ManualClock(start)
    lim = rq.Limiter(rate, clock=clock)
    for c in drain:
        if c <= rate.burst:
            lim.reserve(c)  # queue up some debt
    before = lim.available()
    wait = lim.retry_after(cost)
    assert lim.available() == before  # asking changes nothing
    d = ns(wait)
    assert abs(wait * 1e9 - d) < 1e-3  # whole nanoseconds
    if d == 0:
        assert lim.try_acquire(cost)
        return
    clock.advance((d - 1) / 1e9)
    assert not lim.try_acquire(cost)
    assert lim.retry_after(cost) == pytest.approx(1e-9, abs=1e-15)
    clock.advance(1e-9)
    assert lim.retry_after(cost) == 0.0
    assert lim.try_acquire(cost)


@given(rate=rates(), cost=st.integers(1, 40), k=st.integers(1, 5))
def test_advancing_by_the_reported_float_admits(rate: rq.Rate, cost: int, k: int) -> None:
    cost = min(cost, rate.burst)
    clock = rq.ManualClock()
    lim = rq.Limiter(rate, clock=clock)
    lim.reserve(rate.burst)  # empty the bucket, then queue k more
    for _ in range(k):
        lim.reserve(cost)
    wait = lim.retry_after(cost)
    assert wait > 0
    clock.advance(wait)
    assert lim.try_acquire(cost)


def test_retry_after_waits_for_the_slowest_unit(multi: rq.Limiter, clock: rq.ManualClock) -> None:
    assert multi.try_acquire(5, tokens=10)
    # requests: 1 in 0.1 s; tokens: 95 - 90 = 5 more in 0.05 s
    assert multi.retry_after(tokens=95) == pytest.approx(0.1, abs=1e-9)
    assert multi.retry_after(0, tokens=95) == pytest.approx(0.05, abs=1e-9)
    assert multi.retry_after(0, tokens=0) == 0.0


# ---------------------------------------------------------------------------------------
# reserve: the Lindley recursion, max_wait
# ---------------------------------------------------------------------------------------


def lindley(
    amount: float, per: float, burst: int, start_ns: int, arrivals: list[tuple[int, int]]
) -> list[Fraction]:
    """Exact grant delays (seconds) of a G/D/1 queue in schedule time.

    s_n = max(a_n, TAT + (c - burst)·T), then TAT <- max(TAT, s_n) + c·T, with
    T = per / amount, from a full bucket (TAT = 0)."""
    t = Fraction(per) / Fraction(amount)
    tat = Fraction(0)
    a = Fraction(start_ns, NS)
    out = []
    for gap, c in arrivals:
        a += Fraction(gap, NS)
        s = max(a, tat + (c - burst) * t)
        tat = max(tat, s) + c * t
        out.append(s - a)
    return out


@given(
    amount=rate_amounts,
    per=st.sampled_from([1, 60, 0.5, 7.25]),
    burst=st.integers(1, 30),
    start=st.integers(0, 10**6),
    arrivals=st.lists(
        st.tuples(
            st.one_of(st.just(0), st.integers(0, 10**6), st.integers(0, 10**11)),
            st.integers(0, 30),
        ),
        min_size=1,
        max_size=60,
    ),
)
def test_reserve_follows_the_lindley_recursion(
    amount: float, per: float, burst: int, start: int, arrivals: list[tuple[int, int]]
) -> None:
    arrivals = [(gap, min(c, burst)) for gap, c in arrivals]
    clock = rq.ManualClock(start)
    lim = rq.Limiter(rq.Rate(amount, per=per, burst=burst), clock=clock)
    want = lindley(amount, per, burst, start * NS, arrivals)
    now = start * NS
    for (gap, c), w in zip(arrivals, want, strict=True):
        clock.advance(gap / 1e9)
        now += gap
        assert clock.now_ns() == now
        r = lim.reserve(c)
        # Within one nanosecond (the delay is reported in whole nanoseconds).
        assert abs(ns(r.delay) - w * NS) <= 1, f"delay {r.delay} s, Lindley {float(w)} s"
        assert r.at == pytest.approx(now / 1e9 + r.delay, abs=1e-6)
        assert not r.cancelled


def test_the_burst_demo_numbers(clock: rq.ManualClock) -> None:
    """500 at once against 100/minute, burst 5: the last waits (500 - 5) * 0.6 s."""
    lim = rq.Limiter(rq.Rate(100, per="minute", burst=5), clock=clock)
    delays = [lim.reserve().delay for _ in range(500)]
    assert delays[:5] == [0.0] * 5
    for k, d in enumerate(delays[5:], start=1):
        assert d == pytest.approx(0.6 * k, abs=1e-9)
    assert delays[-1] == pytest.approx(297.0, abs=1e-9)


@given(
    rate=rates(),
    backlog=st.lists(st.integers(1, 40), min_size=1, max_size=10),
    cost=st.integers(1, 40),
    frac=st.floats(0.0, 0.999),
)
def test_reserve_over_max_wait_is_overloaded_and_consumes_nothing(
    rate: rq.Rate, backlog: list[int], cost: int, frac: float
) -> None:
    cost = min(cost, rate.burst)
    clock = rq.ManualClock()
    lim = rq.Limiter(rate, clock=clock)
    for c in backlog:
        lim.reserve(min(c, rate.burst))
    need = lim.retry_after(cost)
    assume(need > 1e-6)
    max_wait = need * frac
    assume(ns(need) - ns(max_wait) >= 1)
    before = lim.available()
    with pytest.raises(rq.Overloaded) as info:
        lim.reserve(cost, max_wait=max_wait)
    err = info.value
    assert isinstance(err, rq.RateQueueError)
    assert not isinstance(err, ValueError)
    assert err.retry_after > 0
    assert abs(err.retry_after - (need - max_wait)) <= 2e-9 + 1e-15 * need
    assert "max_wait" in str(err)
    # Nothing consumed: the same state, the same answer, and the full wait still exact.
    assert lim.available() == before
    assert lim.retry_after(cost) == need
    with pytest.raises(rq.Overloaded):
        lim.reserve(cost, max_wait=max_wait)
    r = lim.reserve(cost, max_wait=need)
    assert r.delay == need


def test_max_wait_default_from_the_limiter(clock: rq.ManualClock) -> None:
    lim = rq.Limiter(rq.Rate(1, burst=1), clock=clock, max_wait=2.5)
    assert lim.max_wait == 2.5
    assert lim.reserve().delay == 0.0
    assert lim.reserve().delay == 1.0
    assert lim.reserve().delay == 2.0
    with pytest.raises(rq.Overloaded) as info:
        lim.reserve()
    assert info.value.retry_after == pytest.approx(0.5)
    # A per-call max_wait overrides the default, either way.
    with pytest.raises(rq.Overloaded):
        lim.reserve(max_wait=1)
    assert lim.reserve(max_wait=10).delay == 3.0
    with pytest.raises(ValueError, match="max_wait"):
        lim.reserve(max_wait=-1)


def test_max_wait_zero_is_try(clock: rq.ManualClock) -> None:
    lim = rq.Limiter(rq.Rate(1, burst=2), clock=clock)
    assert lim.reserve(max_wait=0).delay == 0.0
    assert lim.reserve(max_wait=0).delay == 0.0
    with pytest.raises(rq.Overloaded) as info:
        lim.reserve(max_wait=0)
    assert info.value.retry_after == pytest.approx(1.0)
    assert lim.available() == 0.0


# ---------------------------------------------------------------------------------------
# Reservation.cancel: the refund rule
# ---------------------------------------------------------------------------------------


def test_cancel_latest_before_its_time_refunds(clock: rq.ManualClock) -> None:
    lim = rq.Limiter(rq.Rate(1, burst=1), clock=clock)
    assert lim.reserve().delay == 0.0
    r = lim.reserve()
    assert (r.delay, r.at) == (1.0, 1.0)
    assert lim.retry_after() == 2.0
    assert r.cancel() is True
    assert r.cancelled
    assert lim.retry_after() == 1.0
    assert r.cancel() is False  # only the first call has an effect
    assert lim.retry_after() == 1.0
    assert lim.reserve().delay == 1.0  # the slot went back to the queue


def test_cancel_is_refused_when_a_later_reservation_depends_on_it(clock: rq.ManualClock) -> None:
    lim = rq.Limiter(rq.Rate(1, burst=1), clock=clock)
    lim.reserve()
    r1 = lim.reserve()
    r2 = lim.reserve()
    assert (r1.delay, r2.delay) == (1.0, 2.0)
    assert r1.cancel() is False  # r2 was granted after it: the slot stays used
    assert r1.cancelled
    assert lim.retry_after() == 3.0
    assert r2.cancel() is True
    assert lim.retry_after() == 2.0
    assert r1.cancel() is False  # already cancelled once, even though now latest
    assert lim.retry_after() == 2.0


def test_calls_that_debit_nothing_do_not_block_a_cancel(clock: rq.ManualClock) -> None:
    lim = rq.Limiter(rq.Rate(1, burst=3), clock=clock)
    lim.reserve(3)
    r = lim.reserve()
    assert r.delay == 1.0
    clock.advance(0.5)
    assert not lim.try_acquire()  # refused: changes nothing
    assert lim.reserve(0).delay == 0.5  # a zero cost debits nothing
    with pytest.raises(rq.Overloaded):
        lim.reserve(max_wait=0.1)
    assert r.cancel() is True
    assert lim.retry_after() == 0.5


def test_cancel_at_or_after_its_time_follows_the_undo_rule(clock: rq.ManualClock) -> None:
    lim = rq.Limiter(rq.Rate(1, burst=1), clock=clock)
    now = lim.reserve()
    assert now.delay == 0.0
    assert now.cancel() is True  # the latest change: undone exactly, even at its time
    assert lim.available() == 1.0
    lim.reserve()
    r = lim.reserve()
    clock.set(r.at)
    assert r.cancel() is True
    assert lim.available() == 1.0
    r2 = lim.reserve()
    assert lim.try_acquire() is False
    clock.advance(0.5)
    assert r2.cancel() is True
    assert lim.available() == 1.0


def test_cancel_refunds_each_unit_where_it_is_latest(multi: rq.Limiter) -> None:
    assert multi.try_acquire(5, tokens=100)
    r1 = multi.reserve(1, tokens=50)
    assert r1.delay == pytest.approx(0.5)
    # A later reservation that debits requests but no tokens.
    r2 = multi.reserve(1, tokens=0)
    assert r2.delay == pytest.approx(0.5)
    requests, tokens = multi.available(), multi.available("tokens")
    assert r1.cancel() is True  # tokens came back, requests did not
    assert multi.available() == requests
    assert multi.available("tokens") == pytest.approx(tokens + 50)


# ---------------------------------------------------------------------------------------
# Several rates at once
# ---------------------------------------------------------------------------------------


def test_multi_rate_all_or_nothing(multi: rq.Limiter, clock: rq.ManualClock) -> None:
    assert multi.units == ["requests", "tokens"]
    assert multi.try_acquire(tokens=90)  # requests default to 1
    assert (multi.available(), multi.available("tokens")) == (4.0, 10.0)
    assert not multi.try_acquire(tokens=20)  # tokens short: requests untouched
    assert (multi.available(), multi.available("tokens")) == (4.0, 10.0)
    assert multi.try_acquire(4, tokens=0)
    assert not multi.try_acquire(tokens=1)  # requests short: tokens untouched
    assert (multi.available(), multi.available("tokens")) == (0.0, 10.0)
    assert multi.try_acquire(0, tokens=10)
    assert (multi.available(), multi.available("tokens")) == (0.0, 0.0)
    clock.advance(0.1)
    assert multi.try_acquire(requests=1, tokens=10)


def test_multi_rate_requires_every_unit_without_a_default(multi: rq.Limiter) -> None:
    for call in CALLS:
        with pytest.raises(TypeError, match="tokens"):
            getattr(multi, call)()
        with pytest.raises(TypeError, match="tokens"):
            getattr(multi, call)(1)
    assert (multi.available(), multi.available("tokens")) == (5.0, 100.0)
    two = rq.Limiter(rq.Rate(5, unit="tokens"), rq.Rate(5, unit="bytes"), clock=rq.ManualClock())
    with pytest.raises(TypeError, match="bytes"):
        two.try_acquire(tokens=1)
    assert two.try_acquire(bytes=1, tokens=1)
    assert two.try_acquire(1, bytes=1)  # positional: the first unit
    assert (two.available("tokens"), two.available("bytes")) == (3.0, 3.0)


def test_only_unit_defaults_to_one(clock: rq.ManualClock) -> None:
    lim = rq.Limiter(rq.Rate(5, unit="tokens"), clock=clock)
    assert lim.try_acquire()
    assert lim.try_acquire(tokens=2)
    assert lim.available("tokens") == 2.0


def test_same_unit_twice_applies_both_rates(clock: rq.ManualClock) -> None:
    lim = rq.Limiter(rq.Rate(10, burst=2), rq.Rate(1, burst=3), clock=clock)
    assert lim.units == ["requests"]
    assert lim.try_acquire(2)
    assert lim.available() == 0.0  # the least over both rates
    assert not lim.try_acquire()
    clock.advance(0.2)
    assert lim.available() == pytest.approx(1.2)  # 2 back on the fast one, 1.2 on the slow
    assert lim.try_acquire()


@st.composite
def multi_ops(draw: st.DrawFn) -> list[tuple[str, int, int, float | None]]:
    return draw(
        st.lists(
            st.tuples(
                st.sampled_from(["advance", "try", "reserve"]),
                st.integers(0, 6),
                st.integers(0, 110),
                st.one_of(st.none(), st.floats(0, 2)),
            ),
            max_size=60,
        )
    )


@given(ops=multi_ops())
def test_multi_rate_refusals_change_nothing(ops: list[tuple[str, int, int, float | None]]) -> None:
    clock = rq.ManualClock()
    lim = rq.Limiter(rq.Rate(10, burst=5), rq.Rate(100, unit="tokens", burst=100), clock=clock)
    for kind, req, tok, x in ops:
        before = (lim.available(), lim.available("tokens"))
        if kind == "advance":
            clock.advance(x or 0.0)
            continue
        refused = False
        try:
            if kind == "try":
                refused = not lim.try_acquire(req, tokens=tok)
            else:
                lim.reserve(req, tokens=tok, max_wait=x)
        except (rq.Overloaded, rq.CostTooLarge) as e:
            refused = True
            assert isinstance(e, rq.CostTooLarge) == (req > 5 or tok > 100)
        if refused:
            assert (lim.available(), lim.available("tokens")) == before


# ---------------------------------------------------------------------------------------
# set_rate / set_burst at run time
# ---------------------------------------------------------------------------------------


def test_set_rate_keeps_the_content_used(clock: rq.ManualClock) -> None:
    lim = rq.Limiter(rq.Rate(10, burst=10), clock=clock)
    assert lim.try_acquire(4)
    lim.set_rate(1000, burst=20)
    assert lim.rates == [rq.Rate(1000, burst=20)]
    assert lim.available() == pytest.approx(16.0)
    assert lim.try_acquire(16)
    assert not lim.try_acquire()
    assert lim.retry_after() == pytest.approx(0.001, abs=1e-9)


def test_set_rate_period_and_defaults(clock: rq.ManualClock) -> None:
    lim = rq.Limiter(rq.Rate(10, burst=3), clock=clock)
    lim.set_rate(600, per="minute")
    (r,) = lim.rates
    assert (r.amount, r.per, r.burst, r.per_second) == (600, 60.0, 3, pytest.approx(10.0))
    lim.set_rate(1)  # keeps per and burst
    assert lim.rates == [rq.Rate(1, per="minute", burst=3)]
    assert [lim.try_acquire() for _ in range(4)] == [True, True, True, False]
    assert lim.retry_after() == pytest.approx(60.0, abs=1e-9)


def test_set_burst_smaller_than_the_content_goes_into_debt(clock: rq.ManualClock) -> None:
    lim = rq.Limiter(rq.Rate(10, burst=10), clock=clock)
    assert lim.try_acquire(4)
    lim.set_burst(3)
    assert lim.rates == [rq.Rate(10, burst=3)]
    assert lim.available() == pytest.approx(-1.0)
    assert not lim.try_acquire()
    assert lim.retry_after() == pytest.approx(0.2, abs=1e-9)
    clock.advance(0.2)
    assert lim.try_acquire()
    clock.advance(100)
    assert lim.available() == 3.0


def test_set_rate_which_by_index_or_unit(multi: rq.Limiter) -> None:
    multi.set_rate(20, which="tokens")
    multi.set_burst(200, which=1)
    multi.set_rate(1, per="minute", burst=7, which=0)
    assert multi.rates == [
        rq.Rate(1, per="minute", burst=7),
        rq.Rate(20, burst=200, unit="tokens"),
    ]
    assert multi.available("tokens") == 200.0
    multi.set_burst(2, which="requests")
    assert multi.rates[0].burst == 2


@pytest.mark.parametrize(
    ("which", "exc"),
    [("bytes", ValueError), (2, ValueError), (99, ValueError), (1.0, TypeError), ([0], TypeError)],
)
def test_set_rate_bad_which(multi: rq.Limiter, which: object, exc: type) -> None:
    before = multi.rates
    with pytest.raises(exc, match="which"):
        multi.set_rate(1, which=which)  # type: ignore[arg-type]
    with pytest.raises(exc, match="which"):
        multi.set_burst(1, which=which)  # type: ignore[arg-type]
    assert multi.rates == before


def test_set_rate_negative_which_is_a_value_error(multi: rq.Limiter) -> None:
    with pytest.raises(ValueError, match="which"):
        multi.set_rate(1, which=-1)


def test_set_rate_which_ambiguous_unit(clock: rq.ManualClock) -> None:
    lim = rq.Limiter(rq.Rate(10), rq.Rate(1, burst=2), clock=clock)
    with pytest.raises(ValueError, match="several"):
        lim.set_rate(5, which="requests")
    lim.set_rate(5, which=1)
    assert lim.rates[1] == rq.Rate(5, burst=2)


@pytest.mark.parametrize(
    ("args", "kwargs", "exc", "name"),
    [
        ((0,), {}, ValueError, "amount"),
        ((math.nan,), {}, ValueError, "amount"),
        (("5",), {}, TypeError, "amount"),
        ((5,), {"per": "fortnight"}, ValueError, "per"),
        ((5,), {"per": 0}, ValueError, "per"),
        ((5,), {"burst": 0}, ValueError, "burst"),
        ((5,), {"burst": 1.5}, TypeError, "burst"),
        ((2e9,), {}, ValueError, "amount"),
    ],
)
def test_set_rate_rejects_bad_values_and_changes_nothing(
    single: rq.Limiter, args: tuple[object, ...], kwargs: dict[str, object], exc: type, name: str
) -> None:
    with pytest.raises(exc, match=name):
        single.set_rate(*args, **kwargs)  # type: ignore[arg-type]
    assert single.rates == [rq.Rate(10, burst=3)]


@pytest.mark.parametrize(
    ("burst", "exc"), [(0, ValueError), (-1, ValueError), (2.0, TypeError), ("2", TypeError)]
)
def test_set_burst_rejects_bad_values_and_changes_nothing(
    single: rq.Limiter, burst: object, exc: type
) -> None:
    with pytest.raises(exc, match="burst"):
        single.set_burst(burst)  # type: ignore[arg-type]
    assert single.rates == [rq.Rate(10, burst=3)]


# ---------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------


def test_error_hierarchy() -> None:
    for cls in (rq.Overloaded, rq.WaitTimeout, rq.CostTooLarge):
        assert issubclass(cls, rq.RateQueueError)
        assert cls.__name__ in rq.__all__
    assert issubclass(rq.RateQueueError, Exception)
    assert issubclass(rq.CostTooLarge, ValueError)
    assert not issubclass(rq.Overloaded, ValueError)
    assert not issubclass(rq.WaitTimeout, ValueError)
    assert rq.Overloaded("x").retry_after == 0.0
    assert rq.WaitTimeout("x", 2).retry_after == 2.0
    assert rq.CostTooLarge("x").retry_after == math.inf
    assert str(rq.Overloaded("queue full", 1.5)) == "queue full"


# ---------------------------------------------------------------------------------------
# The window invariant on the Python surface
# ---------------------------------------------------------------------------------------


def worst_window(grants: list[tuple[int, int]], per_ns: float, burst: int) -> float:
    """Largest excess of admitted cost over burst + rate·d across windows [s, s+d]."""
    at: dict[int, int] = {}
    for t, c in grants:
        at[t] = at.get(t, 0) + c
    times = sorted(at)
    worst = -math.inf
    for i, s in enumerate(times):
        total = 0
        for e in times[i:]:
            total += at[e]
            worst = max(worst, total - burst - per_ns * (e - s))
    return worst


@given(
    rate=rates(max_burst=20),
    ops=st.lists(
        st.tuples(
            st.sampled_from(["advance", "try", "reserve"]),
            st.integers(0, 22),
            st.floats(0, 3),
            st.one_of(st.none(), st.floats(0, 10)),
        ),
        max_size=80,
    ),
)
def test_window_invariant(rate: rq.Rate, ops: list[tuple[str, int, float, float | None]]) -> None:
    """Admitted cost in any window [s, s+d] is at most burst + rate·d (schedule time)."""
    clock = rq.ManualClock()
    lim = rq.Limiter(rate, clock=clock)
    interval = 1.0 / rate.per_second
    grants: list[tuple[int, int]] = []
    for kind, cost, steps, max_wait in ops:
        if kind == "advance":
            clock.advance(steps * interval)
        elif kind == "try":
            try:
                if lim.try_acquire(cost):
                    grants.append((clock.now_ns(), cost))
            except rq.CostTooLarge:
                assert cost > rate.burst
        else:
            now = clock.now_ns()
            try:
                r = lim.reserve(cost, max_wait=None if max_wait is None else max_wait * interval)
            except rq.CostTooLarge:
                assert cost > rate.burst
            except rq.Overloaded:
                pass
            else:
                grants.append((now + ns(r.delay), cost))
    per_ns = rate.per_second / 1e9
    # 1e-6 units for float, plus one clock tick (< 1 ns) of rate: see the Rust invariants.
    assert worst_window(grants, per_ns, rate.burst) <= 1e-6 + per_ns


# ---------------------------------------------------------------------------------------
# The demo
# ---------------------------------------------------------------------------------------


#: The demo under a CPU budget (the child's own CPU seconds, whatever the machine's load):
#: a runaway loop is killed (SIGXCPU) after it, a hang is caught by the wall-clock guard.
_BUDGETED = """
import resource, runpy, sys
cpu = int(sys.argv.pop(1))
resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 10))  # SIGXCPU, then SIGKILL
sys.argv[0] = "ratequeue"
runpy.run_module("ratequeue", run_name="__main__")
"""


@pytest.mark.timeout(660)  # past the wall-clock guard below
def test_demo_runs(tmp_path: Path) -> None:
    """``python -m ratequeue demo`` end to end: the burst table, then the lab's scenario
    (every load level and strategy, the burst, M/M/1 and M/D/1, the JSON, CSV and plot),
    with 3,000 arrivals per level instead of 30,000. The demo is CPU bound in virtual time
    (about 24 s of CPU at 30,000, 8 s at 3,000 with the plot): at load 10-19 on two cores
    it got 5-10 % of a core and ran past a 120 s wall-clock timeout. So the bound is the
    child's CPU (60 s, killed past it), and the wall clock only guards against a hang."""
    args = ["demo", "--per-level", "3000", "--out", str(tmp_path), "--no-progress"]
    run = subprocess.run(
        [sys.executable, "-c", _BUDGETED, "60", *args],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, (run.returncode, run.stderr[-3000:])
    out = run.stdout
    # policy, admitted, refused, p50, p95, p99, max
    row = re.compile(r"^(unbounded queue|max_wait)\S*(?: s)?\s+(\d+)\s+(\d+)((?:\s+[\d.]+){4})\s*$")
    rows = {}
    for line in out.splitlines():
        m = row.match(line)
        if m:
            pcts = [float(x) for x in m.group(4).split()]
            rows[m.group(1)] = (int(m.group(2)), int(m.group(3)), pcts)
    assert set(rows) == {"unbounded queue", "max_wait"}, out
    admitted, refused, (p50, p95, p99, top) = rows["unbounded queue"]
    assert (admitted, refused) == (500, 0)
    assert top == pytest.approx(297.0, abs=0.01)
    assert p50 <= p95 <= p99 <= top
    admitted, refused, (p50, p95, p99, top) = rows["max_wait"]
    assert admitted + refused == 500
    assert refused > 0
    assert admitted >= 5
    assert p50 <= p95 <= p99 <= top <= 5.0
    # the lab's scenario: a table per load level and for the burst, every strategy in each
    strategies = (
        "naive retry on 429",
        "token bucket, unbounded queue",
        "bounded wait, max_wait=5 s",
        "priority: interactive",
        "priority: batch",
        "pool 2x limit, max_wait=5 s",
    )
    tables = re.split(r"^(?=rho = |burst of 500 at once)", out, flags=re.M)[1:]
    heads = [t.split(":", 1)[0] for t in tables]
    assert heads == [f"rho = {r:g}" for r in (0.5, 0.7, 0.8, 0.9, 0.95, 0.98)] + [
        "burst of 500 at once"
    ], out
    for t in tables:
        names = [line[:34].rstrip() for line in t.splitlines()]
        assert all(s in names for s in strategies), t
    assert out.count("M/D/1, burst 5 (exact)") == 6
    files = ("demo.json", "demo.csv", "demo.png")
    assert "wrote " + ", ".join(str(tmp_path / f) for f in files) in out
    assert all((tmp_path / f).stat().st_size > 0 for f in files)
