"""The transport: queue before sending, settle real usage, follow the provider's headers.

One class serves httpx and httpx2, sync and async: it wraps any transport with
``handle_request`` and/or ``handle_async_request`` and imports neither package itself
(the response's own module provides the stream base classes).
"""

from __future__ import annotations

import logging
import math
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from time import perf_counter
from typing import TYPE_CHECKING, Any, Literal

from .._errors import CostTooLarge, RateQueueError
from .._ratequeue import (
    Histogram,
    Limiter,
    Policy,
    _BodyReader,
    _read_response,
    _settle_response,
)
from .._threads import AfterFork
from ..pool import Pool
from . import _budget
from ._background import Background, _Settles
from ._caps import Cap, CapTable
from ._closing import _Closing
from ._estimate import Estimate, default_estimator
from ._headers import RateLimitHeaders, parse_raw_headers
from ._ledger import call_async, hold_async
from ._prepare import ACCOUNT_HEADER, PRIORITY_HEADER, TASK_HEADER, _Requests
from ._record import _ESTIMATE, _RELEASE, CallRecord, _Call
from ._record import json_usage as _json_usage
from ._stream import (
    _done,
    aread_ahead,
    ignore,
    native_stream,
    nothing_used,
    read_ahead,
    wrap,
)
from ._unclosed import Unclosed, _pay_off_thread, raise_held
from ._usage import Usage
from ._wire import _TRIPLES, for_sdk, header_list, hint_retry, scan_response, split_base

if TYPE_CHECKING:
    from ..ledger._protocol import LedgerLike as Ledger

_log = logging.getLogger("ratequeue.httpx")

__all__ = [
    "ACCOUNT_HEADER",
    "PRIORITY_HEADER",
    "TASK_HEADER",
    "CallRecord",
    "RateLimitedTransport",
]

_new = tuple.__new__
_U64 = (1 << 64) - 1

_TRANSPORTS = AfterFork("_after_fork_in_child")  # new locks in a forked child


def _bound(name: str, v: float | None, *, allow_none: bool = True) -> float | None:
    if v is None and allow_none:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise TypeError(f"{name}={v!r} must be a number of seconds")
    if not (v >= 0 and math.isfinite(v)):
        raise ValueError(f"{name}={v!r} must be finite and >= 0")
    return float(v)


class RateLimitedTransport(_Closing, _Settles, _Requests):
    """An httpx / httpx2 transport that waits in ratequeue's queue before each call.

    ``limit`` is a :class:`~ratequeue.Limiter`, :class:`~ratequeue.Policy` or
    :class:`~ratequeue.Pool`. Each call is estimated (1 request; prompt + max output
    tokens), capped (``caps``; a call a cap may match whose body cannot be capped —
    past ``max_body``, a stream, not one JSON object — raises ``CapNotApplied`` unless
    ``uncapped="send"``), checked against the :class:`CallBudget` of its context,
    held in the ``ledger``, then acquired with ``timeout`` as the bound on its queue wait
    (``Overloaded`` / ``WaitTimeout`` otherwise; nothing is sent). The response settles
    the permit, budget and ledger with the real usage. A 429 puts the provider's limiter
    in debt until the provider's reset (at most ``max_pause`` s; ``default_pause``
    without headers) and a Pool in cooldown; ``calibrate=True`` sets the local rates to
    the limits the headers state.
    """

    # Read when the transport is built (the native request reader, the cap table, the
    # units and what a call needs): assigning one later raises instead of diverging.
    _FIXED = frozenset(
        {"caps", "stream_usage", "max_body", "uncapped", "ledger", "limit", "units", "upstream"}
    )

    def __setattr__(self, name: str, value: Any) -> None:
        if name in self._FIXED and name in self.__dict__:
            raise AttributeError(
                f"RateLimitedTransport.{name} is fixed when the transport is built: "
                "make a new transport"
            )
        object.__setattr__(self, name, value)

    def __init__(
        self,
        inner: Any,
        limit: Limiter | Policy | Pool,
        *,
        timeout: float | None = None,
        priority: str | None = None,
        estimator: Callable[[dict[str, Any] | None, str], Estimate] | None = None,
        caps: Sequence[Cap] = (),
        ledger: Ledger | None = None,
        account: str | Callable[[Any], str] = "default",
        calibrate: bool = False,
        upstream: Limiter | None = None,
        units: Sequence[str] | None = None,
        keys: Callable[[Any], Mapping[str, Any]] | None = None,
        urls: Mapping[str, str] | None = None,
        max_pause: float = 300.0,
        default_pause: float = 1.0,
        retry_hint: bool = True,
        stream_usage: bool = True,
        max_body: int = 8 << 20,
        uncapped: Literal["refuse", "send"] = "refuse",
        max_background: int = 1000,
    ) -> None:
        if not (hasattr(inner, "handle_request") or hasattr(inner, "handle_async_request")):
            raise TypeError(f"inner={inner!r} is not an httpx or httpx2 transport")
        if not isinstance(limit, (Limiter, Policy, Pool)):
            raise TypeError(f"limit={limit!r} must be a Limiter, Policy or Pool")
        self.inner = inner
        self.limit = limit
        self.timeout = _bound("timeout", timeout)
        self.priority = priority
        self.estimator = estimator if estimator is not None else default_estimator()
        self.caps = tuple(caps)
        for c in self.caps:
            if not isinstance(c, Cap):
                raise TypeError(f"caps must be Cap rules, got {c!r}")
        self._cap_table = CapTable(self.caps)
        self.ledger = ledger
        self.account = account
        self.calibrate = bool(calibrate)
        self.keys = keys
        self.max_pause = _bound("max_pause", max_pause, allow_none=False) or 0.0
        self.default_pause = _bound("default_pause", default_pause, allow_none=False) or 0.0
        self.retry_hint = bool(retry_hint)
        self.stream_usage = bool(stream_usage)
        if isinstance(max_body, bool) or not isinstance(max_body, int) or max_body < 0:
            raise ValueError(f"max_body={max_body!r} must be an int >= 0")
        self.max_body = max_body
        # What the native settle reads it as: no body is longer than sys.maxsize bytes,
        # so the bound is the same, and a max_body past 64 bits is no OverflowError.
        self._native_max_body = min(max_body, sys.maxsize)
        if not isinstance(uncapped, str) or uncapped not in ("refuse", "send"):
            raise ValueError(f"uncapped={uncapped!r} must be 'refuse' or 'send'")
        self.uncapped: str = uncapped
        if (
            isinstance(max_background, bool)
            or not isinstance(max_background, int)
            or max_background < 0
        ):
            raise ValueError(f"max_background={max_background!r} must be an int >= 0")
        # Background responses' creations waiting for their poll's usage (the dict is
        # read on every call: empty, nothing is looked up).
        self._background = Background(max_background)
        self._waiting_ids = self._background._ids
        if isinstance(limit, Limiter):
            self.upstream: Limiter | None = limit
            self.units = frozenset(limit.units)
        elif isinstance(limit, Pool):
            self.upstream = None
            self.units = frozenset().union(*(p.units for p in limit.providers))
        else:
            self.upstream = upstream
            self.units = frozenset(
                units or (upstream.units if upstream is not None else ["requests"])
            )
        if units is not None and not isinstance(limit, Policy):
            raise ValueError("units= is for a Policy (a Limiter or Pool knows its units)")
        self.urls = {k: v.rstrip("/") for k, v in (urls or {}).items()}
        if urls and not isinstance(limit, Pool):
            raise ValueError("urls= maps a Pool's providers to base URLs")
        self._set_bursts()
        # Units whose cost follows the tokens: without them no call needs its estimate
        # before sending (it is read from the body when asked for).
        self._tokens = bool(self.units & {"tokens", "input_tokens", "output_tokens"})
        self._needs_body = self._tokens or bool(self.caps) or self.ledger is not None
        self._reader = self._new_reader()
        self._is_pool = isinstance(limit, Pool)
        self._is_policy = isinstance(limit, Policy)
        # A Limiter's 2xx responses settle in one native call (_settle_response); False
        # takes the Python reference for every call (tests compare the two).
        self._native_settle = isinstance(limit, Limiter)
        # A streamed body (not read yet) read by the native reader; False: the Python one.
        self._native_stream = True
        self.wait_histogram = Histogram()
        self.http_histogram = Histogram()
        self._applied: dict[tuple[int, str], tuple[float, float]] = {}
        self._lock = threading.Lock()
        self._unclosed = Unclosed()  # streams dropped unclosed, not settled yet
        _TRANSPORTS.add(self)
        # Calls granted and sent are the histograms' counts; the rest, rare, are here.
        self._counts = dict.fromkeys(("refused", "rate_limited", "paused", "calibrated"), 0)
        self._counts["unclosed"] = 0

    def _count(self, name: str) -> None:
        with self._lock:
            self._counts[name] += 1

    def _after_fork_in_child(self) -> None:
        self._lock = threading.Lock()  # maybe held at the fork (the settling thread)

    # -- the steps of a call -------------------------------------------------------------

    def _hold_kw(self, call: _Call) -> dict[str, Any]:
        est = call.estimate
        return {
            "input_tokens": est.input_tokens,
            "output_tokens": est.output_tokens,
            "calls": 1,
            "model": call.model,
            "parent_id": call._chain[-1].id if call._chain else None,
            "meta": {"path": call.path, "task": call.task},
        }

    def _hold(self, call: _Call) -> None:
        assert self.ledger is not None
        try:
            self.ledger.hold(call.request_id, call._account, **self._hold_kw(call))
        except Exception:
            self._unwind(call)
            raise
        except BaseException:
            # A Ctrl-C while the ledger answers: the hold may be made. Its release (a
            # no-op for a hold never made) goes to the worker threads, not to a ledger
            # the caller may have just given up waiting for.
            call._held = True
            try:
                self._unwind(call, pay=False)
            finally:
                _pay_off_thread(self, call, None)
            raise
        call._held = True

    async def _hold_async(self, call: _Call) -> None:
        """The hold, off the event loop."""
        try:
            await hold_async(self.ledger, call.request_id, call._account, **self._hold_kw(call))
        except BaseException:
            self._unwind(call)
            raise
        call._held = True

    def _granted(self, call: _Call, grant: Any) -> None:
        """A Pool's grant: the provider chosen, and the request sent to its URL."""
        call._provider, call._permit = grant
        call.provider = name = call._provider.name
        base = self.urls.get(name)
        if base is not None:
            request = call._request
            url = request.url.copy_with(**split_base(base, request.url))
            request.url = url
            request.headers["host"] = url.netloc.decode("ascii")

    def _received(
        self,
        call: _Call,
        response: Any,
        http_seconds: float,
        is_async: bool,
        body: bytes | None = None,
        ahead: bool = True,
    ) -> Any:
        """The response; on the native path a JSON body of a known length is read first
        (``read_ahead``; asyncio: the caller awaits it, given the length returned, and
        calls again with the body, or with ``ahead`` False for a stream that gave more
        than its length). A ``body`` given was read ahead: the call that gave its length
        has checked the headers already."""
        call.http_seconds = http_seconds
        call.status = status = response.status_code
        hl = response.headers
        hl = hl._list if type(hl) in _TRIPLES else header_list(hl)
        consumed = body is not None or response.is_stream_consumed
        found: Any = False
        if call._tokenless:
            return self._received_tokenless(call, response, status, hl, http_seconds, is_async)
        if (
            status < 300
            and (consumed or self._native_stream)
            and self._native_settle
            and call._sub is None
            and not call._held
            and not call._bodyless
            and not self.calibrate
            and type(hl) is list
            and not (self._waiting_ids and self._background.watches(call))
        ):
            # The common path in one native call (None: done; a body not read yet: its
            # length, to read it first, or its native reader). Otherwise nothing was done
            # and the reference below takes the call: from the start (False), or from
            # what the headers say (an SSE type or an exhausted quota; usage not read).
            ahead = ahead and body is None
            while True:
                found = _settle_response(
                    call,
                    call._once,
                    call._permit,
                    call._charged,
                    self._token_plan,
                    hl if body is None else None,  # a body read ahead: checked before
                    (response.content if body is None else body) if consumed else None,
                    self._native_max_body,
                    self.http_histogram,
                    http_seconds,
                    Usage,
                    self,
                    ahead,
                )
                if type(found) is not int:
                    break
                if is_async:
                    return found
                body = read_ahead(self, call, response, found, http_seconds)
                consumed = body is not None
                ahead = False  # longer than its length: read as it passes
            if found is None:
                response.extensions["ratequeue"] = call
                return response
            if type(found) is _BodyReader:
                native_stream(response, found, is_async)
                response.extensions["ratequeue"] = call
                return response
        self.http_histogram.record(http_seconds)
        # The body is here already (what MockTransport and ASGI tests return, or read
        # ahead): its usage is read in the same native call as the headers when the
        # settle needs it.
        content = (response.content if body is None else body) if consumed else None
        wanted = (
            status < 300
            and content
            and len(content) <= self.max_body
            and (self._token_plan or call._sub is not None or call._held)
        )
        if found is False:
            found = _read_response(hl, content if wanted else None) if type(hl) is list else None
        if found is None:
            ctype, exhausted = scan_response(hl)
            usage: Any = False
        else:
            ctype, exhausted, usage = found
        self._headers(call, response, status, exhausted)
        if not call._done:
            sse = ctype[:17].lower() == b"text/event-stream"  # any case (RFC 9110)
            if sse or not consumed:
                wrap(response, call, self, is_async, sse)
            elif wanted:
                if usage is False:  # the native reader deferred (or did not run)
                    usage = _json_usage(content)  # type: ignore[arg-type]
                elif usage is not None:
                    usage = _new(Usage, usage)
                if usage is None:
                    usage = nothing_used(call, content)  # type: ignore[arg-type]
                self._settle(call, usage, status, reported=True, body=content)
            elif not content or len(content) > self.max_body:
                used = nothing_used(call, b"") if not content else None
                self._settle(call, used, status, reported=True)
            else:  # only the record wants the usage: read when asked for
                self._settle(call, None, status, reported=True)
                call._usage_body = content
        return response

    def _headers(self, call: _Call, response: Any, status: int, exhausted: bool) -> None:
        """What the headers say, followed (a 429, an exhausted quota, calibration; a Pool's
        report); an error status settles the call with nothing used."""
        if status == 429 or exhausted or self.calibrate:
            self._limits(call, response, status)
        elif self._is_pool and call._provider is not None:
            self.limit.report(call._provider, status)  # type: ignore[union-attr]
        if status >= 300 and status != 429:
            self._settle(call, None, status)
        response.extensions["ratequeue"] = call

    def _received_tokenless(
        self,
        call: _Call,
        response: Any,
        status: int,
        hl: Any,
        http_seconds: float,
        is_async: bool,
    ) -> Any:
        """A call that spends none of the model's tokens (batch or file management, a
        token count): its headers followed as any call's, then settled at its estimate of
        nothing whatever usage its body reports (a batch's own); a body not read yet settles
        the call when it ends (a Policy's concurrency slot is held until then), unread."""
        self.http_histogram.record(http_seconds)
        self._headers(call, response, status, scan_response(hl)[1])
        if not call._done:
            if response.is_stream_consumed:
                self._settle(call, None, status, reported=True)
            else:
                ignore(response, call, self, is_async)
        return response

    def _stream_deferred(self, call: _Call, body: bytes | None) -> None:
        """A streamed body the native reader could not settle from: as ``_Reader.finish``."""
        _done(call, self, None if body is None else _json_usage(body), body)

    def _limits(self, call: _Call, response: Any, status: int) -> None:
        """Follow what the headers say: calibrate, pause exhausted units; on a 429 pause
        the limiter (or cool the Pool's provider down) and hint the SDK's retry."""
        info = parse_raw_headers([(k, v) for k, _, v in header_list(response.headers)])
        call.rate_limits = info if info else None
        limiter = call._provider.limiter if call._provider is not None else self.upstream
        paused = False
        if info and limiter is not None:
            paused = self._follow(info, limiter)
        if status != 429:
            if self._is_pool and call._provider is not None:
                self.limit.report(call._provider, status)  # type: ignore[union-attr]
            return
        self._count("rate_limited")
        wait = info.wait()
        wait = min(self.max_pause, self.default_pause if wait is None else wait)
        if limiter is not None and wait > 0:
            # Every call costs one request: pausing that unit stops them all without
            # emptying the token buckets (an exhausted quota was paused above).
            limiter.pause(wait, unit="requests" if "requests" in limiter.units else None)
            paused = True
            self._count("paused")
        if self._is_pool and call._provider is not None:
            self.limit.report(call._provider, 429, retry_after=wait)  # type: ignore[union-attr]
            paused = True
        self._settle(call, None, status, rate_limited=True)
        if paused and self.retry_hint:
            hint_retry(response.headers)

    def _follow(self, info: RateLimitHeaders, limiter: Limiter) -> bool:
        """Calibrate the limiter's rates (when asked) and pause exhausted units."""
        units = limiter.units
        paused = False
        for dim, q in info.quotas.items():
            if self.calibrate and q.limit and q.window and dim in units:
                key = (id(limiter), dim)
                if self._applied.get(key) != (q.limit, q.window):
                    try:
                        cur = next(r for r in limiter.rates if r.unit == dim)
                        burst = max(1, min(cur.burst, int(q.limit)))
                        limiter.set_rate(q.limit, per=q.window, burst=burst, which=dim)
                    except ValueError:
                        pass
                    else:
                        self._count("calibrated")
                        self._set_bursts()  # estimates clamp to the new burst
                    self._applied[key] = (q.limit, q.window)
            if q.remaining is not None and q.remaining <= 0 and q.reset:
                limiter.pause(min(q.reset, self.max_pause), unit=dim if dim in units else None)
                paused = True
        return paused

    def _settle(
        self,
        call: _Call,
        usage: Usage | None,
        status: int | None,
        *,
        rate_limited: bool = False,
        reported: bool = False,
        body: bytes | None = None,
        response_id: str | None = None,
        done: bool = False,
    ) -> None:
        """Settle the permit, budget and ledger once: real usage, or nothing used; a body
        ``reported`` without a usage keeps the estimate charged (never admit more than
        allowed), or waits for its poll's (a background response's creation; ``body``
        is a JSON answer, None for an event stream's, which may name the response:
        ``response_id``, or tell it ended: ``done``). An asyncio call leaves the ledger's
        part owed, for its caller to await."""
        if not call._once:
            return  # settled before (a poll must not settle its creation twice)
        if (
            reported
            and self._waiting_ids
            and not call._tokenless
            and self._background.watches(call)
        ):
            if self._polled(call, usage, status, body, done):
                return
        elif (
            usage is None
            and reported
            and (body or response_id)
            and self._keep(call, body, response_id)
        ):
            return
        # Kept while it streamed, its stream now over: settled here unless a poll took it.
        if call._rkey is not None and not self._background.ended(call, usage is not None):
            return
        self._settle_one(call, usage, status, rate_limited=rate_limited, reported=reported)
        if call._rkey is not None:
            # Named by its stream in another thread while this settled it (a close):
            # not kept.
            self._background.ended(call, usage is not None)

    def _settle_one(
        self,
        call: _Call,
        usage: Usage | None,
        status: int | None,
        *,
        rate_limited: bool = False,
        reported: bool = False,
    ) -> None:
        """``_settle`` itself. An interrupt (a Ctrl-C) in one of its steps stops none of
        the others: each runs in a ``finally`` of the one before, and what the ledger is
        owed is set before any of them (plain stores, where no Ctrl-C lands). CPython
        raises a Ctrl-C as a call returns or a Python function is entered: one raised as
        the pop returns is held back until the steps ran, then raised whatever they raised
        (``raise_held``); one on the way into ``_pay`` leaves the ledger's part to the
        worker threads."""
        held: list[BaseException] = []
        try:
            call._once.pop()  # atomic: one caller settles
        except IndexError:
            return
        except BaseException as e:  # a Ctrl-C as the pop returned: the call is taken
            held.append(e)
        try:
            call._done = True
            call._usage = usage
            call.settled = True
            # A body without a usage keeps what acquire took: the estimate, clamped to what
            # the limiter can ever grant (budget and ledger keep the estimate itself).
            keep = usage is None and reported
            if call._held:
                call._owed = usage if usage is not None else _ESTIMATE if keep else _RELEASE
            permit = call._permit
            try:
                if permit is not None and self._token_plan and not keep:
                    if usage is None:
                        i = o = 0
                    else:
                        i, o = usage
                    actual = (1, min(i + o, _U64), i, o)  # saturated, as natively
                    costs = call._charged
                    # Only what differs from the estimate: the rest is already right.
                    kw = {}
                    for unit, j in self._token_plan:
                        if actual[j] != costs[unit]:
                            kw[unit] = actual[j]
                    if kw:
                        call._correction = kw  # what acquire took, corrected to the usage
                        if call.clamped:
                            call.clamped = ()
                        if call._provider is not None:
                            kw = call._provider.costs_for(kw)
                        permit.settle(**kw)
            finally:
                try:
                    if permit is not None and self._is_policy:
                        permit.release()  # its concurrency slots (a rate permit has none)
                finally:
                    try:
                        if call._sub is not None:
                            self._settle_budget(call, usage, keep, status, rate_limited)
                    finally:
                        # Inline, not a helper: a Ctrl-C on the way into a helper would land
                        # before its try (as ``_unwind`` does too).
                        if call._held and not call._async:
                            try:
                                self._pay(call)
                            except BaseException:
                                if call._owed is not None:  # interrupted before it was taken
                                    _pay_off_thread(self, call, None)
                                raise
        finally:
            if held:
                raise_held(self, call, held)

    @staticmethod
    def _settle_budget(
        call: _Call, usage: Usage | None, keep: bool, status: int | None, rate_limited: bool
    ) -> None:
        """The call's sub-call settled in its budgets: its usage, its estimate when it
        keeps it, nothing used when rate limited (taken back)."""
        if rate_limited:
            _budget.uncount(call._sub, call._chain, status)  # type: ignore[arg-type]
            return
        if usage is not None:
            i, o = usage
        elif keep:
            est = call.estimate
            i, o = est.input_tokens, est.output_tokens
        else:
            i = o = 0
        _budget.settle(call._sub, call._chain, i, o, status)  # type: ignore[arg-type]

    @staticmethod
    def _ledger_op(call: _Call, owed: object) -> tuple[str, dict[str, Any]]:
        """The ledger call for what the call owes (``owed``: settle or release)."""
        if owed is _RELEASE:
            return "release", {}
        if owed is _ESTIMATE:
            est = call.estimate
            owed = _new(Usage, (est.input_tokens, est.output_tokens))
        assert isinstance(owed, Usage)
        return "settle", {
            "input_tokens": owed.input_tokens,
            "output_tokens": owed.output_tokens,
            "calls": 1,
            "model": call.model,
        }

    def _pay(self, call: _Call, hand_off: bool = True) -> None:
        """What the call owes the ledger, inline (and the creation its poll settled),
        taken once. An interrupt (a Ctrl-C while the ledger answers, or on the way into
        the creation's pay) has the worker threads pay what is left with ``hand_off``:
        the ledger's calls are idempotent per request id (the workers do not hand it off
        again). A creation's error never replaces the call's own error or interrupt."""
        owed: object = None
        failed = False
        try:
            owed, call._owed = call._owed, None
            if owed is not None:
                self._pay_owed(call, owed)
        except Exception:
            failed = True
            raise
        except BaseException:
            failed = True
            if hand_off:
                if owed is not None:
                    _pay_off_thread(self, call, None, owed)
                linked = call._linked  # not paid inline on a ledger given up on
                if linked is not None:
                    call._linked = None
                    _pay_off_thread(self, linked, None)
            raise
        finally:
            linked = call._linked
            if linked is not None:
                call._linked = None
                try:
                    self._pay(linked, hand_off)
                except Exception:
                    if not failed:
                        raise
                    _log.exception("the call %s failed to pay its ledger part", linked.request_id)
                except BaseException:
                    if hand_off and linked._owed is not None:  # interrupted on the way in
                        _pay_off_thread(self, linked, None)
                    raise

    def _pay_owed(self, call: _Call, owed: object) -> None:
        """The ledger call for ``owed`` (taken from the call before)."""
        name, kw = self._ledger_op(call, owed)
        getattr(self.ledger, name)(call.request_id, **kw)

    async def _pay_async(self, call: _Call) -> None:
        """What the call owes the ledger, off the event loop (and the creation its poll
        settled), taken once; the ledger's call runs to its end even if this is
        cancelled meanwhile (``call_async``)."""
        owed, call._owed = call._owed, None
        try:
            if owed is not None:
                name, kw = self._ledger_op(call, owed)
                await call_async(self.ledger, name, call.request_id, **kw)
        finally:
            linked, call._linked = call._linked, None
            if linked is not None:
                await self._pay_async(linked)

    def _unwind(self, call: _Call, pay: bool = True) -> None:
        """Nothing was sent: give back the budget and the ledger hold (released inline
        unless ``pay`` is False or the call is asyncio's: left owed). A Ctrl-C as the
        clear returns is held back and raised after (``raise_held``: an asyncio call's
        release then goes to the worker threads); one on the way into ``_pay`` leaves
        the release to the worker threads."""
        held: list[BaseException] = []
        try:
            call._once.clear()
        except BaseException as e:  # a Ctrl-C as the clear returned: the call is taken
            held.append(e)
        call._done = True
        if call._held:
            call._owed = _RELEASE
        try:
            if call._sub is not None:
                _budget.uncount(call._sub, call._chain, None)
        finally:
            try:
                if call._held and not call._async and pay:
                    try:
                        self._pay(call)
                    except BaseException:
                        if call._owed is not None:  # interrupted before it was taken
                            _pay_off_thread(self, call, None)
                        raise
            finally:
                if held:
                    raise_held(self, call, held)

    def _unsettled(self, call: _Call) -> None:
        """A response received whose settle did not run (a Ctrl-C, a failure before it):
        settled at its estimate (never admit more than allowed), its ledger part left
        owed for the caller to pay."""
        if call._once:
            call._async = True
            self._settle_one(call, None, call.status, reported=True)

    def _abandoned(self, call: _Call) -> None:
        """A call left by an interrupt before its send (a Ctrl-C on the way into its
        unwind, or after its permit was granted): unwound, or settled with nothing used
        when it holds a permit (its concurrency slots given back)."""
        if call._permit is None:
            self._unwind(call)
        else:
            self._settle_one(call, None, None)

    def _failed(self, call: _Call) -> None:
        """Sent but no response (connection error, timeout, cancel): no tokens used."""
        if self._is_pool and call._provider is not None:
            self.limit.report(call._provider, ok=False)  # type: ignore[union-attr]
        self._settle(call, None, None)

    def _refused(self, call: _Call, err: BaseException) -> bool:
        """After acquire raised ``err``: True to try once more (a CostTooLarge after the
        bursts changed: the call's costs are clamped again), else the call is unwound."""
        if isinstance(err, CostTooLarge) and not call._retried:
            call._retried = True
            self._set_bursts()
            est = call.estimate if self._tokens else None
            costs, clamped = self._costs(est) if est is not None else (self._unit_costs, ())
            if costs != call._charged:
                call._kw = {**call._kw, **costs}
                call._charged = costs
                call.clamped = clamped
                return True
        self._count("refused")
        self._unwind(call)
        return False

    # -- httpx entry points ----------------------------------------------------------------

    def handle_request(self, request: Any) -> Any:
        """Wait for a permit (GIL released), send, and settle when the body is read."""
        call = None
        try:
            call = self._prepare(request, False)
            if call._permit is None:  # not granted at once by the native prepare
                self._acquire(call)
        except RateQueueError as e:
            for_sdk(e, request)
            raise
        except BaseException:
            if call is not None and call._once:  # a Ctrl-C before its unwind started
                self._abandoned(call)
            raise
        try:
            t1 = perf_counter()
            response = self.inner.handle_request(call._request)
        except BaseException:
            try:
                self._failed(call)
            finally:
                if call._once:  # a Ctrl-C on the way into its settle
                    self._settle_one(call, None, None)
            raise
        try:
            return self._received(call, response, perf_counter() - t1, False)
        except BaseException:
            try:
                self._unsettled(call)
            finally:
                self._pay(call)
            raise

    def _acquire(self, call: _Call) -> None:
        """The call held in the ledger, then its permit acquired (waiting, GIL released)."""
        if self.ledger is not None:
            self._hold(call)
        t0 = perf_counter()
        while True:
            try:
                grant = self.limit.acquire(**call._kw)
                break
            except BaseException as e:
                if not self._refused(call, e):
                    raise
        self._admitted(call, grant, perf_counter() - t0)

    def _admitted(self, call: _Call, grant: Any, waited: float) -> None:
        if self._is_pool:
            self._granted(call, grant)
        else:
            call._permit = grant
        call.waited = waited
        self.wait_histogram.record(waited)

    async def handle_async_request(self, request: Any) -> Any:
        """The asyncio form: one wake-up per grant, no polling; cancellation gives back;
        the ledger is called off the event loop."""
        call = None
        try:
            call = self._prepare(request, True)
            if call._permit is None:  # not granted at once by the native prepare
                await self._acquire_async(call)
        except RateQueueError as e:
            for_sdk(e, request)
            raise
        except BaseException:
            if call is not None and call._once:  # a Ctrl-C before its unwind started
                self._abandoned(call)
                if call._owed is not None:
                    await self._pay_async(call)
            raise
        try:
            t1 = perf_counter()
            response = await self.inner.handle_async_request(call._request)
        except BaseException:
            try:
                self._failed(call)
            finally:
                if call._once:  # a Ctrl-C on the way into its settle
                    self._settle_one(call, None, None)
            if call._owed is not None:
                await self._pay_async(call)
            raise
        took = perf_counter() - t1
        try:
            got = self._received(call, response, took, True)
            if type(got) is int:  # a JSON body of this length: read first
                body = await aread_ahead(self, call, response, got, took)
                self._received(call, response, took, True, body, body is not None)
        except BaseException:
            self._unsettled(call)
            if call._owed is not None:
                await self._pay_async(call)
            raise
        if call._owed is not None:
            await self._pay_async(call)
        return response

    async def _acquire_async(self, call: _Call) -> None:
        """The call held in the ledger (off the event loop), then its permit acquired."""
        if self.ledger is not None:
            await self._hold_async(call)
        t0 = perf_counter()
        while True:
            try:
                grant = await self.limit.acquire_async(**call._kw)
                break
            except BaseException as e:
                if not self._refused(call, e):
                    if call._owed is not None:
                        await self._pay_async(call)
                    raise
        self._admitted(call, grant, perf_counter() - t0)

    def stats(self) -> dict[str, Any]:
        """Counters (calls: granted or refused by the queue; sent, rate_limited, paused,
        calibrated; unclosed: streams dropped without a close, settled as closed;
        background: creations of background responses waiting for their poll's usage)
        and the p50/p99 of the queue wait and the HTTP time, in seconds."""
        with self._lock:
            counts = dict(self._counts)
        out: dict[str, Any] = {
            "calls": self.wait_histogram.count + counts.pop("refused"),
            "sent": self.http_histogram.count,
            **counts,
            "background": self._background.waiting,
        }
        for name, h in (("wait", self.wait_histogram), ("http", self.http_histogram)):
            out[f"{name}_p50"], out[f"{name}_p99"] = (
                h.percentiles([50, 99]) if h.count else (0.0, 0.0)
            )
        return out
