"""A forked child uses the parent's long-lived objects even when another thread of the
parent held one of their Python locks at the fork (that thread does not exist in the
child: the lock would never be released). Each case holds the object's lock across the
fork, as such a thread would, and the child must still use the object; before the fix
each child hung on its first use (stop 41)."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any

import pytest
import ratequeue as rq
from forking import check_child, fork_child

pytestmark = [
    pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork (POSIX)"),
    pytest.mark.filterwarnings("ignore:.*fork.*:DeprecationWarning"),
]

TIMEOUT = 20.0


def _pool() -> tuple[Any, Callable[[Any], object]]:
    clock = rq.ManualClock()
    pool = rq.Pool([rq.Provider("a", rpm=60, burst=1, clock=clock)], clock=clock)
    return pool, lambda p: p.acquire(timeout=0)


def _budget() -> tuple[Any, Callable[[Any], object]]:
    from ratequeue.httpx._budget import charge, settle

    budget = rq.httpx.CallBudget(calls=3, tokens=100)

    def use(b: Any) -> None:
        sub = charge(b.chain(), "r1", "m", 10, 5)
        settle(sub, b.chain(), 3, 2, 200)
        assert b.usage == [sub] and b.tokens_used == 5

    return budget, use


def _quota_counts() -> tuple[Any, Callable[[Any], object]]:
    from ratequeue.ledger import QuotaLevel, QuotaPolicy, SqliteLedger

    led = SqliteLedger(":memory:")
    policy = QuotaPolicy(
        rq.Policy({"c": rq.Limiter(rq.Rate(10, per=1))}), QuotaLevel(led, key="tenant")
    )
    return policy._counts, lambda counts: (counts.add("held"), counts.snapshot())


def _breaker() -> tuple[Any, Callable[[Any], object]]:
    from ratequeue.redis import CircuitBreaker

    return CircuitBreaker(retry_interval=0), lambda b: (b._failure(OSError()), b._allow())


def _arm() -> tuple[Any, Callable[[Any], object]]:
    from ratequeue.canary._kpi import ArmStats

    def use(s: Any) -> None:
        s.record(latency=1.0, tokens=3, calls=1, rate_limited=0, error=False, valid=True)
        assert s.snapshot().requests == 1

    return ArmStats("a"), use


CASES = {
    "pool": _pool,
    "call budget": _budget,
    "quota level counts": _quota_counts,
    "redis circuit breaker": _breaker,
    "canary arm": _arm,
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_lock_held_at_the_fork_is_free_in_the_child(case: str) -> None:
    obj, use = CASES[case]()
    lock: Any = obj._lock
    with lock:  # held at the fork, as by another thread
        result = fork_child(lambda: use(obj), TIMEOUT)
    check_child(result, TIMEOUT)
    use(obj)  # and the parent's still works


def test_a_tiktoken_load_under_way_at_the_fork_is_made_again_in_the_child() -> None:
    """The loading thread does not exist in the child: ``load()`` waited for good."""
    from ratequeue.httpx import TokenEstimator

    gate = threading.Event()
    est = TokenEstimator("o200k_base")
    est._name = None  # loads nothing: the child's own load ends at once
    real_load = est._load

    parent = os.getpid()

    def slow_load() -> None:
        if os.getpid() == parent:
            gate.wait(TIMEOUT)
        real_load()

    est._load = slow_load  # type: ignore[method-assign]
    est._start()  # under way in a thread: at the fork its event is not set
    try:
        check_child(fork_child(lambda: est.load(timeout=None), TIMEOUT), TIMEOUT)
    finally:
        gate.set()
    assert est.load(timeout=TIMEOUT) is False  # the parent's load ends too
