"""A response sent with a ``Content-Encoding`` (httpx asks for gzip and deflate by
default; CDNs and providers compress JSON and event streams): its usage is read from the
decoded bytes, the bytes passed on stay as they came, and what cannot be decoded (an
encoding not known, corrupt data, a decompression bomb) keeps the estimate charged
(never less), never raises."""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import importlib
import zlib
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
import ratequeue as rq
from ratequeue.httpx import RateLimitedTransport
from ratequeue.httpx._decode import decoder

CHAT = "http://p/v1/chat/completions"
BODY = {"model": "m", "messages": [{"role": "u", "content": "hi"}], "max_tokens": 100}
USAGE = b'"usage":{"prompt_tokens":80,"completion_tokens":3000}'
JSON = b'{"choices":[],' + USAGE + b"}"
SSE = (
    b'data: {"choices":[{"delta":{"content":"x"},"finish_reason":null}]}\n\n'
    b'data: {"choices":[],' + USAGE + b"}\n\ndata: [DONE]\n\n"
)
MODS = ["httpx", "httpx2"]
CTYPE = {"json": "application/json", "sse": "text/event-stream"}


def _deflate(raw: bytes, wbits: int) -> bytes:
    c = zlib.compressobj(wbits=wbits)
    return c.compress(raw) + c.flush()


ENCODINGS: dict[str, Any] = {
    "gzip": gzip.compress,
    "x-gzip": gzip.compress,
    "GZip": gzip.compress,
    "deflate": lambda raw: _deflate(raw, zlib.MAX_WBITS),
    "deflate-raw": lambda raw: _deflate(raw, -zlib.MAX_WBITS),
    "gzip, gzip": lambda raw: gzip.compress(gzip.compress(raw)),
    "deflate, gzip": lambda raw: gzip.compress(_deflate(raw, zlib.MAX_WBITS)),
    "identity": lambda raw: raw,
    "identity, gzip": gzip.compress,
}


def _pieces(data: bytes, size: int) -> list[bytes]:
    return [data[i : i + size] for i in range(0, len(data), size)] or [b""]


def _call(
    modname: str, encoding: str, wire: bytes, kind: str, *, size: int = 7, max_body: int = 8 << 20
) -> tuple[bytes, Any]:
    """One streamed call answered with ``wire`` in ``size``-byte chunks: the bytes the
    consumer read (decoded by httpx) and the call record."""
    mod = importlib.import_module(modname)
    header = "deflate" if encoding == "deflate-raw" else encoding
    hs = {"content-type": CTYPE[kind], "content-encoding": header}

    def answer(r: Any) -> Any:
        return mod.Response(200, headers=hs, content=iter(_pieces(wire, size)))

    lim = rq.Limiter(rq.Rate(10**6, per="minute"), rq.Rate(10**9, per="minute", unit="tokens"))
    client = mod.Client(
        transport=RateLimitedTransport(mod.MockTransport(answer), lim, max_body=max_body)
    )
    with client.stream("POST", CHAT, json=BODY) as r:
        got = r.read()
    return got, r.extensions["ratequeue"]


@pytest.mark.parametrize("modname", MODS)
@pytest.mark.parametrize("kind", ["json", "sse"])
@pytest.mark.parametrize("encoding", sorted(ENCODINGS))
def test_a_compressed_response_settles_with_its_usage(
    modname: str, kind: str, encoding: str
) -> None:
    raw = JSON if kind == "json" else SSE
    wire = ENCODINGS[encoding](raw)
    got, call = _call(modname, encoding, wire, kind)
    # httpx decoded what passed through unchanged (it leaves x-gzip as it came)
    assert got == (wire if encoding == "x-gzip" else raw)
    assert call.charged["tokens"] == 3080


@pytest.mark.parametrize("modname", MODS)
@pytest.mark.parametrize("kind", ["json", "sse"])
def test_async_a_compressed_response_settles_with_its_usage(modname: str, kind: str) -> None:
    mod = importlib.import_module(modname)
    raw = JSON if kind == "json" else SSE
    wire = gzip.compress(raw)
    hs = {"content-type": CTYPE[kind], "content-encoding": "gzip"}

    async def chunks() -> AsyncIterator[bytes]:
        for p in _pieces(wire, 5):
            yield p

    def answer(r: Any) -> Any:
        return mod.Response(200, headers=hs, content=chunks())

    async def main() -> Any:
        lim = rq.Limiter(rq.Rate(10**6, per="minute"), rq.Rate(10**9, per="minute", unit="tokens"))
        t = RateLimitedTransport(mod.MockTransport(answer), lim)
        async with (
            mod.AsyncClient(transport=t) as client,
            client.stream("POST", CHAT, json=BODY) as r,
        ):
            assert await r.aread() == raw
        return r.extensions["ratequeue"]

    assert asyncio.run(main()).charged["tokens"] == 3080


def _estimate(modname: str, kind: str) -> int:
    """What the call is charged when its body reports no usage."""
    mod = importlib.import_module(modname)
    hs = {"content-type": CTYPE[kind]}
    answer = lambda r: mod.Response(200, headers=hs, content=iter([b"{}"]))  # noqa: E731
    lim = rq.Limiter(rq.Rate(10**6, per="minute"), rq.Rate(10**9, per="minute", unit="tokens"))
    client = mod.Client(transport=RateLimitedTransport(mod.MockTransport(answer), lim))
    with client.stream("POST", CHAT, json=BODY) as r:
        r.read()
    charged: int = r.extensions["ratequeue"].charged["tokens"]
    assert charged >= 100
    return charged


@pytest.mark.parametrize("modname", MODS)
@pytest.mark.parametrize("kind", ["json", "sse"])
@pytest.mark.parametrize(
    ("encoding", "wire"),
    [
        ("gzip", b"not gzip at all"),  # corrupt
        ("gzip", gzip.compress(JSON)[:-30]),  # cut short (JSON: the reader never sees all)
        ("deflate", b"\xff\xfe\xfd garbage"),
        ("compress", b"whatever"),  # an encoding nobody decodes here
        ("gzip, foo", b"x"),
    ],
)
def test_a_body_that_cannot_be_decoded_keeps_the_estimate(
    modname: str, kind: str, encoding: str, wire: bytes
) -> None:
    mod = importlib.import_module(modname)
    hs = {"content-type": CTYPE[kind], "content-encoding": encoding}
    answer = lambda r: mod.Response(200, headers=hs, content=iter(_pieces(wire, 4)))  # noqa: E731
    lim = rq.Limiter(rq.Rate(10**6, per="minute"), rq.Rate(10**9, per="minute", unit="tokens"))
    client = mod.Client(transport=RateLimitedTransport(mod.MockTransport(answer), lim))
    # httpx's own decoder may raise for the consumer; the transport never does.
    with client.stream("POST", CHAT, json=BODY) as r, contextlib.suppress(mod.DecodingError):
        r.read()
    call = r.extensions["ratequeue"]
    assert call.settled
    assert call.charged["tokens"] == _estimate(modname, kind)


@pytest.mark.parametrize("kind", ["json", "sse"])
def test_a_decompression_bomb_stops_decoding_and_keeps_the_estimate(kind: str) -> None:
    # 64 MiB of zeros in ~64 KiB of gzip (ratio ~1000): past the bound (JSON: max_body;
    # a stream: 1 MiB + 100 bytes per encoded byte), decoding stops for good.
    raw = (JSON if kind == "json" else SSE) + b"\0" * (64 << 20)
    wire = gzip.compress(raw, compresslevel=9)
    assert len(wire) < 200_000
    hs = {"content-type": CTYPE[kind], "content-encoding": "gzip"}
    mod = importlib.import_module("httpx2")
    fed: list[int] = []

    def chunks() -> Iterator[bytes]:
        for p in _pieces(wire, 4096):
            fed.append(len(p))
            yield p

    answer = lambda r: mod.Response(200, headers=hs, content=chunks())  # noqa: E731
    lim = rq.Limiter(rq.Rate(10**6, per="minute"), rq.Rate(10**9, per="minute", unit="tokens"))
    t = RateLimitedTransport(mod.MockTransport(answer), lim, max_body=1 << 20)
    client = mod.Client(transport=t)
    with client.stream("POST", CHAT, json=BODY) as r:
        for _ in r.iter_raw():  # a proxy passing the bytes on, never decoding them
            pass
    call = r.extensions["ratequeue"]
    assert sum(fed) == len(wire)  # every byte passed on
    if kind == "json":
        assert call.charged["tokens"] == _estimate("httpx2", kind)
    else:  # the usage event came first: read before the bomb
        assert call.charged["tokens"] == 3080


def test_the_decoder_is_bounded_and_sliced() -> None:
    wire = gzip.compress(b"\0" * (8 << 20))
    dec = decoder("gzip", 1 << 20)
    assert dec is not None
    out = list(dec.feed(wire))
    assert all(len(p) <= 1 << 16 for p in out)
    assert sum(map(len, out)) <= 1 << 20 and dec.stopped
    assert list(dec.feed(wire)) == []  # stopped for good
    # The ratio: each encoded byte allows that many decoded ones more.
    dec = decoder("gzip", 0, ratio=2000)
    assert dec is not None
    assert sum(len(p) for c in _pieces(wire, 512) for p in dec.feed(c)) == 8 << 20
    assert not dec.stopped
    assert decoder(None, 10) is None and decoder("identity", 10) is None
    unknown = decoder("br, gzip", 10)  # brotli is not installed with the test extra
    assert unknown is not None
    try:
        import brotli  # type: ignore[import-not-found]  # noqa: F401
    except ImportError:
        assert unknown.stopped and list(unknown.feed(b"x")) == []
