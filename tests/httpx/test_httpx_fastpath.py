"""The transport's lean call path keeps every behaviour: lazy estimates, header scans,
body decoding, settling only what changed."""

from __future__ import annotations

import importlib
import json
from typing import Any

import pytest
import ratequeue as rq
from ratequeue.httpx import Estimate, RateLimitedTransport, chars_estimate
from ratequeue.httpx._record import json_object
from ratequeue.httpx._wire import header_list, scan_response

CHAT = "/v1/chat/completions"
BODY = {"model": "gpt-x", "messages": [{"role": "user", "content": "x" * 40}], "max_tokens": 9}


@pytest.fixture(params=["httpx", "httpx2"])
def mod(request: pytest.FixtureRequest) -> Any:
    return importlib.import_module(request.param)


def answer(mod: Any) -> Any:
    usage = {"usage": {"prompt_tokens": 3, "completion_tokens": 4}}
    return mod.MockTransport(lambda req: mod.Response(200, json=usage))


def test_requests_only_limit_reads_the_estimate_when_asked(mod: Any) -> None:
    lim = rq.Limiter(rq.Rate(60, per="minute", burst=5), clock=rq.ManualClock())
    c = mod.Client(transport=RateLimitedTransport(answer(mod), lim), base_url="http://p")
    r = c.post(CHAT, json=BODY)
    rec = r.extensions["ratequeue"]
    assert rec.settled and rec.usage == (3, 4)
    assert rec.model == "gpt-x"
    assert rec.estimate == chars_estimate(BODY, CHAT) == Estimate(10 + 4, 9)
    assert lim.available() == pytest.approx(4)


def test_requests_only_limit_still_asks_streams_for_usage(mod: Any) -> None:
    sent: list[Any] = []

    def handler(req: Any) -> Any:
        sent.append(json.loads(req.content))
        return mod.Response(200, json={})

    lim = rq.Limiter(rq.Rate(60, per="minute", burst=5), clock=rq.ManualClock())
    c = mod.Client(transport=RateLimitedTransport(mod.MockTransport(handler), lim))
    c.post("http://p" + CHAT, json={**BODY, "stream": True})
    assert sent[0]["stream_options"] == {"include_usage": True}


def test_settle_refunds_tokens_and_leaves_requests(mod: Any) -> None:
    lim = rq.Limiter(
        rq.Rate(60, per="minute", burst=5),
        rq.Rate(60_000, per="minute", burst=10_000, unit="tokens"),
        clock=rq.ManualClock(),
    )
    c = mod.Client(transport=RateLimitedTransport(answer(mod), lim), base_url="http://p")
    c.post(CHAT, json=BODY)
    assert lim.available("requests") == pytest.approx(4)
    assert lim.available("tokens") == pytest.approx(10_000 - 7)


def test_header_list_of_any_headers_type(mod: Any) -> None:
    h = mod.Headers({"Content-Type": "text/event-stream", "X-A": "1"})
    assert header_list(h) is h._list  # httpx's own list: no copy

    class Plain:
        def __init__(self) -> None:
            self.raw = [(b"Content-Type", b"a/b")]

    assert header_list(Plain()) == [(b"Content-Type", b"content-type", b"a/b")]


def test_scan_response_finds_exhaustion_by_any_dialect() -> None:
    def scan(*pairs: tuple[str, str]) -> tuple[bytes, bool]:
        return scan_response([(k.encode(), k.lower().encode(), v.encode()) for k, v in pairs])

    assert scan(("Content-Type", "application/json")) == (b"application/json", False)
    assert scan(("x-ratelimit-remaining-tokens", "0"))[1]
    assert scan(("x-ratelimit-remaining-input-tokens", "0.0"))[1]  # not a known name
    assert not scan(("x-ratelimit-remaining-tokens", "10"))[1]
    assert not scan(("x-ratelimit-limit-tokens", "0"))[1]  # a limit says nothing used
    assert scan(("anthropic-ratelimit-tokens-remaining", "0"))[1]
    assert scan(("RateLimit", '"default";r=0;t=3'))[1]
    assert scan(("ratelimit-remaining", "5"))[1]  # the full parse decides


def test_json_object_decodes_what_json_loads_decodes() -> None:
    for data in (
        b'{"a": 1}',
        b' \n{"a": 1}\r\n',
        '{"a": "é"}'.encode("utf-16"),
        b'\xef\xbb\xbf{"a": 1}',
        b'{"a": "\xed\xa0\x80"}',  # a lone surrogate: json.loads takes it
    ):
        assert json_object(data) == json.loads(data)
    for bad in (b"[1, 2]", b'{"a": 1} x', b"\xff{", b"", b"null"):
        assert json_object(bad) is None
