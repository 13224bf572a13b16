"""The wait queue's contract (DESIGN.md, "Waiting = a reservation in a queue").

Everything whose outcome depends on time runs on a ManualClock driven by
``Limiter.run_until`` (the virtual-time driver): grants are compared with an
independent Lindley recursion in exact fractions, fair shares are counted over a
backlogged window, and cancellations/timeouts are checked against the counters and
the bucket's capacity. Real-time tests (threads, Ctrl-C) only smoke-test the driver
thread and use wide tolerances.
"""

from __future__ import annotations

import asyncio
import random
import signal
import threading
import time
from fractions import Fraction

import pytest
import ratequeue as rq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

NS = 10**9

# ---------------------------------------------------------------------------------------
# helpers


def lindley(arrivals_ns, costs, interval, burst):
    """Grant times (exact Fractions of a second) of a G/D/1 FIFO queue in front of GCRA.

    T = ``interval`` seconds per unit; s_n = max(a_n, TAT + (c - burst)·T),
    TAT <- max(TAT, s_n) + c·T, starting from a full bucket.
    """
    tat = Fraction(0)
    out = []
    for a_ns, c in zip(arrivals_ns, costs, strict=True):
        a = Fraction(a_ns, NS)
        s = max(a, tat + (c - burst) * interval)
        tat = max(tat, s) + c * interval
        out.append(s)
    return out


def interval_of(amount, per):
    return Fraction(per) / Fraction(amount)


def waited_ns(permit):
    return round(permit.waited * NS)


async def settle(rounds=4):
    """Let the loop run a few iterations: tasks submit, the channel is drained, futures
    resolve. Nothing here moves the (manual) clock."""
    for _ in range(rounds):
        await asyncio.sleep(0)


async def acquire_in_task(limiter, *args, **kwargs):
    return await limiter.acquire_async(*args, **kwargs)


def wait_until(pred, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.0005)


class ThreadWaiter:
    """One blocking acquire in its own thread; started so that it has surely submitted
    (granted at once, refused, or queued) before ``start`` returns."""

    def __init__(self, limiter, *args, **kwargs):
        self.limiter = limiter
        self.permit = None
        self.error = None
        self.thread = threading.Thread(target=self._run, args=args, kwargs=kwargs, daemon=True)

    def _run(self, *args, **kwargs):
        try:
            self.permit = self.limiter.acquire(*args, **kwargs)
        except BaseException as e:
            self.error = e

    def start(self):
        before = self.limiter.waiting
        self.thread.start()
        wait_until(lambda: not self.thread.is_alive() or self.limiter.waiting == before + 1)
        return self

    @property
    def done(self):
        return not self.thread.is_alive()

    def join(self, timeout=5.0):
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "waiter still blocked"
        return self


# ---------------------------------------------------------------------------------------
# 1. grant times follow the Lindley recursion

AMOUNTS = [1, 3, 4, 7, 10, 100, 250, 1000, 12345]
PERS = [1, 0.5, 2, 60]


@st.composite
def schedules(draw, max_n=40):
    amount = draw(st.sampled_from(AMOUNTS))
    per = draw(st.sampled_from(PERS))
    burst = draw(st.integers(1, 6))
    interval = interval_of(amount, per)
    n = draw(st.integers(1, max_n))
    span = max(1, int(interval * NS * burst * 3))
    gap = st.one_of(st.just(0), st.integers(0, span), st.integers(0, max(1, span // 50)))
    gaps = draw(st.lists(gap, min_size=n, max_size=n))
    costs = draw(st.lists(st.integers(1, burst), min_size=n, max_size=n))
    start = draw(st.sampled_from([0, 1_000_123_456_789]))
    arrivals = []
    t = start
    for g in gaps:
        t += g
        arrivals.append(t)
    return amount, per, burst, start, arrivals, costs


async def _async_schedule(limiter, clock, arrivals, costs, **kwargs):
    tasks, actual = [], []
    for a, c in zip(arrivals, costs, strict=True):
        limiter.run_until(a / NS)
        await settle()
        actual.append(clock.now_ns())
        tasks.append(asyncio.ensure_future(acquire_in_task(limiter, c, **kwargs)))
        await settle()
    limiter.run_until(clock.now() + 10**7)
    permits = await asyncio.gather(*tasks)
    return actual, permits


def _check_lindley(actual, permits, costs, interval, burst):
    expected = lindley(actual, costs, interval, burst)
    for k, (a, p, s) in enumerate(zip(actual, permits, expected, strict=True)):
        got = a + waited_ns(p)
        assert abs(got - s * NS) <= 2, f"request {k}: granted at {got} ns, Lindley {s * NS} ns"


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=schedules())
def test_async_grants_follow_lindley(case):
    amount, per, burst, start, arrivals, costs = case
    clock = rq.ManualClock(start / NS)
    limiter = rq.Limiter(rq.Rate(amount, per=per, burst=burst), clock=clock)
    actual, permits = asyncio.run(_async_schedule(limiter, clock, arrivals, costs))
    assert actual[0] == arrivals[0]
    _check_lindley(actual, permits, costs, interval_of(amount, per), burst)
    assert limiter.waiting == 0


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=schedules(max_n=12))
@pytest.mark.timeout(60)
def test_thread_grants_follow_lindley(case):
    amount, per, burst, start, arrivals, costs = case
    clock = rq.ManualClock(start / NS)
    limiter = rq.Limiter(rq.Rate(amount, per=per, burst=burst), clock=clock)
    waiters, actual = [], []
    for a, c in zip(arrivals, costs, strict=True):
        limiter.run_until(a / NS)
        actual.append(clock.now_ns())
        waiters.append(ThreadWaiter(limiter, c).start())
    limiter.run_until(clock.now() + 10**7)
    for w in waiters:
        w.join()
        assert w.error is None
    _check_lindley(actual, [w.permit for w in waiters], costs, interval_of(amount, per), burst)


def test_lindley_with_multiple_units_waits_for_the_slowest_rate():
    # Two rates on different units: each request is granted when both buckets admit.
    clock = rq.ManualClock()
    limiter = rq.Limiter(rq.Rate(10, burst=1), rq.Rate(100, burst=100, unit="tokens"), clock=clock)

    async def main():
        tasks = [
            asyncio.ensure_future(acquire_in_task(limiter, tokens=t)) for t in (100, 50, 10, 60)
        ]
        await settle()
        limiter.run_until(10)
        return await asyncio.gather(*tasks)

    permits = asyncio.run(main())
    # requests: 0, 0.1, 0.2, 0.3 ; tokens (T=10 ms): 0, +0.5, +0.1, +0.6 -> 0, 0.5, 0.6, 1.2
    assert [waited_ns(p) for p in permits] == pytest.approx(
        [0, 500_000_000, 600_000_000, 1_200_000_000], abs=2
    )


def test_lindley_cost_equal_to_burst_does_not_drift():
    # cost == burst and T = 2/3 s (not a whole number of ns): each grant is taken at
    # its exact schedule time, not at the ns-rounded one, so nothing accumulates.
    clock = rq.ManualClock()
    limiter = rq.Limiter(rq.Rate(3, per=2, burst=1), clock=clock)  # T = 2/3 s

    async def main():
        tasks = [asyncio.ensure_future(acquire_in_task(limiter)) for _ in range(1000)]
        await settle()
        limiter.run_until(10_000)
        return await asyncio.gather(*tasks)

    permits = asyncio.run(main())
    # request k is granted at k·2/3 s; the last one at exactly 666 s
    assert abs(waited_ns(permits[-1]) - 666 * NS) <= 2


# ---------------------------------------------------------------------------------------
# 2. weighted fair shares across classes


async def _backlog(limiter, per_class):
    """Submit ``per_class`` = {class: (count, cost)} interleaved, at the current instant;
    returns {class: [task, ...]} in submission order."""
    tasks = {name: [] for name in per_class}
    longest = max(n for n, _ in per_class.values())
    for i in range(longest):
        for name, (n, cost) in per_class.items():
            if i < n:
                tasks[name].append(
                    asyncio.ensure_future(acquire_in_task(limiter, cost, priority=name))
                )
                await asyncio.sleep(0)  # submits in this order
    await settle()
    return tasks


@pytest.mark.parametrize(
    ("weights", "costs"),
    [
        ({"interactive": 8, "batch": 1}, {"interactive": 1, "batch": 1}),
        ({"a": 1, "b": 1}, {"a": 1, "b": 1}),
        ({"a": 3, "b": 2, "c": 1}, {"a": 1, "b": 1, "c": 1}),
        # shares are of service time: a cost-3 request uses three slots
        ({"small": 1, "big": 1}, {"small": 1, "big": 3}),
    ],
)
def test_weighted_shares_when_backlogged(weights, costs):
    rate, window = 1000, 2.0
    clock = rq.ManualClock()
    limiter = rq.Limiter(rq.Rate(rate, burst=3), clock=clock, classes=weights)
    total_w = sum(weights.values())
    # more than each class can get in the window: all stay backlogged
    per_class = {
        name: (int(rate * window * w / total_w / costs[name]) + 200, costs[name])
        for name, w in weights.items()
    }

    async def main():
        tasks = await _backlog(limiter, per_class)
        limiter.run_until(window)
        await settle()
        # permits granted so far, None for those still queued, in submission order
        return {k: [t.result() if t.done() else None for t in v] for k, v in tasks.items()}

    got = asyncio.run(main())
    assert all(None in ps for ps in got.values()), "a class ran dry"
    served = {name: costs[name] * sum(p is not None for p in ps) for name, ps in got.items()}
    total = sum(served.values())
    assert total >= rate * window  # work-conserving: the whole rate was used
    for name, w in weights.items():
        share = served[name] / total
        assert abs(share - w / total_w) <= 0.01, f"{name}: {share:.4f} vs {w / total_w:.4f}"
    # FIFO within each class: the granted ones are a prefix, in increasing grant times
    for name, ps in got.items():
        n = sum(p is not None for p in ps)
        assert all(p is not None for p in ps[:n]), f"out-of-order grant in {name}"
        g = [waited_ns(p) for p in ps[:n]]
        assert g == sorted(g), f"out-of-order grant in {name}"


def test_weighted_shares_are_within_one_percent_for_8_to_1():
    rate = 1000
    clock = rq.ManualClock()
    limiter = rq.Limiter(
        rq.Rate(rate, burst=1), clock=clock, classes={"interactive": 8, "batch": 1}
    )

    async def main():
        tasks = await _backlog(limiter, {"interactive": (1500, 1), "batch": (400, 1)})
        limiter.run_until(1.0)
        await settle()
        return {k: sum(t.done() for t in v) for k, v in tasks.items()}

    got = asyncio.run(main())
    total = got["interactive"] + got["batch"]
    assert total == rate + 1  # grants at 0 (immediate), 1 ms, ..., 1000 ms
    # within 1 % of the weights (relative for the large share, one grant for the small)
    assert abs(got["interactive"] / total - 8 / 9) <= 0.01 * 8 / 9
    assert abs(got["batch"] / total - 1 / 9) <= 0.01 * 1 / 9 + 1 / total
    assert limiter.waiting == 0  # the rest was cancelled when the loop closed


def test_lone_class_gets_the_whole_rate():
    clock = rq.ManualClock()
    limiter = rq.Limiter(
        rq.Rate(1000, burst=1), clock=clock, classes={"interactive": 8, "batch": 1}
    )

    async def main():
        batch = (await _backlog(limiter, {"batch": (600, 1)}))["batch"]
        limiter.run_until(0.5)
        await settle()
        done = [t for t in batch if t.done()]
        assert len(done) == 501
        assert [waited_ns(t.result()) for t in done] == [k * 1_000_000 for k in range(501)]
        # A class that was idle is served at once when it shows up (no debt from its
        # idle past, no penalty either), then the backlog goes on.
        late = asyncio.ensure_future(acquire_in_task(limiter, priority="interactive"))
        await settle()
        limiter.run_until(0.502)
        await settle()
        assert late.done()
        assert waited_ns(late.result()) == 1_000_000
        assert sum(t.done() for t in batch) == 502

    asyncio.run(main())


def test_low_weight_class_is_not_starved():
    clock = rq.ManualClock()
    limiter = rq.Limiter(rq.Rate(100, burst=1), clock=clock, classes={"hi": 1000, "lo": 1})

    async def main():
        tasks = await _backlog(limiter, {"hi": (3000, 1), "lo": (3, 1)})
        limiter.run_until(25.0)
        await settle()
        return {k: [t for t in v if t.done()] for k, v in tasks.items()}

    done = asyncio.run(main())
    # 2501 grants; the low class gets about 1/1001 of them, i.e. at least 2
    assert len(done["lo"]) >= 2
    assert len(done["hi"]) + len(done["lo"]) == 2501


# ---------------------------------------------------------------------------------------
# 3. no barging


def test_try_acquire_is_false_while_someone_waits():
    clock = rq.ManualClock()
    limiter = rq.Limiter(rq.Rate(10, burst=1), clock=clock)
    assert limiter.try_acquire()
    w = ThreadWaiter(limiter).start()
    assert limiter.waiting == 1
    # The waiter's slot is at 0.1 s. Move the clock past it without polling: capacity
    # exists, but it belongs to the waiter.
    clock.set(0.15)
    assert limiter.available() == pytest.approx(1.0)
    assert not limiter.try_acquire()
    assert limiter.waiting == 1
    limiter.poll()
    w.join()
    assert waited_ns(w.permit) == 100_000_000
    assert limiter.waiting == 0
    assert not limiter.try_acquire()  # the waiter used that slot
    clock.set(0.2)
    assert limiter.try_acquire()


def test_newcomers_queue_behind_waiters():
    clock = rq.ManualClock()
    limiter = rq.Limiter(rq.Rate(10, burst=2), clock=clock)
    assert limiter.try_acquire(2)

    async def main():
        first = asyncio.ensure_future(acquire_in_task(limiter, 2))  # needs the full bucket
        await settle()
        assert limiter.waiting == 1
        clock.set(0.1)  # one unit is free, not two: the small request must not overtake
        assert not limiter.try_acquire(1)
        second = asyncio.ensure_future(acquire_in_task(limiter, 1))
        await settle()
        assert limiter.waiting == 2
        assert not second.done()
        limiter.run_until(1)
        return await first, await second

    first, second = asyncio.run(main())
    assert waited_ns(first) == 200_000_000  # granted at 0.2
    assert waited_ns(second) == 200_000_000  # arrived at 0.1, granted at 0.3


# ---------------------------------------------------------------------------------------
# 4. bounded queue: max_queue, predicted deadline, WaitTimeout


def test_max_queue_refuses_at_once_with_retry_after():
    clock = rq.ManualClock()
    limiter = rq.Limiter(rq.Rate(10, burst=1), clock=clock, max_queue=2)
    assert limiter.try_acquire()
    waiters = [ThreadWaiter(limiter).start() for _ in range(2)]
    assert limiter.waiting == 2
    before = limiter.available()
    with pytest.raises(rq.Overloaded) as exc:
        limiter.acquire()
    assert exc.value.retry_after == pytest.approx(0.3)
    assert isinstance(exc.value, rq.RateQueueError)

    async def refused_async():
        with pytest.raises(rq.Overloaded):
            await limiter.acquire_async()

    asyncio.run(refused_async())
    assert limiter.available() == before
    assert limiter.waiting == 2
    stats = limiter.stats()
    assert stats["refused_full"] == 2
    limiter.run_until(1)
    for w in waiters:
        w.join()
    assert [waited_ns(w.permit) for w in waiters] == [100_000_000, 200_000_000]


@pytest.mark.parametrize("how", ["timeout", "max_wait"])
def test_predicted_deadline_miss_is_refused_at_once(how):
    clock = rq.ManualClock()
    kw = {"max_wait": 0.35} if how == "max_wait" else {}
    limiter = rq.Limiter(rq.Rate(10, burst=1), clock=clock, **kw)
    call = {"timeout": 0.35} if how == "timeout" else {}
    assert limiter.try_acquire()
    ahead = [ThreadWaiter(limiter).start() for _ in range(3)]  # slots 0.1, 0.2, 0.3
    avail = limiter.available()
    nw = limiter.next_wake()
    with pytest.raises(rq.Overloaded) as exc:  # would be granted at 0.4 > 0.35
        limiter.acquire(**call)
    assert exc.value.retry_after == pytest.approx(0.05)
    assert limiter.available() == avail
    assert limiter.next_wake() == nw
    assert limiter.waiting == 3
    assert limiter.stats()["refused_deadline"] == 1
    # a deadline that can be met is accepted and met
    fits = ThreadWaiter(limiter, timeout=0.4).start()
    assert limiter.waiting == 4
    limiter.run_until(1)
    for w in [*ahead, fits]:
        w.join()
        assert w.error is None
    assert waited_ns(fits.permit) == 400_000_000
    if how == "max_wait":
        # an explicit timeout overrides the limiter's max_wait
        clock.set(10)
        assert limiter.try_acquire()
        ahead = [ThreadWaiter(limiter).start() for _ in range(3)]
        with pytest.raises(rq.Overloaded):
            limiter.acquire()
        patient = ThreadWaiter(limiter, timeout=5).start()
        limiter.run_until(20)
        for w in [*ahead, patient]:
            w.join()
            assert w.error is None
        assert waited_ns(patient.permit) == 400_000_000


def test_refused_request_consumes_nothing():
    # A refusal leaves the schedule of everyone else untouched.
    clock = rq.ManualClock()
    limiter = rq.Limiter(rq.Rate(4, burst=2), clock=clock)

    async def main():
        tasks = [asyncio.ensure_future(acquire_in_task(limiter)) for _ in range(6)]
        await settle()
        for _ in range(20):
            with pytest.raises(rq.Overloaded):
                await limiter.acquire_async(timeout=0.1)
        limiter.run_until(10)
        return await asyncio.gather(*tasks)

    permits = asyncio.run(main())
    quarter = 250_000_000
    assert [waited_ns(p) for p in permits] == [0, 0, quarter, 2 * quarter, 3 * quarter, 4 * quarter]


def _multi_class_backlog(clock):
    """Class b gets 1/101 of the rate while a is backlogged, so a b request whose own
    class looks short (FIFO prediction: a lower bound) still misses its deadline."""
    limiter = rq.Limiter(rq.Rate(10, burst=1), clock=clock, classes={"a": 100, "b": 1})
    assert limiter.try_acquire()
    return limiter


def test_timeout_with_several_classes_expires_at_the_deadline():
    clock = rq.ManualClock()
    limiter = _multi_class_backlog(clock)

    async def main():
        a = [asyncio.ensure_future(acquire_in_task(limiter, priority="a")) for _ in range(200)]
        b = [asyncio.ensure_future(acquire_in_task(limiter, priority="b")) for _ in range(3)]
        await settle()
        timed = asyncio.ensure_future(acquire_in_task(limiter, priority="b", timeout=1.0))
        await settle()
        assert limiter.waiting == 204  # predicted 0.4 s <= 1 s: queued, not refused
        limiter.run_until(0.999999999)
        await settle()
        assert not timed.done()
        limiter.run_until(1.0)
        await settle()
        assert timed.done()
        with pytest.raises(rq.WaitTimeout) as exc:
            timed.result()
        assert exc.value.retry_after >= 0.0
        assert isinstance(exc.value, rq.RateQueueError)
        # nothing consumed: the others keep the exact spacing of the bucket
        limiter.run_until(3.0)
        await settle()
        done = [t for t in a + b if t.done()]
        for t in a + b:
            t.cancel()
        await settle()
        return done

    done = asyncio.run(main())
    grant_times = sorted(waited_ns(t.result()) for t in done)
    assert grant_times == [k * 100_000_000 for k in range(1, 31)]
    stats = limiter.stats()
    assert stats["timed_out"] == 1
    assert stats["waiting"] == 0


def test_thread_timeout_with_several_classes():
    clock = rq.ManualClock()
    limiter = _multi_class_backlog(clock)
    a = [ThreadWaiter(limiter, priority="a").start() for _ in range(30)]
    b = [ThreadWaiter(limiter, priority="b").start() for _ in range(2)]
    timed = ThreadWaiter(limiter, priority="b", timeout=0.5).start()
    assert limiter.waiting == 33
    limiter.run_until(0.4999)
    assert not timed.done
    limiter.run_until(0.5)
    timed.join()
    assert isinstance(timed.error, rq.WaitTimeout)
    assert timed.error.retry_after >= 0.0
    limiter.run_until(10)
    for w in a + b:
        w.join()
        assert w.error is None
    assert limiter.stats()["timed_out"] == 1
    assert sorted(waited_ns(w.permit) for w in a + b) == [k * 100_000_000 for k in range(1, 33)]


def test_cost_too_large_is_refused_even_behind_waiters():
    clock = rq.ManualClock()
    limiter = rq.Limiter(rq.Rate(10, burst=3), clock=clock)
    with pytest.raises(rq.CostTooLarge) as exc:
        limiter.acquire(4)
    assert isinstance(exc.value, ValueError)
    assert exc.value.retry_after == float("inf")
    assert limiter.try_acquire(3)
    w = ThreadWaiter(limiter, 1).start()
    with pytest.raises(rq.CostTooLarge):
        limiter.acquire(4)
    assert limiter.waiting == 1
    limiter.run_until(1)
    w.join()


def test_stats_count_every_decision():
    clock = rq.ManualClock()
    limiter = rq.Limiter(rq.Rate(10, burst=3), clock=clock)
    assert limiter.acquire().waited == 0.0  # fast path

    async def main():
        assert (await limiter.acquire_async()).waited == 0.0  # fast path
        assert limiter.try_acquire()
        assert not limiter.try_acquire()
        t = asyncio.ensure_future(acquire_in_task(limiter))
        await settle()
        limiter.run_until(1)
        return await t

    assert waited_ns(asyncio.run(main())) == 100_000_000
    stats = limiter.stats()
    assert stats["immediate"] == 2
    assert stats["queued_grants"] == 1
    assert stats["waiting"] == 0


def test_set_rate_reschedules_waiters_on_a_manual_clock():
    clock = rq.ManualClock()
    limiter = rq.Limiter(rq.Rate(1, burst=1), clock=clock)
    assert limiter.try_acquire()

    async def main():
        t = asyncio.ensure_future(acquire_in_task(limiter))
        await settle()
        assert limiter.next_wake() == pytest.approx(1.0)
        clock.set(0.05)
        limiter.set_rate(1000)  # the bucket keeps its content: 1 unit used
        assert limiter.next_wake() < 0.06
        limiter.run_until(0.06)
        await settle()
        assert t.done()
        return t.result()

    assert asyncio.run(main()).waited < 0.06


def test_unknown_priority_is_a_value_error():
    limiter = rq.Limiter(rq.Rate(10), clock=rq.ManualClock(), classes={"a": 1})
    with pytest.raises(ValueError):
        limiter.acquire(priority="b")
    with pytest.raises(ValueError):
        limiter.acquire_async(priority="b")


# ---------------------------------------------------------------------------------------
# 5. cancellation and timeouts restore capacity exactly


@st.composite
def cancel_cases(draw):
    amount = draw(st.sampled_from([3, 4, 10, 100]))
    burst = draw(st.integers(1, 4))
    n = draw(st.integers(2, 30))
    gaps = draw(st.lists(st.integers(0, int(NS / amount * 2)), min_size=n, max_size=n))
    costs = draw(st.lists(st.integers(1, burst), min_size=n, max_size=n))
    cancel = draw(st.lists(st.booleans(), min_size=n, max_size=n))
    delay = draw(st.lists(st.integers(0, int(NS / amount * 3)), min_size=n, max_size=n))
    return amount, burst, gaps, costs, cancel, delay


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=cancel_cases())
def test_cancelled_waiters_leave_no_trace(case):
    """Grants of the others equal the Lindley recursion over the requests that were not
    cancelled while queued."""
    amount, burst, gaps, costs, cancel, delay = case
    clock = rq.ManualClock()
    limiter = rq.Limiter(rq.Rate(amount, burst=burst), clock=clock)
    events = []
    t = 0
    for i, g in enumerate(gaps):
        t += g
        events.append((t, 0, i))
        if cancel[i]:
            events.append((t + delay[i], 1, i))
    events.sort()

    async def main():
        tasks, arrival = {}, {}
        cancelled = set()
        for when, kind, i in events:
            limiter.run_until(when / NS)
            await settle()
            if kind == 0:
                arrival[i] = clock.now_ns()
                tasks[i] = asyncio.ensure_future(acquire_in_task(limiter, costs[i]))
            elif not tasks[i].done():
                tasks[i].cancel()
                cancelled.add(i)
            await settle()
        limiter.run_until(clock.now() + 1000)
        await asyncio.gather(*tasks.values(), return_exceptions=True)
        return tasks, arrival, cancelled

    tasks, arrival, cancelled = asyncio.run(main())
    kept = [i for i in range(len(gaps)) if i not in cancelled]
    assert all(tasks[i].cancelled() for i in cancelled)
    expected = lindley(
        [arrival[i] for i in kept], [costs[i] for i in kept], Fraction(1, amount), burst
    )
    for i, s in zip(kept, expected, strict=True):
        got = arrival[i] + waited_ns(tasks[i].result())
        assert abs(got - s * NS) <= 2, f"request {i}: {got} vs {s * NS}"
    stats = limiter.stats()
    assert stats["cancelled"] == len(cancelled)
    assert stats["waiting"] == 0


def test_cancel_racing_the_grant_gives_it_back_exactly_once():
    clock = rq.ManualClock()
    limiter = rq.Limiter(rq.Rate(10, burst=1), clock=clock)
    assert limiter.try_acquire()

    async def main():
        x = asyncio.ensure_future(acquire_in_task(limiter))
        y = asyncio.ensure_future(acquire_in_task(limiter))
        await settle()
        limiter.run_until(0.1)  # x granted at 0.1; its outcome is on its way
        x.cancel()  # ...cancelled before the loop delivers it
        await settle()
        assert x.cancelled()
        assert limiter.waiting == 0  # x's slot went to y at once
        assert y.done()
        return await y

    y = asyncio.run(main())
    assert waited_ns(y) == 100_000_000  # arrival 0, granted at 0.1 in x's place
    stats = limiter.stats()
    assert stats["queued_grants"] == 2
    assert stats["cancelled"] == 0
    assert not limiter.try_acquire()  # y holds the 0.1 slot: nothing was given twice
    clock.set(0.2)
    assert limiter.try_acquire()


def test_late_give_back_does_not_break_the_rate_bound():
    # A grant cancelled after a later grant was made on top of it cannot be returned:
    # the slot it held has been used by time; refunding it would admit a newcomer in a
    # slot already taken.
    clock = rq.ManualClock()
    limiter = rq.Limiter(rq.Rate(10, burst=1), clock=clock)
    assert limiter.try_acquire()

    async def main():
        x = asyncio.ensure_future(acquire_in_task(limiter))
        z = asyncio.ensure_future(acquire_in_task(limiter))
        await settle()
        limiter.run_until(0.2)  # x granted at 0.1, z at 0.2 (on top of x's debit)
        x.cancel()  # x's grant comes back after z already used the next slot
        await asyncio.gather(x, z, return_exceptions=True)
        return z.result()

    z = asyncio.run(main())
    assert waited_ns(z) == 200_000_000
    # z was admitted at 0.2 with burst 1: nothing else may be admitted at 0.2
    assert not limiter.try_acquire()


class Mix:
    """n random requests over two weighted classes with random costs, timeouts and
    cancellations, on a ManualClock; records what happened."""

    amount, burst = 2000, 5  # T = 0.5 ms per unit; mean cost 2 -> ~1000 requests/s

    def __init__(self, seed, n, race, load=1300.0, p_cancel=0.4, p_timeout=0.6, max_queue=400):
        rng = random.Random(seed)
        self.clock = rq.ManualClock()
        self.limiter = rq.Limiter(
            rq.Rate(self.amount, burst=self.burst),
            clock=self.clock,
            classes={"a": 4, "b": 1},
            max_queue=max_queue,
        )
        self.race = race
        self.events = []
        t = 0
        for i in range(n):
            t += int(rng.expovariate(load) * NS)  # requests/s, against ~1000 served
            self.events.append((t, 0, i))
            if rng.random() < p_cancel:
                self.events.append((t + int(rng.uniform(0, 0.5) * NS), 1, i))
        self.events.sort()
        self.spec = [
            (
                rng.choice("aab"),
                rng.randint(1, 3),
                rng.uniform(0.001, 0.5) if rng.random() < p_timeout else None,
            )
            for _ in range(n)
        ]
        self.tasks, self.arrival, self.queued = {}, {}, set()
        asyncio.run(self._run())
        self.outcomes = self._outcomes()

    async def _run(self):
        limiter = self.limiter
        for when, kind, i in self.events:
            limiter.run_until(when / NS)
            if kind == 0:
                # Deliver every outcome (and any grant given back); a cancellation may
                # have made the next waiter due, and on a ManualClock only a poll grants.
                await settle()
                limiter.poll()
                await settle()
                w0 = limiter.waiting
                cls, cost, timeout = self.spec[i]
                self.arrival[i] = self.clock.now_ns()
                self.tasks[i] = asyncio.ensure_future(
                    acquire_in_task(limiter, cost, priority=cls, timeout=timeout)
                )
                await settle(2)
                if limiter.waiting == w0 + 1:
                    self.queued.add(i)
                else:
                    assert limiter.waiting == w0
            else:
                if not self.race:
                    # only waiters still queued are cancelled; with races, a grant may
                    # be on its way to the task being cancelled
                    await settle()
                if not self.tasks[i].done():
                    self.tasks[i].cancel()
                await settle()  # the task leaves the queue before the clock moves on
        while limiter.waiting:
            limiter.run_until(limiter.next_wake())
            await settle()
        await asyncio.gather(*self.tasks.values(), return_exceptions=True)
        await settle()

    def _outcomes(self):
        out = {"permit": [], "timeout": [], "overloaded": [], "cancelled": []}
        for i, t in self.tasks.items():
            if t.cancelled():
                out["cancelled"].append(i)
            elif isinstance(t.exception(), rq.WaitTimeout):
                out["timeout"].append(i)
            elif isinstance(t.exception(), rq.Overloaded):
                out["overloaded"].append(i)
            else:
                assert t.exception() is None, t.exception()
                out["permit"].append(i)
        return out


def replay_gcra(mix):
    """Replays the grants that were kept (permits held by tasks) through an independent
    GCRA in exact fractions: each must conform. Returns the bucket content it implies
    at the clock's current time."""
    T = Fraction(1, mix.amount)
    grants = sorted(
        (mix.arrival[i] + waited_ns(mix.tasks[i].result()), mix.spec[i][1])
        for i in mix.outcomes["permit"]
    )
    tat = Fraction(0)
    for at_ns, cost in grants:
        s = Fraction(at_ns, NS)
        assert tat + (cost - mix.burst) * T <= s + Fraction(2, NS), "grant beyond the rate"
        tat = max(tat, s) + cost * T
    now = Fraction(mix.clock.now_ns(), NS)
    return float(mix.burst - max(Fraction(0), tat - now) / T)


@pytest.mark.timeout(120)
def test_ten_thousand_cancellations_and_timeouts_restore_capacity_exactly():
    mix = Mix(seed=7, n=30_000, race=False, load=2000, p_cancel=0.9, p_timeout=0.5, max_queue=2000)
    out, limiter = mix.outcomes, mix.limiter
    stats = limiter.stats()
    assert stats["waiting"] == 0
    assert all(v == 0 for v in stats["depths"].values())
    # every queued request left the queue exactly once
    assert stats["queued_grants"] + stats["timed_out"] + stats["cancelled"] == len(mix.queued)
    assert stats["timed_out"] == len(out["timeout"]) > 500
    assert stats["cancelled"] == len(out["cancelled"]) > 5000
    assert stats["timed_out"] + stats["cancelled"] >= 10_000
    assert stats["refused_full"] + stats["refused_deadline"] == len(out["overloaded"]) > 0
    assert set(out["timeout"]) | set(out["cancelled"]) <= mix.queued
    assert stats["queued_grants"] == len([i for i in out["permit"] if i in mix.queued])
    # The bucket holds exactly what the granted requests took, nothing for the timed-out,
    # cancelled or refused ones.
    assert limiter.available() == pytest.approx(replay_gcra(mix), abs=1e-5)
    limiter.run_until(mix.clock.now() + 1.0)
    assert limiter.available() == mix.burst
    assert limiter.try_acquire(mix.burst)
    assert not limiter.try_acquire(1)


@pytest.mark.timeout(120)
def test_ten_thousand_cancellations_timeouts_and_races_add_up():
    mix = Mix(seed=11, n=10_000, race=True, max_queue=400)
    out, limiter = mix.outcomes, mix.limiter
    stats = limiter.stats()
    assert stats["waiting"] == 0
    assert stats["queued_grants"] + stats["timed_out"] + stats["cancelled"] == len(mix.queued)
    assert stats["refused_full"] + stats["refused_deadline"] == len(out["overloaded"])
    # A cancelled task either left the queue (counted as cancelled) or lost the race to
    # its outcome: a grant (given back, counted as a queued grant) or its deadline
    # (counted as timed out).
    raced = len(out["cancelled"]) - stats["cancelled"]
    raced_grants = stats["queued_grants"] - len([i for i in out["permit"] if i in mix.queued])
    raced_timeouts = stats["timed_out"] - len(out["timeout"])
    assert raced_grants > 0 and raced_timeouts >= 0
    assert raced == raced_grants + raced_timeouts
    # The kept grants never exceed the rate, and the bucket never holds less than they
    # took (a raced grant is given back only while nothing was granted on top of it;
    # otherwise its slot stays used).
    assert limiter.available() <= replay_gcra(mix) + 1e-5
    limiter.run_until(mix.clock.now() + 1.0)
    assert limiter.available() == mix.burst
    assert limiter.try_acquire(mix.burst)
    assert not limiter.try_acquire(1)


# ---------------------------------------------------------------------------------------
# 6. real time (threads, signals): wide tolerances


@pytest.mark.timeout(60)
def test_threads_share_the_rate_in_real_time():
    limiter = rq.Limiter(rq.Rate(200, burst=1))
    waits = []
    lock = threading.Lock()

    def worker():
        for _ in range(25):
            p = limiter.acquire()
            with lock:
                waits.append(p.waited)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    t0 = time.monotonic()
    for th in threads:
        th.start()
    for th in threads:
        th.join(30)
    elapsed = time.monotonic() - t0
    assert len(waits) == 100
    # 100 grants at 200/s with burst 1: the last one is due 99/200 s after the first
    assert 0.49 <= elapsed <= 3.0, elapsed
    assert limiter.waiting == 0
    stats = limiter.stats()
    assert stats["queued_grants"] >= 90
    assert stats["timed_out"] == stats["cancelled"] == 0


@pytest.mark.timeout(60)
def test_thread_timeout_in_real_time():
    # T = 0.1 s: wide enough that no grant falls while the waiters are being set up
    limiter = rq.Limiter(rq.Rate(10, burst=1), classes={"a": 100, "b": 1})
    assert limiter.try_acquire()
    hogs = [ThreadWaiter(limiter, priority="a").start() for _ in range(8)]
    first_b = ThreadWaiter(limiter, priority="b").start()
    # b's own class looks short (predicted 0.2 s), but a takes 100/101 of the rate
    t0 = time.monotonic()
    with pytest.raises(rq.WaitTimeout) as exc:
        limiter.acquire(priority="b", timeout=0.3)
    elapsed = time.monotonic() - t0
    assert 0.28 <= elapsed <= 1.5, elapsed
    assert exc.value.retry_after >= 0.0
    assert limiter.waiting >= 1
    for w in [*hogs, first_b]:
        w.join()
        assert w.error is None
    assert limiter.waiting == 0
    assert limiter.stats()["timed_out"] == 1


@pytest.mark.timeout(60)
def test_set_rate_wakes_the_driver_in_real_time():
    limiter = rq.Limiter(rq.Rate(1, burst=1))
    assert limiter.try_acquire()  # next slot in 1 s
    t0 = time.monotonic()
    w = ThreadWaiter(limiter).start()
    time.sleep(0.05)
    limiter.set_rate(1000)  # next slot now within a millisecond
    w.join()
    elapsed = time.monotonic() - t0
    assert w.error is None
    assert elapsed <= 0.5, f"granted after {elapsed:.3f} s (waited={w.permit.waited:.3f})"


@pytest.mark.timeout(60)
def test_ctrl_c_interrupts_a_blocked_acquire_on_the_main_thread(ctrl_c):
    assert threading.current_thread() is threading.main_thread()
    limiter = rq.Limiter(rq.Rate(1, per=10, burst=1))
    assert limiter.try_acquire()
    ctrl_c(0.2)
    t0 = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        limiter.acquire()  # due in 10 s
    elapsed = time.monotonic() - t0
    assert 0.15 <= elapsed <= 5.0, elapsed
    assert limiter.waiting == 0
    assert limiter.stats()["cancelled"] == 1
    # the interrupted waiter took nothing: the next slot is still the one 10 s after the
    # first grant, not 20 s
    assert 0 < limiter.retry_after() <= 10.0 - elapsed + 0.05


@pytest.mark.timeout(60, method="thread")  # this test owns SIGALRM
def test_alarm_signal_handler_exception_leaves_the_queue_clean():
    class Alarm(Exception):
        pass

    def on_alarm(signum, frame):
        raise Alarm

    old = signal.signal(signal.SIGALRM, on_alarm)
    try:
        limiter = rq.Limiter(rq.Rate(2, burst=1))
        assert limiter.try_acquire()
        signal.setitimer(signal.ITIMER_REAL, 0.15)
        t0 = time.monotonic()
        with pytest.raises(Alarm):
            limiter.acquire()
        elapsed = time.monotonic() - t0
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    assert elapsed <= 0.45, elapsed
    assert limiter.waiting == 0
    p = limiter.acquire()  # the 0.5 s slot was not consumed by the interrupted waiter
    assert p.waited <= 0.4


@pytest.mark.timeout(60)
def test_ctrl_c_behind_thread_waiters_keeps_their_schedule(ctrl_c):
    limiter = rq.Limiter(rq.Rate(2, burst=1))
    assert limiter.try_acquire()
    others = [ThreadWaiter(limiter).start() for _ in range(3)]  # 0.5, 1.0, 1.5 s
    ctrl_c(0.2)
    with pytest.raises(KeyboardInterrupt):
        limiter.acquire()  # slot 2.0 s
    late = ThreadWaiter(limiter).start()
    for w in [*others, late]:
        w.join()
        assert w.error is None
    assert limiter.waiting == 0
    assert limiter.stats()["cancelled"] == 1
