"""Per-key wait queues (core keyed_queue): bounded in number, dropped when idle."""

from __future__ import annotations

import asyncio
import gc

import pytest
import ratequeue as rq


def drained(n_keys: int, keys: list[str]) -> tuple[rq.KeyedLimiter, rq.ManualClock]:
    clock = rq.ManualClock()
    kl = rq.KeyedLimiter(rq.Rate(1, per="second", burst=1), max_keys=n_keys, clock=clock)
    for k in keys:
        assert kl.try_acquire(k)
    return kl, clock


def test_the_keys_waiting_at_once_are_bounded_by_max_keys() -> None:
    kl, _ = drained(3, ["a", "b", "c"])
    waits = [kl.acquire_async(k) for k in ("a", "b", "c")]
    assert kl.stats()["waiting_keys"] == 3
    kl.try_acquire("d")  # d's bucket drained (another key's may be evicted for it)
    assert not kl.try_acquire("d")
    with pytest.raises(rq.Overloaded, match="keys have waiters already"):
        kl.acquire_async("d")
    with pytest.raises(rq.Overloaded):
        kl.acquire("d", timeout=0.5)
    assert kl.stats()["waiting_keys"] == 3
    del waits[0]
    gc.collect()
    assert kl.stats()["waiting_keys"] == 2, "an abandoned awaitable gives its key's queue up"
    again = kl.acquire_async("d")
    assert kl.stats()["waiting_keys"] == 3
    del again, waits
    gc.collect()
    assert kl.stats()["waiting_keys"] == 0


def test_queued_waits_on_many_keys_leave_no_queue_behind() -> None:
    clock = rq.ManualClock()
    kc = rq.KeyedConcurrency(1, clock=clock)
    keys = [f"k{i}" for i in range(50)]

    async def main() -> None:
        async def one(k: str) -> None:
            async with kc.acquire_async(k):
                await asyncio.sleep(0)

        await asyncio.gather(*(one(k) for k in keys for _ in range(3)))

    asyncio.run(main())
    assert kc.stats()["waiting_keys"] == 0
    assert all(kc.in_use(k) == 0 for k in keys)


def test_the_call_floor_is_a_private_class() -> None:
    floor = rq._ratequeue._Floor()
    assert floor.noop() is None
    assert not hasattr(rq.Limiter, "_noop")
    assert "_Floor" not in rq.__all__


def test_errors_are_raised_without_importing_the_package() -> None:
    import sys

    saved = sys.modules.pop("ratequeue._errors")
    try:
        lim = rq.Limiter(rq.Rate(1, per="second", burst=1))
        with pytest.raises(saved.CostTooLarge):
            lim.try_acquire(5)
        assert "ratequeue._errors" not in sys.modules
    finally:
        sys.modules["ratequeue._errors"] = saved
