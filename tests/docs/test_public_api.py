"""The public surface is deliberate: each package exports exactly its ``__all__``, every
name in it imports, and the Python classes of ``ratequeue.redis`` show exactly their API.

A new public name (a helper left without ``_``, a stray import) fails here: add it to
the lists below only when it is meant for users.
"""

from __future__ import annotations

import importlib
import types
from typing import Any

import pytest
import ratequeue as rq
import redis
import redis.asyncio

RATEQUEUE = {
    "AIMD",
    "Acquiring",
    "Adaptive",
    "BudgetExceeded",
    "CallBudget",
    "Canary",
    "Channel",
    "Gradient2",
    "QueueDepth",
    "Vegas",
    "Concurrency",
    "CostTooLarge",
    "Histogram",
    "KeyedConcurrency",
    "KeyedLimiter",
    "Limiter",
    "ManualClock",
    "MonotonicClock",
    "Overloaded",
    "Permit",
    "Policy",
    "PolicyAcquiring",
    "PolicyPermit",
    "Pool",
    "PoolAcquiring",
    "PoolOverloaded",
    "Provider",
    "QuotaExceeded",
    "Rate",
    "RateQueueError",
    "Reservation",
    "WaitTimeout",
    "__version__",
}

REDIS = {
    "GCRA_LUA",
    "GCRA_SHA",
    "AsyncRedisKeyedLimiter",
    "AsyncRedisLimiter",
    "AsyncRedisPolicy",
    "CircuitBreaker",
    "Key",
    "OnFailure",
    "PolicyLevel",
    "RedisKeyedLimiter",
    "RedisLedger",
    "RedisLimiter",
    "RedisPermit",
    "RedisPolicy",
    "RedisReservation",
    "RedisUnavailable",
    "connect",
    "connect_async",
}

TESTING = {"COMPLETION_PATHS", "MAX_BODY", "ManualClock", "MockProvider", "default_burst"}


def public_names(module: types.ModuleType) -> set[str]:
    """Names a user sees in the module: neither private nor a submodule."""
    return {
        n
        for n, v in vars(module).items()
        if not n.startswith("_") and not isinstance(v, types.ModuleType)
    }


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("ratequeue", RATEQUEUE),
        ("ratequeue.redis", REDIS),
        ("ratequeue.testing", TESTING),
        ("ratequeue.cli", set()),
    ],
)
def test_a_package_exports_exactly_its_all(name: str, expected: set[str]) -> None:
    module = importlib.import_module(name)
    assert sorted(module.__all__) == sorted(expected)
    assert len(module.__all__) == len(set(module.__all__))
    assert public_names(module) == expected - {"__version__"}
    for n in module.__all__:
        assert getattr(module, n) is not None


def test_every_redis_name_imports_from_the_package() -> None:
    namespace: dict[str, Any] = {}
    for n in sorted(REDIS):
        exec(f"from ratequeue.redis import {n}", namespace)
    assert namespace["RedisLimiter"].__module__ == "ratequeue.redis"
    assert (
        namespace["GCRA_SHA"]
        == __import__("hashlib").sha1(namespace["GCRA_LUA"].encode()).hexdigest()
    )


LIMITER = {
    "acquire",
    "available",
    "breaker",
    "close",
    "on_failure",
    "rates",
    "reserve",
    "reset",
    "retry_after",
    "stats",
    "try_acquire",
    "units",
}
KEYED = {
    "acquire",
    "available",
    "breaker",
    "key",
    "rate",
    "reserve",
    "reset",
    "retry_after",
    "stats",
    "try_acquire",
}
POLICY = {"acquire", "breaker", "levels", "reserve", "stats", "try_acquire"}
SETTINGS = {"max_wait", "name", "prefix", "tag"}


def surfaces() -> list[tuple[object, set[str]]]:
    from ratequeue import redis as rr

    c, ac = redis.Redis(), redis.asyncio.Redis()
    rate = rq.Rate(10)
    lim_attrs = SETTINGS | {"keys", "lease", "lease_ttl"}
    return [
        (rr.RedisLimiter(c, rate, name="x"), LIMITER | lim_attrs),
        (rr.AsyncRedisLimiter(ac, rate, name="x"), LIMITER | lim_attrs | {"acquire_async"}),
        (rr.RedisKeyedLimiter(c, rate, name="k"), KEYED | SETTINGS),
        (rr.AsyncRedisKeyedLimiter(ac, rate, name="k"), KEYED | SETTINGS | {"acquire_async"}),
        (rr.RedisPolicy(c, {"a": rate}, name="p"), POLICY | SETTINGS),
        (rr.AsyncRedisPolicy(ac, {"a": rate}, name="p"), POLICY | SETTINGS | {"acquire_async"}),
        (
            rr.CircuitBreaker(),
            {"retry_interval", "state", "retry_after", "stats", "failures", "opened", "last_error"},
        ),
        (
            rr.RedisPermit(0.0, {"requests": 1}, None),
            {"costs", "delay", "settle", "settle_async", "waited"},
        ),
        (
            rr.RedisReservation(0.0, rr.RedisPermit(0.0, {"requests": 1}, None), None),
            {"cancel", "cancel_async", "cancelled", "delay", "permit"},
        ),
    ]


@pytest.mark.parametrize(("obj", "expected"), surfaces(), ids=lambda x: type(x).__name__)
def test_redis_classes_show_only_their_api(obj: object, expected: set[str]) -> None:
    """Plumbing (engine calls, the breaker's protocol, a fallback's local permit) is private."""
    names = {n for n in dir(obj) if not n.startswith("_")}
    assert names == expected


NATIVE = sorted(
    n
    for n in rq.__all__
    if isinstance(getattr(rq, n), type)
    and getattr(rq, n).__module__ in {"ratequeue", "ratequeue._ratequeue"}
)


@pytest.mark.parametrize("name", NATIVE)
def test_native_classes_carry_no_plumbing(name: str) -> None:
    """The asyncio bridge's calls are private functions of the native module, not
    ``_methods`` of the public classes."""
    cls = getattr(rq, name)
    private = [
        a for a in dir(cls) if a.startswith("_") and not (a.startswith("__") and a.endswith("__"))
    ]
    assert private == []


def test_native_classes_are_listed() -> None:
    assert {"Acquiring", "Limiter", "Permit", "Policy", "PolicyPermit", "Concurrency"} <= set(
        NATIVE
    )
