"""Races between real threads on a frozen ManualClock: the lock-free decisions admit
exactly the capacity, never one more, and leave no partial debit behind."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
import ratequeue as rq

THREADS = 8
CALLS = 200_000

pytestmark = pytest.mark.timeout(120)


def race(work: Callable[[int], int]) -> list[int]:
    """Runs work(k) on THREADS threads released together; returns their results."""
    start = threading.Barrier(THREADS)
    results = [0] * THREADS
    errors: list[BaseException] = []

    def run(k: int) -> None:
        try:
            start.wait()
            results[k] = work(k)
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(k,)) for k in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    return results


def test_race_try_acquire_admits_exactly_the_burst() -> None:
    clock = rq.ManualClock(10)
    lim = rq.Limiter(rq.Rate(1, burst=1000), clock=clock)

    def work(_: int) -> int:
        acquire = lim.try_acquire
        return sum(1 for _ in range(CALLS) if acquire())

    admitted = race(work)
    assert sum(admitted) == 1000
    assert lim.available() == 0.0
    assert not lim.try_acquire()
    assert clock.now_ns() == 10 * 1_000_000_000  # nobody moved the clock


def test_race_multi_rate_leaves_no_partial_debit() -> None:
    clock = rq.ManualClock()
    lim = rq.Limiter(
        rq.Rate(10, burst=1000),
        rq.Rate(100, unit="tokens", burst=2000),
        clock=clock,
    )
    # Thread k asks for one request and 1 + k % 5 tokens, so neither unit is always the
    # one that runs out first.
    costs = [1 + k % 5 for k in range(THREADS)]

    def work(k: int) -> int:
        acquire = lim.try_acquire
        tokens = costs[k]
        return sum(1 for _ in range(CALLS) if acquire(tokens=tokens))

    admitted = race(work)
    requests = sum(admitted)
    tokens = sum(n * c for n, c in zip(admitted, costs, strict=True))
    assert requests <= 1000
    assert tokens <= 2000
    # Every unit was debited by exactly what was admitted: no refused call left a debit.
    assert lim.available() == 1000 - requests
    assert lim.available("tokens") == 2000 - tokens
    # And what is left cannot take the smallest call any thread made.
    assert lim.available() < 1 or lim.available("tokens") < min(costs)


def test_race_reserve_grants_the_sequential_schedule() -> None:
    """Concurrent reservations on a frozen clock get exactly the grant times a single
    queue would give: burst at once, then one per interval, none shared, none skipped."""
    clock = rq.ManualClock()
    lim = rq.Limiter(rq.Rate(1000, burst=10), clock=clock)
    per_thread = 5_000
    grants: list[list[int]] = [[] for _ in range(THREADS)]

    def work(k: int) -> int:
        reserve = lim.reserve
        out = grants[k]
        for _ in range(per_thread):
            out.append(round(reserve().delay * 1e9))
        return len(out)

    assert sum(race(work)) == THREADS * per_thread
    delays = sorted(d for g in grants for d in g)
    for n, d in enumerate(delays):
        assert abs(d - max(0, n - 9) * 1_000_000) <= 1, (n, d)
