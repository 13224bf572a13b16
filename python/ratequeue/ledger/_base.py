"""What every ledger backend shares: argument rules, the public calls, async twins,
warning delivery, compensation runs and queries over the backend's primitives."""

from __future__ import annotations

import abc
import asyncio
import csv
import inspect
import json
import threading
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from typing import IO, Any, ParamSpec, TypeVar

from .._errors import QuotaExceeded
from .._threads import DaemonThreads, ProcessThreads
from ._campaign import Campaigns
from ._model import (
    DAY,
    Balance,
    Charge,
    ClockLike,
    Hold,
    Notice,
    Page,
    Plan,
    RequestUsage,
    Span,
    Totals,
    UnknownAccount,
    amounts,
    check_fraction,
    check_id,
    check_meta,
    check_seconds,
    check_thresholds,
    clock_fn,
    request_fingerprint,
    settle_fingerprint,
    utc,
)

NoticeCallback = Callable[[Notice], "Awaitable[None] | None"]

P = ParamSpec("P")
T = TypeVar("T")

_CHARGE_KEYS = frozenset(
    (
        "request_id",
        "account",
        "input_tokens",
        "output_tokens",
        "calls",
        "model",
        "parent_id",
        "meta",
        "units",
    )
)


def quota_exceeded(account: str, unit: str, need: int, avail: int, span: Span, now: float) -> Any:
    """The refusal of a charge that does not fit."""
    return QuotaExceeded(
        f"account {account!r} is out of {unit} quota: needs {need}, {avail} left "
        f"until {utc(span.end)}",
        max(0.0, span.end - now),
        account=account,
        unit=unit,
        reset_at=span.end,
    )


class LedgerBase(Campaigns, abc.ABC):
    """The public surface of a quota ledger; backends fill in the storage (the abstract
    methods: every one is needed, so a backend missing one cannot be made)."""

    def __init__(
        self,
        *,
        clock: ClockLike | None = None,
        retention: float | None = None,
        hold_ttl: float = 600.0,
        default_plan: Plan | None = None,
    ) -> None:
        self._now = clock_fn(clock)
        self.retention = 35 * DAY if retention is None else check_seconds("retention", retention)
        self.hold_ttl = check_seconds("hold_ttl", hold_ttl)
        if default_plan is not None and not isinstance(default_plan, Plan):
            raise TypeError(f"default_plan must be a Plan, got {type(default_plan).__name__}")
        if default_plan is not None:
            self._check_retention(default_plan)
        self.default_plan = default_plan
        self._spans: dict[tuple[str, float | None], Span] = {}
        self._plans: dict[str, Plan] = {}
        self._notice_event = threading.Event()

    # -- helpers for backends ----------------------------------------------------------

    def _check_retention(self, plan: Plan) -> None:
        if plan.period.max_length > self.retention:
            raise ValueError(
                f"retention={self.retention:g} s must cover the plan's period "
                f"({plan.period.max_length:g} s): request ids are kept at least a period"
            )

    def _plan(self, text: str) -> Plan:
        p = self._plans.get(text)
        if p is None:
            p = Plan.from_dict(json.loads(text))
            if len(self._plans) > 10_000:
                self._plans.clear()
            self._plans[text] = p
        return p

    def _span(self, plan_json: str, plan: Plan, anchor: float | None, now: float) -> Span:
        key = (plan_json, anchor)
        s = self._spans.get(key)
        if s is None or not s.start <= now < s.end:
            s = plan.period.at(now, anchor)
            if len(self._spans) > 10_000:
                self._spans.clear()
            self._spans[key] = s
        return s

    # -- accounts ------------------------------------------------------------------------

    def set_plan(
        self,
        account: str,
        plan: Plan,
        *,
        anchor: float | None = None,
        thresholds: Sequence[float] | None = None,
    ) -> None:
        """Gives ``account`` a plan (created if new); usage and bonus are kept.

        ``anchor`` (Unix seconds, e.g. the purchase time) starts anchored periods;
        ``thresholds`` overrides the plan's warning thresholds for this account.
        """
        check_id("account", account)
        if not isinstance(plan, Plan):
            raise TypeError(f"plan must be a Plan, got {type(plan).__name__}")
        self._check_retention(plan)
        a = None if anchor is None else check_fraction("anchor", anchor)
        thr = None if thresholds is None else check_thresholds(thresholds)
        self._set_plan(account, plan, a, thr)

    @abc.abstractmethod
    def _set_plan(
        self, account: str, plan: Plan, anchor: float | None, thr: tuple[int, ...] | None
    ) -> None: ...

    def accounts(self) -> Iterator[str]:
        """Every account with a plan (in batches from the backend)."""
        after = ""
        while True:
            batch = self._accounts_after(after, 1000)
            if not batch:
                return
            yield from batch
            after = batch[-1]

    def settings(self, account: str) -> tuple[Plan, float | None, tuple[float, ...] | None]:
        """The account's plan, anchor and own thresholds (None: the plan's), as
        ``set_plan`` last stored them (``UnknownAccount`` if it has none)."""
        check_id("account", account)
        plan, anchor, thr = self._settings(account)
        return plan, anchor, None if thr is None else tuple(bp / 10_000 for bp in thr)

    @abc.abstractmethod
    def _settings(self, account: str) -> tuple[Plan, float | None, tuple[int, ...] | None]: ...

    @abc.abstractmethod
    def _accounts_after(self, after: str, limit: int) -> list[str]: ...

    @abc.abstractmethod
    def count_accounts(self) -> int:
        """How many accounts have a plan."""
        ...

    # -- deduction -----------------------------------------------------------------------

    def charge(
        self,
        request_id: str,
        account: str,
        *,
        input_tokens: int = 0,
        output_tokens: int = 0,
        calls: int = 1,
        model: str | None = None,
        parent_id: str | None = None,
        meta: dict[str, Any] | None = None,
        units: Mapping[str, int] | None = None,
    ) -> Charge:
        """Counts a request once per ``request_id``: a retry returns the first record with
        ``replay=True``; the same id with another payload raises ``IdempotencyConflict``;
        out of quota raises ``QuotaExceeded`` and charges nothing. ``units``: amounts in
        units of your own (``{"images": 3}``)."""
        args = self._request_args(
            request_id, account, input_tokens, output_tokens, calls, model, parent_id, meta, units
        )
        return self._charge_now(args, request_fingerprint("charge", *args[1:]))

    def _charge_now(self, args: tuple[Any, ...], fp: str) -> Charge:
        """Runs a checked charge (``_request_args`` and its fingerprint), blocking."""
        return self._call(self._charge_call(*args, fp))  # type: ignore[no-any-return]

    def charge_many(self, requests: Sequence[Mapping[str, Any]]) -> list[Charge | Exception]:
        """Charges several requests (each as ``charge(**request)``) together: one
        transaction in SQLite, one pipelined round trip in Redis; returns each one's
        Charge or the error it raised (the others still count). After an error that is
        not the request's own (a lost connection), retry it with the same id."""
        ops: list[tuple[tuple[Any, ...], str] | Exception] = []
        for r in requests:
            try:
                unknown = set(r) - _CHARGE_KEYS
                if unknown:
                    raise TypeError(f"unexpected keys {sorted(unknown)} in a charge")
                args = self._request_args(
                    r["request_id"],
                    r["account"],
                    r.get("input_tokens", 0),
                    r.get("output_tokens", 0),
                    r.get("calls", 1),
                    r.get("model"),
                    r.get("parent_id"),
                    r.get("meta"),
                    r.get("units"),
                )
            except (TypeError, ValueError, KeyError) as e:
                ops.append(e)
                continue
            ops.append((args, request_fingerprint("charge", *args[1:])))
        return self._charge_many(ops)

    @abc.abstractmethod
    def _charge_many(self, ops: list[Any]) -> list[Charge | Exception]:
        """Charges ``(arguments, fingerprint)`` pairs in order (an Exception item stays
        that item's result)."""

    def hold(
        self,
        request_id: str,
        account: str,
        *,
        input_tokens: int = 0,
        output_tokens: int = 0,
        calls: int = 1,
        model: str | None = None,
        parent_id: str | None = None,
        meta: dict[str, Any] | None = None,
        units: Mapping[str, int] | None = None,
    ) -> Hold:
        """Reserves an estimate before a call so concurrent requests cannot overspend;
        idempotent per ``request_id``; expires after ``hold_ttl`` giving its amount back."""
        args = self._request_args(
            request_id, account, input_tokens, output_tokens, calls, model, parent_id, meta, units
        )
        fp = request_fingerprint("hold", *args[1:])
        return self._call(self._hold_call(*args, fp))  # type: ignore[no-any-return]

    def settle(
        self,
        request_id: str,
        *,
        input_tokens: int,
        output_tokens: int,
        calls: int = 1,
        model: str | None = None,
        account: str | None = None,
        units: Mapping[str, int] | None = None,
    ) -> Charge:
        """Records a hold's actual usage (the difference given back or taken, past the
        quota if need be: the work was done); without a hold, charges ``account``
        directly. Idempotent: a retry returns the charge with ``replay=True``. The actual
        amounts replace the estimate in every unit (``units`` not given: none of yours)."""
        args = self._parse_settle(
            request_id,
            input_tokens=input_tokens,
            output_tokens=output_tokens,
            calls=calls,
            model=model,
            account=account,
            units=units,
        )
        return self._call(self._settle_call(*args))  # type: ignore[no-any-return]

    def _parse_settle(
        self,
        request_id: str,
        *,
        input_tokens: int,
        output_tokens: int,
        calls: int = 1,
        model: str | None = None,
        account: str | None = None,
        units: Mapping[str, int] | None = None,
    ) -> tuple[Any, ...]:
        check_id("request_id", request_id)
        am = amounts(input_tokens, output_tokens, calls, units)
        if model is not None:
            check_id("model", model)
        if account is not None:
            check_id("account", account)
        return (request_id, am, model, account, settle_fingerprint(am, model))

    def release(self, request_id: str) -> None:
        """Gives a hold back in full; a no-op when it was settled, released or expired."""
        check_id("request_id", request_id)
        self._call(self._release_call(request_id, None))

    def _request_args(
        self,
        request_id: str,
        account: str,
        input_tokens: int = 0,
        output_tokens: int = 0,
        calls: int = 1,
        model: str | None = None,
        parent_id: str | None = None,
        meta: dict[str, Any] | None = None,
        units: Mapping[str, int] | None = None,
    ) -> tuple[Any, ...]:
        """A charge's or hold's arguments checked: (request id, account, amounts, model,
        parent id, meta JSON); the asyncio twins pass their keywords here."""
        check_id("request_id", request_id)
        check_id("account", account)
        am = amounts(input_tokens, output_tokens, calls, units)
        if model is not None:
            check_id("model", model)
        if parent_id is not None:
            check_id("parent_id", parent_id)
        return (request_id, account, am, model, parent_id, check_meta(meta))

    # -- what a backend provides: calls, and how to run one -----------------------------

    @abc.abstractmethod
    def _charge_call(self, *args: Any) -> Any:
        """The backend's call charging ``_request_args`` + fingerprint."""

    @abc.abstractmethod
    def _hold_call(self, *args: Any) -> Any:
        """The backend's call holding ``_request_args`` + fingerprint."""

    @abc.abstractmethod
    def _settle_call(self, *args: Any) -> Any:
        """The backend's call settling ``_parse_settle``'s arguments."""

    @abc.abstractmethod
    def _release_call(self, request_id: str, account: str | None) -> Any:
        """The backend's call giving a hold back (``account``: where it is, if known)."""

    @abc.abstractmethod
    def _balance_call(self, account: str) -> Any:
        """The backend's call reading an account's balance."""

    @abc.abstractmethod
    def _call(self, call: Any) -> Any:
        """Runs a call, blocking this thread."""

    @abc.abstractmethod
    async def _call_async(
        self,
        call: Any,
        undo: Any = None,
        again: Callable[[], Any] | None = None,
        finish: bool = False,
    ) -> Any:
        """Runs a call on the running event loop without a worker thread. Its caller
        cancelled, the call either counted or provably did not (``finish``: it always
        runs to completion; cancelling only stops the waiting); ``again`` makes a fresh
        copy of the (idempotent) call for a backend that runs it again without the loop
        to learn which; once it counted, ``undo`` (a call) runs without the loop."""

    @abc.abstractmethod
    def expire_holds(self) -> int:
        """Gives back every hold past its expiry now; returns how many (also done lazily
        whenever an account is charged)."""
        ...

    # -- async twins: the same calls, awaited on the event loop ---------------------------

    async def charge_async(self, request_id: str, account: str, **kw: Any) -> Charge:
        """``charge`` awaited on the event loop (no worker thread); cancelled, it either
        still counts (finished without the loop) or, withdrawn before it ran, counted
        nothing: a retry with the same id tells which (a replay, or the first charge)."""
        args = self._request_args(request_id, account, **kw)
        fp = request_fingerprint("charge", *args[1:])
        return await self._call_async(  # type: ignore[no-any-return]
            self._charge_call(*args, fp), again=lambda: self._charge_call(*args, fp)
        )

    async def hold_async(self, request_id: str, account: str, **kw: Any) -> Hold:
        """``hold`` awaited on the event loop; cancelled, the hold is never left standing:
        not made, or given back (without the event loop: a loop closing meanwhile is
        fine)."""
        args = self._request_args(request_id, account, **kw)
        fp = request_fingerprint("hold", *args[1:])
        return await self._call_async(  # type: ignore[no-any-return]
            self._hold_call(*args, fp),
            self._release_call(request_id, account),
            again=lambda: self._hold_call(*args, fp),
        )

    async def settle_async(self, request_id: str, **kw: Any) -> Charge:
        """``settle`` awaited on the event loop; cancelled, it still settles (run to
        completion without the loop): a correction is never lost."""
        args = self._parse_settle(request_id, **kw)
        return await self._call_async(  # type: ignore[no-any-return]
            self._settle_call(*args), again=lambda: self._settle_call(*args), finish=True
        )

    async def release_async(self, request_id: str) -> None:
        """``release`` awaited on the event loop; cancelled, it still gives the hold back
        (run to completion without the loop)."""
        check_id("request_id", request_id)
        await self._call_async(
            self._release_call(request_id, None),
            again=lambda: self._release_call(request_id, None),
            finish=True,
        )

    async def balance_async(self, account: str) -> Balance:
        """``balance`` awaited on the event loop."""
        check_id("account", account)
        return await self._call_async(self._balance_call(account))  # type: ignore[no-any-return]

    # -- queries -------------------------------------------------------------------------

    def balance(self, account: str) -> Balance:
        """Quota, usage (open holds included), holds and bonus of the current period."""
        check_id("account", account)
        return self._call(self._balance_call(account))  # type: ignore[no-any-return]

    def plan_of(self, account: str) -> Plan:
        """The account's plan (``UnknownAccount`` if it has none)."""
        check_id("account", account)
        return self._plan_of(account)

    @abc.abstractmethod
    def _plan_of(self, account: str) -> Plan: ...

    def usage(
        self,
        account: str,
        *,
        start: float | None = None,
        end: float | None = None,
        limit: int = 100,
        cursor: str | None = None,
    ) -> Page:
        """Charged rows of ``account`` with ``start <= at < end``, oldest first (rows of
        one instant by id in SQLite, in arrival order in Redis), ``limit`` per page (at
        most 10,000)."""
        check_id("account", account)
        if isinstance(limit, bool) or not isinstance(limit, int):
            raise TypeError(f"limit must be an int, got {type(limit).__name__}")
        if not 1 <= limit <= 10_000:
            raise ValueError(f"limit={limit} must be from 1 to 10000")
        lo = -1.0 if start is None else check_fraction("start", start)
        hi = float("inf") if end is None else check_fraction("end", end)
        if cursor is not None and not isinstance(cursor, str):
            raise TypeError(f"cursor must be a str, got {type(cursor).__name__}")
        return self._usage(account, lo, hi, limit, cursor)

    @abc.abstractmethod
    def _usage(
        self, account: str, lo: float, hi: float, limit: int, cursor: str | None
    ) -> Page: ...

    def iter_usage(
        self, account: str, *, start: float | None = None, end: float | None = None
    ) -> Iterator[Charge]:
        """Every charged row of ``account`` in the range, page by page."""
        cursor: str | None = None
        while True:
            page = self.usage(account, start=start, end=end, limit=1000, cursor=cursor)
            yield from page.rows
            if page.cursor is None:
                return
            cursor = page.cursor

    def request_usage(self, account: str, request_id: str) -> RequestUsage:
        """One user request: its own charged row and every row whose parent it is."""
        check_id("account", account)
        check_id("request_id", request_id)
        rows = self._request_rows(account, request_id)
        totals = Totals()
        for r in rows:
            totals = totals.add(r)
        return RequestUsage(request_id, rows, totals)

    @abc.abstractmethod
    def _request_rows(self, account: str, request_id: str) -> list[Charge]: ...

    def totals_by_model(
        self, account: str, *, start: float | None = None, end: float | None = None
    ) -> dict[str, Totals]:
        """Summed usage per model (``""`` for rows without one) in the range."""
        out: dict[str, Totals] = {}
        for c in self.iter_usage(account, start=start, end=end):
            k = c.model or ""
            out[k] = out.get(k, Totals()).add(c)
        return out

    def export_csv(
        self,
        account: str,
        out: IO[str],
        *,
        start: float | None = None,
        end: float | None = None,
    ) -> int:
        """Writes the rows as CSV (header first); returns how many rows."""
        w = csv.writer(out)
        w.writerow(
            [
                "request_id",
                "parent_id",
                "account",
                "period",
                "at",
                "time_utc",
                "input_tokens",
                "output_tokens",
                "calls",
                "model",
                "meta",
                "units",
            ]
        )
        n = 0
        for c in self.iter_usage(account, start=start, end=end):
            w.writerow(
                [
                    c.request_id,
                    c.parent_id or "",
                    c.account,
                    c.period,
                    repr(c.at),
                    utc(c.at),
                    c.input_tokens,
                    c.output_tokens,
                    c.calls,
                    c.model or "",
                    "" if c.meta is None else json.dumps(c.meta, sort_keys=True),
                    json.dumps(c.units, sort_keys=True) if c.units else "",
                ]
            )
            n += 1
        return n

    # -- warnings --------------------------------------------------------------------------

    def pending_notices(self, limit: int = 1000) -> list[Notice]:
        """Notices in the outbox not yet acknowledged (oldest first)."""
        return self._peek_notices(limit)

    def deliver(self, callback: Callable[[Notice], object], *, limit: int = 1000) -> int:
        """Hands pending notices to ``callback`` (sync, or async run to completion);
        each is removed from the outbox only after the callback returned: at least once."""
        notices = self._claim_notices(limit)
        n = 0
        try:
            for notice in notices:
                r = callback(notice)
                if inspect.isawaitable(r):
                    _run_awaitable(r)
                self._ack_notice(notice)
                n += 1
        except BaseException:
            self._unclaim(notices[n:])
            raise
        return n

    async def deliver_async(self, callback: NoticeCallback, *, limit: int = 1000) -> int:
        """``deliver`` for asyncio: storage on a worker thread, async callbacks awaited."""
        notices = await _in_thread(self._claim_notices, limit)
        n = 0
        try:
            for notice in notices:
                r = callback(notice)
                if inspect.isawaitable(r):
                    await r
                await _in_thread(self._ack_notice, notice)
                n += 1
        except BaseException:
            self._unclaim(notices[n:])
            raise
        return n

    @abc.abstractmethod
    def _peek_notices(self, limit: int) -> list[Notice]: ...

    @abc.abstractmethod
    def _claim_notices(self, limit: int) -> list[Notice]: ...

    @abc.abstractmethod
    def _ack_notice(self, notice: Notice) -> None: ...

    @abc.abstractmethod
    def _unclaim(self, notices: Sequence[Notice]) -> None: ...

    # -- misc --------------------------------------------------------------------------------

    def _unknown(self, account: str) -> UnknownAccount:
        return UnknownAccount(f"account {account!r} has no plan (set_plan first)")

    def close(self) -> None:
        """Releases the storage handle."""

    def __enter__(self) -> LedgerBase:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_threads = ProcessThreads("ratequeue-ledger", 16)


def _executor() -> DaemonThreads:
    """The ledger's worker threads for asyncio callers (made again in a forked child)."""
    return _threads.get()


async def _in_thread(fn: Callable[P, T], *args: P.args, **kw: P.kwargs) -> T:
    return await asyncio.wrap_future(_executor().submit(fn, *args, **kw))


def _run_awaitable(r: Awaitable[Any]) -> Any:
    async def wait() -> Any:
        return await r

    return asyncio.run(wait())


def parse_json_obj(text: str | None) -> dict[str, Any] | None:
    """A stored meta JSON (or None)."""
    if not text:
        return None
    v = json.loads(text)
    return v if isinstance(v, dict) else None
