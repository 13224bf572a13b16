"""Rate-limit headers of LLM providers, parsed by pure functions with bounded work.

OpenAI ``x-ratelimit-{limit,remaining,reset}-{requests,tokens}`` (resets as durations:
``1s``, ``6m0s``, ``20ms``), Anthropic
``anthropic-ratelimit-{requests,tokens,input-tokens,output-tokens}-{limit,remaining,reset}``
(RFC 3339 instants), ``retry-after-ms``, ``retry-after`` (seconds or an HTTP date) and the
IETF ``RateLimit`` / ``RateLimit-Policy`` fields (structured: ``"default";q=100;w=60`` and
``"default";r=50;t=30``; the older ``limit=, remaining=, reset=`` and ``RateLimit-Limit``
forms too). A value that is malformed, negative, not finite or longer than
:data:`MAX_VALUE` characters is ignored, never fatal.
"""

from __future__ import annotations

import datetime as _dt
import email.utils
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

__all__ = [
    "MAX_VALUE",
    "Quota",
    "RateLimitHeaders",
    "parse_duration",
    "parse_instant",
    "parse_number",
    "parse_rate_limit_headers",
    "parse_raw_headers",
    "parse_retry_after",
]

#: Longest header value read (characters); longer values are ignored.
MAX_VALUE = 256
#: Most list members read from one IETF field.
_MAX_ITEMS = 16
#: Dimensions a quota can count.
DIMENSIONS = ("requests", "tokens", "input_tokens", "output_tokens")

_DURATION = re.compile(r"(\d{1,15}(?:\.\d{1,15})?)(h|ms|m|s|us|µs|ns)")
_UNIT_SECONDS = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}
_NUMBER = re.compile(r"[+]?\d{1,30}(?:\.\d{1,30})?(?:[eE][+-]?\d{1,3})?")


@dataclass(frozen=True, slots=True)
class Quota:
    """One dimension of a provider's limit; None where the headers did not say."""

    limit: float | None = None
    remaining: float | None = None
    #: Seconds from the response until the quota is restored.
    reset: float | None = None
    #: Seconds the limit counts over (60 for OpenAI and Anthropic, ``w`` for IETF).
    window: float | None = None


@dataclass(frozen=True, slots=True)
class RateLimitHeaders:
    """What a response said about the provider's limits."""

    quotas: dict[str, Quota] = field(default_factory=dict)
    #: Seconds to wait before retrying (``retry-after-ms`` first, then ``retry-after``).
    retry_after: float | None = None

    def wait(self) -> float | None:
        """Seconds the provider asks for: ``retry_after``, else the longest reset of an
        exhausted quota; None when it asked for nothing."""
        if self.retry_after is not None:
            return self.retry_after
        resets = [
            q.reset
            for q in self.quotas.values()
            if q.remaining is not None and q.remaining <= 0 and q.reset is not None
        ]
        return max(resets) if resets else None

    def exhausted(self) -> dict[str, float]:
        """Dimensions with nothing remaining, and the seconds until each resets."""
        return {
            d: q.reset
            for d, q in self.quotas.items()
            if q.remaining is not None and q.remaining <= 0 and q.reset is not None
        }

    def __bool__(self) -> bool:
        return bool(self.quotas) or self.retry_after is not None


def parse_number(text: str) -> float | None:
    """A finite number >= 0 (``"500"``, ``"1.5"``), else None."""
    if len(text) > MAX_VALUE:
        return None
    t = text.strip()
    if not _NUMBER.fullmatch(t):
        return None
    v = float(t)
    return v if math.isfinite(v) else None


def parse_duration(text: str) -> float | None:
    """Seconds from a Go-style duration (``1s``, ``6m0s``, ``20ms``, ``1h2m3.5s``) or a bare
    number of seconds; None when malformed."""
    if len(text) > MAX_VALUE:
        return None
    t = text.strip()
    if not t:
        return None
    n = parse_number(t)
    if n is not None:
        return n
    total = 0.0
    pos = 0
    for m in _DURATION.finditer(t):
        if m.start() != pos:
            return None
        total += float(m.group(1)) * _UNIT_SECONDS[m.group(2)]
        pos = m.end()
    if pos != len(t) or pos == 0:
        return None
    return total if math.isfinite(total) else None


def parse_instant(text: str, now: float) -> float | None:
    """Seconds from ``now`` (Unix time) until an RFC 3339 instant (0.0 if past); None
    when malformed."""
    if len(text) > 64:
        return None
    t = text.strip()
    if len(t) < 10 or not t[:4].isdigit():
        return None
    try:
        when = _dt.datetime.fromisoformat(t.replace("z", "Z"))
    except ValueError:
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=_dt.timezone.utc)
    try:
        return max(0.0, when.timestamp() - now)
    except (OverflowError, OSError, ValueError):
        return None


def parse_retry_after(text: str, now: float) -> float | None:
    """Seconds from a ``Retry-After`` value: delay seconds or an HTTP date (0.0 if past);
    None when malformed."""
    if len(text) > MAX_VALUE:
        return None
    n = parse_number(text)
    if n is not None:
        return n
    t = text.strip()
    if not t or t[0].isdigit():
        return None
    try:
        when = email.utils.parsedate_to_datetime(t)
    except (TypeError, ValueError, IndexError, OverflowError):
        return None
    if when is None:
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=_dt.timezone.utc)
    try:
        return max(0.0, when.timestamp() - now)
    except (OverflowError, OSError, ValueError):
        return None


# -- IETF structured fields -------------------------------------------------------------


def _sf_items(text: str) -> list[tuple[str, dict[str, str]]]:
    """Members of a structured-field list (``"name";k=v;k2=v2, ...``), at most
    ``_MAX_ITEMS``; a member that does not parse is skipped."""
    out: list[tuple[str, dict[str, str]]] = []
    for member in text.split(",", _MAX_ITEMS)[:_MAX_ITEMS]:
        parts = member.strip().split(";", 8)
        name = parts[0].strip()
        if len(name) >= 2 and name[0] == '"' and name[-1] == '"':
            name = name[1:-1]
        params: dict[str, str] = {}
        for p in parts[1:]:
            k, eq, v = p.partition("=")
            if eq:
                v = v.strip()
                if len(v) >= 2 and v[0] == '"' and v[-1] == '"':
                    v = v[1:-1]
                params[k.strip().lower()] = v
        out.append((name, params))
    return out


def _ietf(policy: str | None, current: str | None) -> Quota | None:
    """The quota the IETF fields describe: the policy ``RateLimit`` names (else the
    first), with its remaining and reset."""
    policies: dict[str, dict[str, str]] = {}
    if policy is not None:
        for name, params in _sf_items(policy):
            policies.setdefault(name, params)
    limit = window = remaining = reset = None
    chosen: str | None = None
    if current is not None:
        items = _sf_items(current)
        legacy = dict(
            (k.strip().lower(), v.strip())
            for k, _, v in (m.partition("=") for m in current.split(",", _MAX_ITEMS)[:_MAX_ITEMS])
        )
        if "remaining" in legacy or "limit" in legacy:  # draft <= 06: limit=, remaining=, reset=
            limit = parse_number(legacy.get("limit", ""))
            remaining = parse_number(legacy.get("remaining", ""))
            reset = parse_number(legacy.get("reset", ""))
        elif items:
            chosen, params = items[0]
            remaining = parse_number(params.get("r", ""))
            reset = parse_number(params.get("t", ""))
    if policies:
        params = policies.get(chosen or "") or next(iter(policies.values()))
        limit = parse_number(params.get("q", "")) if limit is None else limit
        window = parse_number(params.get("w", ""))
        if window is not None and window <= 0:
            window = None
    if limit is remaining is reset is None:
        return None
    return Quota(limit=limit, remaining=remaining, reset=reset, window=window)


# -- all of them -------------------------------------------------------------------------

_PREFIXES = (b"x-ratelimit-", b"anthropic-ratelimit-", b"retry-after", b"ratelimit")
_NOTHING = RateLimitHeaders()


def parse_raw_headers(
    raw: Iterable[tuple[bytes, bytes]], *, now: float | None = None
) -> RateLimitHeaders:
    """:func:`parse_rate_limit_headers` over raw byte pairs (httpx ``Headers.raw``),
    decoding only the rate-limit fields."""
    items = [
        (lk.decode("latin-1"), v.decode("latin-1"))
        for k, v in raw
        if (lk := k.lower()).startswith(_PREFIXES)
    ]
    return parse_rate_limit_headers(items, now=now) if items else _NOTHING


_OPENAI = "x-ratelimit-"
_ANTHROPIC = "anthropic-ratelimit-"


def parse_rate_limit_headers(
    headers: Mapping[str, str] | Iterable[tuple[str, str]], *, now: float | None = None
) -> RateLimitHeaders:
    """Every rate-limit header of a response, in one pass; malformed values ignored.

    ``headers`` is a mapping (an httpx ``Headers`` too) or ``(name, value)`` pairs;
    ``now`` (Unix time, default the wall clock) anchors RFC 3339 and HTTP dates.
    """
    if now is None:
        now = _dt.datetime.now(_dt.timezone.utc).timestamp()
    items = headers.items() if isinstance(headers, Mapping) else headers
    fields: dict[str, dict[str, float]] = {}
    retry_ms = retry_s = None
    policy = current = None
    ietf_limit: dict[str, float] = {}
    for name, value in items:
        key = name.lower()
        if key.startswith(_OPENAI):
            # x-ratelimit-{limit,remaining,reset}-{requests,tokens}
            kind, _, dim = key[len(_OPENAI) :].partition("-")
            dim = dim.replace("-", "_")
            if dim not in DIMENSIONS:
                continue
            v = parse_duration(value) if kind == "reset" else parse_number(value)
            if kind in ("limit", "remaining", "reset") and v is not None:
                fields.setdefault(dim, {"window": 60.0})[kind] = v
        elif key.startswith(_ANTHROPIC):
            # anthropic-ratelimit-{requests,tokens,input-tokens,output-tokens}-{limit,...}
            dim, _, kind = key[len(_ANTHROPIC) :].rpartition("-")
            dim = dim.replace("-", "_")
            if dim not in DIMENSIONS:
                continue
            v = parse_instant(value, now) if kind == "reset" else parse_number(value)
            if kind in ("limit", "remaining", "reset") and v is not None:
                fields.setdefault(dim, {"window": 60.0})[kind] = v
        elif key == "retry-after-ms":
            ms = parse_number(value)
            retry_ms = None if ms is None else ms / 1000.0
        elif key == "retry-after":
            retry_s = parse_retry_after(value, now)
        elif key == "ratelimit-policy":
            policy = value if len(value) <= 4 * MAX_VALUE else None
        elif key == "ratelimit":
            current = value if len(value) <= 4 * MAX_VALUE else None
        elif key in ("ratelimit-limit", "ratelimit-remaining", "ratelimit-reset"):
            v = parse_number(value)
            if v is not None:
                ietf_limit[key[len("ratelimit-") :]] = v
    quotas = {
        d: Quota(f.get("limit"), f.get("remaining"), f.get("reset"), f.get("window"))
        for d, f in fields.items()
    }
    if "requests" not in quotas:
        q = _ietf(policy, current)
        if q is None and ietf_limit:
            q = Quota(ietf_limit.get("limit"), ietf_limit.get("remaining"), ietf_limit.get("reset"))
        if q is not None:
            quotas["requests"] = q
    return RateLimitHeaders(quotas, retry_ms if retry_ms is not None else retry_s)
