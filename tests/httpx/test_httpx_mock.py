"""The mock provider's LLM dialects: routes, SSE with usage, header dialects, 429 styles."""

from __future__ import annotations

import http.client
import json
from typing import Any

import pytest
from ratequeue.httpx import parse_rate_limit_headers
from ratequeue.httpx._usage import SSEUsage, usage_from_json
from ratequeue.testing import MAX_BODY, MockProvider

pytestmark = pytest.mark.timeout(60)


def post(mock: MockProvider, path: str, body: Any, headers: dict[str, str] | None = None) -> Any:
    conn = http.client.HTTPConnection("127.0.0.1", mock.port, timeout=10)
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    conn.request("POST", path, body=data, headers=headers or {})
    r = conn.getresponse()
    payload = r.read()
    conn.close()
    return r.status, dict(r.getheaders()), payload


@pytest.mark.parametrize(
    ("path", "kind"),
    [
        ("/v1/chat/completions", "chat.completion"),
        ("/v1/responses", "response"),
        ("/v1/messages", "message"),
    ],
)
def test_each_route_answers_its_dialect_with_usage(path: str, kind: str) -> None:
    with MockProvider(6000, gen_time=0.0, output_tokens=5) as mock:
        body = {"model": "m", "messages": [{"role": "user", "content": "x" * 40}], "max_tokens": 3}
        status, _, payload = post(mock, path, body)
    reply = json.loads(payload)
    assert status == 200 and reply.get("object", reply.get("type")) == kind
    assert usage_from_json(reply) == (10, 3)  # ceil(40 / 4) in, min(5, max_tokens) out


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/responses", "/v1/messages"])
def test_streams_carry_usage(path: str) -> None:
    with MockProvider(6000, gen_time=0.0, output_tokens=4) as mock:
        body = {
            "model": "m",
            "input": "y" * 8,
            "messages": [{"role": "user", "content": "y" * 8}],
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        status, headers, payload = post(mock, path, body)
    assert status == 200 and headers["Content-Type"] == "text/event-stream"
    r = SSEUsage()
    r.feed(payload)
    assert r.final and r.usage is not None and r.usage.output_tokens == 4


def test_background_responses_are_polled_and_cancelled() -> None:
    """Created queued without usage; the first poll finds it in progress, the next
    completed with its usage; a cancel reports the usage too; an unknown id is a 404."""

    def get(mock: MockProvider, path: str) -> tuple[int, Any]:
        conn = http.client.HTTPConnection("127.0.0.1", mock.port, timeout=10)
        conn.request("GET", path)
        r = conn.getresponse()
        out = r.status, json.loads(r.read())
        conn.close()
        return out

    with MockProvider(6000, gen_time=0.0, output_tokens=5) as mock:
        body = {"model": "m", "input": "x" * 40, "background": True}
        status, _, payload = post(mock, "/v1/responses", body)
        created = json.loads(payload)
        assert status == 200 and created["status"] == "queued" and created["usage"] is None
        rid = created["id"]
        polls = [get(mock, f"/v1/responses/{rid}") for _ in range(3)]
        assert [(s, p["status"]) for s, p in polls] == [
            (200, "in_progress"),
            (200, "completed"),
            (200, "completed"),
        ]
        assert polls[0][1]["usage"] is None and usage_from_json(polls[1][1]) == (10, 5)
        status, _, payload = post(mock, f"/v1/responses/{rid}/cancel", b"")
        assert status == 200 and json.loads(payload)["status"] == "cancelled"
        assert get(mock, "/v1/responses/resp_nope")[0] == 404
        assert post(mock, "/v1/responses/resp_nope/cancel", b"")[0] == 404
        assert mock.stats()["requests"] == 1  # polls are not completions


def test_chat_stream_without_include_usage_has_none() -> None:
    with MockProvider(6000, gen_time=0.0) as mock:
        _, _, payload = post(mock, "/v1/chat/completions", {"messages": [], "stream": True})
    r = SSEUsage()
    r.feed(payload)
    assert r.usage is None and payload.endswith(b"data: [DONE]\n\n")


@pytest.mark.parametrize("dialect", ["openai", "anthropic", "ietf"])
def test_header_dialects_parse(dialect: str) -> None:
    # 6 a minute, burst 2: the third call is refused unless 10 s passed (at 600 a minute
    # a loaded machine took the 100 ms and the third call was admitted).
    with MockProvider(6, tpm=60_000, burst=2, gen_time=0.0, dialect=dialect) as mock:
        _, headers, _ = post(mock, "/v1/chat/completions", {"messages": []})
        post(mock, "/v1/chat/completions", {"messages": []})
        status, h429, _ = post(mock, "/v1/chat/completions", {"messages": []})
    assert status == 429
    info = parse_rate_limit_headers(headers)
    assert info.quotas["requests"].limit == 6
    if dialect != "ietf":
        assert info.quotas["tokens"].limit == 60_000
    exhausted = parse_rate_limit_headers(h429)
    assert exhausted.quotas["requests"].remaining == 0
    assert 0 < exhausted.wait() <= 10.0  # type: ignore[operator]


def test_auto_dialect_follows_the_route() -> None:
    with MockProvider(600, gen_time=0.0) as mock:
        _, oa, _ = post(mock, "/v1/chat/completions", {})
        _, an, _ = post(mock, "/v1/messages", {})
    assert "x-ratelimit-limit-requests" in oa and "anthropic-ratelimit-requests-limit" in an


@pytest.mark.parametrize(
    ("style", "keys"),
    [
        ("both", {"Retry-After", "retry-after-ms"}),
        ("seconds", {"Retry-After"}),
        ("ms", {"retry-after-ms"}),
        ("date", {"Retry-After"}),
        ("none", set()),
    ],
)
def test_retry_styles(style: str, keys: set[str]) -> None:
    with MockProvider(600, gen_time=0.0, retry_style=style, dialect="none") as mock:
        mock.fail_next(1, retry_after=0.5)
        status, headers, payload = post(mock, "/v1/chat/completions", {})
        assert post(mock, "/v1/chat/completions", {})[0] == 200
    assert status == 429 and json.loads(payload)["error"]["type"] == "rate_limit_exceeded"
    assert {k for k in headers if "retry" in k.lower()} == keys
    info = parse_rate_limit_headers(headers)
    assert (info.retry_after is None) == (style == "none")
    if style == "date":
        assert "GMT" in headers["Retry-After"]


def test_retries_are_counted_and_big_bodies_refused() -> None:
    with MockProvider(6000, gen_time=0.0) as mock:
        post(mock, "/v1/messages", {}, {"x-stainless-retry-count": "1"})
        status, _, _ = post(mock, "/v1/messages", b"x" * (MAX_BODY + 1))
        stats = mock.stats()
    assert status == 413
    assert (stats["requests"], stats["retried"]) == (1, 1)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"dialect": "x"},
        {"retry_style": "x"},
        {"tpm": 0},
        {"output_tokens": -1},
        {"stream_delay": -1},
    ],
)
def test_bad_settings(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        MockProvider(60, **kwargs)
