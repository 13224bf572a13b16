"""A limiter counts time from its own epoch: any clock reading works, far from zero too.

Issue 10, defect 4: ticks were counted from the clock's origin, so on a clock showing an
epoch timestamp (or 2**62 ns) every request was refused, ``retry_after`` said 0.0,
``reserve`` reported an 18e9 s wait and ``run_until`` could spin forever. Each test runs
on clocks started at 0, at ``time.time()`` and at 2**62 ns, and must behave alike.
"""

from __future__ import annotations

import threading
import time

import pytest
import ratequeue as rq
from ratequeue._ratequeue import Channel

STARTS = [0.0, float(int(time.time())), 2**62 / 1e9]
IDS = ["zero", "unix-now", "2**62ns"]
DAY = 86_400.0
YEAR = 365.25 * DAY


@pytest.fixture(params=STARTS, ids=IDS)
def start(request: pytest.FixtureRequest) -> float:
    return float(request.param)


def _bounded(fn, limit: float = 20.0):
    """Runs fn in a thread; fails (instead of hanging) if it does not return in time."""
    out: list[object] = []
    err: list[BaseException] = []

    def run() -> None:
        try:
            out.append(fn())
        except BaseException as e:
            err.append(e)

    th = threading.Thread(target=run, daemon=True)
    th.start()
    th.join(limit)
    assert not th.is_alive(), f"{fn} did not return within {limit} s (spinning?)"
    if err:
        raise err[0]
    return out[0]


def test_limiter_admits_and_tells_the_wait(start: float) -> None:
    clock = rq.ManualClock(start)
    lim = rq.Limiter(rq.Rate(10, per="second", burst=2), clock=clock)
    assert lim.try_acquire()
    assert lim.try_acquire()
    assert not lim.try_acquire()
    assert lim.retry_after() == pytest.approx(0.1, abs=1e-6)
    assert lim.available() == pytest.approx(0.0, abs=1e-6)
    clock.advance(0.1)
    assert lim.try_acquire()
    assert not lim.try_acquire()
    r = lim.reserve()
    assert r.delay == pytest.approx(0.1, abs=1e-6)
    with pytest.raises(rq.Overloaded) as e:
        lim.reserve(max_wait=0.15)
    assert e.value.retry_after == pytest.approx(0.05, abs=1e-6)
    assert r.cancel()
    clock.advance(10)
    assert lim.available() == pytest.approx(2.0)


def test_limiter_queue_runs_in_virtual_time(start: float) -> None:
    clock = rq.ManualClock(start)
    lim = rq.Limiter(rq.Rate(10, per="second", burst=1), clock=clock)
    assert lim.try_acquire()
    ch = Channel()
    tickets = [lim.submit(ch) for _ in range(3)]
    assert all(isinstance(t, int) for t in tickets)
    assert lim.predicted_wait() == pytest.approx(0.4, abs=1e-6)
    assert lim.next_wake() == pytest.approx(start + 0.1, abs=1e-6)
    _bounded(lambda: lim.run_until(start + 1.0))
    got = ch.drain()
    assert [g[1] for g in got] == [True, True, True]
    assert [g[2] / 1e9 for g in got] == pytest.approx([0.1, 0.2, 0.3], abs=1e-6)
    assert lim.waiting == 0
    assert clock.now() == pytest.approx(start + 1.0, abs=1e-6)


def test_keyed_limiter(start: float) -> None:
    clock = rq.ManualClock(start)
    kl = rq.KeyedLimiter(rq.Rate(10, per="second", burst=2), clock=clock)
    assert kl.try_acquire("a")
    assert kl.try_acquire("a", 1)
    assert not kl.try_acquire("a")
    assert kl.retry_after("a") == pytest.approx(0.1, abs=1e-6)
    assert kl.available("b") == 2.0
    out = kl.try_acquire_many([1, 1, 1, 2], None)
    assert list(out) == [True, True, False, True]
    clock.advance(0.1)
    assert kl.try_acquire("a")
    assert not kl.try_acquire("a")


def test_keyed_limiter_waiters_in_virtual_time(start: float) -> None:
    clock = rq.ManualClock(start)
    kl = rq.KeyedLimiter(rq.Rate(2, per="second", burst=1), clock=clock)
    assert kl.try_acquire("a")
    waited: list[float] = []
    th = threading.Thread(target=lambda: waited.append(kl.acquire("a").waited), daemon=True)
    th.start()
    end = time.monotonic() + 5
    # queued, not only announced: the key's gate exists (waiting_keys) a moment before its
    # waiter is in the queue, and retry_after counts the queued waiter
    while kl.retry_after("a") < 0.9 and time.monotonic() < end:
        time.sleep(0.001)
    assert kl.retry_after("a") == pytest.approx(1.0, abs=1e-6)
    _bounded(lambda: kl.run_until(start + 2.0))
    th.join(5)
    assert waited == [pytest.approx(0.5, abs=1e-6)]


def test_policy(start: float) -> None:
    clock = rq.ManualClock(start)
    user = rq.KeyedLimiter(rq.Rate(1, per="second", burst=2), clock=clock)
    cluster = rq.Limiter(rq.Rate(10, per="second", burst=3), clock=clock)
    policy = rq.Policy({"user": user, "cluster": cluster})
    assert policy.try_acquire(user="u") is not None
    assert policy.try_acquire(user="u") is not None
    assert policy.try_acquire(user="u") is None
    assert policy.try_acquire(user="v") is not None
    assert policy.try_acquire(user="w") is None  # the cluster is empty
    p = policy.reserve(user="w")
    assert p.delay == pytest.approx(0.1, abs=1e-6)
    p = policy.reserve(user="u")
    assert p.delay == pytest.approx(1.0, abs=1e-6)
    # Policy.acquire on a ManualClock: no sleep, the delay tells the wait
    p = _bounded(lambda: policy.acquire(user="x"))
    assert p.delay == pytest.approx(0.9, abs=1e-6)  # behind the cluster grant at 1.0


def test_one_per_day_for_120_years_admits_the_exact_count(start: float) -> None:
    clock = rq.ManualClock(start)
    lim = rq.Limiter(rq.Rate(1, per="day", burst=1), clock=clock)
    days = int(120 * YEAR / DAY)
    admitted = 0
    for _ in range(days):
        admitted += lim.try_acquire()
        assert not lim.try_acquire()
        clock.advance(DAY)
    assert admitted == days
    assert lim.retry_after() == 0.0


def test_keyed_one_per_day_for_120_years(start: float) -> None:
    clock = rq.ManualClock(start)
    kl = rq.KeyedLimiter(rq.Rate(1, per="day", burst=1), clock=clock)
    days = int(120 * YEAR / DAY)
    admitted = 0
    for _ in range(days):
        admitted += kl.try_acquire("k")
        clock.advance(DAY)
    assert admitted == days


def test_a_long_jump_keeps_the_bucket_exact(start: float) -> None:
    clock = rq.ManualClock(start)
    lim = rq.Limiter(rq.Rate(1, per="second", burst=3), clock=clock)
    assert lim.try_acquire(3)
    clock.advance(100 * YEAR)
    assert lim.available() == 3.0
    assert lim.try_acquire(3)
    assert lim.retry_after() == pytest.approx(1.0, abs=1e-6)


def test_a_time_beyond_the_range_is_a_clear_error(start: float) -> None:
    clock = rq.ManualClock(start)
    lim = rq.Limiter(rq.Rate(1, per="second"), clock=clock)
    with pytest.raises(ValueError, match=r"seconds=.*range"):
        clock.advance(400 * YEAR)
    with pytest.raises(ValueError, match=r"until=.*range"):
        _bounded(lambda: lim.run_until(start + 400 * YEAR))
    assert clock.now() == start
    with pytest.raises(ValueError, match=r"start=.*range"):
        rq.ManualClock(400 * YEAR)


def test_the_clock_reaches_a_century_after_an_epoch_start() -> None:
    clock = rq.ManualClock(2**62 / 1e9)
    assert clock.advance(120 * YEAR) == pytest.approx(2**62 / 1e9 + 120 * YEAR)


def test_due_times_in_float_seconds_reach_their_nanosecond(start: float) -> None:
    """Far from zero a float second is coarser than a nanosecond: a due time read as
    seconds and passed back to run_until must still reach it (the lab's loop spun)."""
    from ratequeue.lab.engine import VirtualTime

    t0 = start + 0.123456789
    vt = VirtualTime(rq.ManualClock(t0))
    lim = vt.limiter(rq.Rate(7, per="second", burst=1))
    seen: list[float] = []
    for i in range(50):
        vt.at(t0 + i * 0.01, lambda: vt.submit(lim, lambda ok, w: seen.append(w)))
    _bounded(lambda: vt.run(t0 + 100))
    assert len(seen) == 50
    assert seen[-1] == pytest.approx(49 / 7 - 0.49, abs=1e-6)


def test_set_rate_far_from_zero_keeps_the_content(start: float) -> None:
    clock = rq.ManualClock(start)
    lim = rq.Limiter(rq.Rate(10, per="second", burst=4), clock=clock)
    assert lim.try_acquire(3)
    lim.set_rate(100, per="second", burst=8)
    assert lim.available() == pytest.approx(5.0, abs=1e-6)
    clock.advance(20 * YEAR)
    lim.set_rate(1, per="second", burst=2)
    assert lim.available() == 2.0
    assert lim.try_acquire(2)
    assert lim.retry_after() == pytest.approx(1.0, abs=1e-6)


def test_setting_the_clock_to_its_own_reading_is_no_step_back(start: float) -> None:
    clock = rq.ManualClock(start)
    for _ in range(200):
        clock.advance(0.0000003)
        ns = clock.now_ns()
        assert clock.set(clock.now()) == clock.now()
        assert clock.now_ns() == ns
    clock.advance(1)
    with pytest.raises(ValueError, match="never goes back"):
        clock.set(clock.now() - 0.001)
