"""The Lua scripts decide exactly as the Rust core, call by call, on random sequences.

Both sides run on one ``rq.ManualClock``: the Redis limiters pass its time to the
script (test mode) instead of the server's TIME. Rates are chosen so that the interval
T = per / amount is a whole number of microseconds and every clock step is a whole
number of microseconds: then the script's integer-microsecond arithmetic and the core's
sub-nanosecond ticks are both exact, and every decision, wait and retry_after agrees
to the nanosecond.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import pytest
import ratequeue as rq
import redis
from hypothesis import given, settings
from hypothesis import strategies as st
from ratequeue.redis import RedisKeyedLimiter, RedisLimiter, RedisPolicy
from redis_server import RedisServer

# amount per second -> T in whole microseconds (and not just below a power of two in
# nanoseconds, where the core's tick rounding has no slack).
AMOUNTS = [1, 2, 4, 5, 8, 10, 16, 20, 25, 40, 50, 100, 125, 200, 250, 500, 1000]
_ids = itertools.count()
# Each example costs tens of round trips: cap the CI profile's count.
few = settings(max_examples=min(settings.default.max_examples, 200))


@pytest.fixture(scope="module")
def r(redis_server: RedisServer) -> Iterator[redis.Redis]:
    """One client for the module (hypothesis runs many examples per test)."""
    c = redis_server.client()
    yield c
    c.close()


def prefix() -> str:
    return f"parity{next(_ids)}"


@st.composite
def rates(draw: st.DrawFn, units: tuple[str, ...] = ("requests", "tokens")) -> list[rq.Rate]:
    n = draw(st.integers(1, 3))
    out = []
    for i in range(n):
        amount = draw(st.sampled_from(AMOUNTS))
        per = draw(st.sampled_from([1, 2, 60]))
        burst = draw(st.integers(1, 12))
        unit = units[0] if i == 0 else draw(st.sampled_from(units))
        out.append(rq.Rate(amount * per, per=per, burst=burst, unit=unit))
    return out


def step_us(draw: st.DrawFn, rates_: list[rq.Rate]) -> int:
    t = max(round(r.per * 1e6 / r.amount) for r in rates_)
    return draw(st.one_of(st.just(0), st.integers(0, 3 * t), st.integers(0, 50)))


def ns(seconds: float) -> int:
    return round(seconds * 1e9)


def costs_of(draw: st.DrawFn, units: list[str], top: int) -> dict[str, int]:
    return {u: draw(st.integers(0, top)) for u in units}


@few
@given(data=st.data(), rs=rates())
def test_limiter_matches_core(r, data: st.DataObject, rs: list[rq.Rate]) -> None:
    clock = rq.ManualClock()
    core = rq.Limiter(*rs, clock=clock)
    red = RedisLimiter(r, *rs, name="lim", prefix=prefix(), clock=clock)
    top = max(x.burst for x in rs) + 1
    for _ in range(data.draw(st.integers(5, 40))):
        clock.advance(step_us(data.draw, rs) / 1e6)
        costs = costs_of(data.draw, core.units, top)
        op = data.draw(st.sampled_from(["try", "try", "reserve", "retry", "available"]))
        if op == "try":
            try:
                want: object = core.try_acquire(**costs)
            except rq.CostTooLarge:
                want = "too large"
            try:
                got: object = red.try_acquire(**costs)
            except rq.CostTooLarge:
                got = "too large"
        elif op == "reserve":
            mw = data.draw(st.one_of(st.none(), st.integers(0, 200_000).map(lambda u: u / 1e6)))
            try:
                want = ns(core.reserve(max_wait=mw, **costs).delay)
            except rq.Overloaded as e:
                want = ("overloaded", ns(e.retry_after))
            except rq.CostTooLarge:
                want = "too large"
            try:
                got = ns(red.reserve(max_wait=mw, **costs).delay)
            except rq.Overloaded as e:
                got = ("overloaded", ns(e.retry_after))
            except rq.CostTooLarge:
                got = "too large"
        elif op == "retry":
            try:
                want = ns(core.retry_after(**costs))
            except rq.CostTooLarge:
                want = "too large"
            try:
                got = ns(red.retry_after(**costs))
            except rq.CostTooLarge:
                got = "too large"
        else:
            unit = data.draw(st.sampled_from(core.units))
            # available() is a float: the core reads its clock in sub-ns ticks.
            want = pytest.approx(core.available(unit), abs=1e-5)
            got = red.available(unit)
        assert got == want, (op, costs, clock.now_ns())


@few
@given(data=st.data(), amount=st.sampled_from(AMOUNTS), burst=st.integers(1, 10))
def test_keyed_matches_core(r, data: st.DataObject, amount: int, burst: int) -> None:
    clock = rq.ManualClock()
    rate = rq.Rate(amount, per=1, burst=burst)
    core = rq.KeyedLimiter(rate, clock=clock)
    red = RedisKeyedLimiter(r, rate, name="user", prefix=prefix(), clock=clock)
    for _ in range(data.draw(st.integers(5, 40))):
        clock.advance(step_us(data.draw, [rate]) / 1e6)
        key = data.draw(st.sampled_from(["alice", "bob", b"carol", 7]))
        cost = data.draw(st.integers(0, burst + 1))
        op = data.draw(st.sampled_from(["try", "try", "retry", "available"]))
        if op == "try":
            try:
                want: object = core.try_acquire(key, cost)
            except rq.CostTooLarge:
                want = "too large"
            try:
                got: object = red.try_acquire(key, cost)
            except rq.CostTooLarge:
                got = "too large"
        elif op == "retry":
            try:
                want = ns(core.retry_after(key, cost))
            except rq.CostTooLarge:
                want = "too large"
            try:
                got = ns(red.retry_after(key, cost))
            except rq.CostTooLarge:
                got = "too large"
        else:
            want = pytest.approx(core.available(key), abs=1e-5)
            got = red.available(key)
        assert got == want, (op, key, cost, clock.now_ns())


@few
@given(
    data=st.data(),
    user_amount=st.sampled_from(AMOUNTS),
    user_burst=st.integers(1, 6),
    cluster=rates(),
    shadow=st.sampled_from([(), ("user",), ("cluster",)]),
)
def test_policy_matches_core(
    r,
    data: st.DataObject,
    user_amount: int,
    user_burst: int,
    cluster: list[rq.Rate],
    shadow: tuple[str, ...],
) -> None:
    clock = rq.ManualClock()
    user = rq.Rate(user_amount, per=1, burst=user_burst)
    core = rq.Policy(
        {"user": rq.KeyedLimiter(user, clock=clock), "cluster": rq.Limiter(*cluster, clock=clock)},
        shadow=list(shadow),
    )
    red = RedisPolicy(
        r,
        {"user": rq.KeyedLimiter(user), "cluster": rq.Limiter(*cluster)},
        name="api",
        prefix=prefix(),
        shadow=shadow,
        clock=clock,
    )
    units = rq.Limiter(*cluster).units
    top = max(x.burst for x in [*cluster, user])
    for _ in range(data.draw(st.integers(5, 30))):
        clock.advance(step_us(data.draw, [user, *cluster]) / 1e6)
        kw: dict[str, object] = {"user": data.draw(st.sampled_from(["a", "b"]))}
        kw.update(costs_of(data.draw, units, top))
        if "requests" not in kw:
            kw["requests"] = data.draw(st.integers(0, 2))
        if data.draw(st.booleans()):
            try:
                p = core.try_acquire(**kw)
                want: object = p is not None
            except rq.CostTooLarge:
                want = "too large"
            try:
                got: object = red.try_acquire(**kw) is not None
            except rq.CostTooLarge:
                got = "too large"
                # The core checks the burst level by level and answers None when an
                # earlier level refuses first; Redis checks every burst up front.
                if want is False:
                    want = "too large"
        else:
            mw = data.draw(st.one_of(st.none(), st.integers(0, 200_000).map(lambda u: u / 1e6)))
            try:
                want = ns(core.reserve(max_wait=mw, **kw).delay)
            except rq.Overloaded as e:
                want = ("overloaded", ns(e.retry_after))
            except rq.CostTooLarge:
                want = "too large"
            try:
                got = ns(red.reserve(max_wait=mw, **kw).delay)
            except rq.Overloaded as e:
                got = ("overloaded", ns(e.retry_after))
            except rq.CostTooLarge:
                got = "too large"
        assert got == want, (kw, clock.now_ns())
    assert red.stats()["admitted"] == core.stats()["admitted"]


def test_reservation_cancel_matches_core(r) -> None:
    """The refund rule: a cancel gives back only where no later reservation stands."""
    clock = rq.ManualClock()
    rate = rq.Rate(10, per=1, burst=2)
    core = rq.Limiter(rate, clock=clock)
    red = RedisLimiter(r, rate, name="cancel", prefix=prefix(), clock=clock)
    for lim in (core, red):
        lim.try_acquire()
        lim.try_acquire()
    a, ra = core.reserve(), red.reserve()
    b, rb = core.reserve(), red.reserve()
    assert (ns(a.delay), ns(b.delay)) == (ns(ra.delay), ns(rb.delay)) == (100_000_000, 200_000_000)
    assert a.cancel() is ra.cancel() is False  # b stands after a
    assert b.cancel() is rb.cancel() is True
    assert ns(core.retry_after()) == ns(red.retry_after()) == 200_000_000


@pytest.mark.parametrize("amount", [3, 7, 90_000 / 60])
def test_inexact_intervals_stay_close(r, amount: float) -> None:
    """When T is not whole microseconds each debit rounds to 0.5 us at most: no drift."""
    clock = rq.ManualClock()
    rate = rq.Rate(amount, per=1, burst=5)
    core = rq.Limiter(rate, clock=clock)
    red = RedisLimiter(r, rate, name="inexact", prefix=prefix(), clock=clock)
    admitted_core = admitted_red = 0
    for _ in range(300):
        clock.advance(0.5 / amount)
        admitted_core += core.try_acquire()
        admitted_red += red.try_acquire()
    assert abs(admitted_core - admitted_red) <= 1
