"""A response's ``Content-Encoding`` undone for the usage reader only: the bytes passed on
to the consumer stay as they came (httpx decodes its own copy).

Decoded output comes in slices of at most 64 KiB (zlib's ``max_length``) and stops for
good past a bound: ``limit`` bytes, plus ``ratio`` times the encoded bytes fed (a
decompression bomb costs at most that). The reader then sees no usage and the estimate
stays charged, never less. Encodings decoded: ``gzip``/``x-gzip`` and ``deflate`` (zlib or raw,
as httpx accepts), ``br`` when ``brotli`` or ``brotlicffi`` is installed, ``zstd`` when
``zstandard`` is — the ones httpx itself asks for and decodes. Any other (or a body that
is not what its header says) stops decoding the same way."""

from __future__ import annotations

import zlib
from collections.abc import Iterator
from typing import Any

_STEP = 1 << 16


class _Stop(Exception):
    """The body cannot be decoded (unknown encoding, corrupt data, past the bound)."""


class _Zlib:
    __slots__ = ("_d", "_deflate")

    def __init__(self, gzip: bool) -> None:
        # gzip: the gzip wrapper only; deflate: zlib's wrapper, or raw deflate if the
        # first bytes say so (servers send both under "deflate", and httpx takes both).
        self._deflate = not gzip
        self._d = zlib.decompressobj(zlib.MAX_WBITS | 16 if gzip else zlib.MAX_WBITS)

    def decode(self, data: bytes) -> Iterator[bytes]:
        d = self._d
        while data and not d.eof:
            try:
                out = d.decompress(data, _STEP)
            except zlib.error:
                if not self._deflate:
                    raise _Stop from None
                self._deflate = False
                self._d = d = zlib.decompressobj(-zlib.MAX_WBITS)
                continue
            self._deflate = False
            data = d.unconsumed_tail
            if out:
                yield out
            elif data:  # no progress with input left: cannot happen with max_length > 0
                raise _Stop


class _Whole:
    """A decoder without an output bound per call (brotli, zstandard): one chunk in,
    its output out, as httpx's own decoder does for the consumer."""

    __slots__ = ("_process",)

    def __init__(self, process: Any) -> None:
        self._process = process

    def decode(self, data: bytes) -> Iterator[bytes]:
        try:
            out = self._process(data)
        except Exception:  # each library has its own error type
            raise _Stop from None
        if out:
            yield out


def _brotli() -> _Whole | None:
    try:
        import brotli  # type: ignore[import-not-found]
    except ImportError:
        try:
            import brotlicffi as brotli  # type: ignore[import-not-found]
        except ImportError:
            return None
    d = brotli.Decompressor()
    return _Whole(getattr(d, "process", None) or d.decompress)


def _zstd() -> _Whole | None:
    try:
        import zstandard  # type: ignore[import-not-found]
    except ImportError:
        return None
    return _Whole(zstandard.ZstdDecompressor().decompressobj().decompress)


def _stage(token: str) -> Any:
    if token in ("gzip", "x-gzip"):
        return _Zlib(gzip=True)
    if token == "deflate":
        return _Zlib(gzip=False)
    if token == "br":
        return _brotli()
    if token == "zstd":
        return _zstd()
    return None


class Decoder:
    """Undoes ``Content-Encoding`` chunk by chunk, at most ``limit`` decoded bytes plus
    ``ratio`` per encoded byte in all; ``feed`` yields decoded slices, then nothing once
    ``stopped``."""

    __slots__ = ("_left", "_ratio", "_stages", "stopped")

    def __init__(self, stages: list[Any], limit: int, ratio: int) -> None:
        self._stages = stages
        self._left = limit
        self._ratio = ratio
        self.stopped = False

    def feed(self, chunk: bytes) -> Iterator[bytes]:
        if self.stopped:
            return
        self._left += self._ratio * len(chunk)
        slices: Iterator[bytes] = iter((chunk,))
        for stage in self._stages:
            slices = _through(stage, slices)
        try:
            for piece in slices:
                self._left -= len(piece)
                if self._left < 0:
                    raise _Stop
                yield piece
        except _Stop:
            self.stopped = True


def _through(stage: Any, slices: Iterator[bytes]) -> Iterator[bytes]:
    for s in slices:
        yield from stage.decode(s)


def decoder(encoding: str | None, limit: int, ratio: int = 0) -> Decoder | None:
    """The decoder for a ``Content-Encoding`` value (None: nothing to undo); a decoder
    already stopped when an encoding is not one this module decodes."""
    if not encoding:
        return None
    # Encodings are listed in the order applied: undo the last one first.
    tokens = [t.strip().lower() for t in encoding.split(",")]
    tokens = [t for t in tokens if t and t != "identity"]
    if not tokens:
        return None
    stages = [_stage(t) for t in reversed(tokens)]
    dec = Decoder([s for s in stages if s is not None], limit, ratio)
    dec.stopped = None in stages or len(stages) > 4
    return dec
