"""Random histories of reservations, cancels and settles on one Redis bucket (one
ManualClock): whatever is given back, the grants that go, at their settled costs, never
exceed the rate, over any window: cost in [s, s + d] <= burst + rate * d. (Settles go
down only: a charge is usage beyond what was admitted, paid by later admissions.)"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import ratequeue as rq
import redis
from hypothesis import example, given, settings
from hypothesis import strategies as st
from ratequeue.redis import RedisLimiter, RedisPermit, RedisReservation
from redis_server import RedisServer

_ids = itertools.count()
AMOUNT, BURST = 10, 4  # per second: T = 100 ms, a whole number of microseconds
few = settings(max_examples=max(settings.default.max_examples, 300))


@pytest.fixture(scope="module")
def client(redis_server: RedisServer) -> Iterator[redis.Redis]:
    c = redis_server.client()
    yield c
    c.close()


@dataclass
class Grant:
    at_ns: int
    cost: int
    permit: RedisPermit
    reservation: RedisReservation | None
    cancelled: bool = False


ops = st.lists(
    st.one_of(
        st.tuples(st.just("acquire"), st.sampled_from([1, 2, 3, BURST])),
        st.tuples(st.just("reserve"), st.sampled_from([1, 2, 3, BURST])),
        st.tuples(st.just("cancel"), st.integers(0, 2)),  # counted from the latest grant
        st.tuples(st.just("settle"), st.integers(0, 2), st.sampled_from([0, 0, 1, 2])),
        st.tuples(st.just("advance"), st.sampled_from([50, 100, 150, 300])),  # ms
    ),
    max_size=30,
)


@few
@given(history=ops)
# A refund must not return what time restored: the later debits hold it now.
@example(
    history=[("acquire", 4), ("advance", 300), ("acquire", 3), ("settle", 1, 0), ("acquire", 4)]
)
def test_the_rate_bound_holds_whatever_is_given_back(
    client: redis.Redis, history: list[tuple[object, ...]]
) -> None:
    clock = rq.ManualClock()
    rate = rq.Rate(AMOUNT, per=1, burst=BURST, unit="tokens")
    lim = RedisLimiter(client, rate, name=f"bound{next(_ids)}", clock=clock)
    grants: list[Grant] = []
    for op in history:
        kind = op[0]
        if kind == "acquire":
            try:
                p = lim.acquire(tokens=int(op[1]), timeout=0)  # type: ignore[call-overload]
            except rq.Overloaded:
                continue
            grants.append(Grant(clock.now_ns(), int(op[1]), p, None))  # type: ignore[call-overload]
        elif kind == "reserve":
            try:
                r = lim.reserve(tokens=int(op[1]), max_wait=1.0)  # type: ignore[call-overload]
            except rq.Overloaded:
                continue
            at = clock.now_ns() + round(r.delay * 1e9)
            grants.append(Grant(at, int(op[1]), r.permit, r))  # type: ignore[call-overload]
        elif kind == "cancel" and grants:
            g = grants[-1 - int(op[1]) % len(grants)]  # type: ignore[call-overload]
            if g.reservation is not None and clock.now_ns() <= g.at_ns:
                g.reservation.cancel()
                g.cancelled = True
        elif kind == "settle" and grants:
            g = grants[-1 - int(op[1]) % len(grants)]  # type: ignore[call-overload]
            if not g.cancelled:  # down only: a charge is usage beyond what was admitted
                g.cost = min(g.cost, int(op[2]))  # type: ignore[call-overload]
                g.permit.settle(tokens=g.cost)
        elif kind == "advance":
            clock.advance(int(op[1]) / 1000)  # type: ignore[call-overload]
    going = sorted((g.at_ns, g.cost) for g in grants if not g.cancelled and g.cost)
    for i, (start, _) in enumerate(going):
        total = 0
        for at, cost in going[i:]:
            total += cost
            allowed = BURST + AMOUNT * (at - start) / 1e9
            assert total <= allowed + 1e-9, (start, at, total, allowed, history)
