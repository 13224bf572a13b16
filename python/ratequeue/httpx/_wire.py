"""What the transport reads and writes on the wire: header scans, request ids, retry
hints, URLs of a Pool's providers, and errors made to pass through the anthropic SDK."""

from __future__ import annotations

import contextlib
import os
import sys
import uuid
from typing import Any

from .._errors import RateQueueError
from .._ratequeue import _next_id, _scan_response
from ._headers import RateLimitHeaders

_NO_LIMITS = RateLimitHeaders()
# First bytes of the response header names that may say a quota is exhausted
# (x-ratelimit-remaining-*, anthropic-ratelimit-*, ratelimit*), and their prefixes.
_RESPONSE_FIRST = frozenset(b"xar")
_REMAINING = (b"x-ratelimit-remaining-", b"anthropic-ratelimit-", b"ratelimit")
# Response header names by what the scan does with them: 0 the content type; 1 nothing
# (not a rate-limit field, or one that cannot say a quota is exhausted: limits and
# resets, read only by the full parse); 2 a remaining count (0 or less: exhausted);
# 3 an IETF field (any "=0" may say so); 4 the IETF draft's remaining count (the full
# parse decides). Names seen are added, up to _KNOWN_MAX.
_KNOWN: dict[bytes, int] = {b"content-type": 0, b"ratelimit-policy": 1}
_KNOWN_MAX = 512
for _part in ("limit", "reset"):
    for _dim in ("requests", "tokens"):
        _KNOWN[f"x-ratelimit-{_part}-{_dim}".encode()] = 1
    for _dim in ("requests", "tokens", "input-tokens", "output-tokens"):
        _KNOWN[f"anthropic-ratelimit-{_dim}-{_part}".encode()] = 1
del _part, _dim


def _kind(lk: bytes) -> int:
    """What the scan does with a header of this lower-case name (see ``_KNOWN``)."""
    kind = _KNOWN.get(lk)
    if kind is None:
        if not lk or lk[0] not in _RESPONSE_FIRST or not lk.startswith(_REMAINING):
            kind = 1
        elif lk.startswith(b"ratelimit"):
            kind = 4 if b"remaining" in lk else 3
        else:
            kind = 2 if b"remaining" in lk else 1
        if len(_KNOWN) < _KNOWN_MAX:  # names come from the network: the table stays bounded
            _KNOWN[lk] = kind
    return kind


# Header classes whose private ``_list`` holds (name, lower-case name, value).
_TRIPLES: set[type] = set()
_NOT_TRIPLES: set[type] = set()


def _keeps_triples(cls: type) -> bool:
    try:
        h = cls([("X-A", "b")])
    except Exception:
        return False
    return getattr(h, "_list", None) == [(b"X-A", b"x-a", b"b")]


def header_list(headers: Any) -> list[tuple[bytes, bytes, bytes]]:
    """``(name, lower-case name, value)`` of every header: httpx's and httpx2's own list
    (no copy), or one built from ``raw`` for any other headers type."""
    cls = type(headers)
    if cls in _TRIPLES:
        lst: list[tuple[bytes, bytes, bytes]] = headers._list
        return lst
    if cls not in _NOT_TRIPLES:
        (_TRIPLES if _keeps_triples(cls) else _NOT_TRIPLES).add(cls)
        return header_list(headers)
    return [(k, k.lower(), v) for k, v in headers.raw]


def scan_response(
    headers: list[tuple[bytes, bytes, bytes]], known: dict[bytes, int] | None = None
) -> tuple[bytes, bool]:
    """The content type, and whether a rate-limit header may say a quota is exhausted
    (a cheap scan of the pairs, by the kinds of their names in ``known``; the full
    parse decides)."""
    if known is None:
        if type(headers) is list:
            found = _scan_response(headers)  # the same rules, natively
            if found is not None:
                return found
        known = _KNOWN
    ctype = b""
    exhausted = False
    try:
        for _, lk, v in headers:
            kind = known[lk]  # a name not seen yet raises: classified below, then again
            if kind == 1:
                continue
            if kind == 0:
                ctype = v
            elif not exhausted:
                if kind == 3:
                    exhausted = b"=0" in v
                elif kind == 4:
                    exhausted = True
                else:
                    s = v.strip()
                    exhausted = s == b"0" or s.startswith((b"0.", b"-"))
    except KeyError:
        # Names not classified yet: into the table while it has room; once it is full,
        # the kinds of these headers' names, every time.
        return scan_response(headers, {lk: _kind(lk) for _, lk, _ in headers})
    return ctype, exhausted


_ID_PREFIX = uuid.uuid4().hex[:12]
_PREFIX = f"rq-{_ID_PREFIX}-{os.getpid()}-"


def _forked() -> None:
    global _PREFIX
    _PREFIX = f"rq-{_ID_PREFIX}-{os.getpid()}-"


os.register_at_fork(after_in_child=_forked)


def new_id() -> str:
    """A request id unique across processes (a random prefix per start, the pid for
    forks, a counter)."""
    return _next_id(_PREFIX)  # the counter is shared with the native prepare


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
