"""One key identity: equal keys share a bucket, distinct keys never do (on Redis too:
redis/test_redis_keys.py, which shares these examples).

A key is a str, bytes or integer (int of any size, bool, numpy integer scalars); two
keys are the same key exactly when they are of the same kind (integer, str, bytes) and
equal as Python values. Anything else is a TypeError naming the argument.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import ratequeue as rq
from key_examples import DISTINCT, NOT_KEYS, SAME, local_same, one_per_hour

_names = itertools.count()


def fresh(prefix: str) -> str:
    return f"{prefix}{next(_names)}"


# -- locally -----------------------------------------------------------------------------


@pytest.mark.parametrize(("a", "b"), DISTINCT)
def test_keyed_limiter_distinct_keys_have_their_own_bucket(a: object, b: object) -> None:
    assert not local_same(a, b)


@pytest.mark.parametrize(("a", "b"), SAME)
def test_keyed_limiter_spellings_of_one_key_share_its_bucket(a: object, b: object) -> None:
    assert local_same(a, b)


@pytest.mark.parametrize(("a", "b"), DISTINCT)
def test_keyed_concurrency_distinct_keys_have_their_own_permits(a: object, b: object) -> None:
    s = rq.KeyedConcurrency(1)
    p = s.try_acquire(a)  # type: ignore[arg-type]
    assert p is not None
    assert s.in_use(b) == 0  # type: ignore[arg-type]
    assert s.try_acquire(b) is not None  # type: ignore[arg-type]
    p.release()


@pytest.mark.parametrize(("a", "b"), SAME)
def test_keyed_concurrency_spellings_of_one_key_share_its_permits(a: object, b: object) -> None:
    s = rq.KeyedConcurrency(1)
    p = s.try_acquire(a)  # type: ignore[arg-type]
    assert p is not None
    assert s.in_use(b) == 1  # type: ignore[arg-type]
    assert s.try_acquire(b) is None  # type: ignore[arg-type]


@pytest.mark.parametrize(("a", "b"), DISTINCT)
def test_policy_keyed_levels_keep_distinct_keys_apart(a: object, b: object) -> None:
    p = rq.Policy(
        {
            "user": rq.KeyedLimiter(one_per_hour(), clock=rq.ManualClock()),
            "tenant": rq.KeyedConcurrency(1),
        }
    )
    assert p.try_acquire(user=a, tenant="t1") is not None
    assert p.try_acquire(user=b, tenant="t2") is not None
    assert p.try_acquire(user="u", tenant=a) is not None
    assert p.try_acquire(user="v", tenant=b) is not None


@pytest.mark.parametrize(("a", "b"), SAME)
def test_policy_keyed_levels_merge_spellings_of_one_key(a: object, b: object) -> None:
    p = rq.Policy(
        {
            "user": rq.KeyedLimiter(one_per_hour(), clock=rq.ManualClock()),
            "tenant": rq.KeyedConcurrency(1),
        }
    )
    assert p.try_acquire(user=a, tenant="t1") is not None
    assert p.try_acquire(user=b, tenant="t2") is None
    held = p.try_acquire(user="u", tenant=a)  # kept: a permit dropped gives its slot back
    assert held is not None
    assert p.try_acquire(user="v", tenant=b) is None


@pytest.mark.parametrize("bad", NOT_KEYS, ids=repr)
def test_not_a_key_is_a_type_error_naming_the_argument_and_type(bad: object) -> None:
    ty = type(bad).__name__
    k = rq.KeyedLimiter(one_per_hour())
    for call in (k.try_acquire, k.available, k.retry_after):
        with pytest.raises(TypeError, match=rf"key must be .*got {ty}"):
            call(bad)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=rf"key must be .*got {ty}"):
        k.try_acquire_many(["a", bad])  # type: ignore[list-item]
    s = rq.KeyedConcurrency(1)
    with pytest.raises(TypeError, match=rf"key must be .*got {ty}"):
        s.try_acquire(bad)  # type: ignore[arg-type]
    p = rq.Policy({"user": rq.KeyedLimiter(one_per_hour()), "tenant": rq.KeyedConcurrency(1)})
    with pytest.raises(TypeError, match=rf"user must be .*got {ty}"):
        p.try_acquire(user=bad, tenant="t")
    with pytest.raises(TypeError, match=rf"tenant must be .*got {ty}"):
        p.try_acquire(user="u", tenant=bad)


def test_batch_over_arrays_equals_the_loop_of_single_calls() -> None:
    i64 = np.array([-1, -(2**63), 0, 1, 2**63 - 1, -2, 7], dtype=np.int64)
    u64 = np.array([2**64 - 1, 2**63, 0, 1, 2**63 - 1, 2**64 - 2, 7], dtype=np.uint64)
    # int64 -1 and uint64 2**64-1 are different keys; 0, 1, 2**63-1 and 7 are the same.
    k = rq.KeyedLimiter(one_per_hour(), clock=rq.ManualClock())
    assert k.try_acquire_many(i64).tolist() == [True] * 7
    assert k.try_acquire_many(u64).tolist() == [True, True, False, False, False, True, False]
    # Each array value v is the key int(v): the single calls and a list agree.
    for arr in (i64, u64):
        batch = rq.KeyedLimiter(one_per_hour(), clock=rq.ManualClock())
        loop = rq.KeyedLimiter(one_per_hour(), clock=rq.ManualClock())
        listed = rq.KeyedLimiter(one_per_hour(), clock=rq.ManualClock())
        doubled = np.concatenate([arr, arr])
        got = batch.try_acquire_many(doubled).tolist()
        assert got == [loop.try_acquire(int(v)) for v in doubled]
        assert got == listed.try_acquire_many([int(v) for v in doubled]).tolist()
        assert got == [True] * len(arr) + [False] * len(arr)
        for v in arr:
            assert not batch.try_acquire(int(v)) and not batch.try_acquire(v)


def test_batch_of_other_integer_dtypes_uses_the_same_keys() -> None:
    k = rq.KeyedLimiter(one_per_hour(), clock=rq.ManualClock())
    assert k.try_acquire_many(np.array([-3, 200], dtype=np.int16)).tolist() == [True, True]
    assert k.try_acquire_many([-3, 200, np.uint8(200), np.int32(-3)]).tolist() == [False] * 4
