"""One key identity on Redis: the keyed limiter and a policy's keyed levels store equal
keys in one bucket and distinct keys apart, exactly as the local limiters do (the
examples are key_examples.py's), and no key names another level's bucket."""

from __future__ import annotations

import asyncio
import itertools
import operator
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import ratequeue as rq
import redis
from hypothesis import given
from hypothesis import strategies as st
from key_examples import DISTINCT, NOT_KEYS, SAME, local_same, one_per_hour
from ratequeue.redis import (
    AsyncRedisKeyedLimiter,
    AsyncRedisPolicy,
    RedisKeyedLimiter,
    RedisPolicy,
)
from redis_server import RedisServer

_names = itertools.count()


def fresh(prefix: str) -> str:
    return f"{prefix}{next(_names)}"


def redis_same(c: redis.Redis, a: object, b: object) -> bool:
    k = RedisKeyedLimiter(c, one_per_hour(), name=fresh("keys"))
    assert k.try_acquire(a)  # type: ignore[arg-type]
    same = not k.try_acquire(b)  # type: ignore[arg-type]
    assert same == (k.key(a) == k.key(b))  # type: ignore[arg-type]
    return same


# -- on Redis ----------------------------------------------------------------------------


@pytest.mark.parametrize(("a", "b"), DISTINCT)
def test_redis_keyed_limiter_distinct_keys_have_their_own_bucket(
    r: redis.Redis, a: object, b: object
) -> None:
    assert not redis_same(r, a, b)


@pytest.mark.parametrize(("a", "b"), SAME)
def test_redis_keyed_limiter_spellings_of_one_key_share_its_bucket(
    r: redis.Redis, a: object, b: object
) -> None:
    assert redis_same(r, a, b)


def test_redis_key_names_are_readable_and_tagged(r: redis.Redis) -> None:
    k = RedisKeyedLimiter(r, one_per_hour(), name="user")
    assert k.key("alice") == b"rq:{s:alice}:user:s:alice"
    assert k.key(b"alice") == b"rq:{b:alice}:user:b:alice"
    assert k.key(-1) == b"rq:{i:-1}:user:i:-1"
    assert k.key(np.uint64(7)) == k.key(True + 6) == b"rq:{i:7}:user:i:7"
    tagged = RedisKeyedLimiter(r, one_per_hour(), name="user", tag="t1")
    assert tagged.key("alice") == b"rq:{t1}:user:s:alice"


@pytest.mark.parametrize("bad", NOT_KEYS, ids=repr)
def test_redis_not_a_key_is_a_type_error_naming_the_argument_and_type(
    r: redis.Redis, bad: object
) -> None:
    ty = type(bad).__name__
    k = RedisKeyedLimiter(r, one_per_hour(), name="user")
    with pytest.raises(TypeError, match=rf"key must be .*got {ty}"):
        k.try_acquire(bad)  # type: ignore[arg-type]
    p = RedisPolicy(r, {"user": rq.KeyedLimiter(one_per_hour())}, name="p")
    with pytest.raises(TypeError, match=rf"user must be .*got {ty}"):
        p.try_acquire(user=bad)
    with pytest.raises(TypeError, match=rf"user must be .*got {ty}"):
        p.try_acquire(user=bad, requests=1)  # the general path, not the packed one


def redis_policy_same(c: Any, a: object, b: object, *, general: bool) -> bool:
    p = RedisPolicy(c, {"user": rq.KeyedLimiter(one_per_hour())}, name=fresh("pol"))
    extra = {"requests": 1} if general else {}
    assert p.try_acquire(user=a, **extra) is not None
    return p.try_acquire(user=b, **extra) is None


@pytest.mark.parametrize("general", [False, True])
def test_redis_policy_keyed_levels_one_identity(r: redis.Redis, general: bool) -> None:
    for a, b in DISTINCT:
        assert not redis_policy_same(r, a, b, general=general), (a, b)
    for a, b in SAME:
        assert redis_policy_same(r, a, b, general=general), (a, b)


def test_async_redis_keyed_limiter_and_policy_one_identity(redis_server: RedisServer) -> None:
    async def main() -> None:
        c = redis_server.async_client()
        try:
            for pairs, same in ((DISTINCT, False), (SAME, True)):
                for a, b in pairs:
                    k = AsyncRedisKeyedLimiter(c, one_per_hour(), name=fresh("akeys"))
                    assert await k.try_acquire(a)  # type: ignore[arg-type]
                    assert (not await k.try_acquire(b)) == same, (a, b)  # type: ignore[arg-type]
                    p = AsyncRedisPolicy(
                        c, {"user": rq.KeyedLimiter(one_per_hour())}, name=fresh("apol")
                    )
                    assert await p.try_acquire(user=a) is not None
                    assert (await p.try_acquire(user=b) is None) == same, (a, b)
        finally:
            await c.aclose()

    asyncio.run(main())


# -- local and Redis agree with Python's == --------------------------------------------


def norm(k: object) -> object:
    """The value a key stands for: a str, a bytes or an int."""
    return k if isinstance(k, str | bytes) else operator.index(k)  # type: ignore[arg-type]


ints = st.one_of(
    st.integers(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([0, 1, -1, 2**63 - 1, 2**63, -(2**63), 2**64 - 1, 2**64, -(2**64)]),
)
numpy_ints = st.one_of(
    st.integers(min_value=-(2**63), max_value=2**63 - 1).map(np.int64),
    st.integers(min_value=0, max_value=2**64 - 1).map(np.uint64),
)
keys = st.one_of(ints, numpy_ints, st.booleans(), st.text(max_size=8), st.binary(max_size=8))


def respellings(k: object) -> list[object]:
    """Keys a user might confuse with ``k``: its other spellings and near kinds."""
    v = norm(k)
    if isinstance(v, str):
        return [v, v.encode(), *([int(v)] if v.isascii() and v.isdecimal() else [])]
    if isinstance(v, bytes):
        return [v, v.decode("latin-1")]
    out: list[object] = [v, v % 2**64, -v, str(v), str(v).encode(), v - 2**64, v + 2**64]
    if -(2**63) <= v < 2**63:
        out.append(np.int64(v))
    if 0 <= v < 2**64:
        out.append(np.uint64(v))
        out.append(int(np.uint64(v).astype(np.int64)))
    return out


@pytest.fixture(scope="module")
def shared(redis_server: RedisServer) -> Iterator[redis.Redis]:
    c = redis_server.client()
    try:
        yield c
    finally:
        c.close()


@given(data=st.data())
def test_local_and_redis_agree_with_python_equality(shared: redis.Redis, data: Any) -> None:
    a = data.draw(keys, label="a")
    b = data.draw(st.one_of(keys, st.sampled_from(respellings(a))), label="b")
    expected = type(norm(a)) is type(norm(b)) and norm(a) == norm(b)
    assert local_same(a, b) == expected
    sem = rq.KeyedConcurrency(1)
    assert (_held := sem.try_acquire(a)) is not None  # held while in_use is read
    assert (sem.in_use(b) == 1) == expected
    assert redis_same(shared, a, b) == expected


def test_redis_policy_keyed_level_key_never_names_another_levels_bucket(r: redis.Redis) -> None:
    # Level "user" with the int key 0 is stored under ...:user:i:0, which is also the
    # Redis key of bucket 0 of the unkeyed level "user:i": the two levels share one
    # Redis bucket, and the fast level's write lets user 0 (1 per hour) through again
    # 10 ms later.
    clock = rq.ManualClock(1000.0)
    p = RedisPolicy(
        r,
        {
            "user": rq.KeyedLimiter(rq.Rate(1, per=3600, burst=1)),
            "user:i": rq.Rate(1000, per=1, burst=1000),
        },
        name=fresh("review"),
        clock=clock,
    )
    assert p.try_acquire(user=0) is not None
    clock.advance(0.01)
    assert p.try_acquire(user=0) is None
