"""The SSE usage reader framed natively (``_SSEFrames``, ``ratequeue_core::llm::sse``)
against the Python reference (``SSEUsage(native=False)``): the same usage, finality and
event count after every chunk, for any stream cut anywhere, and through the transport."""

from __future__ import annotations

import json
from typing import Any

import httpx2
import ratequeue as rq
from hypothesis import given, settings
from hypothesis import strategies as st
from ratequeue.httpx import RateLimitedTransport
from ratequeue.httpx._usage import SSEUsage

COUNTS = st.one_of(st.integers(0, 10**6), st.sampled_from([-1, 2**70, 1.5, None, True, "7"]))


@st.composite
def usage_objects(draw: Any) -> dict[str, Any]:
    names = draw(
        st.lists(
            st.sampled_from(
                [
                    "prompt_tokens",
                    "completion_tokens",
                    "input_tokens",
                    "output_tokens",
                    "cache_read_input_tokens",
                    "cache_creation_input_tokens",
                ]
            ),
            max_size=4,
        )
    )
    return {n: draw(COUNTS) for n in names}


@st.composite
def payloads(draw: Any) -> str:
    u = draw(usage_objects())
    kind = draw(
        st.sampled_from(
            [
                "chat",
                "chat_null",
                "message_start",
                "message_delta",
                "response.completed",
                "response.created",
                "ping",
                "background",
                "not_json",
                "array",
                "escaped",
            ]
        )
    )
    if kind == "chat":
        ev: Any = {"choices": [], "usage": u}
    elif kind == "chat_null":
        ev = {"choices": [{"delta": {"content": "x"}}], "usage": None}
    elif kind == "message_start":
        ev = {"type": kind, "message": {"usage": u}}
    elif kind == "message_delta":
        ev = {"type": kind, "usage": u}
    elif kind.startswith("response."):
        ev = {"type": kind, "response": {"usage": u}}
    elif kind == "ping":
        ev = {"type": "ping"}
    elif kind == "background":  # a background response's first events: its id
        ev = {
            "type": draw(
                st.sampled_from(
                    ["response.created", "response.queued", "response.failed", "response.done"]
                )
            ),
            "response": {
                "id": draw(st.sampled_from(["resp_1", "resp_2", "resp 3", ""])),
                "status": draw(st.sampled_from(["queued", "in_progress", "completed"])),
                "background": draw(st.sampled_from([True, False, "true"])),
                "usage": None,
            },
        }
    elif kind == "not_json":
        return '{"usage": {' + draw(st.text(max_size=5))
    elif kind == "array":
        return json.dumps([{"usage": u}])
    else:
        return json.dumps({"choices": [], "usage": u}, ensure_ascii=True) + "\u00e9"
    return json.dumps(ev, separators=draw(st.sampled_from([(",", ":"), (", ", ": ")])))


@st.composite
def events(draw: Any) -> bytes:
    payload = draw(payloads())
    eol = draw(st.sampled_from(["\n", "\r\n", "\r"]))
    lines = []
    if draw(st.booleans()):
        lines.append("event: x")
    parts = [payload]
    if draw(st.booleans()) and len(payload) > 2:
        i = draw(st.integers(1, len(payload) - 1))
        parts = [payload[:i], payload[i:]]  # a payload over two data: lines
    lines += ["data:" + draw(st.sampled_from(["", " ", "  "])) + p for p in parts]
    return (eol.join(lines) + eol + eol).encode()


@st.composite
def streams(draw: Any) -> tuple[list[bytes], int]:
    body = b"".join(draw(st.lists(events(), max_size=6)))
    if draw(st.booleans()):
        body += b"data: [DONE]\n\n"
    cuts = sorted(draw(st.lists(st.integers(0, len(body)), max_size=6)))
    chunks = [body[a:b] for a, b in zip([0, *cuts], [*cuts, len(body)], strict=True)]
    return chunks, draw(st.sampled_from([8, 40, 1 << 20]))


@settings(max_examples=400, deadline=None)
@given(streams())
def test_native_framing_agrees_with_the_reference(stream: tuple[list[bytes], int]) -> None:
    chunks, max_event = stream
    native, ref = SSEUsage(max_event), SSEUsage(max_event, native=False)
    assert native._frames is not None and ref._frames is None
    for c in chunks:
        native.feed(c)
        ref.feed(c)
        assert (native.usage, native.final, native.events) == (ref.usage, ref.final, ref.events)
        assert (native.response_id, native.done) == (ref.response_id, ref.done)


def test_a_chat_stream_settles_at_its_final_event_either_way() -> None:
    sse = (
        b'data: {"choices":[{"delta":{"content":"x"}}],"usage":null}\n\n' * 3
        + b'data: {"choices":[],"usage":{"prompt_tokens":8,"completion_tokens":3}}\n\n'
        + b"data: [DONE]\n\n"
    )
    for native in (True, False):
        u = SSEUsage(native=native)
        u.feed(sse)
        assert (tuple(u.usage or ()), u.final, u.events) == ((8, 3), True, 5)


def test_a_streamed_call_settles_with_its_usage_through_the_transport() -> None:
    sse = (
        b'data: {"choices":[{"delta":{"content":"x"}}],"usage":null}\n\n' * 19
        + b'data: {"choices":[],"usage":{"prompt_tokens":80,"completion_tokens":19}}\n\n'
        + b"data: [DONE]\n\n"
    )
    seen: list[bytes] = []

    def answer(r: httpx2.Request) -> httpx2.Response:
        seen.append(r.content)
        return httpx2.Response(200, headers={"content-type": "text/event-stream"}, content=sse)

    lim = rq.Limiter(rq.Rate(10**6, per="minute"), rq.Rate(10**9, per="minute", unit="tokens"))
    t = RateLimitedTransport(httpx2.MockTransport(answer), lim)
    c = httpx2.Client(transport=t)
    r = c.post(
        "http://p/v1/chat/completions",
        json={"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True},
    )
    rec = r.extensions["ratequeue"]
    assert rec.settled and tuple(rec.usage) == (80, 19)
    assert rec.charged["tokens"] == 99
    assert json.loads(seen[-1])["stream_options"] == {"include_usage": True}
