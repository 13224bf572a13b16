"""Limiter.try_acquire's fast entry reads keywords itself: same answers, same errors."""

from __future__ import annotations

import pytest
import ratequeue as rq


def _two(clock: rq.ManualClock | None = None) -> rq.Limiter:
    return rq.Limiter(
        rq.Rate(1000, per="second"),
        rq.Rate(1000, per="second", unit="tokens"),
        clock=clock or rq.ManualClock(),
    )


def _tokens_only() -> rq.Limiter:
    return rq.Limiter(rq.Rate(1000, per="second", unit="tokens"), clock=rq.ManualClock())


def test_keyword_costs_are_debited_on_every_rate_all_or_nothing() -> None:
    clock = rq.ManualClock()
    lim = _two(clock)
    assert lim.try_acquire(tokens=600) is True
    assert lim.try_acquire(tokens=600) is False
    assert lim.try_acquire(tokens=400) is True
    assert lim.try_acquire(tokens=1) is False
    clock.advance(1.0)
    assert lim.try_acquire(999, tokens=1) is True
    assert lim.try_acquire(1, tokens=0) is True
    assert lim.try_acquire(1, tokens=0) is False


def test_keywords_in_any_order_and_through_a_dict() -> None:
    lim = _two()
    assert lim.try_acquire(tokens=500, requests=500) is True
    assert lim.try_acquire(**{"requests": 500, "tokens": 500}) is True
    assert lim.try_acquire(requests=1, tokens=1) is False


def test_the_only_unit_by_keyword_or_positionally() -> None:
    lim = _tokens_only()
    assert lim.try_acquire(tokens=999) is True
    assert lim.try_acquire(tokens=2) is False
    assert lim.try_acquire(1) is True
    assert rq.Limiter.try_acquire(lim, tokens=0) is True


def test_an_unknown_keyword_is_a_type_error_naming_the_units() -> None:
    lim = _two()
    with pytest.raises(
        TypeError,
        match=r'^unexpected keyword "foo": this limiter counts units \["requests", "tokens"\]$',
    ):
        lim.try_acquire(foo=1, tokens=1)
    with pytest.raises(TypeError, match=r'^unexpected keyword "n": '):
        lim.try_acquire(n=1, tokens=1)
    with pytest.raises(
        TypeError, match=r'^unexpected keyword "requests": this limiter counts units \["tokens"\]$'
    ):
        _tokens_only().try_acquire(requests=1)
    assert lim.try_acquire(1000, tokens=1000) is True


def test_a_cost_given_twice_is_a_type_error() -> None:
    with pytest.raises(TypeError, match=r'^cost for unit "requests" given twice$'):
        _two().try_acquire(5, requests=1, tokens=1)
    with pytest.raises(TypeError, match=r'^cost for unit "tokens" given twice$'):
        _tokens_only().try_acquire(5, tokens=5)


def test_a_missing_unit_is_a_type_error() -> None:
    with pytest.raises(TypeError, match=r'^missing cost for unit "tokens" \(pass tokens=\.\.\.\)$'):
        _two().try_acquire()
    with pytest.raises(TypeError, match=r"^missing cost for unit"):
        _two().try_acquire(requests=3)


@pytest.mark.parametrize(
    ("value", "error", "message"),
    [
        (1.5, TypeError, r"^tokens must be an int, got float$"),
        ("1", TypeError, r"^tokens must be an int, got str$"),
        (True, TypeError, r"^tokens must be an int, got bool$"),
        (None, TypeError, r"^tokens must be an int, got NoneType$"),
        (-1, ValueError, r"^tokens=-1 must be >= 0$"),
    ],
)
def test_a_bad_keyword_cost_is_refused_and_debits_nothing(
    value: object, error: type[Exception], message: str
) -> None:
    lim = _two()
    with pytest.raises(error, match=message):
        lim.try_acquire(1, tokens=value)  # type: ignore[arg-type]
    assert lim.try_acquire(1000, tokens=1000) is True


def test_a_keyword_cost_above_the_burst_or_2_64_is_cost_too_large() -> None:
    lim = _two()
    with pytest.raises(
        rq.CostTooLarge, match=r"^cost 2000 tokens exceeds the burst of 1000 tokens"
    ):
        lim.try_acquire(tokens=2000)
    with pytest.raises(
        rq.CostTooLarge, match=r"^cost 1180591620717411303424 tokens exceeds the burst"
    ):
        lim.try_acquire(tokens=2**70)
    assert lim.try_acquire(1000, tokens=1000) is True


def test_too_many_positional_arguments_keep_their_message() -> None:
    msg = r"^Limiter\.try_acquire\(\) takes from 0 to 1 positional arguments but 2 were given$"
    with pytest.raises(TypeError, match=msg):
        _two().try_acquire(1, 2)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match=msg):
        _two().try_acquire(1, 2, tokens=3)  # type: ignore[call-arg]


def test_the_unbound_method_checks_its_self() -> None:
    with pytest.raises(TypeError, match=r"doesn't apply to a 'object' object"):
        rq.Limiter.try_acquire(object(), tokens=1)  # type: ignore[arg-type]
