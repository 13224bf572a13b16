"""Clients fit for a limiter, which Redis errors mean an outage, and commands packed in RESP."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final

import redis
import redis.asyncio
import redis.exceptions
from redis.backoff import NoBackoff
from redis.retry import Retry

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

    return redis.asyncio.Redis.from_url(
        url,
        socket_timeout=timeout,
        socket_connect_timeout=timeout,
        retry=AsyncRetry(NoBackoff(), 0),
    )


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
