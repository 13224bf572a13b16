"""`try_acquire()` with no argument (core17's fast entry, decided before the
general entry) decides exactly what the general path decides, on twin limiters over
ManualClocks driven through the same schedule: the same admit/refuse sequence, the same
stats (counters, depths, available capacity, histograms) and the same permits of the
waiters queued between (their grant times and waits)."""

from __future__ import annotations

from typing import Any

import pytest
import ratequeue as rq
from hypothesis import given, settings
from hypothesis import strategies as st

# One op: ("advance", seconds) | ("try", _) | ("submit", cost) | ("poll", _) |
# ("set_rate", per_second) | ("pause", seconds)
OPS = st.one_of(
    st.tuples(st.just("advance"), st.floats(0.0, 3.0)),
    st.tuples(st.just("try"), st.just(0)),
    st.tuples(st.just("try"), st.just(0)),
    st.tuples(st.just("submit"), st.integers(1, 3)),
    st.tuples(st.just("poll"), st.just(0)),
    st.tuples(st.just("set_rate"), st.floats(0.5, 50.0)),
    st.tuples(st.just("pause"), st.floats(0.0, 2.0)),
)

STYLES = {
    "fast": lambda lim: lim.try_acquire(),
    "positional": lambda lim: lim.try_acquire(1),
    "keyword": lambda lim: lim.try_acquire(requests=1),
}


def twin(per_second: float, burst: int) -> tuple[rq.Limiter, rq.ManualClock, rq.Channel]:
    clock = rq.ManualClock(start=1_000.0)
    lim = rq.Limiter(
        rq.Rate(per_second, per="second", burst=burst), clock=clock, max_wait=30.0, max_queue=8
    )
    return lim, clock, rq.Channel()


def snapshot(lim: rq.Limiter) -> Any:
    s = lim.stats()
    s["wait"] = {k: v.to_bytes() for k, v in s["wait"].items()}
    h = lim.wait_histogram()
    return (s, h.count, h.sum, h.to_bytes(), lim.waiting, lim.available())


@settings(max_examples=150, deadline=None)
@given(
    per_second=st.floats(0.5, 50.0),
    burst=st.integers(1, 4),
    ops=st.lists(OPS, min_size=1, max_size=60),
)
@pytest.mark.parametrize("general", ["positional", "keyword"])
def test_fast_entry_decides_as_the_general_path(
    general: str, per_second: float, burst: int, ops: list[tuple[str, Any]]
) -> None:
    sides = {name: twin(per_second, burst) for name in ("fast", general)}
    grants: dict[str, list[Any]] = {name: [] for name in sides}
    for i, (op, arg) in enumerate(ops):
        seen = {}
        for name, (lim, clock, ch) in sides.items():
            if op == "advance":
                clock.advance(arg)
                lim.poll()
            elif op == "try":
                seen[name] = STYLES[name](lim)
            elif op == "submit":
                try:
                    r = lim.submit(ch, arg)
                    seen[name] = "permit" if isinstance(r, rq.Permit) else "queued"
                except rq.RateQueueError as e:
                    seen[name] = type(e).__name__
            elif op == "poll":
                lim.poll()
            elif op == "set_rate":
                lim.set_rate(arg, "second", burst=burst)
            elif op == "pause":
                lim.pause(arg)
            grants[name].extend((t, ok, at) for t, ok, at in ch.drain())
        if seen:
            assert len(set(seen.values())) == 1, (i, op, seen)
        a, b = (snapshot(lim) for lim, _, _ in sides.values())
        assert a == b, (i, op)
    # The same grants, at the same times (tickets differ: they are process-wide).
    fast, other = ([(ok, at) for _, ok, at in grants[n]] for n in sides)
    assert fast == other
