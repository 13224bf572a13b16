"""A call a Limiter grants at once takes its permit in the native prepare (no acquire
crossing of its own): the same permit, costs, wait record and refusals as the acquire
it replaces, and never ahead of anyone queued."""

from __future__ import annotations

import asyncio
import importlib
import json
import threading
import time
from typing import Any

import pytest
import ratequeue as rq
from ratequeue.httpx import RateLimitedTransport, TokenEstimator
from ratequeue.httpx._wire import header_list

CHAT = "http://p/v1/chat/completions"
ANSWER = json.dumps({"usage": {"prompt_tokens": 5, "completion_tokens": 6}}).encode()
BODY = {"model": "m", "max_tokens": 100, "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture(params=["httpx", "httpx2"])
def mod(request: pytest.FixtureRequest) -> Any:
    return importlib.import_module(request.param)


def limiter(burst: int = 10**6, **kw: Any) -> rq.Limiter:
    return rq.Limiter(
        rq.Rate(60, per="minute", burst=burst),
        rq.Rate(10**6, per="minute", burst=10**6, unit="tokens"),
        clock=rq.ManualClock(),
        **kw,
    )


def inner(mod: Any) -> Any:
    return mod.MockTransport(lambda r: mod.Response(200, content=ANSWER))


def request(mod: Any) -> Any:
    req = mod.Request("POST", CHAT, json=BODY)
    header_list(req.headers)  # its headers' type known (as after a process's first call)
    return req


def transport(inner: Any, limit: Any, **kw: Any) -> RateLimitedTransport:
    # The character count, started: the tiktoken default reads its first calls in Python.
    return RateLimitedTransport(inner, limit, estimator=TokenEstimator(None), **kw)


def native_and_reference(mod: Any) -> list[tuple[Any, rq.Limiter]]:
    """Two transports alike: the first prepares natively, the second in Python."""
    out = []
    for native in (True, False):
        lim = limiter()
        t = transport(inner(mod), lim)
        if not native:
            t._reader = None
        out.append((t, lim))
    return out


def test_granted_at_once_in_prepare(mod: Any) -> None:
    """The native prepare takes the permit acquire would (same costs, no wait, the wait
    recorded once); the call ends as the reference's does, the limiter alike."""
    ends = []
    for t, lim in native_and_reference(mod):
        call = t._prepare(request(mod), False)
        if t._reader is not None:
            assert call._permit is not None and call._permit.costs == call._charged
            call._permit.settle(**dict.fromkeys(call._charged, 0))  # given back
        else:
            assert call._permit is None
        t.wait_histogram.reset()
        rec = mod.Client(transport=t).post(CHAT, json=BODY).extensions["ratequeue"]
        ends.append(
            (
                rec.settled,
                rec.usage,
                rec.charged,
                rec.waited,
                rec._permit.costs,
                rec._permit.waited,
                t.wait_histogram.count,
                lim.available("tokens"),
            )
        )
    native, ref = ends
    assert native[:3] == ref[:3] and native[4:] == ref[4:]  # all but the wait measured
    assert native[3] == native[5] == ref[5] == 0.0 and native[6] == 1


def test_async_granted_at_once(mod: Any) -> None:
    (t, lim), (rt, rlim) = native_and_reference(mod)

    async def run(t: Any) -> Any:
        async with mod.AsyncClient(transport=t) as c:
            return (await c.post(CHAT, json=BODY)).extensions["ratequeue"]

    a, b = asyncio.run(run(t)), asyncio.run(run(rt))
    assert (a.settled, a.usage, a.charged, a._permit.costs) == (
        b.settled,
        b.usage,
        b.charged,
        b._permit.costs,
    )
    assert lim.available("tokens") == rlim.available("tokens") == 10**6 - 11
    assert t.wait_histogram.count == rt.wait_histogram.count == 1


def test_nobody_queued_is_overtaken(mod: Any) -> None:
    """With a waiter in the Limiter's queue the prepare grants nothing (and changes
    nothing); the call then queues behind the waiter and is granted after it."""
    lim = limiter(burst=1)
    clock = lim.clock
    lim.acquire(tokens=0)  # the burst taken: the next waits a second
    t = transport(inner(mod), lim)
    order: list[str] = []

    def waiter() -> None:
        lim.acquire(tokens=0, timeout=60)
        order.append("waiter")

    th = threading.Thread(target=waiter)
    th.start()
    deadline = time.monotonic() + 10
    while lim.stats()["waiting"] == 0:
        assert time.monotonic() < deadline
        time.sleep(0.001)
    before = (lim.available("requests"), lim.available("tokens"))
    call = t._prepare(request(mod), False)
    assert call._permit is None
    assert (lim.available("requests"), lim.available("tokens")) == before
    assert t.wait_histogram.count == 0

    def caller() -> None:
        mod.Client(transport=t).post(CHAT, json=BODY)
        order.append("call")

    tc = threading.Thread(target=caller)
    tc.start()
    while lim.stats()["waiting"] < 2:
        assert time.monotonic() < deadline
        time.sleep(0.001)
    for n in (1, 2):  # one grant a second, in turn (a manual clock: polled)
        clock.advance(1.0)
        lim.poll()
        while len(order) < n:
            assert time.monotonic() < deadline
            time.sleep(0.001)
    th.join(10)
    tc.join(10)
    assert order == ["waiter", "call"]
    assert t.wait_histogram.count == 1


def test_refusals_are_acquires_own(mod: Any) -> None:
    """A timeout or priority acquire refuses is not granted in the prepare: the call
    raises acquire's error, nothing is charged and nothing sent."""
    lim = limiter()
    sent: list[Any] = []
    t = transport(
        mod.MockTransport(lambda r: sent.append(r) or mod.Response(200, content=ANSWER)), lim
    )
    t.timeout = -1.0  # a setting assigned after the checks of the constructor
    with pytest.raises(ValueError, match="timeout=-1"):
        mod.Client(transport=t).post(CHAT, json=BODY)
    t.timeout = None
    with pytest.raises(ValueError, match="is not one of the classes"):
        mod.Client(transport=t).post(CHAT, json=BODY, headers={"x-ratequeue-priority": "zz"})
    assert sent == [] and t.wait_histogram.count == 0
    assert (lim.available("requests"), lim.available("tokens")) == (10**6, 10**6)


def test_a_cost_past_the_burst_is_clamped_again(mod: Any) -> None:
    """A burst lowered after the transport was built: the prepare grants nothing (the
    cost is past it), acquire refuses, and the call is clamped again and sent."""
    lim = limiter()
    t = transport(inner(mod), lim)
    lim.set_rate(10**6, 60, burst=50, which="tokens")
    rec = mod.Client(transport=t).post(CHAT, json=BODY).extensions["ratequeue"]
    assert t._bursts["tokens"] == 50 and rec.waited > 0.0  # clamped again, acquired
    assert rec.settled and rec.charged == {"requests": 1, "tokens": 11}
    assert t.wait_histogram.count == 1 and lim.available("tokens") == 50 - 11


def test_with_a_ledger_the_hold_comes_first(mod: Any) -> None:
    """A transport with a ledger acquires after the call is held: the prepare grants
    nothing; a Policy or Pool transport never has the native grant."""
    lim = limiter()
    log: list[tuple[str, int]] = []

    class Ledger:
        def __getattr__(self, name: str) -> Any:
            def op(*a: Any, **kw: Any) -> None:
                log.append((name, lim.available("requests")))

            return op

    t = transport(inner(mod), lim, ledger=Ledger())
    call = t._prepare(request(mod), False)
    assert call._permit is None and t.wait_histogram.count == 0
    rec = mod.Client(transport=t).post(CHAT, json=BODY).extensions["ratequeue"]
    assert rec.settled and t.wait_histogram.count == 1
    assert log[0] == ("hold", 10**6)  # held before anything was taken
    pt = transport(inner(mod), rq.Policy({"l": lim}), units=["requests", "tokens"])
    assert pt._prepare(request(mod), False)._permit is None


def test_a_wait_histogram_of_its_own_is_recorded_in(mod: Any) -> None:
    """A transport's ``wait_histogram`` replaced by any object with ``record``: calls go
    on (the grant at once is the Python path's then), and their waits are recorded in it
    (from the review: the native prepare took only a ``Histogram``, a TypeError)."""

    class Recorder:
        def __init__(self) -> None:
            self.waits: list[float] = []

        def record(self, seconds: float) -> None:
            self.waits.append(seconds)

    lim = limiter()
    t = transport(inner(mod), lim)
    t.wait_histogram = rec = Recorder()  # type: ignore[assignment]
    client = mod.Client(transport=t)
    for _ in range(2):
        assert client.post(CHAT, json=BODY).extensions["ratequeue"].settled
    assert len(rec.waits) == 2 and all(w >= 0.0 for w in rec.waits)
    assert lim.available("tokens") == 10**6 - 22
