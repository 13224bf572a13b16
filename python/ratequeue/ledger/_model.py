"""Plans, periods, records and the argument rules shared by every ledger backend."""

from __future__ import annotations

import abc
import calendar
import hashlib
import json
import math
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone, tzinfo
from typing import Any, Protocol, TypeAlias
from zoneinfo import ZoneInfo

#: The units a plan can count: ``tokens`` is input + output tokens.
UNITS: tuple[str, ...] = ("tokens", "input_tokens", "output_tokens", "calls")
MAX_AMOUNT = 2**63 - 1
#: At most this many units of your own per plan and per request.
MAX_UNITS = 16
#: A unit of your own: a lower-case letter, then up to 31 lower-case letters, digits or
#: underscores (stored as a column name part, a Redis field and a record field as is).
_UNIT_NAME = re.compile(r"[a-z][a-z0-9_]{0,31}")
MAX_ID_LEN = 256
MAX_META_BYTES = 4096
DEFAULT_THRESHOLDS: tuple[float, ...] = (0.8, 0.95)
DAY = 86_400.0


class LedgerError(Exception):
    """Base of the ledger's own errors (``QuotaExceeded`` is a ``RateQueueError``)."""


class IdempotencyConflict(LedgerError, ValueError):
    """A request id was used again with a different payload; nothing was charged."""


def conflict(request_id: str) -> IdempotencyConflict:
    """The refusal of a request id used again with another payload or operation."""
    return IdempotencyConflict(
        f"request id {request_id!r} was already used with a different payload or operation"
    )


class UnknownAccount(LedgerError, LookupError):
    """The account has no plan (and the ledger has no ``default_plan``)."""


class UnknownRequest(LedgerError, LookupError):
    """No hold or charge has this request id, and no account was given to charge."""


class _NowFn(Protocol):
    def now(self) -> float: ...


#: A clock: a callable returning seconds since the Unix epoch, or an object with ``now()``
#: (``ratequeue.ManualClock``). Its seconds are read as Unix time for calendar periods.
ClockLike: TypeAlias = Callable[[], float] | _NowFn


def clock_fn(clock: ClockLike | None) -> Callable[[], float]:
    """The clock as a callable of seconds (default: wall clock, ``time.time``)."""
    if clock is None:
        return time.time
    now = getattr(clock, "now", None)
    if callable(now):
        return now  # type: ignore[no-any-return]
    if callable(clock):
        return clock
    raise TypeError(f"clock must be a callable or have now(), got {type(clock).__name__}")


# -- argument rules ----------------------------------------------------------------------


def check_amount(name: str, v: object) -> int:
    """An int from 0 to 2**63-1 (not bool, not float)."""
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"{name} must be an int, got {type(v).__name__}")
    if v < 0:
        raise ValueError(f"{name}={v} must be >= 0")
    if v > MAX_AMOUNT:
        raise ValueError(f"{name}={v} must be <= 2**63-1")
    return int(v)


def check_id(name: str, v: object, *, optional: bool = False) -> str:
    """A non-empty str of at most 256 characters."""
    if type(v) is str and 0 < len(v) <= MAX_ID_LEN and v.isprintable():
        return v
    if v is None and optional:
        return ""
    if not isinstance(v, str):
        raise TypeError(f"{name} must be a str, got {type(v).__name__}")
    if not v or len(v) > MAX_ID_LEN:
        raise ValueError(f"{name} must be 1 to {MAX_ID_LEN} characters, got {len(v)}")
    if not v.isprintable():
        raise ValueError(f"{name}={v!r} must hold no control characters")
    return v


def check_meta(meta: object) -> str:
    """``meta`` as canonical JSON (a dict, at most 4 KiB); ``""`` for None."""
    if meta is None:
        return ""
    if not isinstance(meta, Mapping):
        raise TypeError(f"meta must be a dict, got {type(meta).__name__}")
    try:
        text = json.dumps(dict(meta), sort_keys=True, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as e:
        raise ValueError(f"meta must be JSON-serializable: {e}") from None
    if len(text.encode()) > MAX_META_BYTES:
        raise ValueError(f"meta must be at most {MAX_META_BYTES} bytes of JSON")
    return text


def check_fraction(name: str, v: object) -> float:
    """A finite number >= 0 (not bool)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(v).__name__}")
    f = float(v)
    if not math.isfinite(f) or f < 0:
        raise ValueError(f"{name}={v} must be a finite number >= 0")
    return f


def check_seconds(name: str, v: object, *, low: float = 0.0) -> float:
    """A finite number of seconds > ``low``."""
    f = check_fraction(name, v)
    if f <= low:
        raise ValueError(f"{name}={v} must be > {low:g} seconds")
    return f


def check_thresholds(v: object) -> tuple[int, ...]:
    """Thresholds as fractions in (0, 1] -> sorted distinct basis points."""
    if isinstance(v, (str, bytes)) or not isinstance(v, Sequence):
        raise TypeError(f"thresholds must be a sequence of fractions, got {type(v).__name__}")
    out = set()
    for i, t in enumerate(v):
        f = check_fraction(f"thresholds[{i}]", t)
        if not 0 < f <= 1:
            raise ValueError(f"thresholds[{i}]={t} must be within (0, 1]")
        out.add(round(f * 10_000))
    if len(out) > 16:
        raise ValueError("at most 16 thresholds")
    return tuple(sorted(out))


def check_units(v: object, *, name: str = "units") -> dict[str, int]:
    """Amounts in units of your own (``{"images": 3}``) checked: at most 16 names, each a
    lower-case identifier of at most 32 characters that is not a built-in unit, each
    amount an int from 0 to 2**63-1; sorted by name, zero amounts left out (an absent
    unit and a unit of 0 are the same payload)."""
    if v is None:
        return {}
    if not isinstance(v, Mapping):
        raise TypeError(f"{name} must be a dict of unit name to int, got {type(v).__name__}")
    if len(v) > MAX_UNITS:
        raise ValueError(f"{name} must name at most {MAX_UNITS} units, got {len(v)}")
    out: dict[str, int] = {}
    for u in sorted(v, key=lambda k: k if isinstance(k, str) else ""):
        if type(u) is not str:
            raise TypeError(f"{name} names must be str, got {type(u).__name__}")
        if not _UNIT_NAME.fullmatch(u):
            raise ValueError(
                f"{name} name {u[:40]!r} must be a lower-case letter then up to 31 lower-case "
                "letters, digits or underscores"
            )
        if u in UNITS:
            raise ValueError(f"{u!r} is a built-in unit: pass it as {u}=, not in {name}")
        amount = check_amount(f"{name}[{u!r}]", v[u])
        if amount:
            out[u] = amount
    return out


def custom_units(am: Mapping[str, int]) -> dict[str, int]:
    """The units of your own in an ``amounts`` dict (after the four built-in ones)."""
    if len(am) <= 4:
        return {}
    return {u: v for u, v in am.items() if u not in UNITS}


def amounts(
    input_tokens: int, output_tokens: int, calls: int, units: object = None
) -> dict[str, int]:
    """The amount of each unit of one request (validated): the four built-in units, then
    the nonzero ``units`` of your own sorted by name."""
    if units is not None:
        am = amounts(input_tokens, output_tokens, calls)
        am.update(check_units(units))
        return am
    if (
        type(input_tokens) is int
        and type(output_tokens) is int
        and type(calls) is int
        and input_tokens >= 0
        and output_tokens >= 0
        and 0 <= calls <= MAX_AMOUNT
        and input_tokens + output_tokens <= MAX_AMOUNT
    ):
        return {
            "tokens": input_tokens + output_tokens,
            "input_tokens": input_tokens,
            "output_tokens": output_tokens,
            "calls": calls,
        }
    i = check_amount("input_tokens", input_tokens)
    o = check_amount("output_tokens", output_tokens)
    c = check_amount("calls", calls)
    t = i + o
    if t > MAX_AMOUNT:
        raise ValueError(f"input_tokens + output_tokens = {t} must be <= 2**63-1")
    return {"tokens": t, "input_tokens": i, "output_tokens": o, "calls": c}


def fingerprint(*parts: str | int | dict[str, int] | None) -> str:
    """A short stable digest of a request's payload (idempotency check): the ``repr`` of
    str, int, None and insertion-ordered dicts of them is the same in every process."""
    return hashlib.blake2b(repr(parts).encode(), digest_size=12).hexdigest()


def request_fingerprint(
    kind: str, account: str, am: dict[str, int], model: str | None, parent: str | None, meta: str
) -> str:
    """``fingerprint(kind, account, am, model, parent, meta)`` of a charge or hold, the
    same digest built without ``repr`` of the amounts dict (``amounts``' key order; units
    of your own, sorted, come after the built-in ones, so a request without them has the
    digest it had before they existed)."""
    extra = "" if len(am) == 4 else "".join(f", {u!r}: {v}" for u, v in custom_units(am).items())
    text = (
        f"({kind!r}, {account!r}, {{'tokens': {am['tokens']}, 'input_tokens': "
        f"{am['input_tokens']}, 'output_tokens': {am['output_tokens']}, 'calls': "
        f"{am['calls']}{extra}}}, {model!r}, {parent!r}, {meta!r})"
    )
    return hashlib.blake2b(text.encode(), digest_size=12).hexdigest()


def settle_fingerprint(am: Mapping[str, int], model: str | None) -> str:
    """The digest of a settle's payload (units of your own only when it has some)."""
    cu = custom_units(am)
    i, o, c = am["input_tokens"], am["output_tokens"], am["calls"]
    if cu:
        return fingerprint("settle", i, o, c, model, cu)
    return fingerprint("settle", i, o, c, model)


# -- periods -------------------------------------------------------------------------------


def _zone(tz: str | tzinfo) -> tzinfo:
    if isinstance(tz, tzinfo):
        return tz
    if not isinstance(tz, str):
        raise TypeError(f"tz must be a str or tzinfo, got {type(tz).__name__}")
    return timezone.utc if tz.upper() == "UTC" else ZoneInfo(tz)


def _tzname(tz: tzinfo) -> str:
    return "UTC" if tz is timezone.utc else str(tz)


def _add_months(d: datetime, months: int, day: int) -> datetime:
    m = d.month - 1 + months
    y, m = d.year + m // 12, m % 12 + 1
    last = calendar.monthrange(y, m)[1]
    return d.replace(year=y, month=m, day=min(day, last))


@dataclass(frozen=True)
class Span:
    """One period: its key (unique per account), start and end in Unix seconds."""

    key: str
    start: float
    end: float


class Period(abc.ABC):
    """How a plan's quota renews; ``at(t, anchor)`` is the period holding ``t``."""

    #: Longest length of one period, seconds (retention must be at least this).
    max_length: float = 0.0

    @abc.abstractmethod
    def at(self, t: float, anchor: float | None = None) -> Span:
        """The period holding Unix time ``t`` (``anchor``: the account's, if any)."""

    @abc.abstractmethod
    def to_dict(self) -> dict[str, Any]:
        """A JSON-able description (``Period.from_dict`` reads it back)."""

    @staticmethod
    def from_dict(d: Mapping[str, Any]) -> Period:
        """The period a ``to_dict()`` described."""
        kind = d.get("kind")
        if kind == "monthly":
            return Monthly(tz=d.get("tz", "UTC"), anchored=bool(d.get("anchored")))
        if kind == "daily":
            return Daily(tz=d.get("tz", "UTC"))
        if kind == "every":
            return Every(float(d["seconds"]), origin=float(d.get("origin", 0.0)))
        raise ValueError(f"unknown period kind {kind!r}")


class Monthly(Period):
    """A calendar month in ``tz`` (UTC unless given), or with ``anchored=True`` a month
    from the account's purchase date (its anchor): the 31st renews on the last day of
    shorter months, at the anchor's time of day."""

    max_length = 31 * DAY + 3600.0

    def __init__(self, *, tz: str | tzinfo = "UTC", anchored: bool = False) -> None:
        self.tz = _zone(tz)
        self.anchored = bool(anchored)

    def at(self, t: float, anchor: float | None = None) -> Span:
        now = datetime.fromtimestamp(t, self.tz)
        if not self.anchored or anchor is None:
            start = now.replace(day=1, hour=0, minute=0, second=0, microsecond=0)
            end = _add_months(start, 1, 1)
            return Span(start.strftime("%Y-%m"), _ts(start), _ts(end))
        a = datetime.fromtimestamp(anchor, self.tz)
        n = (now.year - a.year) * 12 + (now.month - a.month)
        start = _add_months(a, n, a.day)
        if _ts(start) > t:
            n -= 1
            start = _add_months(a, n, a.day)
        end = _add_months(a, n + 1, a.day)
        if _ts(end) <= t:  # a DST fold at the boundary
            n += 1
            start, end = end, _add_months(a, n + 1, a.day)
        return Span(start.strftime("%Y-%m-%dT%H:%M:%S"), _ts(start), _ts(end))

    def to_dict(self) -> dict[str, Any]:
        return {"kind": "monthly", "tz": _tzname(self.tz), "anchored": self.anchored}

    def __repr__(self) -> str:
        return f"Monthly(tz={_tzname(self.tz)!r}, anchored={self.anchored})"


def _ts(d: datetime) -> float:
    # Wall-clock arithmetic in a zone: normalise through UTC so DST gaps resolve.
    return d.timestamp()


class Daily(Period):
    """A calendar day in ``tz`` (UTC unless given)."""

    max_length = DAY + 3600.0

    def __init__(self, *, tz: str | tzinfo = "UTC") -> None:
        self.tz = _zone(tz)

    def at(self, t: float, anchor: float | None = None) -> Span:
        now = datetime.fromtimestamp(t, self.tz)
        start = now.replace(hour=0, minute=0, second=0, microsecond=0)
        nxt = start + timedelta(days=1)  # wall-clock arithmetic: the next local midnight
        return Span(start.strftime("%Y-%m-%d"), _ts(start), _ts(nxt))

    def to_dict(self) -> dict[str, Any]:
        return {"kind": "daily", "tz": _tzname(self.tz)}

    def __repr__(self) -> str:
        return f"Daily(tz={_tzname(self.tz)!r})"


class Every(Period):
    """Fixed-length periods of ``seconds`` counted from ``origin`` (Unix seconds), or from
    the account's anchor when it has one."""

    def __init__(self, seconds: float, *, origin: float = 0.0) -> None:
        self.seconds = check_seconds("seconds", seconds)
        if self.seconds < 1:
            raise ValueError(f"seconds={seconds} must be >= 1")
        self.origin = float(check_fraction("origin", origin)) if origin else 0.0
        self.max_length = self.seconds

    def at(self, t: float, anchor: float | None = None) -> Span:
        origin = self.origin if anchor is None else anchor
        n = math.floor((t - origin) / self.seconds)
        start = origin + n * self.seconds
        return Span(f"e{n}", start, start + self.seconds)

    def to_dict(self) -> dict[str, Any]:
        return {"kind": "every", "seconds": self.seconds, "origin": self.origin}

    def __repr__(self) -> str:
        return f"Every({self.seconds:g}, origin={self.origin:g})"


# -- plans and records ---------------------------------------------------------------------


class Plan:
    """A quota per period in one or more units; a charge must fit every unit's quota.

    ``units`` are quotas in units of your own (``{"images": 100}``), counted like the
    built-in ones; a request's units that its account's plan does not name are recorded
    with the request and count against nothing."""

    def __init__(
        self,
        name: str,
        *,
        tokens: int | None = None,
        input_tokens: int | None = None,
        output_tokens: int | None = None,
        calls: int | None = None,
        units: Mapping[str, int] | None = None,
        period: Period | None = None,
        thresholds: Sequence[float] = DEFAULT_THRESHOLDS,
    ) -> None:
        self.name = check_id("name", name)
        given = {
            "tokens": tokens,
            "input_tokens": input_tokens,
            "output_tokens": output_tokens,
            "calls": calls,
        }
        self.quota: dict[str, int] = {
            u: check_amount(u, v) for u, v in given.items() if v is not None
        }
        if units is not None:  # a quota of 0 is a quota here (nothing of that unit)
            if not isinstance(units, Mapping):
                check_units(units)  # the TypeError
            for u in check_units(dict.fromkeys(units, 1)):
                self.quota[u] = check_amount(f"units[{u!r}]", units[u])
        if not self.quota:
            raise ValueError("a plan needs a quota in at least one unit (tokens=, calls=, ...)")
        if period is None:
            period = Monthly()
        if not isinstance(period, Period):
            raise TypeError(f"period must be a Period, got {type(period).__name__}")
        self.period = period
        self.thresholds_bp = check_thresholds(thresholds)

    @property
    def thresholds(self) -> tuple[float, ...]:
        """The warning thresholds as fractions of the quota."""
        return tuple(bp / 10_000 for bp in self.thresholds_bp)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able description (what the backends store)."""
        return {
            "name": self.name,
            "quota": self.quota,
            "period": self.period.to_dict(),
            "thresholds": list(self.thresholds),
        }

    @staticmethod
    def from_dict(d: Mapping[str, Any]) -> Plan:
        """The plan a ``to_dict()`` described."""
        q = d["quota"]
        return Plan(
            d["name"],
            **{u: int(v) for u, v in q.items() if u in UNITS},
            units={u: int(v) for u, v in q.items() if u not in UNITS} or None,
            period=Period.from_dict(d["period"]),
            thresholds=d.get("thresholds", DEFAULT_THRESHOLDS),
        )

    def to_json(self) -> str:
        """``to_dict()`` as canonical JSON."""
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Plan) and self.to_dict() == other.to_dict()

    def __hash__(self) -> int:
        return hash(self.to_json())

    def __repr__(self) -> str:
        q = ", ".join(f"{u}={v}" for u, v in self.quota.items())
        return f"Plan({self.name!r}, {q}, period={self.period!r})"


def threshold_amounts(quota: int, bps: Sequence[int]) -> list[int]:
    """The usage at which each threshold fires: ceil(quota * bp / 10000), at least 1."""
    return [max(1, -((-quota * bp) // 10_000)) for bp in bps]


@dataclass(frozen=True)
class Charge:
    """One request's recorded usage; ``replay`` says it was recorded by an earlier call."""

    request_id: str
    account: str
    period: str
    at: float
    input_tokens: int
    output_tokens: int
    calls: int
    model: str | None = None
    parent_id: str | None = None
    meta: dict[str, Any] | None = None
    replay: bool = False
    #: Amounts in units of your own (nonzero ones, by name).
    units: dict[str, int] = field(default_factory=dict)

    @property
    def tokens(self) -> int:
        """Input plus output tokens."""
        return self.input_tokens + self.output_tokens


_new = object.__new__


def new_charge(
    request_id: str,
    account: str,
    period: str,
    at: float,
    input_tokens: int,
    output_tokens: int,
    calls: int,
    model: str | None,
    parent_id: str | None,
    meta: dict[str, Any] | None,
    replay: bool = False,
    units: dict[str, int] | None = None,
) -> Charge:
    """``Charge(...)`` for hot paths: the same object, without the frozen dataclass's
    per-field ``object.__setattr__``."""
    c = _new(Charge)
    c.__dict__.update(
        request_id=request_id,
        account=account,
        period=period,
        at=at,
        input_tokens=input_tokens,
        output_tokens=output_tokens,
        calls=calls,
        model=model,
        parent_id=parent_id,
        meta=meta,
        replay=replay,
        units={} if units is None else units,
    )
    return c


@dataclass(frozen=True)
class Hold:
    """An estimate reserved before a call; settle, release or let it expire."""

    request_id: str
    account: str
    period: str
    at: float
    expires_at: float
    input_tokens: int
    output_tokens: int
    calls: int
    model: str | None = None
    parent_id: str | None = None
    meta: dict[str, Any] | None = None
    replay: bool = False
    #: Amounts in units of your own (nonzero ones, by name).
    units: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class Balance:
    """An account's standing in its current period (``used`` counts open holds too)."""

    account: str
    plan: str
    period: str
    period_start: float
    reset_at: float
    quota: dict[str, int]
    used: dict[str, int]
    held: dict[str, int]
    bonus: dict[str, int]

    @property
    def remaining(self) -> dict[str, int]:
        """What a charge could still take per unit: unused quota plus bonus (>= 0)."""
        return {
            u: max(0, self.quota[u] - self.used.get(u, 0)) + self.bonus.get(u, 0)
            for u in self.quota
        }


@dataclass(frozen=True)
class Notice:
    """A threshold crossed: ``id`` is the same on every delivery (dedupe on it)."""

    id: str
    account: str
    period: str
    unit: str
    threshold: float
    used: int
    quota: int
    at: float


@dataclass(frozen=True)
class Page:
    """A page of usage rows; pass ``cursor`` back for the next (None at the end)."""

    rows: list[Charge]
    cursor: str | None


@dataclass(frozen=True)
class Totals:
    """Summed usage of a set of rows."""

    input_tokens: int = 0
    output_tokens: int = 0
    calls: int = 0
    requests: int = 0
    #: Summed amounts in units of your own.
    units: dict[str, int] = field(default_factory=dict)

    @property
    def tokens(self) -> int:
        """Input plus output tokens."""
        return self.input_tokens + self.output_tokens

    def add(self, c: Charge) -> Totals:
        """These totals plus one row."""
        units = self.units
        if c.units:
            units = dict(units)
            for u, v in c.units.items():
                units[u] = units.get(u, 0) + v
        return Totals(
            self.input_tokens + c.input_tokens,
            self.output_tokens + c.output_tokens,
            self.calls + c.calls,
            self.requests + 1,
            units,
        )


@dataclass(frozen=True)
class RequestUsage:
    """One user request: its own row (if charged) and its sub-calls, with totals."""

    request_id: str
    rows: list[Charge]
    totals: Totals


@dataclass
class CampaignReport:
    """What a compensation run did (or, dry, would do)."""

    campaign_id: str
    dry_run: bool
    accounts: int = 0
    changed: int = 0
    already_done: int = 0
    skipped: int = 0
    credited: dict[str, int] = field(default_factory=dict)
    bonus_added: dict[str, int] = field(default_factory=dict)
    actions: list[dict[str, Any]] = field(default_factory=list)


def utc(t: float) -> str:
    """Unix seconds as an ISO-8601 UTC string."""
    return datetime.fromtimestamp(t, timezone.utc).isoformat(timespec="seconds")
