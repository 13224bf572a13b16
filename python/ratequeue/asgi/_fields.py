"""The RateLimit-Policy and RateLimit fields (draft-ietf-httpapi-ratelimit-headers-11) as
valid Structured Fields, and the quota-exceeded problem body."""

from __future__ import annotations

import base64
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .._ratequeue import Concurrency, KeyedConcurrency, KeyedLimiter, Limiter

__all__ = ["PROBLEM_TYPE", "QUOTA_UNITS", "LevelView", "Quota"]

#: The problem type of a refusal (draft section "Quota Exceeded").
PROBLEM_TYPE = "https://iana.org/assignments/http-problem-types#quota-exceeded"
PROBLEM_TITLE = "Request cannot be satisfied as assigned quota has been exceeded"
#: Quota units registered by the draft; a limiter unit of another name is advertised as is.
QUOTA_UNITS = ("requests", "content-bytes", "concurrent-requests")
#: Limiter units (identifiers) advertised as a registered quota unit.
UNIT_QU = {"bytes": "content-bytes", "content_bytes": "content-bytes"}
#: Structured Field Integers have at most 15 digits.
SF_INT_MAX = 999_999_999_999_999

Level = Limiter | KeyedLimiter | Concurrency | KeyedConcurrency


def sf_string(s: str) -> str:
    """An sf-string; ValueError for characters outside printable ASCII."""
    if not all(" " <= c <= "~" for c in s):
        raise ValueError(f"{s!r} must be printable ASCII to be sent in a Structured Field")
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'


def sf_int(n: float) -> int:
    """A non-negative sf-integer (clamped to 15 digits)."""
    if n != n or n <= 0:
        return 0
    return int(min(n, SF_INT_MAX))


def sf_bytes(b: bytes) -> str:
    return ":" + base64.b64encode(b).decode("ascii") + ":"


def ceil_seconds(s: float) -> int:
    """Whole seconds, rounded up (delay-seconds), clamped to an sf-integer."""
    if s != s or s <= 0:
        return 0
    if math.isinf(s):
        return SF_INT_MAX
    return sf_int(math.ceil(s - 1e-9))


@dataclass(frozen=True)
class Quota:
    """One advertised quota policy: a rate of a level, or a concurrency limit."""

    name: str
    unit: str  # the limiter's unit, or "concurrent-requests"
    qu: str  # the unit advertised
    q: int
    w: int | None
    burst: int | None
    per_second: float
    index: int  # rate index in its limiter (0 for concurrency)
    item: str = field(default="", init=False, repr=False, compare=False)  # sf-string name

    def __post_init__(self) -> None:
        object.__setattr__(self, "item", sf_string(self.name))
        sf_string(self.qu)

    def policy_item(self, pk: str | None) -> str:
        """This quota as a RateLimit-Policy item (valid Structured Field syntax)."""
        parts = [self.item, f"q={self.q}"]
        if self.qu != "requests":
            parts.append(f"qu={sf_string(self.qu)}")
        if self.w is not None:
            parts.append(f"w={self.w}")
        if pk is not None:
            parts.append(f"pk={pk}")
        return ";".join(parts)


def _window(amount: float, per: float) -> tuple[int, int]:
    """(q, w): a whole-second window and the whole quota it allows, q >= 1."""
    w = max(1, round(per))
    q = math.floor(amount * w / per + 1e-9)
    if q < 1:
        w = max(w, math.ceil(per / amount - 1e-9))
        q = max(1, math.floor(amount * w / per + 1e-9))
    return sf_int(q), sf_int(w)


class LevelView:
    """How one level of a policy is advertised and read per request."""

    def __init__(self, name: str, level: Level) -> None:
        sf_string(name)
        self.name = name
        self.level = level
        self.keyed = isinstance(level, (KeyedLimiter, KeyedConcurrency))
        self.concurrency = isinstance(level, (Concurrency, KeyedConcurrency))
        quotas: list[Quota] = []
        if isinstance(level, (Concurrency, KeyedConcurrency)):
            quotas.append(
                Quota(
                    name,
                    "concurrent-requests",
                    "concurrent-requests",
                    sf_int(level.limit),
                    None,
                    None,
                    0.0,
                    0,
                )
            )
        else:
            rates = [level.rate] if isinstance(level, KeyedLimiter) else level.rates
            seen: set[str] = set()
            for i, rate in enumerate(rates):
                if rate.unit in seen:
                    # available() reads a unit's first rate: a second rate in the same unit
                    # cannot be reported truthfully, so it is not advertised.
                    continue
                seen.add(rate.unit)
                qname = name if len(rates) == 1 or i == 0 else f"{name}-{rate.unit}"
                q, w = _window(rate.amount, rate.per)
                qu = UNIT_QU.get(rate.unit, rate.unit)
                quotas.append(Quota(qname, rate.unit, qu, q, w, rate.burst, rate.per_second, i))
        self.quotas = quotas
        # 0: Limiter, 1: KeyedLimiter, 2: Concurrency, 3: KeyedConcurrency
        self.kind = [Limiter, KeyedLimiter, Concurrency, KeyedConcurrency].index(type(level))

    def units(self) -> list[str]:
        """The limiter units this level counts (none for a concurrency limit)."""
        return [q.unit for q in self.quotas if q.unit != "concurrent-requests"]

    def remaining(self, key: Any) -> list[tuple[Quota, int, int | None]]:
        """(quota, r, t) now for this level (and key): r whole units left, t whole seconds
        until one more unit is available (None for a concurrency limit)."""
        lv: Any = self.level
        kind = self.kind
        out: list[tuple[Quota, int, int | None]] = []
        if kind == 2:
            r = 0 if lv.waiting else lv.limit - lv.in_use
            return [(self.quotas[0], sf_int(r), None)]
        if kind == 3:
            return [(self.quotas[0], sf_int(lv.limit - lv.in_use(key)), None)]
        for qu in self.quotas:
            if kind == 1:
                avail = lv.available(key)
                busy = False
            else:
                avail = lv.available(qu.unit)
                busy = lv.waiting > 0
            r = 0 if busy else sf_int(math.floor(avail + 1e-9))
            burst = qu.burst or 1
            if busy:
                t = ceil_seconds(self._retry_after(key, qu))
            elif avail >= burst - 1e-9:
                t = 0
            else:
                need = (1.0 - avail) if avail < 1 else (math.floor(avail + 1e-9) + 1 - avail)
                t = ceil_seconds(need / qu.per_second) if qu.per_second > 0 else 0
            out.append((qu, r, t))
        return out

    def _retry_after(self, key: Any, qu: Quota) -> float:
        lv = self.level
        if isinstance(lv, KeyedLimiter):
            return lv.retry_after(key, 1)
        if isinstance(lv, Limiter):
            return lv.retry_after(**{qu.unit: 1})
        return 0.0

    def violated(self, key: Any, costs: dict[str, int], n: int = 1) -> list[str]:
        """The quota names this level would refuse a request of ``costs`` on, now."""
        lv = self.level
        if isinstance(lv, Concurrency):
            return [self.name] if lv.waiting or lv.in_use + n > lv.limit else []
        if isinstance(lv, KeyedConcurrency):
            return [self.name] if lv.in_use(key) + n > lv.limit else []
        out = []
        for qu in self.quotas:
            cost = costs.get(qu.unit, 1 if qu.unit == "requests" else 0)
            if isinstance(lv, KeyedLimiter):
                short = lv.available(key) < cost
            else:
                short = lv.waiting > 0 or lv.available(qu.unit) < cost
            if short:
                out.append(qu.name)
        return out


def policy_field(views: Sequence[LevelView], pks: dict[str, str]) -> bytes:
    """The RateLimit-Policy value: one item per advertised quota."""
    return ", ".join(qu.policy_item(pks.get(v.name)) for v in views for qu in v.quotas).encode(
        "ascii"
    )


def ratelimit_field(
    rows: Sequence[tuple[Quota, int, int | None]], pks: dict[str, str], level_of: dict[str, str]
) -> bytes:
    """The RateLimit value: ``"name";r=..;t=..`` per quota."""
    items = []
    for qu, r, t in rows:
        item = f"{qu.item};r={r}"
        if t is not None:
            item += f";t={t}"
        pk = pks.get(level_of[qu.name])
        if pk is not None:
            item += f";pk={pk}"
        items.append(item)
    return ", ".join(items).encode("ascii")


def problem_body(status: int, detail: str, violated: Sequence[str]) -> bytes:
    """An application/problem+json body of type quota-exceeded."""
    body: dict[str, Any] = {
        "type": PROBLEM_TYPE,
        "title": PROBLEM_TITLE,
        "status": status,
        "detail": detail,
        "violated-policies": list(violated),
    }
    return json.dumps(body, separators=(",", ":")).encode()
