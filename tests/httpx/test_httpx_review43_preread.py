"""Review of 1da27b0 (a response read ahead is a ``_PreRead`` subclass until read): what a
user sees differ from a bare transport. Each test runs the same scenario over a bare
``HTTPTransport`` (passes) and over ``RateLimitedTransport`` (fails on 1da27b0)."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import importlib
from collections.abc import Iterator
from typing import Any

import pytest
from ratequeue.httpx import RateLimitedTransport
from ratequeue.testing import MockProvider
from test_httpx_read_ahead import roomy, socket_mock

pytestmark = pytest.mark.timeout(10)

BODY = {"model": "m", "messages": [{"role": "user", "content": "x" * 40}], "max_tokens": 7}
LIBS = ["httpx", "httpx2"]
# "bare" (a bare HTTPTransport) passes every test below: add it here to compare.
KINDS = ["ratequeue"]


limiter = roomy


@pytest.fixture(scope="module")
def mock() -> Iterator[MockProvider]:
    yield from socket_mock()


def _transport(mod: Any, kind: str, is_async: bool) -> Any:
    inner = mod.AsyncHTTPTransport() if is_async else mod.HTTPTransport()
    return inner if kind == "bare" else RateLimitedTransport(inner, limiter())


def _wrappers(mod: Any, close_error: Exception | None = None) -> tuple[type, type]:
    """An outer transport (sync, async) that wraps the response's stream in place with one
    that upper-cases the bytes and counts them (a logging / metering / rewriting layer)."""

    class Upper(mod.SyncByteStream, mod.AsyncByteStream):  # type: ignore[misc,name-defined]
        def __init__(self, inner: Any) -> None:
            self.inner, self.seen = inner, 0

        def __iter__(self) -> Iterator[bytes]:
            for c in self.inner:
                self.seen += len(c)
                yield c.upper()

        async def __aiter__(self) -> Any:
            async for c in self.inner:
                self.seen += len(c)
                yield c.upper()

        def close(self) -> None:
            self.inner.close()
            if close_error is not None:
                raise close_error

        async def aclose(self) -> None:
            await self.inner.aclose()
            if close_error is not None:
                raise close_error

    class Outer(mod.BaseTransport):  # type: ignore[misc,name-defined]
        def __init__(self, inner: Any) -> None:
            self.inner = inner

        def handle_request(self, request: Any) -> Any:
            r = self.inner.handle_request(request)
            r.stream = Upper(r.stream)
            return r

        def close(self) -> None:
            self.inner.close()

    class AsyncOuter(mod.AsyncBaseTransport):  # type: ignore[misc,name-defined]
        def __init__(self, inner: Any) -> None:
            self.inner = inner

        async def handle_async_request(self, request: Any) -> Any:
            r = await self.inner.handle_async_request(request)
            r.stream = Upper(r.stream)
            return r

        async def aclose(self) -> None:
            await self.inner.aclose()

    return Outer, AsyncOuter


# -- 1. a stream put in place of the replay is bypassed by read() -------------------------


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", LIBS)
@pytest.mark.parametrize("is_async", [False, True])
def test_read_goes_through_a_stream_an_outer_layer_put_in_place(
    mock: MockProvider, kind: str, name: str, is_async: bool
) -> None:
    """An outer transport (or event hook) that replaces ``response.stream`` in place with a
    wrapping stream (logging, metering, decrypting, rewriting): httpx's ``read()`` reads
    through it. ``_PreRead.read()`` returns the body kept in ``_pre_read`` and never
    iterates ``response.stream``: the wrapper's bytes are not what the user gets and it
    sees nothing."""
    mod = importlib.import_module(name)
    Outer, AsyncOuter = _wrappers(mod)
    t = _transport(mod, kind, is_async)

    async def go() -> Any:
        async with mod.AsyncClient(transport=AsyncOuter(t)) as c:
            return await c.post(mock.url, json=BODY)

    if is_async:
        r = asyncio.run(go())
    else:
        with mod.Client(transport=Outer(t)) as c:
            r = c.post(mock.url, json=BODY)
    assert r.content == r.content.upper()  # the wrapper's bytes
    assert b'"ID"' in r.content


# -- 2. a close that raises inside read() leaves a half-read response ---------------------


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", LIBS)
def test_a_close_raising_in_read_leaves_no_content_and_names_the_request(
    mock: MockProvider, kind: str, name: str
) -> None:
    """httpx's read closes the stream inside ``request_context``: an httpx error raised by
    the close carries ``.request`` and the read leaves no ``_content`` (``content`` raises
    ``ResponseNotRead``). ``_PreRead.read()`` sets ``_content`` first and closes outside
    ``request_context``: the error has no request and the response afterwards reads as if
    it had been read whole."""
    mod = importlib.import_module(name)
    Outer, _ = _wrappers(mod, close_error=mod.ReadError("close failed"))
    t = _transport(mod, kind, False)
    with mod.Client(transport=Outer(t)) as c, c.stream("POST", mock.url, json=BODY) as r:
        with pytest.raises(mod.ReadError) as e:
            r.read()
        try:
            has_request = e.value.request is not None
        except RuntimeError:  # "The .request property has not been set."
            has_request = False
        try:
            r.content  # noqa: B018
            half_read = True
        except mod.ResponseNotRead:
            half_read = False
        assert (has_request, half_read) == (True, False)
        with contextlib.suppress(mod.ReadError):
            r.close()


# -- 3. a response read to its end another way keeps the body and its subclass -------------


def _holds(root: Any, length: int) -> bool:
    """Whether a bytes object of ``length`` is reachable from ``root`` (depth-limited)."""
    seen: set[int] = set()
    todo = [(root, 0)]
    while todo:
        o, depth = todo.pop()
        if id(o) in seen or depth > 6:
            continue
        seen.add(id(o))
        if type(o) is bytes and len(o) == length:
            return True
        if isinstance(o, (str, int, float, type)) or o is None:
            continue
        todo.extend((x, depth + 1) for x in gc.get_referents(o))
    return False


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", LIBS)
@pytest.mark.parametrize("way", ["iter_bytes", "iter_raw", "iter_lines"])
def test_a_stream_read_to_its_end_is_a_plain_response_holding_no_body(
    mock: MockProvider, kind: str, name: str, way: str
) -> None:
    """Stream mode read to its end with ``iter_bytes``/``iter_raw``/``iter_lines`` (the
    user writing the body out as it comes) and closed: bare httpx keeps nothing of the
    body and the response is a plain ``Response``. Here only ``read()`` swaps the class
    back: the response stays a ``_PreRead`` (``type(r) is httpx.Response`` is False, its
    ``__module__`` is ratequeue's) and keeps the whole body alive (``_pre_read`` and the
    replay) for as long as the response lives."""
    mod = importlib.import_module(name)
    t = _transport(mod, kind, False)
    with mod.Client(transport=t) as c:
        with c.stream("POST", mock.url, json=BODY) as r:
            n = sum(len(x) for x in getattr(r, way)())
        assert r.is_closed and n > 0
        assert type(r) is mod.Response
        assert not _holds(r, int(r.headers["content-length"]))
