"""The response body, read as it passes (or, a JSON body of a known length, read ahead):
usage found in JSON or SSE, the call settled at its end; stream wrappers subclass the
stream bases of httpx or httpx2 (whichever made the response), imported only then."""

from __future__ import annotations

import contextlib
import importlib
import sys
from collections.abc import AsyncIterator, Iterator
from typing import TYPE_CHECKING, Any

from .._ratequeue import _BodyReader
from ._decode import Decoder, decoder
from ._record import json_object
from ._record import json_usage as _json_usage
from ._unclosed import GENERATION, collecting, hand_over, ready
from ._usage import SSEUsage, Usage

if TYPE_CHECKING:
    from ._record import _Call
    from ._transport import RateLimitedTransport


#: What a call sent without a body used when its whole answer is a JSON object (or empty)
#: that reports no usage: nothing (it had nothing to generate from). A stream cut short, an
#: event stream without its final usage, a body past the bound or undecodable keep the
#: estimate: they may have generated.
NONE_USED = Usage(0, 0)


def nothing_used(call: _Call, body: bytes) -> Usage | None:
    """``NONE_USED`` for a call sent without a body whose whole answer ``body`` (read to
    its end) is empty or a JSON object, reporting no usage; else None (the estimate
    stays)."""
    if call._bodyless and (not body or json_object(body) is not None):
        return NONE_USED
    return None


def _done(
    call: _Call,
    transport: RateLimitedTransport,
    usage: Usage | None,
    body: bytes | None = None,
    response_id: str | None = None,
    done: bool = False,
) -> None:
    """Settle with the usage the body reported; without one, the estimate stays charged
    (never admit more than allowed) and ``usage`` stays None, or a background response's
    creation (``body`` its JSON answer; ``response_id`` the id its event stream named)
    waits for its poll's. ``done``: an event stream told its response ended."""
    transport._settle(
        call, usage, call.status, reported=True, body=body, response_id=response_id, done=done
    )


# A compressed event stream is decoded for its usage up to 1 MiB plus 100 decoded bytes
# per encoded byte (text streams compress 2-20x): a decompression bomb stops there.
_SSE_DECODED = 1 << 20
_SSE_RATIO = 100


class _Reader:
    """Finds the usage in a body as it is read (its ``Content-Encoding`` undone on the
    side); settles the call at its end. ``over``: the usage cannot be read."""

    __slots__ = (
        "__weakref__",
        "_unfinished",
        "buf",
        "call",
        "ended",
        "finished",
        "named",
        "over",
        "size",
        "sse",
        "transport",
    )

    def __init__(self, call: _Call, transport: RateLimitedTransport, sse: bool) -> None:
        self.call, self.transport = call, transport
        self.sse = SSEUsage() if sse else None
        self.buf: list[bytes] = []
        self.size = 0
        self.over = False
        self.ended = False  # the body was read to its end (not closed before)
        self.finished = False  # finish ran: the body ended, was closed or cut
        self._unfinished = [None]  # popped by the one caller that finishes
        self.named = False  # a background response's id seen (kept from then on)

    def feed(self, chunk: bytes) -> None:
        sse = self.sse
        if sse is not None:
            sse.feed(chunk)
            if sse.response_id is not None and not self.named:
                # A background response named while its creation streams: kept now,
                # its polls meanwhile charged nothing (a final one settles it).
                self.named = True
                self.transport._background.streaming(self.call, sse.response_id)
            if sse.final and not self.call._done:
                self.finish()
        elif not self.over:
            self.size += len(chunk)
            if self.size > self.transport.max_body:
                self.over, self.buf = True, []
            else:
                self.buf.append(chunk)

    def finish(self) -> None:
        try:
            self._unfinished.pop()  # atomic: a close racing the end finishes nothing
        except IndexError:
            return
        except BaseException:  # a Ctrl-C as the pop returned: nothing done, unfinished
            self._unfinished.append(None)
            raise
        self.finished = True
        try:
            self._settle()
        except BaseException:
            if self.call._once:
                # Not settled (a Ctrl-C, a failure before the settle): unfinished again,
                # so that the stream's close or drop settles it.
                self.finished = False
                self._unfinished.append(None)
            raise
        self.buf = []

    def _settle(self) -> None:
        if self.call._done:
            return
        usage: Usage | None = None
        whole: bytes | None = None  # a JSON body as read
        rid: str | None = None
        done = False
        if self.over:
            self.buf = []
        elif self.sse is not None:
            # A stream cut before its final usage event may have produced more than it
            # reported so far: the estimate stays charged (a background response's
            # creation, cut while it runs, waits for its poll's usage; one that ended
            # is done, its usage read or not).
            usage = self.sse.usage if self.sse.final else None
            rid = None if self.ended else self.sse.response_id
            done = self.sse.done
        else:
            body = b"".join(self.buf)
            self.buf = [body]  # until settled
            usage = _json_usage(body) if body else None
            whole = body
            if usage is None and self.ended:
                usage = nothing_used(self.call, body)
        _done(self.call, self.transport, usage, whole, rid, done)


class _Decoding(_Reader):
    """A reader of a body sent with a ``Content-Encoding``: it reads the decoded bytes."""

    __slots__ = ("dec",)

    def __init__(
        self, call: _Call, transport: RateLimitedTransport, sse: bool, dec: Decoder
    ) -> None:
        super().__init__(call, transport, sse)
        self.dec = dec
        self.over = dec.stopped

    def feed(self, chunk: bytes) -> None:
        if self.over or self.call._done:  # nothing (more) to read
            return
        dec = self.dec
        for piece in dec.feed(chunk):
            super().feed(piece)
        if dec.stopped:
            self.over, self.buf = True, []


def _dropped(stream: Any) -> None:
    """A stream wrapper's finalizer: its reader, unfinished, is handed over (see
    ``_unclosed``)."""
    with contextlib.suppress(Exception):  # at interpreter shutdown
        hand_over(stream._reader, stream._generation)


_STREAMS: dict[type, tuple[type, type, type, type, type, type, type]] = {}


def _library(response_type: type) -> Any:
    """httpx or httpx2: whichever's ``Response`` ``response_type`` is or derives from (a
    transport may answer with a subclass of its own)."""
    for k in response_type.__mro__:
        mod = sys.modules.get(k.__module__.split(".", 1)[0])
        if mod is not None and getattr(mod, "Response", None) is k:
            return mod
    return importlib.import_module(response_type.__module__.split(".", 1)[0])


def _stream_types(response_type: type) -> tuple[type, type, type, type, type, type, type]:
    """Sync and async stream wrappers subclassing the stream bases of httpx or httpx2
    (whichever ``response_type`` belongs to): over a Python reader, over the native
    ``_BodyReader``, over a body read ahead past its length (``read_ahead``), and a body
    read ahead whole."""
    types = _STREAMS.get(response_type)
    if types is not None:
        return types
    mod = _library(response_type)
    own = getattr(mod, "Response", response_type)
    if own is not response_type:  # a subclass: its library's
        types = _STREAMS[response_type] = _stream_types(own)
        return types

    class _SyncStream(mod.SyncByteStream):  # type: ignore[name-defined,misc]
        def __init__(self, inner: Any, reader: _Reader) -> None:
            self._inner, self._reader = inner, reader
            self._generation = GENERATION[0]  # the process it was made in

        def __iter__(self) -> Iterator[bytes]:
            for chunk in self._inner:
                self._reader.feed(chunk)
                yield chunk
            self._reader.ended = True
            self._reader.finish()

        def close(self) -> None:
            try:
                if hasattr(self._inner, "close"):
                    self._inner.close()
            finally:
                if not collecting():
                    self._reader.finish()
                else:
                    # Closed from a finalizer the garbage collector runs (httpx2's
                    # iterators close their response in a ``finally``), inside code
                    # that may hold the locks a settle takes: handed over.
                    _dropped(self)

        __del__ = _dropped

    class _AsyncStream(mod.AsyncByteStream):  # type: ignore[name-defined,misc]
        def __init__(self, inner: Any, reader: _Reader) -> None:
            self._inner, self._reader = inner, reader
            self._generation = GENERATION[0]  # the process it was made in

        async def __aiter__(self) -> AsyncIterator[bytes]:
            reader = self._reader
            call = reader.call
            async for chunk in self._inner:
                reader.feed(chunk)
                if call._owed is not None:  # settled at the final usage event
                    await reader.transport._pay_async(call)
                yield chunk
            reader.ended = True
            reader.finish()
            await self._pay()

        async def aclose(self) -> None:
            try:
                if hasattr(self._inner, "aclose"):
                    await self._inner.aclose()
            finally:
                self._reader.finish()
                await self._pay()

        async def _pay(self) -> None:
            """What the call owes the ledger once settled, off the event loop."""
            call = self._reader.call
            if call._owed is not None:
                await self._reader.transport._pay_async(call)

        __del__ = _dropped

    class _NativeSyncStream(_SyncStream):
        """Over a ``_BodyReader``: the chunks pass through a native iterator (no Python
        frame per chunk); closed as the Python reader's stream."""

        def __iter__(self) -> Iterator[bytes]:
            return self._reader.iterate(self._inner, self)  # type: ignore[attr-defined,no-any-return]

    class _NativeAsyncStream(_AsyncStream):
        """Over a ``_BodyReader``; no ledger on the native path: nothing is owed after
        the settle."""

        async def __aiter__(self) -> AsyncIterator[bytes]:
            feed = self._reader.feed
            async for chunk in self._inner:
                feed(chunk)
                yield chunk
            self._reader.finish()

        async def _pay(self) -> None:
            pass  # no ledger on the native path

    class _SyncReplay(mod.SyncByteStream):  # type: ignore[name-defined,misc]
        """A stream that gave more than its length: the chunks read ahead, then the rest
        of its iterator; closing closes the stream they came from."""

        def __init__(self, chunks: list[bytes], rest: Any, inner: Any) -> None:
            self._chunks, self._rest, self._inner = chunks, rest, inner

        def __iter__(self) -> Iterator[bytes]:
            chunks, rest = self._chunks, self._rest
            self._chunks, self._rest = [], None
            yield from chunks
            if rest is not None:
                while (chunk := next(rest, _END)) is not _END:
                    yield chunk

        def close(self) -> None:
            if hasattr(self._inner, "close"):
                self._inner.close()

    class _AsyncReplay(mod.AsyncByteStream):  # type: ignore[name-defined,misc]
        """``_SyncReplay`` for asyncio."""

        def __init__(self, chunks: list[bytes], rest: Any, inner: Any) -> None:
            self._left, self._rest, self._inner = chunks[::-1], rest, inner

        def __aiter__(self) -> Any:
            return self

        async def __anext__(self) -> bytes:
            if self._left:
                return self._left.pop()
            if self._rest is not None:
                return await self._rest.__anext__()  # type: ignore[no-any-return]
            raise StopAsyncIteration

        async def aclose(self) -> None:
            if hasattr(self._inner, "aclose"):
                await self._inner.aclose()

    class _Whole(mod.SyncByteStream, mod.AsyncByteStream):  # type: ignore[name-defined,misc]
        """A body read ahead whole, replayed once (sync or asyncio) and let go of once
        iterated or closed: a response kept after its stream was read holds no body."""

        def __init__(self, body: bytes) -> None:
            self._body = body

        def __iter__(self) -> Iterator[bytes]:
            body, self._body = self._body, b""
            yield body

        async def __aiter__(self) -> AsyncIterator[bytes]:
            body, self._body = self._body, b""
            yield body

        def close(self) -> None:
            self._body = b""

        async def aclose(self) -> None:
            self._body = b""

    types = (
        _SyncStream,
        _AsyncStream,
        _NativeSyncStream,
        _NativeAsyncStream,
        _SyncReplay,
        _AsyncReplay,
        _Whole,
    )
    _STREAMS[response_type] = types
    return types


def native_stream(response: Any, reader: _BodyReader, is_async: bool) -> None:
    """Put the native reader between the response's stream and its consumer."""
    types = _STREAMS.get(type(response)) or _stream_types(type(response))
    ready()
    response.stream = types[3 if is_async else 2](response.stream, reader)


def ignore(response: Any, call: _Call, transport: RateLimitedTransport, is_async: bool) -> None:
    """Settle the call without a usage when its body ends or is closed (passed on unread)."""
    sync_t, async_t, *_ = _STREAMS.get(type(response)) or _stream_types(type(response))
    reader = _Reader(call, transport, False)
    reader.over = True  # nothing of the body is kept
    ready()
    response.stream = (async_t if is_async else sync_t)(response.stream, reader)


def wrap(
    response: Any, call: _Call, transport: RateLimitedTransport, is_async: bool, sse: bool
) -> None:
    """Put a reader between the response's stream and its consumer (or read the body
    at once when the response already holds it)."""
    if response.is_stream_consumed:
        content = response.content
        usage: Usage | None = None
        whole: bytes | None = None
        done = False
        if sse:  # ended: a background response's stream is done (no id kept)
            events = SSEUsage()
            events.feed(content)
            usage = events.usage if events.final else None
            done = events.done
        elif content and len(content) <= transport.max_body:
            usage = _json_usage(content)
            whole = content
        _done(call, transport, usage, whole, done=done)
        return
    sync_t, async_t, *_ = _STREAMS.get(type(response)) or _stream_types(type(response))
    enc = response.headers.get("content-encoding")
    dec = None
    if enc is not None:  # a stream: a bound per encoded byte; JSON: max_body in all
        dec = decoder(enc, _SSE_DECODED, _SSE_RATIO) if sse else decoder(enc, transport.max_body)
    reader = _Reader(call, transport, sse) if dec is None else _Decoding(call, transport, sse, dec)
    ready()
    response.stream = (async_t if is_async else sync_t)(response.stream, reader)


# -- a body read ahead -------------------------------------------------------------------
#
# On the native path a 2xx JSON body with one Content-Length within ``max_body`` (no
# Transfer-Encoding, nothing to decode) is read before the response is returned: the call
# is settled in the same native crossing as a body that was here, the stream is closed
# (its connection goes back to the pool, as after httpx's own read) and the consumer reads
# the body from memory. A stream that gives more than its length is passed on whole: what
# was read, then the rest as it comes, through the native reader.

_END: Any = object()


def _read_failed(
    transport: RateLimitedTransport,
    call: _Call,
    response: Any,
    chunks: list[Any],
    http_seconds: float,
    is_async: bool,
) -> None:
    """A read ahead cut by an error: settled from what was read, as the native reader
    settles a body cut short (the estimate stays unless that part holds a usage)."""
    try:
        body = b"".join(chunks)
    except Exception:  # a chunk that is no buffer (what was raised): no usage read
        body = b""
    transport._received(call, response, http_seconds, is_async, body)


def _read(response: Any, stream: Any, chunks: list[Any], over: Any, is_async: bool) -> bytes | None:
    """The body read whole (the stream closed by the caller), a bytes-only stream of it
    put in place of the one read; or None, ``over`` the stream's iterator past its
    length: what was read is replayed before the rest.

    A response of httpx's or httpx2's own ``Response`` type becomes a ``_PreRead`` of it
    until it is read: its ``read()`` (``aread()``) takes the body without running httpx's
    read path (decoder, chunker, stream layers) over the replay, and makes it a plain
    ``Response`` again."""
    if over is not None:
        types = _STREAMS.get(type(response)) or _stream_types(type(response))
        response.stream = types[5 if is_async else 4](chunks, over, stream)
        return None
    body = chunks[0] if len(chunks) == 1 and type(chunks[0]) is bytes else b"".join(chunks)
    base = type(response)
    response.stream = replay = (_STREAMS.get(base) or _stream_types(base))[6](body)
    pre = _PRE_READ.get((base, is_async), _END)
    if pre is _END:
        pre = _pre_read(base, is_async)
    if pre is not None:
        response._pre_read = (replay, body)
        response.__class__ = pre
    return body


# (response type, asyncio) -> its _PreRead, or None for a type left as it is
_PRE_READ: dict[tuple[type, bool], type | None] = {}


def _pre_read(base: type, is_async: bool) -> type | None:
    """The ``_PreRead`` subclass of httpx's or httpx2's ``Response`` (``base``), made once;
    None for any other type (a subclass the inner transport made is left as it is)."""
    mod = _library(base)
    if getattr(mod, "Response", None) is not base:
        _PRE_READ[(base, is_async)] = None
        return None
    own: Any = base  # its read() and aread(), called on a response made a base again
    request_error = mod.RequestError

    def take(self: Any) -> Any:
        """The replay and the body read ahead, the response marked as httpx's own read
        marks it (stream consumed, bytes counted, closed: the caller closes the stream
        then, and sets the content); None (nothing done) when another read came first or
        another layer put its own stream in place of the replay (its bytes may differ).
        The response is a ``base`` again: later reads are httpx's own."""
        self.__class__ = base
        d = self.__dict__
        kept = d.pop("_pre_read", None)
        if kept is None or "_content" in d or self.is_stream_consumed or self.is_closed:
            return None
        stream = self.stream  # the replay, bare or inside the client's bound stream
        if stream is not kept[0] and getattr(stream, "_stream", None) is not kept[0]:
            return None
        self.is_stream_consumed = True
        self._num_bytes_downloaded = len(kept[1])
        self.is_closed = True  # the client's bound stream times ``elapsed`` as it closes
        return kept

    def failed(self: Any, e: BaseException) -> None:
        """A close that raised, as httpx's read leaves it: no content, the request named."""
        if isinstance(e, request_error) and e._request is None:
            e.request = self._request

    def reduce(self: Any, protocol: int) -> Any:
        state = self.__getstate__()
        state.pop("_pre_read", None)
        return object.__new__, (base,), state  # the library's own Response

    if is_async:

        class _AsyncPreRead(base):  # type: ignore[misc]
            async def aread(self) -> bytes:
                kept = take(self)
                if kept is None:
                    return await own.aread(self)  # type: ignore[no-any-return]
                try:
                    await self.stream.aclose()
                except BaseException as e:
                    failed(self, e)
                    raise
                self._content = body = kept[1]
                return body  # type: ignore[no-any-return]

            async def aclose(self) -> None:
                """Closed unread (or read as a stream): a ``base`` again, the body let go."""
                self.__class__ = base
                self.__dict__.pop("_pre_read", None)
                await own.aclose(self)

            __reduce_ex__ = reduce  # type: ignore[assignment]

        pre: type = _AsyncPreRead
    else:

        class _PreRead(base):  # type: ignore[misc]
            def read(self) -> bytes:
                kept = take(self)
                if kept is None:
                    return own.read(self)  # type: ignore[no-any-return]
                try:
                    self.stream.close()
                except BaseException as e:
                    failed(self, e)
                    raise
                self._content = body = kept[1]
                return body  # type: ignore[no-any-return]

            def close(self) -> None:
                """Closed unread (or read as a stream): a ``base`` again, the body let go."""
                self.__class__ = base
                self.__dict__.pop("_pre_read", None)
                own.close(self)

            __reduce_ex__ = reduce  # type: ignore[assignment]

        pre = _PreRead
    pre.__name__ = pre.__qualname__ = "Response"
    pre.__doc__ = (
        f"A {base.__module__}.Response whose 2xx JSON body the transport read ahead: "
        "read() takes it as httpx's own read would leave the response (content kept, "
        "stream consumed and closed, elapsed timed by the client); every other way of "
        "reading goes through a replay of it."
    )
    _STREAMS[pre] = _STREAMS.get(base) or _stream_types(base)
    _PRE_READ[(base, is_async)] = pre
    return pre


def read_ahead(
    transport: RateLimitedTransport, call: _Call, response: Any, length: int, http_seconds: float
) -> bytes | None:
    """The body of ``length`` bytes read now, the stream closed and a replay of the body
    put in its place; None for a stream that gives more than ``length`` (the rest is passed
    on after what was read). An error settles the call from what was read, closes the
    stream (once: not again after a close that raised) and is raised."""
    stream = response.stream
    chunks: list[Any] = []
    size = 0
    closing = False  # a close that raises is not run again
    try:
        it = stream.__iter__()
        while (chunk := next(it, _END)) is not _END:
            chunks.append(chunk)
            size += len(chunk) if type(chunk) is bytes else memoryview(chunk).nbytes
            if size > length:
                return _read(response, stream, chunks, it, False)
        body = _read(response, stream, chunks, None, False)
        closing = True
        stream.close()
        return body
    except BaseException:
        try:
            _read_failed(transport, call, response, chunks, http_seconds, False)
        finally:
            if not closing:
                stream.close()
        raise


async def aread_ahead(
    transport: RateLimitedTransport, call: _Call, response: Any, length: int, http_seconds: float
) -> bytes | None:
    """``read_ahead`` for asyncio (a cancel while reading is such an error)."""
    stream = response.stream
    chunks: list[Any] = []
    size = 0
    closing = False
    try:
        it = stream.__aiter__()
        while True:
            try:
                chunk = await it.__anext__()
            except StopAsyncIteration:
                break
            chunks.append(chunk)
            size += len(chunk) if type(chunk) is bytes else memoryview(chunk).nbytes
            if size > length:
                return _read(response, stream, chunks, it, True)
        body = _read(response, stream, chunks, None, True)
        closing = True
        await stream.aclose()
        return body
    except BaseException:
        try:
            _read_failed(transport, call, response, chunks, http_seconds, True)
        finally:
            if not closing:
                await stream.aclose()
        raise
