"""Issue 10, defect 7: no number a caller supplies wraps an admission decision.

Semaphores compare ``in_use + n`` with the limit, queues add up the costs waiting in a
class, histograms add counts from bytes and merges: each of these wrapped past 2**64
and granted, predicted or counted as if the total were small. Each test here failed
before the fix.
"""

from __future__ import annotations

import struct

import numpy as np
import pytest
import ratequeue as rq
from ratequeue._ratequeue import Channel

U64 = 2**64


def test_concurrency_sum_never_wraps() -> None:
    c = rq.Concurrency(U64 - 1)
    assert (_held1 := c.try_acquire(2**63)) is not None
    assert c.try_acquire(2**63 + 1) is None
    assert c.in_use == 2**63
    assert (_held2 := c.try_acquire(2**63 - 1)) is not None
    assert c.in_use == U64 - 1
    assert c.try_acquire(1) is None


def test_concurrency_waiter_is_granted_only_when_it_fits() -> None:
    clock = rq.ManualClock()
    c = rq.Concurrency(U64 - 1, clock=clock)
    ch = Channel()
    held = c.try_acquire(2**63)
    assert held is not None
    first = c.submit(ch, 2**63 + 1)
    second = c.submit(ch, 2**63 + 1)
    assert isinstance(first, int)
    assert isinstance(second, int)
    c.poll()
    assert ch.drain() == []
    assert c.in_use == 2**63
    held.release()
    c.poll()
    granted = [t for t, ok, _ in ch.drain() if ok]
    assert granted == [first]
    assert c.in_use == 2**63 + 1
    assert c.waiting == 1


def test_keyed_concurrency_sum_never_wraps() -> None:
    k = rq.KeyedConcurrency(U64 - 1)
    assert (_held3 := k.try_acquire("a", 2**63)) is not None
    assert k.try_acquire("a", 2**63 + 1) is None
    assert k.in_use("a") == 2**63
    assert (_held4 := k.try_acquire("b", 2**63 + 1)) is not None


@pytest.mark.parametrize("n", [U64, 2**70])
def test_permits_beyond_u64_are_refused_not_saturated(n: int) -> None:
    c = rq.Concurrency(U64 - 1)
    with pytest.raises(ValueError, match="n="):
        c.try_acquire(n)
    with pytest.raises(ValueError, match="n="):
        c.acquire(n, timeout=0)
    assert c.in_use == 0
    k = rq.KeyedConcurrency(U64 - 1)
    with pytest.raises(ValueError, match="n="):
        k.try_acquire("a", n)
    assert k.in_use("a") == 0


@pytest.mark.parametrize("bad", [-1, -(2**70)])
def test_negative_permits_and_costs_name_the_argument(bad: int) -> None:
    k = rq.KeyedConcurrency(3)
    with pytest.raises(ValueError, match="n="):
        k.try_acquire("a", bad)
    kl = rq.KeyedLimiter(rq.Rate(10, burst=3))
    with pytest.raises(ValueError, match="cost="):
        kl.try_acquire("a", bad)
    with pytest.raises(ValueError, match="cost="):
        kl.retry_after("a", bad)


@pytest.mark.parametrize("cost", [U64 - 1, U64, 2**70])
def test_keyed_limiter_huge_cost_is_cost_too_large(cost: int) -> None:
    kl = rq.KeyedLimiter(rq.Rate(10, burst=3))
    with pytest.raises(rq.CostTooLarge, match="burst of 3"):
        kl.try_acquire("a", cost)
    assert kl.available("a") == 3.0


def test_queued_cost_totals_never_wrap() -> None:
    """256 waiters of 2**56 each add up to 2**64: the predicted wait must not drop."""
    clock = rq.ManualClock()
    big = 2**56
    lim = rq.Limiter(rq.Rate(1e9, per="second", burst=big), clock=clock, max_queue=1000)
    assert lim.try_acquire(big)
    ch = Channel()
    last = lim.predicted_wait(big)
    for i in range(300):
        assert isinstance(lim.submit(ch, big), int)
        wait = lim.predicted_wait(big)
        assert wait >= last, f"after {i + 1} waiters: {wait} < {last}"
        last = wait
    with pytest.raises(rq.Overloaded):
        lim.submit(ch, big, timeout=1e6)


def _histogram_bytes(buckets: dict[int, int], lo: int, hi: int) -> bytes:
    out = bytearray(b"RQH1")
    out += struct.pack("<5Q", 0, lo, hi, 0, 0)
    last = 0
    for i in sorted(buckets):
        for v in (i - last, buckets[i]):
            while v >= 0x80:
                out.append((v & 0x7F) | 0x80)
                v >>= 7
            out.append(v)
        last = i
    return bytes(out)


def test_from_bytes_counts_summing_past_u64_are_refused() -> None:
    data = _histogram_bytes({500: 2**63, 501: 2**63}, 500, 501)
    with pytest.raises(ValueError, match="data"):
        rq.Histogram.from_bytes(data)
    ok = rq.Histogram.from_bytes(_histogram_bytes({500: 2**63, 501: 2**63 - 1}, 500, 501))
    assert ok.count == U64 - 1


def test_merge_saturates_counts_instead_of_wrapping() -> None:
    h = rq.Histogram.from_bytes(_histogram_bytes({500: U64 - 1}, 500, 500))
    assert h.count == U64 - 1
    h.merge(h.copy())
    assert h.count == U64 - 1
    assert h.percentile(50) == pytest.approx(500e-9)
    other = rq.Histogram.from_bytes(_histogram_bytes({700: 2**63}, 700, 700))
    other.merge(h)
    assert other.count == U64 - 1
    assert other.min == pytest.approx(500e-9)
    assert other.max == pytest.approx(700e-9)


def test_record_many_sum_is_exact_past_64_bits() -> None:
    h = rq.Histogram()
    h.record_many(np.full(2_000_000, 1e4))
    h.record_many(np.full(10, 1e4))
    assert h.count == 2_000_010
    assert h.sum == 2_000_010 * 1e4  # 128-bit sum: neither saturated nor wrapped


@pytest.mark.parametrize("limit", [U64, 2**70])
def test_limits_beyond_u64_are_refused_not_saturated(limit: int) -> None:
    with pytest.raises(ValueError, match="limit="):
        rq.Concurrency(limit)
    with pytest.raises(ValueError, match="limit="):
        rq.KeyedConcurrency(limit)
    c = rq.Concurrency(1)
    with pytest.raises(ValueError, match="limit="):
        c.set_limit(limit)
    assert c.limit == 1


def test_huge_max_keys_is_reported_not_wrapped() -> None:
    k = rq.KeyedLimiter(rq.Rate(10, burst=3), max_keys=U64 - 1)
    assert k.max_keys == U64 - 1
    assert k.stats()["max_keys"] == U64 - 1
    assert k.try_acquire("a")
