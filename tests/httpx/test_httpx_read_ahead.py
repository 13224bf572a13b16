"""A 2xx JSON body with one ``Content-Length`` within ``max_body`` (nothing to decode) is
read ahead on the native path: the call is settled before the response is returned, the
consumer reads the same chunks from memory, and closing the response closes the stream
they came from. Against the Python reference (which streams): the same chunks seen, and
the state the reference reaches when the body is read whole, whatever the consumer does;
an error of the stream is raised from the send, the call settled from what was read; a
stream longer than its length is passed on whole, its usage not read; a cancel while
reading settles the call and closes the stream."""

from __future__ import annotations

import asyncio
import copy
import importlib
import json
import pickle
import time
from collections.abc import Iterator
from typing import Any

import pytest
import ratequeue as rq
from hypothesis import example, given, settings
from hypothesis import strategies as st
from ratequeue.httpx import RateLimitedTransport
from ratequeue.httpx._usage import Usage
from ratequeue.testing import MockProvider
from test_httpx_settle_native import BODIES, RAW, UNITS, limiter
from test_httpx_stream_native import (
    CHAT,
    Boom,
    chunks_of,
    reader_of,
    run_async,
    run_sync,
    state,
    transport,
)

pytestmark = pytest.mark.timeout(120)

BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 50}
ANSWER = json.dumps({"usage": {"prompt_tokens": 2, "completion_tokens": 3}}).encode()


# A request the mock provider answers with a usage of 10 + 5 tokens.
SOCKET_BODY = {"model": "m", "messages": [{"role": "user", "content": "x" * 40}], "max_tokens": 7}


def socket_mock() -> Iterator[MockProvider]:
    """The mock provider on loopback, answering every call at once with 5 output tokens
    (a module fixture's body)."""
    with MockProvider(60000, gen_time=0.0, output_tokens=5) as m:
        yield m


def roomy() -> rq.Limiter:
    """Requests and tokens that never make a call wait."""
    return rq.Limiter(
        rq.Rate(10**6, per="minute"),
        rq.Rate(10**6, per="minute", unit="tokens"),
        clock=rq.ManualClock(),
    )


def length(answer: bytes) -> list[tuple[bytes, bytes]]:
    return [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(answer))]


def stream_layers(stream: Any) -> list[str]:
    """The type names of a response stream and the streams it wraps."""
    names = []
    while stream is not None and len(names) < 10:
        names.append(type(stream).__name__)
        stream = getattr(stream, "_inner", None) or getattr(stream, "_stream", None)
    return names


def keep_streams(t: Any) -> list[Any]:
    """The streams the inner (mock) transport answers with, as they are made."""
    streams: list[Any] = []
    answer = t.inner.handler

    def keep(request: Any) -> Any:
        response = answer(request)
        streams.append(response.stream)
        return response

    t.inner.handler = keep
    return streams


def send(mod: Any, t: Any, is_async: bool) -> Any:
    """``client.send(stream=True)``'s response (or the error it raised)."""

    async def go() -> Any:
        async with mod.AsyncClient(transport=t) as c:
            return await c.send(c.build_request("POST", CHAT, json=BODY), stream=True)

    if is_async:
        return asyncio.run(go())
    with mod.Client(transport=t) as c:
        return c.send(c.build_request("POST", CHAT, json=BODY), stream=True)


@pytest.mark.parametrize("name", ["httpx", "httpx2"])
@pytest.mark.parametrize("is_async", [False, True])
@settings(max_examples=150, deadline=None)
@given(
    units=st.sampled_from(UNITS),
    burst=st.sampled_from([40, 10**6]),
    answer=st.one_of(BODIES, RAW),
    cuts=st.lists(st.integers(0, 400), max_size=5),
    plan=st.one_of(
        st.just(("read", 0)),
        st.tuples(st.just("part"), st.integers(0, 4)),
        st.just(("close", 0)),
    ),
)
# Found at stop 40: a usage whose sum passes 64 bits was charged 2**64 by the reference
# and 2**64 - 1 (saturated) natively.
@example(
    units="tokens",
    burst=40,
    answer=b'{"id": "x", "usage": {"prompt_tokens": 1, "completion_tokens": 18446744073709551615}}',
    cuts=[],
    plan=("read", 0),
)
def test_read_ahead_is_the_reference_read_whole(
    name: str,
    is_async: bool,
    units: str,
    burst: int,
    answer: bytes,
    cuts: list[int],
    plan: tuple[str, int],
) -> None:
    mod = importlib.import_module(name)
    chunks = chunks_of(answer, cuts)
    run = run_async if is_async else run_sync
    t, llm = transport(mod, units, burst, 8 << 20, length(answer), chunks, None, True, is_async)
    reader, seen, err, rec = run(mod, t, BODY, plan)
    assert reader == "NoneType" and err is None  # no reader between stream and consumer
    got = state(t, llm, rec)
    ref_t, ref_llm = transport(
        mod, units, burst, 8 << 20, length(answer), chunks, None, False, is_async
    )
    ref_reader, ref_seen, _, ref_rec = run(mod, ref_t, BODY, plan)
    assert ref_reader == "_Reader"
    # The body passed on whole, in one chunk (the reference passes the stream's chunks).
    if plan == ("read", 0) or (plan[0] == "part" and plan[1] > 0):
        assert b"".join(seen) == answer and len(seen) <= 1
    else:
        assert seen == ref_seen == []
    if plan[0] != "read":  # the reference read whole
        ref_t, ref_llm = transport(
            mod, units, burst, 8 << 20, length(answer), chunks, None, False, is_async
        )
        _, _, _, ref_rec = run(mod, ref_t, BODY, ("read", 0))
    assert got == state(ref_t, ref_llm, ref_rec)


@pytest.mark.parametrize("name", ["httpx", "httpx2"])
@pytest.mark.parametrize("is_async", [False, True])
@pytest.mark.parametrize("fail_at", [0, 1, 2])
def test_an_error_while_reading_is_raised_from_the_send(
    name: str, is_async: bool, fail_at: int
) -> None:
    """Settled from what was read (as the native reader settles a body cut short), the
    stream closed once, the error raised where the send is; the reference's state after
    the same error while the consumer reads."""
    mod = importlib.import_module(name)
    chunks = [ANSWER[:5], ANSWER[5:], b""]  # at 2: the whole body came before the error
    t, llm = transport(
        mod, "tokens", 10**6, 8 << 20, length(ANSWER), chunks, fail_at, True, is_async
    )
    streams = keep_streams(t)
    with pytest.raises(Boom):
        send(mod, t, is_async)
    assert [s.closed for s in streams] == [1]
    assert t.stats()["sent"] == 1
    ref_t, ref_llm = transport(
        mod, "tokens", 10**6, 8 << 20, length(ANSWER), chunks, fail_at, False, is_async
    )
    _, _, err, ref_rec = (run_async if is_async else run_sync)(mod, ref_t, BODY, ("raise", 0))
    assert err == "boom"
    assert llm.available("tokens") == ref_llm.available("tokens")
    assert t.http_histogram.count == ref_t.http_histogram.count == 1
    if fail_at == 2:  # the whole body came before the error: its usage is read
        assert ref_rec.usage == Usage(2, 3) and llm.available("tokens") == 10**6 - 5
    else:  # cut short: the estimate stays
        assert ref_rec.usage is None and llm.available("tokens") < 10**6 - 5


@pytest.mark.parametrize("name", ["httpx", "httpx2"])
@pytest.mark.parametrize("is_async", [False, True])
def test_a_stream_longer_than_its_length(name: str, is_async: bool) -> None:
    """Read no further than its length: the consumer gets every byte, what was read and
    then the rest, read as it passes by the native reader (settled at its end)."""
    mod = importlib.import_module(name)
    chunks = [ANSWER[:5], ANSWER[5:], b" " * 10]
    headers = [(b"content-type", b"application/json"), (b"content-length", b"6")]
    t, llm = transport(mod, "tokens", 10**6, 8 << 20, headers, chunks, None, True, is_async)
    streams = keep_streams(t)
    layers: list[list[str]] = []
    received = t._received

    def spy(call: Any, response: Any, *a: Any) -> Any:
        got = received(call, response, *a)
        layers.append(stream_layers(response.stream))
        return got

    t._received = spy
    reader, seen, err, rec = (run_async if is_async else run_sync)(mod, t, BODY, ("read", 0))
    assert reader == "_BodyReader" and err is None and seen == chunks
    assert rec.settled and rec.usage == Usage(2, 3)
    assert llm.available("tokens") == 10**6 - 5
    # Read ahead past the length, then replayed under the native reader; closed once.
    replay = "_AsyncReplay" if is_async else "_SyncReplay"
    assert replay in layers[-1] and [s.closed for s in streams] == [1]


@pytest.mark.parametrize("name", ["httpx", "httpx2"])
def test_only_a_json_body_within_bounds_framed_by_its_length(name: str) -> None:
    """Past ``max_body``, encoded, SSE or another type, framed by a Transfer-Encoding, no
    or two lengths: streamed as before (read as it passes)."""
    mod = importlib.import_module(name)
    n = b"%d" % len(ANSWER)
    json_type = (b"content-type", b"application/json")
    for max_body, headers, kind in (
        (8 << 20, [json_type, (b"content-length", n)], "NoneType"),  # read ahead
        (10, [json_type, (b"content-length", n)], "_BodyReader"),
        (8 << 20, [json_type, (b"content-length", n), (b"content-encoding", b"gzip")], "_Decoding"),
        (8 << 20, [(b"content-length", n), (b"content-type", b"text/event-stream")], "_Reader"),
        (8 << 20, [(b"content-length", n), (b"content-type", b"audio/mpeg")], "_BodyReader"),
        (8 << 20, [(b"content-length", n)], "_BodyReader"),
        (8 << 20, [json_type], "_BodyReader"),
        (
            8 << 20,
            [json_type, (b"content-length", n), (b"transfer-encoding", b"chunked")],
            "_BodyReader",
        ),
        (8 << 20, [json_type, (b"content-length", n), (b"content-length", n)], "_BodyReader"),
        (8 << 20, [json_type, (b"content-length", b"+%d" % len(ANSWER))], "_BodyReader"),
    ):
        t, _ = transport(mod, "tokens", 10**6, max_body, headers, [ANSWER], None, True)
        with mod.Client(transport=t) as c:
            r = c.send(c.build_request("POST", CHAT, json=BODY), stream=True)
            assert reader_of(r) == kind, headers
            assert r.extensions["ratequeue"].settled == (kind == "NoneType"), headers
            r.close()


def test_a_length_beside_chunked_framing_over_a_socket() -> None:
    """A server sending ``Transfer-Encoding: chunked`` and a wrong ``Content-Length``
    (h11 frames the body by its chunks, httpx keeps both headers): read as it passes, its
    usage read."""
    import socket
    import threading

    httpx2 = importlib.import_module("httpx2")
    srv = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        conn, _ = srv.accept()
        with conn:
            buf = b""
            while b"\r\n\r\n" not in buf:
                buf += conn.recv(65536)
            head, rest = buf.split(b"\r\n\r\n", 1)
            want = int(
                next(
                    v
                    for k, _, v in (h.partition(b":") for h in head.split(b"\r\n")[1:])
                    if k.strip().lower() == b"content-length"
                )
            )
            while len(rest) < want:
                rest += conn.recv(65536)
            conn.sendall(
                b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                b"transfer-encoding: chunked\r\ncontent-length: 1\r\n\r\n"
                + b"%x\r\n%s\r\n0\r\n\r\n"
                % (len(ANSWER), ANSWER)
            )

    th = threading.Thread(target=serve, daemon=True)
    th.start()
    llm = limiter("tokens", 10**6)
    port = srv.getsockname()[1]
    with httpx2.Client(transport=RateLimitedTransport(httpx2.HTTPTransport(), llm)) as c:
        r = c.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=BODY)
    th.join(10)
    srv.close()
    assert r.content == ANSWER and r.extensions["ratequeue"].usage == Usage(2, 3)
    assert llm.available("tokens") == 10**6 - 5


@pytest.mark.parametrize("name", ["httpx", "httpx2"])
@pytest.mark.parametrize("is_async", [False, True])
def test_other_buffers_and_no_chunk(name: str, is_async: bool) -> None:
    """A bytearray, a memoryview of wider items (counted in bytes), no chunk at all."""
    mod = importlib.import_module(name)
    wide = memoryview(bytearray(ANSWER + b" " * (-len(ANSWER) % 4))).cast("I")
    for chunks, usage in (
        ([bytearray(ANSWER)], Usage(2, 3)),
        ([wide], Usage(2, 3)),
        ([], None),
    ):
        answer = b"".join(bytes(c) for c in chunks)
        t, llm = transport(
            mod, "tokens", 10**6, 8 << 20, length(answer), chunks, None, True, is_async
        )
        reader, seen, err, rec = (run_async if is_async else run_sync)(mod, t, BODY, ("read", 0))
        assert reader == "NoneType" and err is None and b"".join(seen) == answer
        assert rec.settled and rec.usage == usage
        used = 5 if usage is not None else rec.estimate.tokens
        assert llm.available("tokens") == 10**6 - used


@pytest.mark.parametrize("name", ["httpx", "httpx2"])
@pytest.mark.parametrize("is_async", [False, True])
def test_a_chunk_that_is_no_buffer(name: str, is_async: bool) -> None:
    """A ``str`` chunk: the TypeError raised from the send, the call settled (the
    estimate stays), the stream closed once."""
    mod = importlib.import_module(name)
    chunks: list[Any] = [ANSWER[:5], ANSWER[5:].decode()]
    t, llm = transport(mod, "tokens", 10**6, 8 << 20, length(ANSWER), chunks, None, True, is_async)
    streams = keep_streams(t)
    with pytest.raises(TypeError):
        send(mod, t, is_async)
    assert [s.closed for s in streams] == [1]
    assert t.http_histogram.count == 1 and t.stats()["sent"] == 1
    assert 0 < 10**6 - llm.available("tokens") != 5  # settled at the estimate


@pytest.mark.parametrize("name", ["httpx", "httpx2"])
@pytest.mark.parametrize("is_async", [False, True])
def test_a_stream_whose_iterator_only_has_next(name: str, is_async: bool) -> None:
    """The stream's ``__iter__``/``__aiter__`` returns an object with ``__next__`` /
    ``__anext__`` only (what httpx itself accepts)."""
    mod = importlib.import_module(name)

    class NextOnly:
        def __init__(self) -> None:
            self.left = [ANSWER[:5], ANSWER[5:]]

        def __next__(self) -> bytes:
            if not self.left:
                raise StopIteration
            return self.left.pop(0)

        async def __anext__(self) -> bytes:
            if not self.left:
                raise StopAsyncIteration
            return self.left.pop(0)

    class Stream(mod.SyncByteStream, mod.AsyncByteStream):  # type: ignore[misc,name-defined]
        def __iter__(self) -> Any:
            return NextOnly()

        def __aiter__(self) -> Any:
            return NextOnly()

    llm = limiter("tokens", 10**6)
    inner = mod.MockTransport(lambda r: mod.Response(200, headers=length(ANSWER), stream=Stream()))
    t = RateLimitedTransport(inner, llm)
    r = send(mod, t, is_async)
    assert r.extensions["ratequeue"].usage == Usage(2, 3)  # settled before any read
    assert llm.available("tokens") == 10**6 - 5
    assert (asyncio.run(r.aread()) if is_async else r.read()) == ANSWER  # replayed


@pytest.mark.parametrize("name", ["httpx", "httpx2"])
def test_a_cancel_while_reading_settles_and_closes(name: str) -> None:
    mod = importlib.import_module(name)
    inside = asyncio.Event()
    closed: list[int] = []

    class Stuck(mod.AsyncByteStream):  # type: ignore[misc,name-defined]
        async def __aiter__(self) -> Any:
            yield ANSWER[:4]
            inside.set()
            await asyncio.sleep(3600)
            yield ANSWER[4:]

        async def aclose(self) -> None:
            closed.append(1)

    llm = limiter("tokens", 10**6)

    def answer(request: Any) -> Any:
        return mod.Response(200, headers=length(ANSWER), stream=Stuck())

    t = RateLimitedTransport(mod.MockTransport(answer), llm)

    async def go() -> None:
        async with mod.AsyncClient(transport=t) as c:
            # A send that streams returns at the headers unless the body is read ahead.
            req = c.build_request("POST", CHAT, json=BODY)
            task = asyncio.ensure_future(c.send(req, stream=True))
            await asyncio.wait_for(inside.wait(), 10)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

    asyncio.run(go())
    assert closed == [1]
    assert t.http_histogram.count == 1
    # Settled once, the estimate kept (nothing of the usage was read).
    assert 0 < 10**6 - llm.available("tokens") != 5


@pytest.mark.parametrize("is_async", [False, True])
@pytest.mark.parametrize("name", ["httpx", "httpx2"])
def test_over_a_socket(name: str, is_async: bool) -> None:
    """A real connection: settled when the send returns, before the consumer reads; the
    body read raw as sent; ``elapsed`` set at the close; the connection reused."""
    mod = importlib.import_module(name)
    llm = roomy()
    body = SOCKET_BODY
    with MockProvider(60000, gen_time=0.0, output_tokens=5) as mock:

        def check(r: Any, raw: bytes) -> None:
            rec = r.extensions["ratequeue"]
            assert rec.settled and rec.usage == Usage(10, 5)
            assert json.loads(raw)["usage"]["completion_tokens"] == 5

        if is_async:

            async def go() -> Any:
                t = RateLimitedTransport(mod.AsyncHTTPTransport(), llm)
                async with mod.AsyncClient(transport=t) as c:
                    for _ in range(2):
                        async with c.stream("POST", mock.url, json=body) as r:
                            assert r.extensions["ratequeue"].settled  # before any read
                            check(r, b"".join([x async for x in r.aiter_raw()]))
                        assert r.elapsed.total_seconds() > 0
                    return len(t.inner._pool.connections)

            connections = asyncio.run(go())
        else:
            t = RateLimitedTransport(mod.HTTPTransport(), llm)
            with mod.Client(transport=t) as c:
                for _ in range(2):
                    with c.stream("POST", mock.url, json=body) as r:
                        assert r.extensions["ratequeue"].settled  # before any read
                        check(r, b"".join(r.iter_raw()))
                    assert r.elapsed.total_seconds() > 0
                connections = len(t.inner._pool.connections)
    assert connections == 1
    assert llm.available("tokens") == 10**6 - 2 * 15


@pytest.mark.parametrize("name", ["httpx", "httpx2"])
@pytest.mark.parametrize("is_async", [False, True])
def test_a_close_that_raises_after_a_whole_read(name: str, is_async: bool) -> None:
    """Run once, its error raised from the send; the call settled from the body read."""
    mod = importlib.import_module(name)
    closes: list[int] = []

    class Failing(mod.SyncByteStream, mod.AsyncByteStream):  # type: ignore[misc,name-defined]
        def __iter__(self) -> Any:
            yield ANSWER

        async def __aiter__(self) -> Any:
            yield ANSWER

        def close(self) -> None:
            closes.append(1)
            raise OSError("close failed")

        async def aclose(self) -> None:
            self.close()

    llm = limiter("tokens", 10**6)
    inner = mod.MockTransport(lambda r: mod.Response(200, headers=length(ANSWER), stream=Failing()))
    t = RateLimitedTransport(inner, llm)
    with pytest.raises(OSError, match="close failed"):
        send(mod, t, is_async)
    assert closes == [1] and t.http_histogram.count == 1
    assert llm.available("tokens") == 10**6 - 5


@pytest.mark.parametrize("name", ["httpx", "httpx2"])
def test_an_anyio_cancel_scope_while_reading_over_a_socket(name: str) -> None:
    """A body that stalls half sent, the send in an anyio cancel scope that expires: the
    call settles once (its estimate kept), the connection is closed, not left in use, and
    the client sends again."""
    import socket
    import threading

    import anyio

    mod = importlib.import_module(name)
    srv = socket.create_server(("127.0.0.1", 0))
    stalled = threading.Event()
    done = threading.Event()

    def serve() -> None:
        held = []  # the stalled connection stays open meanwhile
        for stall in (True, False):
            conn, _ = srv.accept()
            held.append(conn)
            buf = b""
            while b"\r\n\r\n" not in buf:
                buf += conn.recv(65536)
            head, rest = buf.split(b"\r\n\r\n", 1)
            want = next(
                int(v)
                for k, _, v in (h.partition(b":") for h in head.split(b"\r\n")[1:])
                if k.strip().lower() == b"content-length"
            )
            while len(rest) < want:
                rest += conn.recv(65536)
            headers = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
            conn.sendall(headers + b"content-length: %d\r\n\r\n" % len(ANSWER))
            conn.sendall(ANSWER[:5] if stall else ANSWER)
            if stall:
                stalled.set()
        done.wait(30)
        for conn in held:
            conn.close()

    th = threading.Thread(target=serve, daemon=True)
    th.start()
    llm = limiter("tokens", 10**6)
    t = RateLimitedTransport(mod.AsyncHTTPTransport(), llm)
    url = f"http://127.0.0.1:{srv.getsockname()[1]}/v1/chat/completions"
    records: list[Any] = []

    async def go() -> tuple[int, Any]:
        async with mod.AsyncClient(transport=t) as c:
            with anyio.move_on_after(0.5) as scope:
                await c.post(url, json=BODY)
            assert scope.cancelled_caught and stalled.is_set()
            in_use = len(t.inner._pool.connections)
            r = await c.post(url, json=BODY)  # a new connection: the old one was closed
            records.append(r.extensions["ratequeue"])
            return in_use, r

    in_use, r = anyio.run(go)
    done.set()
    th.join(10)
    srv.close()
    assert in_use == 0
    assert r.content == ANSWER and records[0].usage == Usage(2, 3)
    assert t.http_histogram.count == 2
    # The first call settled once, its estimate kept (its usage was never read); the
    # second settled to its usage.
    first = 10**6 - llm.available("tokens") - 5
    assert first > 5


@pytest.mark.parametrize("name", ["httpx", "httpx2"])
@pytest.mark.parametrize("is_async", [False, True])
def test_a_body_read_ahead_is_the_content_as_httpx_leaves_it(name: str, is_async: bool) -> None:
    """Sent without stream mode, the response is what httpx's own read leaves, though
    httpx's read path did not run over the body again: a plain ``Response`` holding its
    content, consumed and closed, its bytes downloaded counted and ``elapsed`` timed by
    the client (at least the HTTP time, at most the send's wall time). In stream mode
    the body reads raw or decoded, and the close times it."""
    mod = importlib.import_module(name)
    llm = roomy()
    body = SOCKET_BODY

    def check(r: Any, wall: float) -> None:
        rec = r.extensions["ratequeue"]
        assert rec.settled and rec.usage == Usage(10, 5)
        assert r.json()["usage"]["completion_tokens"] == 5
        assert r.num_bytes_downloaded == len(r.content) > 0
        assert rec.http_seconds <= r.elapsed.total_seconds() <= wall
        assert r.is_closed and r.is_stream_consumed and type(r) is mod.Response

    with MockProvider(60000, gen_time=0.0, output_tokens=5) as mock:
        if is_async:

            async def go() -> None:
                t = RateLimitedTransport(mod.AsyncHTTPTransport(), llm)
                async with mod.AsyncClient(transport=t) as c:
                    w0 = time.perf_counter()
                    r = await c.post(mock.url, json=body)
                    check(r, time.perf_counter() - w0)
                    for way in ("aiter_raw", "aiter_bytes"):
                        async with c.stream("POST", mock.url, json=body) as r:
                            got = b"".join([x async for x in getattr(r, way)()])
                            assert json.loads(got)["usage"]["completion_tokens"] == 5
                        assert r.is_closed and r.elapsed.total_seconds() > 0

            asyncio.run(go())
        else:
            t = RateLimitedTransport(mod.HTTPTransport(), llm)
            with mod.Client(transport=t) as c:
                w0 = time.perf_counter()
                r = c.post(mock.url, json=body)
                check(r, time.perf_counter() - w0)
                for way in ("iter_raw", "iter_bytes"):
                    with c.stream("POST", mock.url, json=body) as r:
                        got = b"".join(getattr(r, way)())
                        assert json.loads(got)["usage"]["completion_tokens"] == 5
                    assert r.is_closed and r.elapsed.total_seconds() > 0
    assert llm.available("tokens") == 10**6 - 3 * 15


@pytest.mark.parametrize("name", ["httpx", "httpx2"])
def test_a_response_read_ahead_pickles_and_copies_as_the_library_s_own(name: str) -> None:
    """Until it is read, a response read ahead is a subclass of the library's
    ``Response``; it pickles and copies as the library's own (without the body kept for
    its read), and once read it is one again."""
    mod = importlib.import_module(name)
    llm = rq.Limiter(rq.Rate(10**6, per="minute"), clock=rq.ManualClock())
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 7}
    with MockProvider(60000, gen_time=0.0, output_tokens=5) as mock:
        t = RateLimitedTransport(mod.HTTPTransport(), llm)
        with mod.Client(transport=t) as c, c.stream("POST", mock.url, json=body) as r:
            assert isinstance(r, mod.Response) and type(r) is not mod.Response
            for back in (pickle.loads(pickle.dumps(r)), copy.copy(r)):
                assert type(back) is mod.Response and "_pre_read" not in vars(back)
                assert back.status_code == 200 and back.headers == r.headers
            assert json.loads(r.read())["usage"]["completion_tokens"] == 5
            assert type(r) is mod.Response and r.is_closed


@pytest.mark.parametrize("name", ["httpx", "httpx2"])
def test_a_response_subclass_from_the_inner_transport_keeps_its_type(name: str) -> None:
    """A ``Response`` subclass the inner transport made is read ahead and settled as any
    response, its type left as it is and its read httpx's own."""
    mod = importlib.import_module(name)

    class Mine(mod.Response):  # type: ignore[misc,name-defined]
        pass

    t, _ = transport(mod, "tokens", 10**6, 8 << 20, length(ANSWER), [ANSWER], None, True)

    def answer(request: Any) -> Any:
        return Mine(200, headers=length(ANSWER), stream=mod.ByteStream(ANSWER))

    t.inner.handler = answer
    for _ in range(2):
        with mod.Client(transport=t) as c:
            r = c.post(CHAT, json=BODY)
        assert type(r) is Mine and r.content == ANSWER and r.is_closed
        assert r.extensions["ratequeue"].settled
