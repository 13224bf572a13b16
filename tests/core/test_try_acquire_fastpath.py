"""try_acquire's fast path (one unit, no argument or a plain int) answers exactly as the
one validation path: same decisions, same errors, same counters."""

from __future__ import annotations

import numpy as np
import pytest
import ratequeue as rq


def limiter(burst: int = 5) -> rq.Limiter:
    return rq.Limiter(rq.Rate(1, per="second", burst=burst), clock=rq.ManualClock())


def test_plain_ints_decide_like_the_default_cost():
    lim = limiter(5)
    assert lim.try_acquire(2) is True
    assert lim.try_acquire() is True
    assert lim.try_acquire(2) is True
    assert lim.try_acquire(1) is False
    assert lim.try_acquire(0) is True
    stats = lim.stats()
    assert (stats["tried_admitted"], stats["tried_refused"]) == (4, 1)


@pytest.mark.parametrize("cost", [True, False, 1.0, "1", None.__class__])
def test_non_ints_are_type_errors(cost):
    with pytest.raises(TypeError):
        limiter().try_acquire(cost)


def test_negative_and_oversized_costs_keep_their_errors():
    lim = limiter(5)
    with pytest.raises(ValueError):
        lim.try_acquire(-1)
    with pytest.raises(rq.CostTooLarge):
        lim.try_acquire(6)
    for huge in (2**64 - 1, 2**64, 2**200):
        with pytest.raises(rq.CostTooLarge) as e:
            lim.try_acquire(huge)
        assert str(huge) in str(e.value)
    assert lim.stats()["tried_refused"] == 0
    assert lim.try_acquire(5) is True


def test_int_like_costs_still_take_the_validation_path():
    class Index:
        def __index__(self) -> int:
            return 2

    class Big(int):
        pass

    lim = limiter(5)
    assert lim.try_acquire(np.uint64(2)) is True
    assert lim.try_acquire(Index()) is True
    assert lim.try_acquire(Big(1)) is True
    assert lim.try_acquire(1) is False


def test_several_units_never_take_the_one_unit_path():
    lim = rq.Limiter(
        rq.Rate(1, per="second", burst=3, unit="requests"),
        rq.Rate(1, per="second", burst=10, unit="tokens"),
        clock=rq.ManualClock(),
    )
    assert lim.try_acquire(1, tokens=4) is True
    assert lim.try_acquire(tokens=4) is True
    assert lim.try_acquire(tokens=4) is False
    with pytest.raises(TypeError):
        rq.Limiter(rq.Rate(1, unit="tokens"), rq.Rate(1, unit="bytes")).try_acquire(1)


def test_a_waiter_still_blocks_the_fast_path():
    from ratequeue._ratequeue import Channel

    clock = rq.ManualClock()
    lim = rq.Limiter(rq.Rate(1, per="second", burst=2), clock=clock)
    assert lim.try_acquire(2) is True
    ch = Channel()
    ticket = lim.submit(ch, 2)  # due at 2 s
    assert isinstance(ticket, int)
    assert lim.waiting == 1
    clock.advance(1.0)  # one unit back; the waiter needs two
    assert lim.try_acquire(1) is False
    assert lim.try_acquire() is False
    assert lim.stats()["tried_refused"] == 2
    lim.run_until(2.0)
    assert [t for t, ok, _ in ch.drain() if ok] == [ticket]
    assert lim.try_acquire(1) is False  # the waiter took both units at 2 s
