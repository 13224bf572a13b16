"""Clients fit for a limiter, which Redis errors mean an outage, and commands packed in RESP."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Sequence
from typing import Any, Final

import redis
import redis.asyncio
import redis.exceptions
from redis.backoff import NoBackoff
from redis.retry import Retry

from .._cancel import HAS_TIMEOUT

_DOWN_REPLIES: Final = frozenset(
    {"LOADING", "BUSY", "MASTERDOWN", "READONLY", "CLUSTERDOWN", "TRYAGAIN", "NOREPLICAS"}
)


_DOWN_ERRORS: Final = (
    redis.exceptions.ConnectionError,
    redis.exceptions.TimeoutError,
    OSError,
)


_CONFIG_ERRORS: Final = (
    redis.exceptions.AuthenticationError,
    redis.exceptions.AuthorizationError,
)


def connect(url: str = "redis://127.0.0.1:6379/0", *, timeout: float = 0.1) -> redis.Redis:
    """A client fit for a limiter: socket timeouts of ``timeout`` s and no retries.

    redis-py retries failed commands 3 times with a backoff of up to seconds by
    default; a limiter would rather take its failure path at once (the circuit breaker
    then spares the following calls).
    """
    return redis.Redis.from_url(
        url,
        socket_timeout=timeout,
        socket_connect_timeout=timeout,
        retry=Retry(NoBackoff(), 0),
    )


def connect_async(
    url: str = "redis://127.0.0.1:6379/0", *, timeout: float = 0.1
) -> redis.asyncio.Redis:
    """The asyncio version of :func:`connect`."""
    from redis.asyncio.retry import Retry as AsyncRetry

    client = redis.asyncio.Redis.from_url(
        url,
        socket_timeout=timeout,
        socket_connect_timeout=timeout,
        retry=AsyncRetry(NoBackoff(), 0),
    )
    pool = client.connection_pool
    pool.connection_class = cancel_safe(pool.connection_class)
    return client


class _SendWithoutWaitFor:
    """redis-py sends a command through ``asyncio.wait_for`` when the connection has a
    ``socket_timeout``; on Python 3.10/3.11 that drops a cancel landing as the send
    finishes (``ratequeue._cancel``). This sends under ``asyncio.timeout`` instead, with
    the same bound and error (replies keep redis-py's own read timeout)."""

    socket_timeout: float | None

    async def send_packed_command(
        self, command: bytes | str | Iterable[bytes], check_health: bool = True
    ) -> None:
        bound = self.socket_timeout
        if not bound:
            return await super().send_packed_command(command, check_health)  # type: ignore[misc,no-any-return]
        if not self.is_connected:  # type: ignore[attr-defined]
            await self.connect()  # type: ignore[attr-defined]  # its own timeouts, as before
        self.socket_timeout = None  # one command at a time on a connection
        try:
            async with asyncio.timeout(bound):  # type: ignore[attr-defined,unused-ignore]
                await super().send_packed_command(command, check_health)  # type: ignore[misc]
        except TimeoutError:
            await self.disconnect(nowait=True)  # type: ignore[attr-defined]
            raise redis.exceptions.TimeoutError("Timeout writing to socket") from None
        finally:
            self.socket_timeout = bound


_SAFE: dict[type, type] = {}


def cancel_safe(cls: type) -> type:
    """``cls`` (a ``redis.asyncio`` connection class) sending without ``wait_for``; the
    class itself before Python 3.11.3 (no ``asyncio.timeout`` to send under)."""
    if not HAS_TIMEOUT or issubclass(cls, _SendWithoutWaitFor):
        return cls
    safe = _SAFE.get(cls)
    if safe is None:
        safe = _SAFE[cls] = type(cls.__name__, (_SendWithoutWaitFor, cls), {})
    return safe


def _is_down_reply(e: redis.exceptions.ResponseError) -> bool:
    head = str(e).split(" ", 1)[0].upper()
    return head in _DOWN_REPLIES or isinstance(e, redis.exceptions.ReadOnlyError)


def _arg_bytes(v: Any) -> bytes:
    return v if isinstance(v, bytes) else str(v).encode()


def _bulk(b: bytes) -> bytes:
    return b"$%d\r\n%s\r\n" % (len(b), b)


def _pack(args: Sequence[Any]) -> bytes:
    """A command in RESP, as redis-py would send it."""
    return b"*%d\r\n" % len(args) + b"".join(_bulk(_arg_bytes(a)) for a in args)


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)
