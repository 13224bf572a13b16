"""A Redis policy reads a call's keywords exactly as ``rq.Policy`` does: the bindings'
parser serves both, so every mistake gets the same error and the same message, and the
same level names are refused at construction."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import pytest
import ratequeue as rq
import redis
from hypothesis import given
from hypothesis import strategies as st
from ratequeue.redis import RedisPolicy
from redis_server import RedisServer

_names = itertools.count()
HUGE = rq.Rate(10**6, per=1)


@pytest.fixture(scope="module")
def client(redis_server: RedisServer) -> Iterator[redis.Redis]:
    """One client for the module (hypothesis runs many examples per test)."""
    c = redis_server.client()
    yield c
    c.close()


def levels() -> dict[str, Any]:
    return {
        "user": rq.KeyedLimiter(HUGE),
        "cluster": rq.Limiter(HUGE, rq.Rate(10**6, per=1, unit="tokens")),
    }


def outcome(call: Any, kw: dict[str, object]) -> tuple[str, str]:
    try:
        granted = call(**kw)
    except (TypeError, ValueError) as e:
        return type(e).__name__, str(e)
    return "granted" if granted is not None else "refused", ""


values = st.one_of(st.integers(-2, 5), st.sampled_from([True, 1.5, "a", b"b", None, 2**64, 2**70]))


@given(
    kw=st.dictionaries(
        st.sampled_from(["user", "tokens", "requests", "color", "cluster"]), values, max_size=4
    )
)
def test_every_call_reads_like_the_local_policy(client: redis.Redis, kw: dict[str, object]) -> None:
    local = rq.Policy(levels())
    remote = RedisPolicy(client, levels(), name=f"kw{next(_names)}")
    want, got = outcome(local.try_acquire, kw), outcome(remote.try_acquire, kw)
    if want[0] == "TypeError" and "user must be" in want[1]:
        assert got[0] == "TypeError" and "user must be" in got[1]  # a key of the wrong type
    elif want[0] == "CostTooLarge":
        assert got[0] == "CostTooLarge"
    else:
        assert got == want, kw


@pytest.mark.parametrize("name", ["timeout", "max_wait", "tokens"])
def test_the_level_names_the_local_policy_refuses_are_refused(r: redis.Redis, name: str) -> None:
    specs = {name: rq.KeyedLimiter(rq.Rate(10)), "cluster": rq.Rate(1000, unit="tokens")}
    with pytest.raises(ValueError, match=f'level "{name}"'):
        rq.Policy({name: rq.KeyedLimiter(rq.Rate(10)), "cluster": rq.Limiter(specs["cluster"])})
    with pytest.raises(ValueError, match=f'level "{name}"'):
        RedisPolicy(r, specs, name="bad")


def test_a_key_of_the_wrong_type_is_refused_before_a_cost_too_large(client: redis.Redis) -> None:
    """Found by the check above: the local Policy reads every key before any cost."""
    kw: dict[str, object] = {"tokens": 0, "requests": 2**64, "user": 1.5}
    local = rq.Policy(levels())
    remote = RedisPolicy(client, levels(), name=f"kw{next(_names)}")
    with pytest.raises(TypeError, match="user must be"):
        local.try_acquire(**kw)
    with pytest.raises(TypeError, match="user must be"):
        remote.try_acquire(**kw)
