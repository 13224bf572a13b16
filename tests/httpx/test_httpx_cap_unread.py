"""A body the transport cannot read (over ``max_body``, streamed, not one JSON object)
on a call an output cap matches: refused before anything is acquired or sent
(``CapNotApplied``), unless the transport was told ``uncapped="send"``. A cap is a
defence against quota amplification: padding a prompt past ``max_body`` must not get a
call around it."""

from __future__ import annotations

import asyncio
import importlib
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
import ratequeue as rq
from ratequeue.httpx import CallBudget, Cap, CapNotApplied, RateLimitedTransport

CHAT = "http://p/v1/chat/completions"
BIG = b'{"model":"m","max_tokens":5000,"pad":"' + b"x" * 4096 + b'"}'


def _limiter() -> rq.Limiter:
    return rq.Limiter(
        rq.Rate(1000, per="minute"),
        rq.Rate(10**6, per="minute", unit="tokens"),
        clock=rq.ManualClock(),
    )


def _setup(
    modname: str, caps: list[Cap], **kw: Any
) -> tuple[Any, list[Any], rq.Limiter, RateLimitedTransport]:
    mod = importlib.import_module(modname)
    sent: list[Any] = []
    lim = _limiter()
    t = RateLimitedTransport(
        mod.MockTransport(lambda r: sent.append(r) or mod.Response(200, json={})),
        lim,
        caps=caps,
        max_body=1024,
        **kw,
    )
    return mod, sent, lim, t


def _untouched(lim: rq.Limiter, sent: list[Any]) -> None:
    assert sent == []
    assert lim.available("requests") == 1000 and lim.available("tokens") == 10**6


MODS = ["httpx", "httpx2"]


@pytest.mark.parametrize("modname", MODS)
def test_a_body_over_max_body_on_a_capped_route_is_refused(modname: str) -> None:
    mod, sent, lim, t = _setup(modname, [Cap(100, route="/chat/completions")])
    c = mod.Client(transport=t)
    with CallBudget(calls=5) as b, pytest.raises(CapNotApplied) as e:
        c.post(CHAT, content=BIG)
    _untouched(lim, sent)
    assert b.calls_used == 0 and b.usage == []
    assert "max_body" in str(e.value) and e.value.retry_after == float("inf")
    assert isinstance(e.value, rq.RateQueueError) and isinstance(e.value, ValueError)


@pytest.mark.parametrize("modname", MODS)
def test_a_streamed_body_on_a_capped_route_is_refused(modname: str) -> None:
    mod, sent, lim, t = _setup(modname, [Cap(100)])

    def chunks() -> Iterator[bytes]:
        yield b'{"max_tokens":'
        yield b"5000}"

    with pytest.raises(CapNotApplied):
        mod.Client(transport=t).post(CHAT, content=chunks())
    _untouched(lim, sent)


@pytest.mark.parametrize("modname", MODS)
def test_async_a_streamed_body_on_a_capped_route_is_refused(modname: str) -> None:
    mod, sent, lim, t = _setup(modname, [Cap(100)])

    async def chunks() -> AsyncIterator[bytes]:
        yield b'{"max_tokens":5000}'

    async def main() -> None:
        async with mod.AsyncClient(transport=t) as c:
            with pytest.raises(CapNotApplied):
                await c.post(CHAT, content=chunks())
            with pytest.raises(CapNotApplied):
                await c.post(CHAT, content=BIG)

    asyncio.run(main())
    _untouched(lim, sent)


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize(
    "data",
    [
        b'{"max_tokens":5000} trailing',  # Go's json.Decoder reads the object and stops
        b'{"max_tokens":5000}{"max_tokens":5000}',
        b'[{"max_tokens":5000}]',
        b'{"max_tokens":5000',
        b"\xff{}",
    ],
)
def test_a_body_that_is_not_one_json_object_is_refused(
    data: bytes, native: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ratequeue.httpx import _prepare

    if not native:
        monkeypatch.setattr(_prepare, "_cap_output", lambda *a: False)
    mod, sent, lim, t = _setup("httpx", [Cap(100)])
    with pytest.raises(CapNotApplied):
        mod.Client(transport=t).post(CHAT, content=data)
    _untouched(lim, sent)


def test_a_cap_on_a_model_refuses_an_unread_body_whose_model_is_unknown() -> None:
    mod, sent, lim, t = _setup("httpx", [Cap(100, model="gpt-4o*")])
    with pytest.raises(CapNotApplied):
        mod.Client(transport=t).post(CHAT, content=BIG)
    _untouched(lim, sent)


@pytest.mark.parametrize("modname", MODS)
def test_what_no_cap_can_match_is_sent_as_before(modname: str) -> None:
    caps = [Cap(100, route="/messages"), Cap(100, task="summary")]
    mod, sent, _, t = _setup(modname, caps)
    c = mod.Client(transport=t)
    c.post(CHAT, content=BIG)  # another route, no task
    c.post(CHAT, content=BIG, headers={"x-ratequeue-task": "chat"})  # another task
    assert [r.content for r in sent] == [BIG, BIG]
    with pytest.raises(CapNotApplied):
        c.post(CHAT, content=BIG, headers={"x-ratequeue-task": "summary"})
    with rq.httpx.using(task="summary"), pytest.raises(CapNotApplied):
        c.post(CHAT, content=BIG)
    assert len(sent) == 2


@pytest.mark.parametrize("modname", MODS)
def test_bodies_with_nothing_to_cap_are_sent(modname: str) -> None:
    mod, sent, _, t = _setup(modname, [Cap(100)])
    c = mod.Client(transport=t)
    c.get(CHAT)  # no body
    c.post(CHAT, content=b"")  # an empty body
    files = {"file": ("a.jsonl", b"x" * 4096)}
    c.post("http://p/v1/files", files=files)  # a multipart upload over max_body
    assert len(sent) == 3
    assert sent[2].headers["content-type"].startswith("multipart/form-data")


@pytest.mark.parametrize("modname", MODS)
def test_uncapped_send_keeps_the_old_behaviour(modname: str) -> None:
    mod, sent, lim, t = _setup(modname, [Cap(100)], uncapped="send")
    mod.Client(transport=t).post(CHAT, content=BIG)
    assert sent[0].content == BIG
    assert lim.available("requests") == 999


@pytest.mark.parametrize("bad", ["drop", "", None, 1, True])
def test_uncapped_takes_refuse_or_send(bad: Any) -> None:
    with pytest.raises(ValueError, match="uncapped"):
        _setup("httpx", [Cap(100)], uncapped=bad)
    assert _setup("httpx", [], uncapped="refuse")[3].uncapped == "refuse"


def test_uncapped_is_fixed_on_a_live_transport() -> None:
    t = _setup("httpx", [Cap(100)])[3]
    assert t.uncapped == "refuse"
    with pytest.raises(AttributeError):
        t.uncapped = "send"
