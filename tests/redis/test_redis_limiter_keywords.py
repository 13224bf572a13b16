"""A Redis limiter reads a call's costs exactly as ``rq.Limiter`` does: the bindings'
parser (``args::unit_costs``) serves both, so every mistake gets the same error and the
same message, and an unnamed unit costs what it costs locally."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import ratequeue as rq
import redis
from hypothesis import given
from hypothesis import strategies as st
from ratequeue._ratequeue import _LimiterKeywords
from ratequeue.redis import RedisLimiter
from redis_server import RedisServer

_names = itertools.count()
UNITS = {
    "two units": ("requests", "tokens"),
    "one unit": ("tokens",),
    "no requests": ("tokens", "images"),
}


@pytest.fixture(scope="module")
def client(redis_server: RedisServer) -> Iterator[redis.Redis]:
    """One client for the module (hypothesis runs many examples per test)."""
    c = redis_server.client()
    yield c
    c.close()


def rates(units: tuple[str, ...]) -> list[rq.Rate]:
    return [rq.Rate(10**6, per=1, burst=10**6, unit=u) for u in units]


def outcome(call: Callable[..., Any], n: object, kw: dict[str, object]) -> tuple[str, str]:
    try:
        granted = call(**kw) if n is None else call(n, **kw)
    except (TypeError, ValueError) as e:
        return type(e).__name__, str(e)
    return "granted" if granted else "refused", ""


values = st.one_of(st.integers(-2, 5), st.sampled_from([True, 1.5, "a", b"b", None, 2**64, 2**70]))


@pytest.mark.parametrize("which", sorted(UNITS))
@given(
    n=st.one_of(st.none(), values),
    kw=st.dictionaries(
        st.sampled_from(["requests", "tokens", "images", "color"]), values, max_size=3
    ),
)
def test_every_call_reads_like_the_local_limiter(
    client: redis.Redis, which: str, n: object, kw: dict[str, object]
) -> None:
    units = UNITS[which]
    local = rq.Limiter(*rates(units))
    remote = RedisLimiter(client, *rates(units), name=f"kw{next(_names)}")
    want, got = outcome(local.try_acquire, n, kw), outcome(remote.try_acquire, n, kw)
    if want[0] == "CostTooLarge":
        assert got[0] == "CostTooLarge"
    else:
        assert got == want, (n, kw)


def test_the_parser_gives_costs_in_unit_order_with_the_defaults() -> None:
    assert _LimiterKeywords(["requests", "tokens"]).parse(None, {"tokens": 7}) == [1, 7]
    assert _LimiterKeywords(["tokens"]).parse() == [1]
    assert _LimiterKeywords(["tokens", "images"]).parse(3, {"images": 2}) == [3, 2]
    with pytest.raises(TypeError, match='missing cost for unit "tokens"'):
        _LimiterKeywords(["tokens", "images"]).parse(None, {"images": 2})
    assert _LimiterKeywords(["a"]).parse(2**70) == [2**64 - 1]  # no bucket holds it


@pytest.mark.parametrize("units", [[], [f"u{i}" for i in range(65)], "tokens", [1]])
def test_the_parser_refuses_bad_units(units: object) -> None:
    with pytest.raises((TypeError, ValueError), match="units"):
        _LimiterKeywords(units)  # type: ignore[arg-type]
