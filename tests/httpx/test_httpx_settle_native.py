"""The response side in one native call (``_settle_response``) against the Python
reference (``_received`` + ``_settle``): for any usage, charged estimate (clamped or not)
and plan of units, the call's record and the limiter's state after the settle are the
same; where the native call defers, nothing was done and the reference takes the call;
a call is settled once."""

from __future__ import annotations

import asyncio
import importlib
import json
import threading
from typing import Any

import pytest
import ratequeue as rq
from hypothesis import given, settings
from hypothesis import strategies as st
from ratequeue._ratequeue import _settle_response
from ratequeue.httpx import RateLimitedTransport
from ratequeue.httpx import _transport as transport_module
from ratequeue.httpx._usage import Usage

CHAT = "http://p/v1/chat/completions"
UNITS = ["tokens", "input_tokens+output_tokens", "tokens+input_tokens+output_tokens", "requests"]
# What a record says once settled (waited and http_seconds are times: not compared).
FIELDS = ("model", "estimate", "status", "usage", "settled", "charged", "clamped", "rate_limits")

COUNT = st.one_of(
    st.integers(0, 3000),
    st.integers(-5, 2**66),
    st.none(),
    st.booleans(),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=2),
)
USAGE_KEYS = st.sampled_from(
    [
        "prompt_tokens",
        "completion_tokens",
        "input_tokens",
        "output_tokens",
        "cache_creation_input_tokens",
        "cache_read_input_tokens",
        "total_tokens",
    ]
)
USAGES = st.dictionaries(USAGE_KEYS, COUNT, max_size=5)
BODIES = st.one_of(
    USAGES.map(lambda u: {"id": "x", "choices": [{"text": "é"}], "usage": u}),
    USAGES.map(lambda u: {"response": {"usage": u}}),
    st.just({"id": "no usage"}),
    st.just({"usage": None}),
).map(lambda b: json.dumps(b, ensure_ascii=False).encode())
RAW = st.sampled_from(
    [b"", b"not json", b'{"usage": {"prompt_tokens": 3, "completion_tokens": 4}', b"[1]"]
)
CTYPES = st.sampled_from(
    [
        None,
        b"application/json",
        b"Text/Event-Stream; charset=utf-8",
        b"text/plain",
    ]
)


@pytest.fixture(params=["httpx", "httpx2"])
def mod(request: pytest.FixtureRequest) -> Any:
    return importlib.import_module(request.param)


def limiter(units: str, burst: int) -> rq.Limiter:
    rates = [rq.Rate(10**6, per="minute", burst=10**6)]
    if units != "requests":
        for u in units.split("+"):
            rates.append(rq.Rate(10**6, per="minute", burst=burst, unit=u))
    return rq.Limiter(*rates, clock=rq.ManualClock())


def pair(
    mod: Any, units: str, burst: int, answer: bytes, headers: list[tuple[bytes, bytes]], code: int
) -> tuple[tuple[Any, rq.Limiter], tuple[Any, rq.Limiter]]:
    """Two transports alike, the first native, the second the Python reference."""
    out = []
    for native in (True, False):
        llm = limiter(units, burst)
        inner = mod.MockTransport(lambda r: mod.Response(code, headers=headers, content=answer))
        t = RateLimitedTransport(inner, llm)
        t._native_settle = native
        out.append((t, llm))
    return out[0], out[1]


def state(t: Any, llm: rq.Limiter, rec: Any) -> tuple[Any, ...]:
    return (
        tuple(getattr(rec, f) for f in FIELDS),
        rec._correction,
        rec._done,
        rec._once,
        rec._permit.costs,
        {u: llm.available(u) for u in llm.units},
        t.http_histogram.count,
        t.stats()["sent"],
    )


@pytest.mark.parametrize("name", ["httpx", "httpx2"])
@settings(max_examples=300, deadline=None)
@given(
    units=st.sampled_from(UNITS),
    burst=st.sampled_from([40, 1000, 10**6]),
    max_tokens=st.integers(0, 3000),
    prompt=st.text(max_size=200),
    answer=st.one_of(BODIES, RAW),
    ctype=CTYPES,
    exhausted=st.booleans(),
    code=st.sampled_from([200, 201, 299]),
)
def test_native_settle_is_the_reference(
    name: str,
    units: str,
    burst: int,
    max_tokens: int,
    prompt: str,
    answer: bytes,
    ctype: bytes | None,
    exhausted: bool,
    code: int,
) -> None:
    mod = importlib.import_module(name)
    headers = [(b"content-type", ctype)] if ctype is not None else []
    if exhausted:
        headers += [(b"x-ratelimit-remaining-tokens", b"0"), (b"x-ratelimit-reset-tokens", b"1s")]
    (nt, nl), (rt, rl) = pair(mod, units, burst, answer, headers, code)
    body = {"model": "m", "messages": [{"role": "user", "content": prompt}]}
    body["max_tokens"] = max_tokens
    got = []
    for t, llm in ((nt, nl), (rt, rl)):
        with mod.Client(transport=t) as c:
            r = c.post(CHAT, json=body)
            r.read()
            r.close()
        rec = r.extensions["ratequeue"]
        got.append(state(t, llm, rec))
        t._settle(rec, None, None)  # a late close: settled already, nothing changes
        assert state(t, llm, rec) == got[-1]
    assert got[0] == got[1]


def test_the_common_path_is_one_native_call(mod: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A 2xx JSON answer with a usage, token units: settled natively, Python's _settle not
    run; the record and limiter as the reference leaves them."""
    answers: list[Any] = []

    def spy(*args: Any) -> Any:
        answers.append(_settle_response(*args))
        return answers[-1]

    monkeypatch.setattr(transport_module, "_settle_response", spy)
    answer = json.dumps({"usage": {"prompt_tokens": 7, "completion_tokens": 11}}).encode()
    (nt, nl), _ = pair(mod, "tokens", 10**6, answer, [(b"content-type", b"application/json")], 200)
    monkeypatch.setattr(nt, "_settle", lambda *a, **k: pytest.fail("the reference ran"))
    r = mod.Client(transport=nt).post(CHAT, json={"model": "m", "max_tokens": 100})
    rec = r.extensions["ratequeue"]
    assert answers == [None]
    assert rec.settled and rec.usage == Usage(7, 11) and type(rec.usage) is Usage
    assert rec.charged == {"requests": 1, "tokens": 18}
    assert rec._correction == {"tokens": 18}
    assert nl.available("tokens") == 10**6 - 18
    assert nt.http_histogram.count == 1


def test_clamped_estimate_is_charged_the_usage(mod: Any) -> None:
    answer = json.dumps({"usage": {"input_tokens": 5, "output_tokens": 6}}).encode()
    (nt, nl), _ = pair(mod, "input_tokens+output_tokens", 50, answer, [], 200)
    r = mod.Client(transport=nt).post(CHAT, json={"model": "m", "max_tokens": 500})
    rec = r.extensions["ratequeue"]
    assert rec.clamped == ()
    assert rec.charged == {"requests": 1, "input_tokens": 5, "output_tokens": 6}
    assert (nl.available("input_tokens"), nl.available("output_tokens")) == (45, 44)


def test_a_call_settled_before_is_left_alone(mod: Any) -> None:
    """The settle-once list empty (a concurrent close, cancel or __del__ settled first):
    the native call changes neither the record nor the limiter."""
    answer = json.dumps({"usage": {"prompt_tokens": 1, "completion_tokens": 1}}).encode()
    (t, llm), _ = pair(mod, "tokens", 10**6, answer, [], 200)
    req = mod.Request("POST", CHAT, json={"model": "m", "max_tokens": 100})
    call = t._prepare(req, False)
    assert call._permit is not None  # granted at once by the native prepare
    t._settle(call, None, 200)  # e.g. a cancel: nothing used
    after = (llm.available("tokens"), call._usage, call._correction, call.charged)
    got = _settle_response(
        call,
        call._once,
        call._permit,
        call._charged,
        t._token_plan,
        [],
        answer,
        t.max_body,
        t.http_histogram,
        0.001,
        Usage,
    )
    assert got is None
    assert (llm.available("tokens"), call._usage, call._correction, call.charged) == after


def test_deferred_calls_change_nothing(mod: Any) -> None:
    """Where the native call defers (a header list it cannot read, an SSE type, an
    exhausted quota, a usage past 64 bits, a permit not a Limiter's), nothing changed;
    an SSE type or an exhausted quota hands on what ``_read_response`` would say."""
    huge = json.dumps({"usage": {"prompt_tokens": 2**64, "completion_tokens": 1}}).encode()
    ok = json.dumps({"usage": {"prompt_tokens": 2, "completion_tokens": 1}}).encode()
    triple = (b"Content-Type", b"content-type", b"text/event-stream")
    exhausted = (b"X", b"x-ratelimit-remaining-tokens", b"0")
    cases: list[tuple[list[Any], bytes, bool, Any]] = [
        ([("not", "a triple")], ok, False, False),
        # What the headers say is handed on (the reference continues from it).
        ([triple], ok, False, (b"text/event-stream", False, False)),
        ([exhausted], ok, False, (b"", True, False)),
        ([triple, exhausted], ok, True, (b"text/event-stream", True, False)),
        ([], huge, False, False),
        ([], ok, True, False),
    ]
    for headers, answer, foreign_permit, want in cases:
        (t, llm), _ = pair(mod, "tokens", 10**6, answer, [], 200)
        req = mod.Request("POST", CHAT, json={"model": "m", "max_tokens": 100})
        call = t._prepare(req, False)
        assert call._permit is not None  # granted at once by the native prepare
        permit = object() if foreign_permit else call._permit
        before = (llm.available("tokens"), call._once, call.settled, call._usage)
        got = _settle_response(
            call,
            call._once,
            permit,
            call._charged,
            t._token_plan,
            headers,
            answer,
            t.max_body,
            t.http_histogram,
            0.001,
            Usage,
        )
        assert got == want and (got is not False or want is False)
        assert (llm.available("tokens"), call._once, call.settled, call._usage) == before
        assert t.http_histogram.count == 0


def test_async_native_settle_is_the_reference(mod: Any) -> None:
    answer = json.dumps({"usage": {"input_tokens": 30, "output_tokens": 4}}).encode()
    (nt, nl), (rt, rl) = pair(mod, "tokens+input_tokens+output_tokens", 1000, answer, [], 200)

    async def run(t: Any) -> Any:
        async with mod.AsyncClient(transport=t) as c:
            return (await c.post(CHAT, json={"model": "m", "max_tokens": 2000})).extensions[
                "ratequeue"
            ]

    a, b = asyncio.run(run(nt)), asyncio.run(run(rt))
    assert state(nt, nl, a) == state(rt, rl, b)
    assert a.usage == Usage(30, 4) and a.clamped == ()


def test_requests_only_keeps_the_body_for_the_record(mod: Any) -> None:
    answer = json.dumps({"usage": {"prompt_tokens": 3, "completion_tokens": 4}}).encode()
    (nt, _nl), _ = pair(mod, "requests", 1, answer, [], 200)
    rec = mod.Client(transport=nt).post(CHAT, json={"model": "m"}).extensions["ratequeue"]
    assert rec.settled and rec._usage_body == answer
    assert rec.usage == Usage(3, 4)
    assert rec.charged == {"requests": 1}


def test_a_race_with_a_cancel_settles_once(mod: Any) -> None:
    """The native settle and a concurrent ``_settle`` (a close, cancel or ``__del__``):
    one of them settles, and the record and the limiter agree on which."""
    answer = json.dumps({"usage": {"prompt_tokens": 5, "completion_tokens": 6}}).encode()
    barrier = threading.Barrier(2)
    for _ in range(200):
        (t, llm), _ = pair(mod, "tokens", 10**6, answer, [], 200)
        req = mod.Request("POST", CHAT, json={"model": "m", "max_tokens": 100})
        call = t._prepare(req, False)
        assert call._permit is not None  # granted at once by the native prepare
        args = (call, call._once, call._permit, call._charged, t._token_plan, [], answer)
        args += (t.max_body, t.http_histogram, 0.001, Usage)

        def native(args: tuple[Any, ...] = args) -> None:
            barrier.wait()
            _settle_response(*args)

        def cancel(t: Any = t, call: Any = call) -> None:
            barrier.wait()
            t._settle(call, None, None)

        threads = [threading.Thread(target=native), threading.Thread(target=cancel)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        assert call.settled and call._once == []
        if call._usage is None:  # the cancel settled: nothing used
            assert call.charged == {"requests": 1, "tokens": 0}
            assert llm.available("tokens") == 10**6
        else:
            assert call._usage == Usage(5, 6)
            assert call.charged == {"requests": 1, "tokens": 11}
            assert llm.available("tokens") == 10**6 - 11
