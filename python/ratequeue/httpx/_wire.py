"""What the transport reads and writes on the wire: header scans, request ids, retry
hints, URLs of a Pool's providers, and errors made to pass through the anthropic SDK."""

from __future__ import annotations

import contextlib
import itertools
import os
import sys
import uuid
from typing import Any

from .._errors import RateQueueError
from ._headers import RateLimitHeaders

_NO_LIMITS = RateLimitHeaders()
# First bytes of the header names a scan looks at (x-ratequeue-*, idempotency-key,
# content-length; content-type, x-ratelimit-*, anthropic-ratelimit-*, ratelimit*).
_REQUEST_FIRST = frozenset(b"xXiIcC")
_RESPONSE_FIRST = frozenset(b"cCxXaArR")
_REMAINING = (b"x-ratelimit-remaining-", b"anthropic-ratelimit-", b"ratelimit")


def scan_response(raw: list[tuple[bytes, bytes]]) -> tuple[bytes, bool]:
    """The content type, and whether a rate-limit header may say a quota is exhausted
    (a cheap scan of the raw pairs; the full parse decides)."""
    ctype = b""
    exhausted = False
    for k, v in raw:
        if k[0] not in _RESPONSE_FIRST:
            continue
        lk = k.lower()
        if lk == b"content-type":
            ctype = v
        elif not exhausted and lk.startswith(_REMAINING) and (b"remaining" in lk or b"=0" in v):
            s = v.strip()
            exhausted = lk.startswith(b"ratelimit") or s == b"0" or s.startswith((b"0.", b"-"))
    return ctype, exhausted


_ID_PREFIX = uuid.uuid4().hex[:12]
_IDS = itertools.count(1)


def new_id() -> str:
    """A request id unique across processes (a random prefix per start, the pid for
    forks, a counter)."""
    return f"rq-{_ID_PREFIX}-{os.getpid()}-{next(_IDS)}"


_SDK_ERRORS: dict[type, type] = {}


def for_sdk(err: RateQueueError, request: Any) -> None:
    """Let a refusal pass through the anthropic SDK as itself, not retried.

    That SDK wraps any other exception of its transport in a retried
    ``APIConnectionError``; a ratequeue error raised for its requests is made an
    instance of a subclass that is also ``anthropic.AnthropicError``, which it re-raises
    as is (``except rq.Overloaded`` / ``BudgetExceeded`` still catch it).
    """
    mod = sys.modules.get("anthropic")
    base = getattr(mod, "AnthropicError", None) if mod is not None else None
    if not isinstance(base, type) or not request.headers.get("user-agent", "").startswith(
        "Anthropic/"
    ):
        return
    cls = type(err)
    if issubclass(cls, base):
        return
    sub = _SDK_ERRORS.get(cls)
    if sub is None:
        sub = type(
            cls.__name__, (cls, base), {"__module__": cls.__module__, "__doc__": cls.__doc__}
        )
        _SDK_ERRORS[cls] = sub
    with contextlib.suppress(TypeError):  # a layout that cannot change class stays
        err.__class__ = sub


def split_base(base: str, url: Any) -> dict[str, Any]:
    """``copy_with`` arguments that move ``url`` to the scheme, host, port and path
    prefix of ``base``."""
    u = type(url)(base)
    prefix = u.path.rstrip("/")
    return {
        "scheme": u.scheme,
        "host": u.host,
        "port": u.port,
        "path": prefix + url.path if prefix else url.path,
    }


def hint_retry(headers: Any) -> None:
    """Tell the SDK to retry at once: its retry then waits in ratequeue's queue, which
    holds it until the provider's reset (the original values are kept aside)."""
    for h in ("retry-after", "retry-after-ms"):
        v = headers.get(h)
        if v is not None:
            headers[f"x-ratequeue-original-{h}"] = v
    headers["retry-after-ms"] = "1"
    if "retry-after" in headers:
        del headers["retry-after"]
    headers["x-should-retry"] = "true"
