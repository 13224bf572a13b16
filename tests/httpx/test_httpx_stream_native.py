"""A streamed JSON body (a response whose body is not read yet: a real network) read
by the native ``_BodyReader`` against the Python reference (``_stream._Reader``): for any
body, split into any chunks, read whole, in part, cut by an error or a close, the call's
record and the limiter's state are the same; settled once; a close from another thread
while the reader waits for a chunk neither deadlocks nor settles twice."""

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
from ratequeue._ratequeue import _BodyReader
from ratequeue.httpx import RateLimitedTransport
from ratequeue.httpx._usage import Usage
from ratequeue.testing import MockProvider
from test_httpx_settle_native import BODIES, FIELDS, RAW, UNITS, limiter

pytestmark = pytest.mark.timeout(120)

CHAT = "http://p/v1/chat/completions"
# How the consumer reads the body: whole; part then close; close at once; an inner stream
# that raises after k chunks; whole then close twice; close then iterate again.
PLANS = st.one_of(
    st.just(("read", 0)),
    st.tuples(st.just("part"), st.integers(0, 4)),
    st.just(("close", 0)),
    st.tuples(st.just("raise"), st.integers(0, 4)),
    st.just(("close2", 0)),
    st.just(("again", 0)),
)
ENCODINGS = st.sampled_from([None, b"identity", b" Identity , identity"])


class Boom(Exception):
    pass


def chunks_of(body: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({min(c, len(body)) for c in cuts})
    out, at = [], 0
    for p in points:
        out.append(body[at:p])
        at = p
    out.append(body[at:])
    return out


def sync_inner(mod: Any, chunks: list[bytes], fail_at: int | None) -> Any:
    class Inner(mod.SyncByteStream):  # type: ignore[misc,name-defined]
        closed = 0

        def __iter__(self) -> Any:
            for k, c in enumerate(chunks):
                if k == fail_at:
                    raise Boom
                yield c

        def close(self) -> None:
            self.closed += 1

    return Inner()


def async_inner(mod: Any, chunks: list[bytes], fail_at: int | None) -> Any:
    class Inner(mod.AsyncByteStream):  # type: ignore[misc,name-defined]
        closed = 0

        async def __aiter__(self) -> Any:
            for k, c in enumerate(chunks):
                if k == fail_at:
                    raise Boom
                yield c

        async def aclose(self) -> None:
            self.closed += 1

    return Inner()


def transport(
    mod: Any,
    units: str,
    burst: int,
    max_body: int,
    headers: Any,
    chunks: Any,
    fail: Any,
    native: bool,
    is_async: bool = False,
) -> tuple[Any, rq.Limiter]:
    llm = limiter(units, burst)
    make = async_inner if is_async else sync_inner

    def answer(request: Any) -> Any:
        return mod.Response(200, headers=headers, stream=make(mod, chunks, fail))

    t = RateLimitedTransport(mod.MockTransport(answer), llm, max_body=max_body)
    t._native_stream = native
    return t, llm


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


def reader_of(r: Any) -> str:
    """The type name of the reader under the client's wrapper of the response stream."""
    s = r.stream
    while not hasattr(s, "_reader") and hasattr(s, "_stream"):
        s = s._stream
    return type(getattr(s, "_reader", None)).__name__


def run_sync(mod: Any, t: Any, body: dict[str, Any], plan: tuple[str, int]) -> tuple[Any, ...]:
    """Read as the plan says: what the consumer saw (chunks, an error) and the record."""
    kind, k = plan
    seen: list[bytes] = []
    err = None
    with mod.Client(transport=t) as c:
        r = c.send(c.build_request("POST", CHAT, json=body), stream=True)
        rec = r.extensions["ratequeue"]
        reader = reader_of(r)
        try:
            if kind in ("read", "raise", "close2"):
                seen.extend(r.iter_raw())
            elif kind == "part":
                for n, chunk in enumerate(r.stream):
                    if n == k:
                        break
                    seen.append(chunk)
            r.close()
            if kind == "close2":
                r.stream.close()
                r.stream.close()
            if kind == "again":
                seen.extend(r.stream)
        except Boom:
            err = "boom"
            r.close()
    return reader, seen, err, rec


def run_async(mod: Any, t: Any, body: dict[str, Any], plan: tuple[str, int]) -> tuple[Any, ...]:
    async def go() -> tuple[Any, ...]:
        kind, k = plan
        seen: list[bytes] = []
        err = None
        async with mod.AsyncClient(transport=t) as c:
            r = await c.send(c.build_request("POST", CHAT, json=body), stream=True)
            rec = r.extensions["ratequeue"]
            reader = reader_of(r)
            try:
                if kind in ("read", "raise", "close2"):
                    seen.extend([x async for x in r.aiter_raw()])
                elif kind == "part":
                    n = 0
                    async for chunk in r.stream:
                        if n == k:
                            break
                        seen.append(chunk)
                        n += 1
                await r.aclose()
                if kind == "close2":
                    await r.stream.aclose()
                    await r.stream.aclose()
                if kind == "again":
                    seen.extend([x async for x in r.stream])
            except Boom:
                err = "boom"
                await r.aclose()
        return reader, seen, err, rec

    return asyncio.run(go())


@pytest.mark.parametrize("name", ["httpx", "httpx2"])
@pytest.mark.parametrize("is_async", [False, True])
@settings(max_examples=300, deadline=None)
@given(
    units=st.sampled_from(UNITS),
    burst=st.sampled_from([40, 1000, 10**6]),
    max_tokens=st.integers(0, 3000),
    answer=st.one_of(BODIES, RAW),
    cuts=st.lists(st.integers(0, 400), max_size=5),
    max_body=st.sampled_from([0, 20, 90, 8 << 20]),
    plan=PLANS,
    encoding=ENCODINGS,
)
def test_native_stream_is_the_reference(
    name: str,
    is_async: bool,
    units: str,
    burst: int,
    max_tokens: int,
    answer: bytes,
    cuts: list[int],
    max_body: int,
    plan: tuple[str, int],
    encoding: bytes | None,
) -> None:
    mod = importlib.import_module(name)
    headers = [(b"content-type", b"application/json")]
    if encoding is not None:
        headers.append((b"content-encoding", encoding))
    chunks = chunks_of(answer, cuts)
    fail = plan[1] if plan[0] == "raise" else None
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": max_tokens}
    got = []
    for native in (True, False):
        t, llm = transport(mod, units, burst, max_body, headers, chunks, fail, native, is_async)
        reader, seen, err, rec = (run_async if is_async else run_sync)(mod, t, body, plan)
        assert reader == ("_BodyReader" if native else "_Reader")
        got.append((seen, err, state(t, llm, rec)))
        t._settle(rec, None, None)  # a late close: settled already, nothing changes
        assert state(t, llm, rec) == got[-1][2]
    assert got[0] == got[1]


@pytest.mark.parametrize("name", ["httpx", "httpx2"])
def test_other_bodies_keep_the_python_reader(name: str) -> None:
    """SSE, a compressed body, a ledger-free Policy: the Python reader, as before."""
    mod = importlib.import_module(name)
    answer = json.dumps({"usage": {"prompt_tokens": 2, "completion_tokens": 3}}).encode()
    for headers in (
        [(b"content-type", b"text/event-stream")],
        [(b"content-encoding", b"gzip")],
        [(b"content-encoding", b"identity, br")],
    ):
        t, _ = transport(mod, "tokens", 10**6, 8 << 20, headers, [answer], None, True)
        reader, *_ = run_sync(mod, t, {"model": "m", "max_tokens": 9}, ("close", 0))
        assert reader in ("_Reader", "_Decoding")
    pol = rq.Policy({"l": rq.Limiter(rq.Rate(10**6, per="minute", unit="tokens"))})
    inner = mod.MockTransport(lambda r: mod.Response(200, stream=sync_inner(mod, [answer], None)))
    t = RateLimitedTransport(inner, pol, units=["tokens"])
    reader, _, _, rec = run_sync(mod, t, {"model": "m", "max_tokens": 9}, ("read", 0))
    assert reader == "_Reader" and rec.usage == Usage(2, 3)


@pytest.mark.parametrize("name", ["httpx", "httpx2"])
def test_the_wrappers_are_the_packages_streams(name: str) -> None:
    mod = importlib.import_module(name)
    answer = json.dumps({"usage": {"prompt_tokens": 2, "completion_tokens": 3}}).encode()
    t, llm = transport(mod, "tokens", 10**6, 8 << 20, [], [answer[:5], answer[5:]], None, True)
    with mod.Client(transport=t) as c:
        r = c.send(c.build_request("POST", CHAT, json={"model": "m", "max_tokens": 9}), stream=True)
        assert isinstance(r.stream, mod.SyncByteStream)
        assert reader_of(r) == _BodyReader.__name__
        assert t.http_histogram.count == 1  # recorded at the headers, not again
        assert r.read() == answer
    rec = r.extensions["ratequeue"]
    assert rec.usage == Usage(2, 3) and rec.charged == {"requests": 1, "tokens": 5}
    assert llm.available("tokens") == 10**6 - 5 and t.http_histogram.count == 1


def close_while_waiting(mod: Any, answer: bytes) -> None:
    """One round: the consumer waits inside the inner stream's second next()."""
    inside, release = threading.Event(), threading.Event()

    class Slow(mod.SyncByteStream):  # type: ignore[misc,name-defined]
        def __iter__(self) -> Any:
            yield answer[:4]
            inside.set()
            release.wait(10)
            yield answer[4:]

    llm = limiter("tokens", 10**6)
    inner = mod.MockTransport(lambda r: mod.Response(200, stream=Slow()))
    t = RateLimitedTransport(inner, llm)
    c = mod.Client(transport=t)
    r = c.send(c.build_request("POST", CHAT, json={"model": "m", "max_tokens": 9}), stream=True)
    assert reader_of(r) == "_BodyReader"
    rec = r.extensions["ratequeue"]
    errors: list[BaseException] = []
    seen: list[bytes] = []

    def consume() -> None:
        try:
            seen.extend(r.stream)
        except BaseException as e:  # pragma: no cover - the failure reported below
            errors.append(e)

    th = threading.Thread(target=consume)
    th.start()
    assert inside.wait(10)
    r.stream.close()  # settles now, from this thread
    assert rec.settled and rec._once == [] and rec.usage is None
    release.set()
    th.join(10)
    assert not th.is_alive() and errors == []
    assert b"".join(seen) == answer
    assert rec.usage is None  # the end of the body after the close changed nothing
    assert rec.charged == {"requests": 1, "tokens": rec.estimate.tokens}
    assert llm.available("tokens") == 10**6 - rec.estimate.tokens
    c.close()


@pytest.mark.parametrize("name", ["httpx", "httpx2"])
def test_a_close_while_waiting_for_a_chunk(name: str) -> None:
    """Another thread closes the response while the iterating thread is inside the
    inner stream's next(): no deadlock, no error from the reader, settled once (with no
    usage: the estimate stays charged)."""
    mod = importlib.import_module(name)
    answer = json.dumps({"usage": {"prompt_tokens": 2, "completion_tokens": 3}}).encode()
    for _ in range(20):
        close_while_waiting(mod, answer)


@pytest.mark.parametrize("name", ["httpx", "httpx2"])
def test_a_close_racing_the_end_settles_once(name: str) -> None:
    """A close from another thread racing the end of the body: one of them settles, and
    the record and the limiter agree on which."""
    mod = importlib.import_module(name)
    answer = json.dumps({"usage": {"prompt_tokens": 2, "completion_tokens": 3}}).encode()
    for _ in range(100):
        llm = limiter("tokens", 10**6)
        inner = mod.MockTransport(
            lambda r: mod.Response(200, stream=sync_inner(mod, [answer[:3], answer[3:]], None))
        )
        c = mod.Client(transport=RateLimitedTransport(inner, llm))
        r = c.send(c.build_request("POST", CHAT, json={"model": "m", "max_tokens": 9}), stream=True)
        rec = r.extensions["ratequeue"]
        barrier = threading.Barrier(2)

        def consume(r: Any = r, barrier: Any = barrier) -> None:
            barrier.wait()
            for _ in r.stream:
                pass

        def close(r: Any = r, barrier: Any = barrier) -> None:
            barrier.wait()
            r.stream.close()

        threads = [threading.Thread(target=consume), threading.Thread(target=close)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(10)
        assert rec.settled and rec._once == []
        if rec.usage is None:  # the close came first: the estimate stays charged
            assert llm.available("tokens") == 10**6 - rec.estimate.tokens
        else:
            assert rec.usage == Usage(2, 3) and llm.available("tokens") == 10**6 - 5
        c.close()


def test_a_loopback_call_settles_the_providers_usage() -> None:
    """Over a real socket (HTTPTransport to the MockProvider) a body of a known length is
    read ahead (``test_httpx_read_ahead``), the permit settled with the provider's usage
    before the consumer reads."""
    httpx2 = importlib.import_module("httpx2")
    llm = rq.Limiter(
        rq.Rate(10**6, per="minute"),
        rq.Rate(10**6, per="minute", unit="tokens"),
        clock=rq.ManualClock(),
    )
    with MockProvider(60000, gen_time=0.0, output_tokens=5) as mock:
        t = RateLimitedTransport(httpx2.HTTPTransport(), llm)
        with httpx2.Client(transport=t) as c:
            body = {
                "model": "m",
                "messages": [{"role": "user", "content": "x" * 40}],
                "max_tokens": 7,
            }
            with c.stream("POST", mock.url, json=body) as r:
                assert reader_of(r) == "NoneType" and r.extensions["ratequeue"].settled
                r.read()
    rec = r.extensions["ratequeue"]
    assert rec.settled and rec.usage == Usage(10, 5)
    assert rec.charged == {"requests": 1, "tokens": 15}
    assert llm.available("tokens") == 10**6 - 15


DEFERRED = [
    json.dumps({"usage": {"prompt_tokens": 2**64, "completion_tokens": 1}}).encode(),
    json.dumps({"usage": {"input_tokens": 3, "output_tokens": 4}}).encode("utf-16"),
    b'{"a": ' * 200 + b'{"usage": {"prompt_tokens": 3, "completion_tokens": 4}}' + b"}" * 200,
]


@pytest.mark.parametrize("name", ["httpx", "httpx2"])
@pytest.mark.parametrize("answer", DEFERRED)
@pytest.mark.parametrize("units", UNITS)
@pytest.mark.parametrize("is_async", [False, True])
def test_a_usage_only_the_reference_reads_is_handed_to_it(
    name: str, answer: bytes, units: str, is_async: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the native settle defers, ``_stream_deferred`` settles as ``_Reader.finish``."""
    mod = importlib.import_module(name)
    handed: list[Any] = []
    body = {"model": "m", "max_tokens": 50}
    got = []
    for native in (True, False):
        t, llm = transport(
            mod, units, 10**6, 8 << 20, [], chunks_of(answer, [7, 9]), None, native, is_async
        )
        deferred = t._stream_deferred

        def spy(call: Any, data: Any, deferred: Any = deferred) -> None:
            handed.append(data)
            deferred(call, data)

        monkeypatch.setattr(t, "_stream_deferred", spy)
        _, seen, _, rec = (run_async if is_async else run_sync)(mod, t, body, ("read", 0))
        assert b"".join(seen) == answer
        got.append(state(t, llm, rec))
    if units != "requests":
        assert handed == [answer]
    assert got[0] == got[1]
