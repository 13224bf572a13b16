"""Bytes a remote party controls (review21): the native SSE framing and usage reading
against the Python reference (``SSEUsage(native=False)``) over arbitrary bytes, any
chunking and any bound; bounded memory on endless lines and events; and the native
request rewrite (a streamed chat call asked for its usage) against the reference for
the JSON objects SDKs send."""

from __future__ import annotations

import functools
import importlib
import json
from typing import Any
from unittest import mock

import pytest
import ratequeue as rq
from hypothesis import given, settings
from hypothesis import strategies as st
from ratequeue.httpx import RateLimitedTransport, TokenEstimator, _stream
from ratequeue.httpx._usage import SSEUsage
from ratequeue.httpx._wire import header_list

# -- the SSE framing over any bytes ---------------------------------------------------------

ATOMS = st.one_of(
    st.sampled_from(
        [
            b"\n",
            b"\r",
            b"\r\n",
            b"\n\n",
            b"\r\n\r\n",
            b"\n\r\n",
            b"data:",
            b"data: ",
            b"event: x\n",
            b": comment\n",
            b'"usage"',
            b" : {",
            b'{"usage":{"prompt_tokens":1,"completion_tokens":2}}',
            b'{"choices":[],"usage":{"prompt_tokens":7,"completion_tokens":99999999999999999999999}}',
            b'{"type":"message_delta","usage":{"output_tokens":5}}',
            b'{"type":"message_start","message":{"usage":{"input_tokens":3,"output_tokens":1}}}',
            b'{"type":"response.completed","response":{"usage":{"input_tokens":4,"output_tokens":6}}}',
            b'{"usage":{"prompt_tokens":-3,"completion_tokens":2.5}}',
            b'{"choices":[{"delta":{}}],"usage":{"prompt_tokens":3,"completion_tokens":4}}',
            b'{"choices":[{"finish_reason":"stop"}],"usage":{"prompt_tokens":3}}',
            b'{"choices":[],"x":{"choices":[1]},"usage":{"prompt_tokens":5}}',
            b'{"u\\u0073age":{"prompt_tokens":1}}',
            b"\xef\xbb\xbf",
            b"\x00",
            b"\xff\xfe",
            b"\xc3",
            b"[" * 200,
            b"]" * 200,
            b"data: [DONE]\n\n",
        ]
    ),
    st.binary(max_size=6),
)
BYTES = st.lists(ATOMS, max_size=30).map(b"".join)
BOUNDS = st.sampled_from([0, 1, 2, 3, 4, 8, 40, 1 << 20])


def cut(body: bytes, cuts: list[int]) -> list[bytes]:
    at = sorted(c % (len(body) + 1) for c in cuts)
    return [body[a:b] for a, b in zip([0, *at], [*at, len(body)], strict=True)]


@settings(max_examples=1500, deadline=None)
@given(BYTES, st.lists(st.integers(0, 10**6), max_size=10), BOUNDS)
def test_native_framing_agrees_on_any_bytes(body: bytes, cuts: list[int], max_event: int) -> None:
    native, ref = SSEUsage(max_event), SSEUsage(max_event, native=False)
    assert native._frames is not None
    for c in cut(body, cuts):
        native.feed(c)
        ref.feed(c)
        assert (native.usage, native.final, native.events) == (ref.usage, ref.final, ref.events)
        # The kept part is the reference's, and bounded.
        assert native._frames.buffered == len(ref._buf) <= max(max_event, 3)


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("max_event", [0, 1, 2])
def test_a_bound_below_three_bytes_frames_without_error(native: bool, max_event: int) -> None:
    u = SSEUsage(max_event, native=native)
    for c in (
        b"a",
        b"bc",
        b"\n",
        b'\ndata: {"usage":{"prompt_tokens":1,"completion_tokens":2}}\n\n',
    ):
        u.feed(c)
    assert (tuple(u.usage or ()), u.final, u.events) == ((1, 2), True, 1)


@pytest.mark.parametrize("native", [True, False])
def test_an_endless_line_or_event_keeps_at_most_the_bound(native: bool) -> None:
    """A provider (or a man in the middle) that never ends a line, or an event: what is
    kept stays within ``max_event``; past it the event is skipped (its usage unread) and
    the stream passes on; the next event is read."""
    max_event = 4096
    for unit in (b"x" * 1000, b"data: " + b"y" * 993 + b"\n"):  # a line; an event of lines
        u = SSEUsage(max_event, native=native)
        for _ in range(200):
            u.feed(unit)
            kept = u._frames.buffered if u._frames is not None else len(u._buf)
            assert kept <= max_event
        u.feed(b'"usage":{"prompt_tokens":9}\n\n')  # ends the skipped event: not read
        assert (u.usage, u.events) == (None, 0)
        u.feed(b'data: {"usage":{"prompt_tokens":1,"completion_tokens":2}}\n\n')
        assert (tuple(u.usage or ()), u.final, u.events) == ((1, 2), True, 1)


def test_endless_nesting_in_an_event_is_not_read_and_does_not_raise() -> None:
    deep = b'data: {"usage":{"prompt_tokens":1},"x":' + b"[" * 500_000 + b"\n\n"
    for native in (True, False):
        u = SSEUsage(native=native)
        u.feed(deep)
        assert (u.usage, u.events) == (None, 1)


# -- usage reported through the transport ----------------------------------------------------

USAGES = st.one_of(
    st.integers(0, 10**6),
    st.sampled_from([-1, 2**64 - 1, 2**64, 2**70, 1.5, 80.0, None, True, "7"]),
)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(USAGES, USAGES), min_size=1, max_size=3), st.booleans(), st.booleans())
def test_a_streamed_usage_settles_as_the_reference_and_never_negative(
    usages: list[tuple[Any, Any]], done: bool, split: bool
) -> None:
    """However a provider spells its counts (negative, float, past 64 bits, repeated,
    later ones smaller), the native path charges what the reference charges, never a
    negative count, and passes the stream's bytes on unchanged (whole, or in chunks of
    7 bytes: events split anywhere)."""
    import httpx2

    sse = b"".join(
        b"data: "
        + json.dumps(
            {"choices": [], "usage": {"prompt_tokens": i, "completion_tokens": o}}
        ).encode()
        + b"\n\n"
        for i, o in usages
    ) + (b"data: [DONE]\n\n" if done else b"")

    def answer(r: httpx2.Request) -> httpx2.Response:
        if split:
            content: Any = iter([sse[i : i + 7] for i in range(0, len(sse), 7)])
        else:
            content = sse
        return httpx2.Response(200, headers={"content-type": "text/event-stream"}, content=content)

    got = {}
    for native in (True, False):
        lim = rq.Limiter(rq.Rate(10**6, per="minute"), rq.Rate(10**9, per="minute", unit="tokens"))
        c = httpx2.Client(transport=RateLimitedTransport(httpx2.MockTransport(answer), lim))
        sse_usage = functools.partial(SSEUsage, native=native)
        with (
            mock.patch.object(_stream, "SSEUsage", sse_usage),
            c.stream(
                "POST",
                "http://p/v1/chat/completions",
                json={"model": "m", "messages": [{"role": "u", "content": "hi"}], "stream": True},
            ) as r,
        ):
            passed = r.read()
        assert passed == sse
        rec = r.extensions["ratequeue"]
        assert rec.settled
        got[native] = (rec.usage, rec.charged)
    assert got[True] == got[False]
    usage, charged = got[True]
    assert all(v >= 0 for v in charged.values())
    assert usage is None or min(usage) >= 0


# -- a streamed chat request asked for its usage: native rewrite vs the reference -----------

KEY_SPELLINGS = {
    "stream": ['"stream"', '"str\\u0065am"'],
    "stream_options": ['"stream_options"', '"stream\\u005foptions"'],
    "model": ['"model"'],
    "messages": ['"messages"'],
    "max_tokens": ['"max_tokens"'],
    "x": ['"x"', '"\\u00e9\\n"'],
}
STREAM_VALUES = st.sampled_from([True, False, None, "true", 1, 0, 1.0])
OPTION_VALUES = st.sampled_from(
    [
        None,
        5,
        "x",
        [],
        {},
        {"include_usage": True},
        {"include_usage": False},
        {"include_usage": 1},
        {"include_usage": True, "include_usage ": False},
        {"other": 1},
    ]
)
OTHER_VALUES = st.one_of(
    st.text(max_size=8),
    st.sampled_from(["\ud800", "é😀", '"stream":true', "\\u0000"]),
    st.integers(-5, 10**20),
    st.lists(
        st.dictionaries(st.sampled_from(["role", "content"]), st.text(max_size=5)), max_size=2
    ),
)


@st.composite
def sdk_bodies(draw: Any) -> bytes:
    """A JSON object an SDK may send: keys repeated or spelled with escapes, ``stream``
    of any type, ``stream_options`` of any type or absent, any spacing."""
    names = draw(
        st.lists(st.sampled_from(list(KEY_SPELLINGS)), max_size=7).map(lambda v: ["stream", *v])
    )
    ws = draw(st.sampled_from(["", " ", "\n  ", "\t"]))
    parts = []
    for n in draw(st.permutations(names)):
        key = draw(st.sampled_from(KEY_SPELLINGS[n]))
        if n == "stream":
            v: Any = draw(STREAM_VALUES)
        elif n == "stream_options":
            v = draw(OPTION_VALUES)
        else:
            v = draw(OTHER_VALUES)
        text = json.dumps(v, ensure_ascii=draw(st.booleans()))
        parts.append(f"{ws}{key}{ws}:{ws}{text}")
    body = "{" + ",".join(parts) + ws + "}" + draw(st.sampled_from(["", " ", "\n"]))
    return body.encode("utf-8", "surrogatepass")


@settings(max_examples=400, deadline=None)
@given(
    sdk_bodies(),
    st.sampled_from(["httpx", "httpx2"]),
    st.sampled_from(["/v1/chat/completions", "/v1/responses"]),
)
def test_the_native_stream_rewrite_sends_what_the_reference_sends(
    body: bytes, modname: str, path: str
) -> None:
    mod = importlib.import_module(modname)
    sent: dict[bool, bytes] = {}
    records: dict[bool, Any] = {}
    for native in (True, False):
        seen: list[bytes] = []

        def answer(r: Any, seen: list[bytes] = seen) -> Any:
            seen.append(r.read())
            return mod.Response(200, json={})

        lim = rq.Limiter(
            rq.Rate(10**6, per="minute"),
            rq.Rate(10**9, per="minute", unit="tokens"),
            clock=rq.ManualClock(),
        )
        t = RateLimitedTransport(mod.MockTransport(answer), lim, estimator=TokenEstimator(None))
        if not native:
            t._reader = None
        c = mod.Client(transport=t)
        r = c.post("http://p" + path, content=body, headers={"content-type": "application/json"})
        header_list(r.request.headers)
        sent[native] = seen[-1]
        records[native] = r.extensions["ratequeue"]
        assert r.request.headers["content-length"] == str(len(seen[-1]))
    # The same bytes go out either way (so the same JSON, for any parser).
    assert sent[True] == sent[False]
    a, b = records[True], records[False]
    assert (a.model, a.estimate, a.charged) == (b.model, b.estimate, b.charged)
    # A chat stream goes out asking for its usage.
    try:
        parsed = json.loads(body)
    except ValueError:
        return
    if path.endswith("/chat/completions") and parsed.get("stream") is True:
        so = json.loads(sent[True]).get("stream_options")
        assert isinstance(so, dict) and so.get("include_usage") is True


# -- usage in every chunk: the transport settles at the last, not the first ----------------


def _chat_chunk(k: int, finish: str | None = None, content: bool = True) -> bytes:
    choices = [{"index": 0, "delta": {"content": "x"}, "finish_reason": finish}] if content else []
    ev = {"choices": choices, "usage": {"prompt_tokens": 10, "completion_tokens": k}}
    return b"data: " + json.dumps(ev).encode() + b"\n\n"


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize(
    "sse",
    [
        # vLLM's continuous_usage_stats: cumulative usage in every chunk, then the chunk
        # OpenAI specifies (choices empty) with the whole count.
        b"".join(_chat_chunk(k) for k in range(1, 6))
        + _chat_chunk(500, "stop")
        + _chat_chunk(500, content=False)
        + b"data: [DONE]\n\n",
        # Usage on the chunk that finishes the choice (DeepSeek, Together): final.
        _chat_chunk(1, None).replace(b'{"prompt_tokens": 10, "completion_tokens": 1}', b"null")
        + _chat_chunk(500, "stop")
        + b"data: [DONE]\n\n",
    ],
    ids=["every_chunk", "on_the_finishing_chunk"],
)
def test_usage_in_every_chunk_settles_at_the_whole_count(native: bool, sse: bytes) -> None:
    """A chat chunk that still streams a choice reports a usage so far: the call settles
    at the chunk that ends the stream's choices (or has none), not at the first count."""
    import httpx2

    def answer(r: httpx2.Request) -> httpx2.Response:
        parts = iter([sse[i : i + 50] for i in range(0, len(sse), 50)])
        return httpx2.Response(200, headers={"content-type": "text/event-stream"}, content=parts)

    lim = rq.Limiter(rq.Rate(10**6, per="minute"), rq.Rate(10**9, per="minute", unit="tokens"))
    c = httpx2.Client(transport=RateLimitedTransport(httpx2.MockTransport(answer), lim))
    with (
        mock.patch.object(_stream, "SSEUsage", lambda: SSEUsage(native=native)),
        c.stream(
            "POST",
            "http://p/v1/chat/completions",
            json={"model": "m", "messages": [{"role": "u", "content": "hi"}], "stream": True},
        ) as r,
    ):
        r.read()
    rec = r.extensions["ratequeue"]
    assert tuple(rec.usage) == (10, 500)
    assert rec.charged["tokens"] == 510


@pytest.mark.parametrize("modname", ["httpx", "httpx2"])
@pytest.mark.parametrize(
    "body",
    [
        b'{"stream":true,"model":"\xed\xa0\x80"}',  # a surrogate written as bytes
        b'\xef\xbb\xbf{"stream":true,"temperature":NaN}',  # a BOM, and NaN
        '{"stream":true,"x":"\u00e9"}'.encode("utf-16"),
    ],
    ids=["surrogate_bytes", "bom_nan", "utf16"],
)
def test_a_body_serialized_again_never_raises(modname: str, body: bytes) -> None:
    """A body that is not plain UTF-8 JSON is written again whole when it must change: in
    ASCII (a lone surrogate escaped) and as it came (NaN kept), never an error."""
    mod = importlib.import_module(modname)
    seen: list[bytes] = []

    def answer(r: Any) -> Any:
        seen.append(r.read())
        return mod.Response(200, json={})

    lim = rq.Limiter(rq.Rate(10**6, per="minute"), rq.Rate(10**9, per="minute", unit="tokens"))
    c = mod.Client(transport=RateLimitedTransport(mod.MockTransport(answer), lim))
    c.post("http://p/v1/chat/completions", content=body)
    sent = json.loads(seen[-1])
    assert sent["stream_options"] == {"include_usage": True}
    assert {k: v for k, v in sent.items() if k != "stream_options"}.keys() == (
        json.loads(body).keys()
    )


@pytest.mark.parametrize("ctype", ["application/json", "text/event-stream"])
def test_a_compressed_response_settles_with_its_usage(ctype: str) -> None:
    import gzip

    import httpx2

    raw = (
        b'{"choices":[],"usage":{"prompt_tokens":80,"completion_tokens":3000}}'
        if ctype == "application/json"
        else b'data: {"choices":[],"usage":{"prompt_tokens":80,"completion_tokens":3000}}\n\n'
    )
    hs = {"content-type": ctype, "content-encoding": "gzip"}

    def answer(r: httpx2.Request) -> httpx2.Response:
        return httpx2.Response(200, headers=hs, content=iter([gzip.compress(raw)]))

    lim = rq.Limiter(rq.Rate(10**6, per="minute"), rq.Rate(10**9, per="minute", unit="tokens"))
    c = httpx2.Client(transport=RateLimitedTransport(httpx2.MockTransport(answer), lim))
    with c.stream(
        "POST",
        "http://p/v1/chat/completions",
        json={"model": "m", "messages": [{"role": "u", "content": "hi"}], "max_tokens": 100},
    ) as r:
        assert r.read() == raw
    assert r.extensions["ratequeue"].charged["tokens"] == 3080


@pytest.mark.parametrize("ctype", ["Text/Event-Stream", "TEXT/EVENT-STREAM; charset=utf-8"])
def test_an_event_stream_type_in_any_case_is_read_as_events(ctype: str) -> None:
    # Media types are case-insensitive (RFC 9110 8.3.1): review21's finding 8 read this
    # stream as one JSON body, found no usage and kept the estimate.
    import httpx2

    raw = b'data: {"choices":[],"usage":{"prompt_tokens":80,"completion_tokens":3000}}\n\n'

    def answer(r: httpx2.Request) -> httpx2.Response:
        return httpx2.Response(200, headers={"content-type": ctype}, content=iter([raw]))

    lim = rq.Limiter(rq.Rate(10**6, per="minute"), rq.Rate(10**9, per="minute", unit="tokens"))
    c = httpx2.Client(transport=RateLimitedTransport(httpx2.MockTransport(answer), lim))
    body = {"model": "m", "messages": [{"role": "u", "content": "hi"}], "max_tokens": 100}
    with c.stream("POST", "http://p/v1/chat/completions", json=body) as r:
        assert r.read() == raw
    assert r.extensions["ratequeue"].charged["tokens"] == 3080
