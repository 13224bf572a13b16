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


def _canary() -> tuple[Any, Callable[[Any], object]]:
    from ratequeue.canary._canary import Canary

    return Canary(lambda r: r, lambda r: r), lambda c: c.rollback("from the child")


def _adaptive() -> tuple[Any, Callable[[Any], object]]:
    """Stepped by its caller (never started): found by review (stop 41)."""
    from ratequeue.adaptive import AIMD, Adaptive

    return Adaptive(rq.Limiter(rq.Rate(100, per=1)), AIMD()), lambda a: a.observe(0.05)


CASES = {
    "pool": _pool,
    "canary": _canary,
    "adaptive, not started": _adaptive,
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


def test_a_tiktoken_load_ending_at_the_fork_leaves_the_child_a_free_event() -> None:
    """Found by review (stop 41): the loader inside ``Event.set()`` at the fork (its flag
    set, the event's own lock held) hung the child's ``load``, whatever its timeout."""
    from ratequeue.httpx import TokenEstimator

    est = TokenEstimator(None)
    event = est._loaded
    event.clear()
    with event._cond:  # type: ignore[attr-defined]
        event._flag = True  # type: ignore[attr-defined]
        result = fork_child(lambda: est.load(timeout=1.0), TIMEOUT)
    check_child(result, TIMEOUT)


def test_the_default_estimator_is_made_without_a_lock() -> None:
    """Found by review (stop 41): its module lock, held by a parent thread making it at
    the fork, hung the child's first call; it is made without one (all get the first)."""
    from ratequeue.httpx import _estimate

    made, _estimate._DEFAULT[:] = list(_estimate._DEFAULT), []
    try:
        first = _estimate.default_estimator()
        assert _estimate.default_estimator() is first
        assert not hasattr(_estimate, "_DEFAULT_LOCK")
    finally:
        _estimate._DEFAULT[:] = made
