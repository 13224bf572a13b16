"""Usage extraction: JSON bodies of each API, and the incremental SSE reader."""

from __future__ import annotations

import itertools
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from ratequeue.httpx import SSEUsage, Usage, usage_from_json


def sse(*events: dict[str, object], crlf: bool = False) -> bytes:
    sep = b"\r\n\r\n" if crlf else b"\n\n"
    return b"".join(b"data: " + json.dumps(e).encode() + sep for e in events)


def test_json_bodies_of_each_api() -> None:
    assert usage_from_json({"usage": {"prompt_tokens": 3, "completion_tokens": 4}}) == (3, 4)
    assert usage_from_json({"usage": {"input_tokens": 5, "output_tokens": 6}}) == (5, 6)
    cached = {"input_tokens": 5, "output_tokens": 6, "cache_read_input_tokens": 100}
    assert usage_from_json({"usage": cached}) == (105, 6)
    assert usage_from_json({"response": {"usage": {"input_tokens": 1, "output_tokens": 2}}}) == (
        1,
        2,
    )
    for bad in (None, [], {"usage": None}, {"usage": {"input_tokens": -1}}, {"usage": "x"}):
        assert usage_from_json(bad) is None
    assert usage_from_json({"usage": {"input_tokens": True, "output_tokens": 2}}) == (0, 2)


def chat_stream() -> bytes:
    chunk = {"choices": [{"delta": {"content": "x"}}], "usage": None}
    final = {"choices": [], "usage": {"prompt_tokens": 11, "completion_tokens": 22}}
    return sse(chunk, chunk, final) + b"data: [DONE]\n\n"


def anthropic_stream() -> bytes:
    return b"".join(
        f"event: {e['type']}\n".encode() + sse(e)
        for e in (
            {
                "type": "message_start",
                "message": {"usage": {"input_tokens": 7, "output_tokens": 1}},
            },
            {"type": "content_block_delta", "delta": {"text": "usage is fine"}},
            {"type": "message_delta", "usage": {"output_tokens": 30}},
            {"type": "message_stop"},
        )
    )


def responses_stream() -> bytes:
    return sse(
        {"type": "response.created", "response": {"usage": None}},
        {"type": "response.output_text.delta", "delta": "hi"},
        {
            "type": "response.completed",
            "response": {"usage": {"input_tokens": 4, "output_tokens": 9}},
        },
    )


@pytest.mark.parametrize(
    ("data", "usage"),
    [(chat_stream(), (11, 22)), (anthropic_stream(), (7, 30)), (responses_stream(), (4, 9))],
)
@pytest.mark.parametrize("size", [1, 3, 7, 64, 1 << 20])
def test_streams_in_any_chunking(data: bytes, usage: tuple[int, int], size: int) -> None:
    r = SSEUsage()
    for i in range(0, len(data), size):
        r.feed(data[i : i + size])
    assert r.final and r.usage == Usage(*usage)


def test_crlf_separators() -> None:
    r = SSEUsage()
    r.feed(sse({"usage": {"prompt_tokens": 1, "completion_tokens": 2}}, crlf=True))
    assert r.usage == (1, 2)


def test_an_oversized_event_is_skipped_without_being_kept() -> None:
    r = SSEUsage(max_event=1000)
    r.feed(b'data: {"usage": {"prompt_tokens": 1, "completion_tokens": ')
    for _ in range(100):
        r.feed(b"9" * 1000)
        assert len(r._buf) <= 1000 + 1000
    r.feed(b"}}\n\n")
    assert r.usage is None
    r.feed(sse({"usage": {"prompt_tokens": 3, "completion_tokens": 4}}))
    assert r.usage == (3, 4)  # the reader recovered at the next event


def test_garbage_is_ignored() -> None:
    r = SSEUsage()
    r.feed(b'data: {"usage": {not json\n\ndata: [1,2,"usage":{]\n\n\x00\xff\n\n')
    assert r.usage is None and not r.final


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=2000), st.integers(1, 50))
def test_any_bytes_are_read_in_bounded_memory(data: bytes, size: int) -> None:
    r = SSEUsage(max_event=100, native=False)
    n = SSEUsage(max_event=100)
    assert n._frames is not None
    for i in range(0, len(data), size):
        r.feed(data[i : i + size])
        n.feed(data[i : i + size])
        assert len(r._buf) <= 100 + size
        assert n._frames.buffered == len(r._buf)


class _SlowSSE(SSEUsage):
    """The event loop before its fast path: every event cut out and searched."""

    __slots__ = ()

    def feed(self, chunk: bytes) -> None:
        data = self._buf + chunk if self._buf else chunk
        start = 0
        while True:
            end = data.find(b"\n\n", start)
            sep = 2
            alt = data.find(b"\r\n\r\n", start)
            if alt != -1 and (end == -1 or alt < end):
                end, sep = alt, 4
            if end == -1:
                break
            if self._skip:
                self._skip = False
            else:
                self._event(data[start:end])
            start = end + sep
        rest = data[start:]
        if len(rest) > self.max_event:
            self._skip = True
            rest = rest[-3:]
        self._buf = rest


_SSE_PARTS = st.sampled_from(
    [
        b'data: {"choices":[{"delta":{"content":"x"}}],"usage":null}\n\n',
        b'data: {"choices":[],"usage":{"prompt_tokens":8,"completion_tokens":2}}\n\n',
        b'data: {"usage"\n\n:{"prompt_tokens":1}}\n\n',
        b'event: message_delta\ndata: {"type":"message_delta","usage":{"output_tokens":5}}\n\n',
        b'data: {"type":"message_start","message":{"usage":{"input_tokens":3}}}\r\n\r\n',
        b"data: [DONE]\n\n",
        b"\n",
        b"\r\n",
        b'"usage": {',
        b"x" * 40,
    ]
)


@settings(max_examples=300, deadline=None)
@given(st.lists(_SSE_PARTS, max_size=12), st.lists(st.integers(0, 400), max_size=6))
def test_sse_fast_path_agrees_with_the_event_loop(parts: list[bytes], cuts: list[int]) -> None:
    data = b"".join(parts)
    bounds = sorted({min(c, len(data)) for c in cuts} | {0, len(data)})
    fast, slow = SSEUsage(max_event=64, native=False), _SlowSSE(max_event=64, native=False)
    for a, b in itertools.pairwise(bounds):
        fast.feed(data[a:b])
        slow.feed(data[a:b])
        state = ("_buf", "_skip", "_input", "_output", "final", "events")
        assert [getattr(fast, f) for f in state] == [getattr(slow, f) for f in state]
