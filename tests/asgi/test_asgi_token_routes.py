"""Token routes of the ASGI middleware on APIs other than chat: a Responses call (its
prompt in ``input``) is charged the default output like any generation; an embeddings
call no output; a request without a body (a gateway forwarding GETs) is settled to the
usage its response reports, or to nothing when it reports none."""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any

import pytest
import ratequeue as rq
from asgi_helpers import call
from ratequeue.asgi import OpenAITokens, RateLimitMiddleware, Rule


async def reply(send: Any, payload: dict[str, Any]) -> None:
    body = json.dumps(payload).encode()
    headers = [(b"content-type", b"application/json")]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def answer(payload: dict[str, Any]) -> Any:
    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        await receive()
        await reply(send, payload)

    return app


def gateway(clock: rq.ManualClock, app: Any) -> tuple[Any, rq.Limiter]:
    cluster = rq.Limiter(
        rq.Rate(100, per="minute"), rq.Rate(10_000, per="minute", unit="tokens"), clock=clock
    )
    mw = RateLimitMiddleware(
        app, levels={"cluster": cluster}, rules=[Rule("/v1/**", tokens=OpenAITokens())]
    )
    return mw, cluster


@pytest.mark.parametrize(
    ("path", "output"),
    [
        ("/v1/responses", 1024),  # a generation: its bound, else the default
        ("/v1/chat/completions", 1024),
        ("/v1/completions", 1024),
        ("/v1/embeddings", 0),
        ("/v1/moderations", 0),
        ("/v1beta/models/text-embedding-004:embedContent", 0),
    ],
)
def test_the_output_estimate_follows_the_route(path: str, output: int) -> None:
    est = OpenAITokens()
    body = json.dumps({"model": "m", "input": "x" * 40}).encode()
    assert est.estimate(body, path) == 10 + output
    bounded = json.dumps({"model": "m", "input": "x" * 40, "max_output_tokens": 7}).encode()
    assert est.estimate(bounded, path) == 10 + 7


def test_without_a_path_the_estimate_is_as_before() -> None:
    est = OpenAITokens()
    assert est.estimate(json.dumps({"input": "x" * 40}).encode()) == 10  # embeddings
    assert est.estimate(b"") == 1024


def test_a_responses_call_is_charged_its_default_output_before_it_runs(
    clock: rq.ManualClock,
) -> None:
    seen: list[float] = []

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        await receive()
        seen.append(cluster.available("tokens"))
        await reply(send, {"usage": {"input_tokens": 10, "output_tokens": 5}})

    mw, cluster = gateway(clock, app)
    body = json.dumps({"model": "m", "input": "x" * 40}).encode()
    r = asyncio.run(call(mw, "POST", "/v1/responses", body=body))
    assert r.status == 200
    assert seen == [10_000 - 1034]  # held while it ran: prompt + default output
    assert cluster.available("tokens") == 10_000 - 15  # settled to the usage


@pytest.mark.parametrize("method", ["GET", "DELETE", "POST"])
def test_a_request_without_a_body_nor_usage_settles_to_nothing(
    clock: rq.ManualClock, method: str
) -> None:
    """A gateway forwarding ``models.list()``: held at the default output while it runs,
    then nothing (before, each kept 1,024 tokens for good)."""
    mw, cluster = gateway(clock, answer({"object": "list", "data": []}))
    for _ in range(3):
        r = asyncio.run(call(mw, method, "/v1/models"))
        assert r.status == 200
    assert cluster.available("tokens") == 10_000


def test_a_request_without_a_body_is_charged_the_usage_it_reports(clock: rq.ManualClock) -> None:
    """A GET may generate (an EventSource sends only GETs: the prompt is in the query)."""
    mw, cluster = gateway(clock, answer({"usage": {"input_tokens": 3_000, "output_tokens": 2_000}}))
    codes = [asyncio.run(call(mw, "GET", "/v1/generate?q=hi")).status for _ in range(3)]
    assert codes == [200, 200, 429]
    assert cluster.available("tokens") == 0


def _events(n: int, fail: bool) -> Any:
    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        await receive()
        headers = [(b"content-type", b"text/event-stream")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        for _ in range(n):
            chunk = b'data: {"choices":[{"delta":{"content":"x"}}]}\n\n'
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        if fail:
            raise RuntimeError("the app failed mid-stream")
        await send({"type": "http.response.body", "body": b""})

    return app


@pytest.mark.parametrize("fail", [False, True])
def test_a_bodyless_event_stream_without_usage_keeps_its_estimate(
    clock: rq.ManualClock, fail: bool
) -> None:
    """It may have generated (an EventSource GET): cut short or never reporting, the
    estimate stays (third review: it settled to nothing)."""
    mw, cluster = gateway(clock, _events(20, fail))
    with contextlib.suppress(RuntimeError):
        asyncio.run(call(mw, "GET", "/v1/generate?q=hi"))
    assert cluster.available("tokens") == 10_000 - 1024
