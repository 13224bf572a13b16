"""Limiter.pause: the debt a provider's 429 puts the local bucket in, until its reset."""

from __future__ import annotations

import math

import pytest
import ratequeue as rq


def two_rates(clock: rq.ManualClock) -> rq.Limiter:
    return rq.Limiter(
        rq.Rate(10, per="second", burst=5),
        rq.Rate(1_000, per="second", burst=1_000, unit="tokens"),
        clock=clock,
    )


def test_nothing_is_admitted_before_the_end_then_one_unit() -> None:
    clock = rq.ManualClock()
    lim = two_rates(clock)
    assert lim.pause(3.0)
    assert lim.retry_after(tokens=1) == pytest.approx(3.0, abs=1e-6)
    clock.advance(2.999)
    assert not lim.try_acquire(tokens=1)
    clock.advance(0.001)
    assert lim.try_acquire(tokens=1)
    assert not lim.try_acquire(tokens=1)  # one request at the end, then the rate


def test_a_pause_never_shortens_a_longer_one_and_does_not_add_up() -> None:
    clock = rq.ManualClock()
    lim = two_rates(clock)
    assert lim.pause(10.0)
    assert not lim.pause(10.0)
    assert not lim.pause(2.0)
    assert lim.retry_after(tokens=1) == pytest.approx(10.0, abs=1e-6)


def test_pausing_one_unit_leaves_the_others() -> None:
    clock = rq.ManualClock()
    lim = two_rates(clock)
    lim.pause(5.0, unit="requests")
    assert lim.available("tokens") == 1_000
    assert lim.available() < 0


def test_queued_waiters_are_granted_after_the_pause_in_order() -> None:
    clock = rq.ManualClock()
    lim = rq.Limiter(rq.Rate(10, per="second", burst=1), clock=clock)
    assert lim.try_acquire()
    ch = rq._ratequeue.Channel()
    tickets = [lim.submit(ch) for _ in range(3)]
    assert all(isinstance(t, int) for t in tickets)
    lim.pause(2.0)
    lim.run_until(1.999)
    assert ch.drain() == []
    lim.run_until(2.2)
    granted = [t for t, ok, _ in ch.drain() if ok]
    assert granted == tickets


@pytest.mark.parametrize(
    ("args", "kwargs", "error"),
    [
        ((-1,), {}, ValueError),
        ((math.nan,), {}, ValueError),
        ((math.inf,), {}, ValueError),
        (("1",), {}, TypeError),
        ((None,), {}, TypeError),
        ((1.0,), {"unit": "widgets"}, ValueError),
        ((1.0,), {"unit": 3}, TypeError),
    ],
)
def test_bad_arguments(args: tuple[object, ...], kwargs: dict[str, object], error: type) -> None:
    lim = two_rates(rq.ManualClock())
    with pytest.raises(error):
        lim.pause(*args, **kwargs)  # type: ignore[arg-type]


def test_a_huge_pause_saturates_instead_of_overflowing() -> None:
    lim = two_rates(rq.ManualClock())
    assert lim.pause(1e30)
    assert lim.retry_after(tokens=1) > 1e9
