"""``Limiter.acquire``, ``Limiter.acquire_async`` and ``Permit.settle`` read their keywords
in vectorcall entries of their own (acq10; PyO3's tuple-and-dict methods before): the
signatures, docs, checks, messages and results stay those of PyO3's methods, pinned here
as main gave them before the change. A refused call consumes nothing."""

from __future__ import annotations

import asyncio
import inspect
import re
from typing import Any

import pytest
import ratequeue as rq


def two_units(clock: rq.ManualClock | None = None) -> rq.Limiter:
    return rq.Limiter(
        rq.Rate(100, per="second", burst=10),
        rq.Rate(1000, per="second", burst=1000, unit="tokens"),
        classes={"hi": 2, "lo": 1},
        clock=clock if clock is not None else rq.ManualClock(),
    )


SIGNATURE = "(self, n=None, /, *, priority=None, timeout=None, **costs)"


@pytest.mark.parametrize(
    ("method", "doc"),
    [
        ("acquire", "Waits in the queue until granted"),
        ("acquire_async", "Awaitable (and async context manager)"),
    ],
)
def test_acquire_entries_keep_signature_and_doc(method: str, doc: str) -> None:
    f = getattr(rq.Limiter, method)
    assert str(inspect.signature(f)) == SIGNATURE
    assert (f.__doc__ or "").startswith(doc)


def test_settle_keeps_signature_and_doc() -> None:
    assert str(inspect.signature(rq.Permit.settle)) == "(self, /, **costs)"
    assert (rq.Permit.settle.__doc__ or "").startswith("Corrects the costs this grant")


TOO_LARGE = "cost {} tokens exceeds the burst of 1000 tokens and can never be admitted"

REFUSED: list[tuple[str, tuple[Any, ...], dict[str, Any], type[BaseException], str]] = [
    (
        "unknown unit",
        (),
        {"requests": 1, "tokens": 5, "bogus": 1},
        TypeError,
        'unexpected keyword "bogus": this limiter counts units ["requests", "tokens"]',
    ),
    (
        "missing unit",
        (),
        {"requests": 1},
        TypeError,
        'missing cost for unit "tokens" (pass tokens=...)',
    ),
    (
        "given twice",
        (1,),
        {"requests": 1, "tokens": 1},
        TypeError,
        'cost for unit "requests" given twice',
    ),
    ("negative", (), {"tokens": -1}, ValueError, "tokens=-1 must be >= 0"),
    ("float", (), {"tokens": 1.5}, TypeError, "tokens must be an int, got float"),
    ("bool", (), {"tokens": True}, TypeError, "tokens must be an int, got bool"),
    ("str", (), {"tokens": "5"}, TypeError, "tokens must be an int, got str"),
    ("above 2**64", (), {"tokens": 2**64}, rq.CostTooLarge, TOO_LARGE.format(2**64)),
    ("2**64 - 1", (), {"tokens": 2**64 - 1}, rq.CostTooLarge, TOO_LARGE.format(2**64 - 1)),
    ("above the burst", (), {"tokens": 1001}, rq.CostTooLarge, TOO_LARGE.format(1001)),
    (
        "unknown class",
        (),
        {"tokens": 1, "priority": "nope"},
        ValueError,
        'priority="nope" is not one of the classes ["hi", "lo"]',
    ),
    (
        "priority not a str",
        (),
        {"tokens": 1, "priority": 3},
        TypeError,
        "priority must be a str, got int",
    ),
    (
        "negative timeout",
        (),
        {"tokens": 1, "timeout": -1},
        ValueError,
        "timeout=-1 must be >= 0 seconds",
    ),
    (
        "timeout not a number",
        (),
        {"tokens": 1, "timeout": "x"},
        TypeError,
        "timeout must be a number of seconds, got str",
    ),
]


@pytest.mark.parametrize("method", ["acquire", "acquire_async"])
@pytest.mark.parametrize(
    ("case", "args", "kw", "exc", "message"), REFUSED, ids=[r[0] for r in REFUSED]
)
def test_refusals_keep_their_errors_and_consume_nothing(
    method: str,
    case: str,
    args: tuple[Any, ...],
    kw: dict[str, Any],
    exc: type[BaseException],
    message: str,
) -> None:
    lim = two_units()
    before = (lim.available("requests"), lim.available("tokens"))
    with pytest.raises(exc) as e:
        getattr(lim, method)(*args, **kw)
    assert str(e.value) == message, case
    assert (lim.available("requests"), lim.available("tokens")) == before
    assert lim.stats()["immediate"] == 0


@pytest.mark.parametrize("method", ["acquire", "acquire_async"])
def test_too_many_positional_arguments(method: str) -> None:
    lim = two_units()
    with pytest.raises(TypeError) as e:
        getattr(lim, method)(1, 2, tokens=1)
    assert (
        str(e.value)
        == f"Limiter.{method}() takes from 0 to 1 positional arguments but 2 were given"
    )
    assert lim.available("tokens") == 1000


def permit_of(lim: rq.Limiter, method: str, *args: Any, **kw: Any) -> rq.Permit:
    if method == "acquire":
        return lim.acquire(*args, **kw)

    async def main() -> rq.Permit:
        return await lim.acquire_async(*args, **kw)

    return asyncio.run(main())


@pytest.mark.parametrize("method", ["acquire", "acquire_async"])
def test_costs_classes_and_none_keywords(method: str) -> None:
    lim = two_units()
    p = permit_of(lim, method, tokens=500)  # requests defaults to 1
    assert p.costs == {"requests": 1, "tokens": 500}
    assert (lim.available("requests"), lim.available("tokens")) == (9, 500)
    p = permit_of(lim, method, 2, tokens=100, priority=None, timeout=None)
    assert p.costs == {"requests": 2, "tokens": 100}
    p = permit_of(lim, method, priority="lo", tokens=1, timeout=0.5)
    assert lim.wait_histogram("lo").count == 1
    assert lim.wait_histogram("hi").count == 2
    assert lim.stats()["immediate"] == 3
    assert p.waited == 0.0


def test_settle_keeps_its_errors_and_results() -> None:
    lim = two_units()
    p = lim.acquire(tokens=500)
    for kw, exc, message in [
        (
            {"bogus": 1},
            TypeError,
            'unexpected keyword "bogus": this limiter counts units ["requests", "tokens"]',
        ),
        ({"tokens": -1}, ValueError, "tokens=-1 must be >= 0"),
        ({"tokens": 1.5}, TypeError, "tokens must be an int, got float"),
        ({"tokens": True}, TypeError, "tokens must be an int, got bool"),
        (
            {"tokens": 300, "bogus": 1},
            TypeError,
            'unexpected keyword "bogus": this limiter counts units ["requests", "tokens"]',
        ),
    ]:
        with pytest.raises(exc) as e:
            p.settle(**kw)
        assert str(e.value) == message
        assert p.costs == {"requests": 1, "tokens": 500}
        assert lim.available("tokens") == 500
    with pytest.raises(TypeError) as e:
        p.settle(5)  # type: ignore[call-arg]
    assert str(e.value) == "Permit.settle() takes 0 positional arguments but 1 was given"
    assert p.settle(tokens=300) is None
    assert p.costs == {"requests": 1, "tokens": 300}
    assert lim.available("tokens") == 700
    p.settle(tokens=900, requests=2)
    assert p.costs == {"requests": 2, "tokens": 900}
    assert (lim.available("requests"), lim.available("tokens")) == (8, 100)
    p.settle()
    assert p.costs == {"requests": 2, "tokens": 900}
    p.settle(tokens=2**64)  # saturates, as before: charged into debt
    assert p.costs["tokens"] == 2**64 - 1


def test_settle_of_a_concurrency_permit() -> None:
    c = rq.Concurrency(2)
    with (
        c.acquire() as p,
        pytest.raises(TypeError, match="a Concurrency permit has no costs to settle"),
    ):
        p.settle(tokens=1)
    with c.acquire() as p, pytest.raises(TypeError, match="a Concurrency permit has no costs"):
        p.settle()


def test_acquire_async_ready_at_once_needs_no_loop() -> None:
    # The immediate grant is an awaitable already done: awaiting it never suspends.
    lim = two_units()
    ready = lim.acquire_async(tokens=10)
    it = ready.__await__()
    with pytest.raises(StopIteration) as e:
        next(it)
    permit = e.value.value
    assert isinstance(permit, rq.Permit)
    assert permit.costs == {"requests": 1, "tokens": 10}


def test_policy_costs_and_settle_keep_their_errors() -> None:
    # Policy reads a plain int at once too (acq10); every other value as before.
    def policy() -> rq.Policy:
        return rq.Policy({"llm": two_units()})

    for kw, exc, message in [
        ({"tokens": -1}, ValueError, "tokens=-1 must be >= 0"),
        ({"tokens": 1.5}, TypeError, "tokens must be an int, got float"),
        ({"tokens": True}, TypeError, "tokens must be an int, got bool"),
        ({"tokens": 2**64}, rq.CostTooLarge, None),
        ({"tokens": 2**64 - 1}, rq.CostTooLarge, None),
    ]:
        with pytest.raises(exc) as e:
            policy().acquire(**kw)
        assert message is None or str(e.value) == message
    pol = policy()
    p = pol.acquire(tokens=500)
    for kw, exc, message in [
        ({"bogus": 1}, TypeError, 'unexpected keyword "bogus": no level counts it'),
        ({"tokens": -1}, ValueError, "tokens=-1 must be >= 0"),
        ({"tokens": True}, TypeError, "tokens must be an int, got bool"),
    ]:
        with pytest.raises(exc) as e:
            p.settle(**kw)
        assert str(e.value) == message
    p.settle(tokens=300)
    assert pol.try_acquire(tokens=700) is not None
    assert pol.try_acquire(tokens=1) is None


POLICY_REFUSED: list[tuple[dict[str, Any], type[BaseException], str]] = [
    ({"tokens": 5, "timeout": -1}, ValueError, "timeout=-1 must be >= 0 seconds"),
    ({"tokens": 5, "timeout": "x"}, TypeError, "timeout must be a number of seconds, got str"),
    (
        {"tokens": 5, "max_wait": 1},
        TypeError,
        'unexpected keyword "max_wait": not a keyed level\'s name nor a unit of any level',
    ),
    ({"requests": 1}, TypeError, 'missing cost for unit "tokens" (level "llm"): pass tokens=...'),
    (
        {"tokens": 1001},
        rq.CostTooLarge,
        'cost 1001 (level "llm") exceeds the burst of 1000 (level "llm") and can never be admitted',
    ),
]


def test_policy_acquire_keeps_signature_errors_and_keys() -> None:
    # Policy.acquire's vectorcall entry (acq10) reads `timeout=` and the levels' keywords.
    assert str(inspect.signature(rq.Policy.acquire)) == "(self, /, *, timeout=None, **kw)"
    assert (rq.Policy.acquire.__doc__ or "").startswith("Waits for every level")

    def policy() -> rq.Policy:
        return rq.Policy(
            {
                "llm": two_units(),
                "user": rq.KeyedLimiter(rq.Rate(5, burst=2), clock=rq.ManualClock()),
            }
        )

    for kw, exc, message in POLICY_REFUSED:
        pol = policy()
        with pytest.raises(exc) as e:
            pol.acquire(user="u", **kw)
        assert str(e.value) == message
        assert pol.try_acquire(user="u", tokens=1000) is not None  # nothing was taken
    pol = policy()
    with pytest.raises(TypeError) as e:
        pol.acquire(1, tokens=1)  # type: ignore[misc]
    assert str(e.value) == "Policy.acquire() takes 0 positional arguments but 1 was given"
    with pytest.raises(TypeError, match=re.escape('missing key for level "user": pass user=...')):
        pol.acquire(tokens=1)
    assert pol.acquire(user="u", tokens=5, timeout=None).delay == 0.0
    assert pol.acquire(user="u", tokens=5, timeout=1.0).delay == 0.0
    assert pol.try_acquire(user="u", tokens=1) is None  # the key's burst of 2 is used

    class Sub(rq.Policy):
        pass

    sub = Sub({"llm": rq.Limiter(rq.Rate(100, burst=10), clock=rq.ManualClock())})
    assert isinstance(sub.acquire(requests=2), rq.PolicyPermit)


def test_settle_of_many_units() -> None:
    # More keywords than settle keeps inline (4): every one applied.
    units = ["requests", "tokens", "a", "b", "c", "d"]
    lim = rq.Limiter(*(rq.Rate(100, burst=100, unit=u) for u in units), clock=rq.ManualClock())
    p = lim.acquire(**dict.fromkeys(units, 50))
    p.settle(**{u: 10 + i for i, u in enumerate(units)})
    assert p.costs == {u: 10 + i for i, u in enumerate(units)}
    assert [lim.available(u) for u in units] == [100 - 10 - i for i in range(6)]


@pytest.mark.parametrize("method", ["acquire", "acquire_async"])
def test_a_positional_none_is_no_cost(method: str) -> None:
    # PyO3 reads an explicit None as the argument left out (ratequeue.adaptive passes it).
    lim = two_units()
    assert permit_of(lim, method, None, tokens=7).costs == {"requests": 1, "tokens": 7}
    one = rq.Limiter(rq.Rate(10, burst=10), clock=rq.ManualClock())
    assert permit_of(one, method, None, priority=None, timeout=None).costs == {"requests": 1}
