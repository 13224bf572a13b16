"""Request and response bodies: the usage read from a JSON body is what a full parse
finds (escaped strings, nesting, invalid JSON), and a capped body is rewritten in place,
byte for byte what the SDK sends with that cap."""

from __future__ import annotations

import importlib
import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from ratequeue.httpx import usage_from_json
from ratequeue.httpx._record import json_usage as _json_usage

USAGE = {"prompt_tokens": 5, "completion_tokens": 6}


def full_parse(body: bytes) -> Any:
    try:
        return usage_from_json(json.loads(body))
    except (ValueError, RecursionError):
        return None


@pytest.mark.parametrize(
    "body",
    [
        {"x": {"usage": USAGE}},  # nested: not the body's usage
        {'say "usage': USAGE},  # a key that ends in an escaped quote and "usage"
        {"usag\u0065": USAGE},
        {"choices": [{"message": {"content": '"usage": {"prompt_tokens": 1}}'}}]},
        {"usage": USAGE, "x": {"usage": {"prompt_tokens": 1, "completion_tokens": 1}}},
        {"usage": {"prompt_tokens": 1, "completion_tokens": 1}, "meta": {"n": [1, {}]}},
        {"response": {"usage": {"input_tokens": 2, "output_tokens": 3}}},
    ],
)
def test_usage_read_is_what_a_full_parse_finds(body: dict[str, Any]) -> None:
    for data in (
        json.dumps(body).encode(),
        json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode(),
        json.dumps(body, indent=2).encode(),
    ):
        assert _json_usage(data) == full_parse(data)


@pytest.mark.parametrize(
    "data",
    [
        b'{"a":{"usage":{"prompt_tokens":1,"completion_tokens":1}}',  # unclosed: not JSON
        b'{"a": [}, "usage": {"prompt_tokens": 1, "completion_tokens": 1}}',
        b'not json "usage": {"prompt_tokens": 1, "completion_tokens": 1}}',
        b'{"usage": {"prompt_tokens": 1, "completion_tokens": 1}} trailing',
        b'{"usag\\u0065": {"prompt_tokens": 1, "completion_tokens": 1}}',
        b'{"usage": {"prompt_tokens": 1}, "usage": null}',  # the last one counts
        '{"usage": {"prompt_tokens": 1, "completion_tokens": 1}}'.encode("utf-16"),
        b' {"usage": {"prompt_tokens": 1, "completion_tokens": 1}}',
        b"\xef\xbb\xbf" + b'{"usage": {"prompt_tokens": 1, "completion_tokens": 1}}',
    ],
)
def test_usage_of_a_body_that_is_not_what_it_seems(data: bytes) -> None:
    assert _json_usage(data) == full_parse(data)


JSON = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-5, 10**6),
        st.sampled_from(["usage", '"usage"', 'x\\"usage":{', "é", "\u2028"]),
        st.text(max_size=6),
    ),
    lambda inner: st.one_of(
        st.lists(inner, max_size=3),
        st.dictionaries(
            st.sampled_from(["usage", "response", "input_tokens", "prompt_tokens", "x"]),
            inner,
            max_size=3,
        ),
    ),
    max_leaves=25,
)


@settings(max_examples=500, deadline=None)
@given(JSON, st.booleans())
def test_usage_read_matches_the_full_parse_on_any_json(v: Any, compact: bool) -> None:
    data = (
        json.dumps(v, separators=(",", ":"), ensure_ascii=False) if compact else json.dumps(v)
    ).encode()
    assert _json_usage(data) == full_parse(data)


# -- a capped body, rewritten in place ----------------------------------------------------

CHAT = "/v1/chat/completions"
MSG = [{"role": "user", "content": 'é "quoted" \\ and \u2028'}]
# Headers that differ between two calls of one SDK client whatever the body.
PER_CALL = {"idempotency-key", "x-stainless-retry-count", "x-stainless-read-timeout"}


class Capture:
    """A transport that keeps the requests it is sent (their bytes) and answers a usage."""

    def __init__(self, mod: Any) -> None:
        self.mod = mod
        self.sent: list[Any] = []

    def handle_request(self, request: Any) -> Any:
        request.read()
        self.sent.append(request)
        usage = {"prompt_tokens": 1, "completion_tokens": 1, "input_tokens": 1, "output_tokens": 1}
        body = {"id": "x", "type": "message", "role": "assistant", "content": [], "usage": usage}
        body["choices"] = [{"index": 0, "message": {"role": "assistant", "content": "ok"}}]
        return self.mod.Response(200, json=body)


def wire(request: Any) -> tuple[Any, ...]:
    headers = [(k.lower(), v) for k, v in request.headers.raw if k.lower() not in PER_CALL]
    return request.method, str(request.url), headers, request.content


def limiter() -> Any:
    import ratequeue as rq

    return rq.Limiter(
        rq.Rate(10**6, per="minute", burst=10**6),
        rq.Rate(10**9, per="minute", burst=10**8, unit="tokens"),
        clock=rq.ManualClock(),
    )


def test_openai_capped_request_is_byte_identical_to_the_sdks_with_that_cap() -> None:
    import httpx2
    import openai
    from ratequeue.httpx import Cap, RateLimitedTransport

    got = Capture(httpx2)
    capped = openai.OpenAI(
        api_key="k",
        base_url="http://p/v1",
        max_retries=0,
        http_client=httpx2.Client(
            transport=RateLimitedTransport(got, limiter(), caps=[Cap(256, route=CHAT)])
        ),
    )
    want = Capture(httpx2)
    plain = openai.OpenAI(
        api_key="k",
        base_url="http://p/v1",
        max_retries=0,
        http_client=httpx2.Client(transport=want),
    )
    for field in ("max_tokens", "max_completion_tokens"):
        capped.chat.completions.create(
            model="gpt-x",
            messages=MSG,
            temperature=0.5,
            **{field: 4000},
        )
        plain.chat.completions.create(
            model="gpt-x",
            messages=MSG,
            temperature=0.5,
            **{field: 256},
        )
        assert wire(got.sent[-1]) == wire(want.sent[-1])
        assert json.loads(got.sent[-1].content)[field] == 256


def test_anthropic_capped_request_is_byte_identical_to_the_sdks_with_that_cap() -> None:
    import anthropic
    import httpx2
    from ratequeue.httpx import Cap, RateLimitedTransport

    got = Capture(httpx2)
    capped = anthropic.Anthropic(
        api_key="k",
        base_url="http://p",
        max_retries=0,
        http_client=httpx2.Client(
            transport=RateLimitedTransport(got, limiter(), caps=[Cap(300, model="claude-*")])
        ),
    )
    want = Capture(httpx2)
    plain = anthropic.Anthropic(
        api_key="k",
        base_url="http://p",
        max_retries=0,
        http_client=httpx2.Client(transport=want),
    )
    capped.messages.create(model="claude-x", messages=MSG, max_tokens=9000)
    plain.messages.create(model="claude-x", messages=MSG, max_tokens=300)
    assert wire(got.sent[-1]) == wire(want.sent[-1])


@pytest.fixture(params=["httpx", "httpx2"])
def mod(request: pytest.FixtureRequest) -> Any:
    return importlib.import_module(request.param)


def send(mod: Any, content: bytes, caps: Any, **kw: Any) -> tuple[Any, Any]:
    from ratequeue.httpx import RateLimitedTransport

    got = Capture(mod)
    client = mod.Client(transport=RateLimitedTransport(got, limiter(), caps=caps, **kw))
    headers = {"Content-Type": "application/json", "X-Keep": "1"}
    r = client.post("http://p" + CHAT, content=content, headers=headers)
    return got.sent[-1], r


@pytest.mark.parametrize(
    ("body", "want"),
    [
        # spaced as json.dumps spaces it: only the number changes
        (
            json.dumps({"model": "m", "max_tokens": 4000, "messages": MSG}).encode(),
            json.dumps({"model": "m", "max_tokens": 100, "messages": MSG}).encode(),
        ),
        # a missing bound is added at the end
        (
            b'{"model":"m","messages":[]}',
            b'{"model":"m","messages":[],"max_completion_tokens":100}',
        ),
        (b"{}", b'{"max_completion_tokens":100}'),
        # every occurrence of a repeated key (parsers keep the first or the last)
        (b'{"max_tokens":7,"max_tokens":4000}', b'{"max_tokens":100,"max_tokens":100}'),
        # a field that is not a number is replaced; a nested one is left alone
        (
            b'{ "max_tokens" : "lots" , "x": {"max_tokens": 9000} }\n',
            b'{ "max_tokens" : 100 , "x": {"max_tokens": 9000} }\n',
        ),
        # two bounds, both lowered, the smaller kept where it was
        (
            b'{"max_output_tokens":50,"max_tokens":500,"max_completion_tokens":5000}',
            b'{"max_output_tokens":50,"max_tokens":100,"max_completion_tokens":100}',
        ),
    ],
)
def test_capped_body_changes_only_its_bound(mod: Any, body: bytes, want: bytes) -> None:
    from ratequeue.httpx import Cap

    sent, r = send(mod, body, [Cap(100)])
    assert sent.content == want
    assert sent.headers["content-length"] == str(len(want))
    assert sent.headers["x-keep"] == "1"
    assert r.request is sent  # rewritten in place: the response's request is what was sent
    assert r.extensions["ratequeue"].capped is not None


def test_body_not_in_utf8_is_serialized_again(mod: Any) -> None:
    from ratequeue.httpx import Cap

    body = {"model": "m", "max_tokens": 4000, "messages": MSG}
    sent, _ = send(mod, json.dumps(body).encode("utf-16"), [Cap(100)])
    assert json.loads(sent.content) == {**body, "max_tokens": 100}
    assert sent.headers["content-length"] == str(len(sent.content))


def test_streamed_chat_asks_for_usage_in_place(mod: Any) -> None:
    body = b'{"model":"m","stream":true,"stream_options":{"x":1},"messages":[]}'
    sent, _ = send(mod, body, [])
    want = (
        b'{"model":"m","stream":true,"stream_options":{"x":1,"include_usage":true},"messages":[]}'
    )
    assert sent.content == want
    sent, _ = send(mod, b'{"stream": true}', [])
    assert sent.content == b'{"stream": true,"stream_options":{"include_usage":true}}'
    assert sent.headers["content-length"] == str(len(sent.content))


def test_uncapped_body_is_not_touched(mod: Any) -> None:
    from ratequeue.httpx import Cap

    body = json.dumps({"model": "m", "max_tokens": 50, "messages": MSG}).encode()
    sent, r = send(mod, body, [Cap(100)])
    assert sent.content == body and r.extensions["ratequeue"].capped is None


def test_usage_only_the_record_wants_is_read_when_asked(mod: Any) -> None:
    import ratequeue as rq
    from ratequeue.httpx import RateLimitedTransport

    lim = rq.Limiter(rq.Rate(60, per="minute", burst=5), clock=rq.ManualClock())
    c = mod.Client(transport=RateLimitedTransport(Capture(mod), lim))
    rec = c.post("http://p" + CHAT, json={"model": "m"}).extensions["ratequeue"]
    assert rec.settled and rec._usage_body is not None  # not parsed yet
    assert rec.usage == (1, 1) and rec._usage_body is None
    assert lim.available() == pytest.approx(4)


def test_async_client_sends_the_rewritten_body(mod: Any) -> None:
    import asyncio

    from ratequeue.httpx import Cap, RateLimitedTransport

    sent: list[bytes] = []

    async def handler(request: Any) -> Any:
        sent.append(await request.aread())
        return mod.Response(200, json={"usage": {"prompt_tokens": 1, "completion_tokens": 2}})

    async def main() -> Any:
        t = RateLimitedTransport(mod.MockTransport(handler), limiter(), caps=[Cap(100)])
        async with mod.AsyncClient(transport=t) as client:
            return await client.post("http://p" + CHAT, content=b'{"max_tokens": 4000}')

    r = asyncio.run(main())
    assert sent == [b'{"max_tokens": 100}'] and r.request.content == sent[0]
    assert r.request.headers["content-length"] == str(len(sent[0]))


def test_cap_table_gives_what_the_rules_give_and_stays_bounded() -> None:
    from ratequeue.httpx import Cap, apply_caps
    from ratequeue.httpx._caps import CapTable

    caps = [Cap(100, route="/chat/completions"), Cap(50, model="gpt-4*", task="t"), Cap(70)]
    table = CapTable(caps, size=4)
    for i in range(20):
        for model in ("gpt-4o", "gpt-3", None, 7):
            for task in ("t", None, f"n{i}"):
                for path in (CHAT, "/v1/responses", f"/x{i}"):
                    body: dict[str, Any] = (
                        {"max_tokens": 90 + i}
                        if model is None
                        else {"model": model, "max_tokens": 90 + i}
                    )
                    want = dict(body)
                    assert table.apply(body, path, task) == apply_caps(caps, want, path, task)
                    assert body == want
    assert len(table.limits) == 4
