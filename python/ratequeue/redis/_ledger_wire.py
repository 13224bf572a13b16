"""The Redis ledger's own connection per thread for its scripts: redis-py opens it (the
handshake: AUTH, SELECT, HELLO, client name, TLS), then the ledger writes pre-packed
commands to its socket and reads the replies itself, below redis-py's command machinery
(no pool get/release, no per-call health check, no parser objects per reply)."""

from __future__ import annotations

import socket
from typing import Any

import redis
import redis.exceptions
from redis._parsers.base import BaseParser

_CRLF = b"\r\n"
_RECV = 65536


def _error(text: str) -> Exception:
    """An error reply as redis-py's exception for it (``NoScriptError``...)."""
    return BaseParser.parse_error(text)  # type: ignore[no-untyped-call,no-any-return]


class _More(Exception):
    """The buffer ends inside a reply: read more."""


def _parse(buf: bytes, pos: int, decode: Any) -> tuple[Any, int]:
    """One RESP2/RESP3 reply at ``pos``: (value, position after it); an error reply is
    returned as its exception (raised by the caller at the top level, as redis-py does)."""
    nl = buf.find(_CRLF, pos)
    if nl < 0:
        raise _More
    t = buf[pos]
    if t == 58:  # ':' integer
        return int(buf[pos + 1 : nl]), nl + 2
    if t == 36 or t == 61 or t == 33:  # '$' bulk, '=' verbatim, '!' blob error
        n = int(buf[pos + 1 : nl])
        if n < 0:
            return None, nl + 2
        end = nl + 2 + n
        if len(buf) < end + 2:
            raise _More
        v = buf[nl + 2 : end]
        if t == 33:
            return _error(v.decode("utf-8", "replace")), end + 2
        if t == 61:
            v = v[4:]  # "txt:" or "mkd:"
        return (v.decode(decode.encoding, decode.encoding_errors) if decode else v), end + 2
    if t == 42 or t == 126 or t == 62:  # '*' array, '~' set, '>' push
        n = int(buf[pos + 1 : nl])
        if n < 0:
            return None, nl + 2
        pos = nl + 2
        out = []
        for _ in range(n):
            v, pos = _parse(buf, pos, decode)
            out.append(v)
        return out, pos
    if t == 37:  # '%' map
        n = int(buf[pos + 1 : nl])
        pos = nl + 2
        d: dict[Any, Any] = {}
        for _ in range(n):
            k, pos = _parse(buf, pos, decode)
            d[k], pos = _parse(buf, pos, decode)
        return d, pos
    line = buf[pos + 1 : nl]
    if t == 43:  # '+' status
        return (line.decode(decode.encoding, decode.encoding_errors) if decode else line), nl + 2
    if t == 45:  # '-' error
        return _error(line.decode("utf-8", "replace")), nl + 2
    if t == 95:  # '_' null
        return None, nl + 2
    if t == 35:  # '#' boolean
        return line == b"t", nl + 2
    if t == 44:  # ',' double
        return float(line), nl + 2
    if t == 40:  # '(' big number
        return int(line), nl + 2
    raise redis.exceptions.InvalidResponse(f"protocol error: {bytes(buf[pos:nl])!r}")


class _Wire:
    """One connection of one thread, for the ledger's script calls: ``call`` sends a
    packed command and returns its reply (an error reply raised); ``call_many`` sends
    several and returns each one's reply or error. A broken connection is closed and
    opened again on the next call; one that had served calls and breaks (e.g. the server
    restarted since) is retried as the client's ``Retry`` says (the ledger's scripts are
    idempotent per request id)."""

    __slots__ = ("__weakref__", "buf", "conn", "decode", "served", "sock")

    def __init__(self, pool: Any) -> None:
        self.conn = pool.connection_class(**pool.connection_kwargs)
        enc = getattr(self.conn, "encoder", None)
        self.decode = enc if enc is not None and enc.decode_responses else None
        self.sock: Any = None
        self.buf = b""
        self.served = False

    def _open(self) -> Any:
        conn = self.conn
        conn.connect()
        self.sock = conn._sock
        self.buf = b""
        return self.sock

    def close(self) -> None:
        """Closes the socket (shut down only in the process that opened it)."""
        self.sock = None
        self.buf = b""
        self.served = False
        self.conn.disconnect()

    def call(self, packed: bytes) -> Any:
        """The reply to one packed command."""
        served = self.served
        try:
            return self._call(packed)
        except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError):
            retry = getattr(self.conn, "retry", None)
            if not served or retry is None or retry.get_retries() < 1:
                raise
            return retry.call_with_retry(lambda: self._call(packed), lambda _e: None)

    def _call(self, packed: bytes) -> Any:
        sock = self.sock or self._open()
        try:
            sock.sendall(packed)
            data = sock.recv(_RECV)
            if not data:
                raise ConnectionResetError("closed by the server")
            # the common reply, an integer in one segment
            if data[0] == 58 and data.find(_CRLF) == len(data) - 2 and not self.buf:
                self.served = True
                return int(data[1:-2])
            v = self._read(data)
        except BaseException as e:
            self._broken(e)
            raise AssertionError("unreachable") from None  # pragma: no cover
        self.served = True
        if isinstance(v, redis.exceptions.ResponseError):
            raise v
        return v

    def call_many(self, packed: bytes, n: int) -> list[Any]:
        """Each of ``n`` packed commands' reply, or its error (an exception object); after
        a connection error every reply not read yet is that error."""
        out: list[Any] = []
        try:
            sock = self.sock or self._open()
            sock.sendall(packed)
            data = b""
            for _ in range(n):
                out.append(self._read(data))
                data = b""
        except Exception as e:
            try:
                self._broken(e)
            except Exception as err:
                out += [err] * (n - len(out))
            return out
        except BaseException as e:
            self._broken(e)
        self.served = True
        return out

    def _read(self, data: bytes) -> Any:
        """One reply, from ``data`` just read plus what the buffer holds."""
        buf = self.buf + data if self.buf else data
        while True:
            if buf:
                try:
                    v, pos = _parse(buf, 0, self.decode)
                except _More:
                    pass
                else:
                    push = buf[0] == 62  # '>' a push message (RESP3): not a reply
                    self.buf = buf = buf[pos:]
                    if not push:
                        return v
                    continue
            more = self.sock.recv(_RECV)
            if not more:
                raise ConnectionResetError("closed by the server")
            buf += more

    def _broken(self, e: BaseException) -> None:
        """Closes the connection (the stream's state is unknown) and raises ``e`` as
        redis-py names it."""
        self.close()
        if isinstance(e, socket.timeout):
            raise redis.exceptions.TimeoutError(f"Timeout reading from Redis: {e}") from e
        if isinstance(e, OSError):
            raise redis.exceptions.ConnectionError(f"Error with Redis: {e}") from e
        raise e
