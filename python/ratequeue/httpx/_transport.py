"""The transport: queue before sending, settle real usage, follow the provider's headers.

One class serves httpx and httpx2, sync and async: it wraps any transport with
``handle_request`` and/or ``handle_async_request`` and imports neither package itself
(the response's own module provides the stream base classes).
"""

from __future__ import annotations

import json
import math
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from .._errors import CostTooLarge, RateQueueError
from .._ratequeue import Histogram, Limiter, Policy
from ..pool import Pool, Provider
from . import _budget
from ._caps import Cap, Capped, apply_caps
from ._context import current_options
from ._estimate import Estimate, default_estimator
from ._headers import RateLimitHeaders, parse_raw_headers
from ._stream import wrap
from ._usage import Usage
from ._wire import (
    _NO_LIMITS,
    _REQUEST_FIRST,
    for_sdk,
    hint_retry,
    new_id,
    scan_response,
    split_base,
)

__all__ = [
    "ACCOUNT_HEADER",
    "PRIORITY_HEADER",
    "TASK_HEADER",
    "CallRecord",
    "Ledger",
    "RateLimitedTransport",
]

PRIORITY_HEADER = "x-ratequeue-priority"
TASK_HEADER = "x-ratequeue-task"
ACCOUNT_HEADER = "x-ratequeue-account"
_OWN_HEADERS = (PRIORITY_HEADER, TASK_HEADER, ACCOUNT_HEADER)


class Ledger(Protocol):
    """A quota ledger (e.g. ``ratequeue.ledger``): holds, settles or releases a call."""

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
    ) -> Any: ...

    def settle(
        self,
        request_id: str,
        *,
        input_tokens: int,
        output_tokens: int,
        calls: int = 1,
        model: str | None = None,
    ) -> Any: ...

    def release(self, request_id: str) -> Any: ...


@dataclass(slots=True)
class CallRecord:
    """One call through the transport, in ``response.extensions["ratequeue"]``.

    ``waited`` is the queue wait and ``http_seconds`` the time from sending to the
    response headers, measured apart; ``usage`` is set when the call settles (the end of
    the body or stream), from the provider's own count.
    """

    request_id: str
    path: str
    model: str | None
    estimate: Estimate
    capped: Capped | None
    priority: str | None
    task: str | None
    provider: str | None = None
    waited: float = 0.0
    http_seconds: float | None = None
    status: int | None = None
    usage: Usage | None = None
    settled: bool = False
    rate_limits: RateLimitHeaders | None = None


class _Call:
    """What one call holds while it is in flight (settled exactly once)."""

    __slots__ = (
        "account",
        "chain",
        "costs",
        "done",
        "held",
        "lock",
        "permit",
        "provider",
        "record",
        "request",
        "sub",
    )

    request: Any
    record: CallRecord
    costs: dict[str, int]
    account: str

    def __init__(self) -> None:
        self.permit: Any = None
        self.provider: Provider | None = None
        self.sub: _budget.SubCall | None = None
        self.chain: list[_budget.CallBudget] = []
        self.held = False
        self.done = False
        self.lock = threading.Lock()


def _bound(name: str, v: float | None, *, allow_none: bool = True) -> float | None:
    if v is None and allow_none:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise TypeError(f"{name}={v!r} must be a number of seconds")
    if not (v >= 0 and math.isfinite(v)):
        raise ValueError(f"{name}={v!r} must be finite and >= 0")
    return float(v)


class RateLimitedTransport:
    """An httpx / httpx2 transport that waits in ratequeue's queue before each call.

    ``limit`` is a :class:`~ratequeue.Limiter`, :class:`~ratequeue.Policy` or
    :class:`~ratequeue.Pool`. Each call is estimated (1 request; prompt + max output
    tokens), capped (``caps``), checked against the :class:`CallBudget` of its context,
    held in the ``ledger``, then acquired with ``timeout`` as the bound on its queue wait
    (``Overloaded`` / ``WaitTimeout`` otherwise; nothing is sent). The response settles
    the permit, budget and ledger with the real usage. A 429 puts the provider's limiter
    in debt until the provider's reset (at most ``max_pause`` s; ``default_pause``
    without headers) and a Pool in cooldown; ``calibrate=True`` sets the local rates to
    the limits the headers state.
    """

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
        self._bursts = self._unit_bursts()
        self.wait_histogram = Histogram()
        self.http_histogram = Histogram()
        self._applied: dict[tuple[int, str], tuple[float, float]] = {}
        self._lock = threading.Lock()
        self._counts = {"calls": 0, "sent": 0, "rate_limited": 0, "paused": 0, "calibrated": 0}

    # -- the steps of a call -------------------------------------------------------------

    def _unit_bursts(self) -> dict[str, int]:
        """Per unit, the largest cost any route could admit (estimates are clamped to it)."""
        limiters: list[Limiter] = []
        if isinstance(self.limit, Pool):
            limiters = [p.limiter for p in self.limit.providers]
        elif self.upstream is not None:
            limiters = [self.upstream]
        out: dict[str, int] = {}
        for lim in limiters:
            per: dict[str, int] = {}
            for r in lim.rates:
                per[r.unit] = min(per.get(r.unit, r.burst), r.burst)
            for u, b in per.items():
                out[u] = max(out.get(u, 0), b)
        return out

    def _prepare(self, request: Any) -> _Call:
        call = _Call()
        headers = request.headers
        priority = task = account = request_id = length = None
        own = False
        for k, v in headers.raw:  # one pass over the raw pairs: far cheaper than lookups
            if k[0] not in _REQUEST_FIRST:
                continue
            lk = k.lower()
            if lk.startswith(b"x-ratequeue-"):
                own = True
                if lk == b"x-ratequeue-priority":
                    priority = v.decode("latin-1")
                elif lk == b"x-ratequeue-task":
                    task = v.decode("latin-1")
                elif lk == b"x-ratequeue-account":
                    account = v.decode("latin-1")
            elif lk == b"idempotency-key":
                request_id = v.decode("latin-1")
            elif lk == b"content-length":
                length = v
        if own:
            for h in _OWN_HEADERS:
                if h in headers:
                    del headers[h]
        opts = current_options()
        priority = priority or opts.priority or self.priority
        task = task or opts.task
        account = account or opts.account
        body_bytes = self._body(request, length)
        path = request.url.path
        body: dict[str, Any] | None = None
        if body_bytes:
            try:
                parsed = json.loads(body_bytes)
            except ValueError:
                parsed = None
            body = parsed if isinstance(parsed, dict) else None
        changed = False
        capped = None
        if body is not None:
            if self.caps:
                capped = apply_caps(self.caps, body, path, task)
                changed = capped is not None
            if (
                self.stream_usage
                and body.get("stream") is True
                and path.endswith("/chat/completions")
            ):
                so = body.get("stream_options")
                if not (isinstance(so, dict) and so.get("include_usage") is True):
                    body["stream_options"] = {
                        **(so if isinstance(so, dict) else {}),
                        "include_usage": True,
                    }
                    changed = True
        est = self.estimator(body, path)
        model = body.get("model") if body is not None else None
        model = model if isinstance(model, str) else None
        request_id = request_id or new_id()
        if changed and body is not None:
            data = json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode()
            new_headers = headers.copy()
            del new_headers["content-length"]
            request = type(request)(
                request.method,
                request.url,
                headers=new_headers,
                content=data,
                extensions=request.extensions,
            )
        call.request = request
        call.record = CallRecord(request_id, path, model, est, capped, priority, task)
        call.costs = self._costs(est)
        if callable(self.account):
            account = account or self.account(request)
        call.account = account or (self.account if isinstance(self.account, str) else "default")
        sub = _budget.charge(request_id, model, est.input_tokens, est.output_tokens)
        if sub is not None:
            b = _budget.current_budget()
            call.sub, call.chain = sub, (b.chain() if b is not None else [])
        if self.ledger is not None:
            try:
                self.ledger.hold(
                    request_id,
                    call.account,
                    input_tokens=est.input_tokens,
                    output_tokens=est.output_tokens,
                    calls=1,
                    model=model,
                    parent_id=call.chain[-1].id if call.chain else None,
                    meta={"path": path, "task": task},
                )
            except BaseException:
                self._unwind(call, None)
                raise
            call.held = True
        with self._lock:
            self._counts["calls"] += 1
        return call

    def _costs(self, est: Estimate) -> dict[str, int]:
        all_costs = {
            "requests": 1,
            "tokens": est.tokens,
            "input_tokens": est.input_tokens,
            "output_tokens": est.output_tokens,
        }
        out = {}
        for u in self.units:
            c = all_costs.get(u, 1)
            b = self._bursts.get(u)
            out[u] = c if b is None else min(c, b)
        return out

    def _acquire_args(self, call: _Call) -> dict[str, Any]:
        kw: dict[str, Any] = dict(call.costs)
        if isinstance(self.limit, Policy):
            keys = dict(current_options().keys)
            if self.keys is not None:
                keys.update(self.keys(call.request))
            kw.update(keys)
        elif call.record.priority is not None:
            kw["priority"] = call.record.priority
        kw["timeout"] = self.timeout
        return kw

    def _granted(self, call: _Call, grant: Any, waited: float) -> None:
        if isinstance(self.limit, Pool):
            call.provider, call.permit = grant
            call.record.provider = call.provider.name
            base = self.urls.get(call.provider.name)
            if base is not None:
                url = call.request.url.copy_with(**split_base(base, call.request.url))
                call.request.url = url
                call.request.headers["host"] = url.netloc.decode("ascii")
        else:
            call.permit = grant
        call.record.waited = waited
        self.wait_histogram.record(waited)

    def _provider_limiter(self, call: _Call) -> Limiter | None:
        return call.provider.limiter if call.provider is not None else self.upstream

    def _received(self, call: _Call, response: Any, http_seconds: float, is_async: bool) -> Any:
        rec = call.record
        rec.http_seconds = http_seconds
        rec.status = status = response.status_code
        self.http_histogram.record(http_seconds)
        with self._lock:
            self._counts["sent"] += 1
        info = _NO_LIMITS
        raw = response.headers.raw
        ctype, exhausted = scan_response(raw)
        if status == 429 or self.calibrate or exhausted:
            info = parse_raw_headers(raw)
            rec.rate_limits = info if info else None
        limiter = self._provider_limiter(call)
        paused = False
        if info and limiter is not None:
            paused = self._follow(info, limiter)
        if status == 429:
            with self._lock:
                self._counts["rate_limited"] += 1
            wait = info.wait()
            wait = min(self.max_pause, self.default_pause if wait is None else wait)
            if limiter is not None and wait > 0:
                # Every call costs one request: pausing that unit stops them all without
                # emptying the token buckets (an exhausted quota was paused above).
                limiter.pause(wait, unit="requests" if "requests" in limiter.units else None)
                paused = True
                with self._lock:
                    self._counts["paused"] += 1
            if isinstance(self.limit, Pool) and call.provider is not None:
                self.limit.report(call.provider, 429, retry_after=wait)
                paused = True
            self._settle(call, None, status, rate_limited=True)
            if paused and self.retry_hint:
                hint_retry(response.headers)
        elif isinstance(self.limit, Pool) and call.provider is not None:
            self.limit.report(call.provider, status)
        if status >= 300 and status != 429:
            self._settle(call, None, status)
        response.extensions["ratequeue"] = rec
        if call.done:
            return response
        wrap(response, call, self, is_async, ctype.startswith(b"text/event-stream"))
        return response

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
                        with self._lock:
                            self._counts["calibrated"] += 1
                        self._bursts = self._unit_bursts()  # estimates clamp to the new burst
                    self._applied[key] = (q.limit, q.window)
            if q.remaining is not None and q.remaining <= 0 and q.reset:
                limiter.pause(min(q.reset, self.max_pause), unit=dim if dim in units else None)
                paused = True
        return paused

    def _settle(
        self, call: _Call, usage: Usage | None, status: int | None, *, rate_limited: bool = False
    ) -> None:
        """Settle the permit, budget and ledger once: real usage, or nothing used."""
        with call.lock:
            if call.done:
                return
            call.done = True
        rec = call.record
        rec.usage, rec.settled = usage, True
        try:
            if call.permit is not None:
                used = usage if usage is not None else Usage(0, 0)
                actual = {
                    "requests": 1,
                    "tokens": used.tokens,
                    "input_tokens": used.input_tokens,
                    "output_tokens": used.output_tokens,
                }
                costs = {u: actual.get(u, c) for u, c in call.costs.items()}
                if call.provider is not None:
                    costs = call.provider.costs_for(costs)
                call.permit.settle(**costs)
        finally:
            try:
                if call.permit is not None and hasattr(call.permit, "release"):
                    call.permit.release()
            finally:
                if call.sub is not None:
                    if rate_limited:
                        _budget.uncount(call.sub, call.chain, status)
                    else:
                        u = usage if usage is not None else Usage(0, 0)
                        _budget.settle(
                            call.sub, call.chain, u.input_tokens, u.output_tokens, status
                        )
                if call.held and self.ledger is not None:
                    if usage is None:
                        self.ledger.release(rec.request_id)
                    else:
                        self.ledger.settle(
                            rec.request_id,
                            input_tokens=usage.input_tokens,
                            output_tokens=usage.output_tokens,
                            calls=1,
                            model=rec.model,
                        )

    def _unwind(self, call: _Call, permit: Any) -> None:
        """Nothing was sent: give back the budget, the ledger hold and the permit."""
        call.done = True
        if call.sub is not None:
            _budget.uncount(call.sub, call.chain, None)
        if call.held and self.ledger is not None:
            self.ledger.release(call.record.request_id)
        if permit is not None:
            zero = {u: 0 for u in call.costs}
            if call.provider is not None:
                zero = call.provider.costs_for(zero)
            permit.settle(**zero)
            if hasattr(permit, "release"):
                permit.release()

    def _failed(self, call: _Call) -> None:
        """Sent but no response (connection error, timeout, cancel): no tokens used."""
        if isinstance(self.limit, Pool) and call.provider is not None:
            self.limit.report(call.provider, ok=False)
        self._settle(call, None, None)

    def _reclamp(self, call: _Call) -> bool:
        """After a CostTooLarge: re-read the bursts (changed since) and clamp the call's
        costs again; False when nothing changed (the cost can never fit)."""
        self._bursts = self._unit_bursts()
        costs = self._costs(call.record.estimate)
        if costs == call.costs:
            return False
        call.costs = costs
        return True

    def _retry_too_large(self, call: _Call, acquire: Callable[..., Any]) -> Any:
        try:
            return acquire(**self._acquire_args(call))
        except CostTooLarge:
            if not self._reclamp(call):
                raise
            return acquire(**self._acquire_args(call))

    # -- httpx entry points ----------------------------------------------------------------

    def _body(self, request: Any, length: bytes | None) -> bytes | None:
        if length is None or not length.isdigit() or int(length) > self.max_body:
            return None
        if request.method not in ("POST", "PUT", "PATCH"):
            return None
        try:
            return bytes(request.content)
        except Exception:  # a stream not read (RequestNotRead): estimate without it
            return None

    def handle_request(self, request: Any) -> Any:
        """Wait for a permit (GIL released), send, and settle when the body is read."""
        try:
            call = self._prepare(request)
            t0 = time.perf_counter()
            try:
                grant: Any = self._retry_too_large(call, self.limit.acquire)
            except BaseException:
                self._unwind(call, None)
                raise
        except RateQueueError as e:
            for_sdk(e, request)
            raise
        t1 = time.perf_counter()
        self._granted(call, grant, t1 - t0)
        try:
            response = self.inner.handle_request(call.request)
        except BaseException:
            self._failed(call)
            raise
        return self._received(call, response, time.perf_counter() - t1, False)

    async def handle_async_request(self, request: Any) -> Any:
        """The asyncio form: one wake-up per grant, no polling; cancellation gives back."""
        try:
            call = self._prepare(request)
            t0 = time.perf_counter()
            try:
                try:
                    grant: Any = await self.limit.acquire_async(**self._acquire_args(call))
                except CostTooLarge:
                    if not self._reclamp(call):
                        raise
                    grant = await self.limit.acquire_async(**self._acquire_args(call))
            except BaseException:
                self._unwind(call, None)
                raise
        except RateQueueError as e:
            for_sdk(e, request)
            raise
        t1 = time.perf_counter()
        self._granted(call, grant, t1 - t0)
        try:
            response = await self.inner.handle_async_request(call.request)
        except BaseException:
            self._failed(call)
            raise
        return self._received(call, response, time.perf_counter() - t1, True)

    def close(self) -> None:
        """Close the inner transport."""
        if hasattr(self.inner, "close"):
            self.inner.close()

    async def aclose(self) -> None:
        """Close the inner async transport."""
        if hasattr(self.inner, "aclose"):
            await self.inner.aclose()

    def __enter__(self) -> RateLimitedTransport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def __aenter__(self) -> RateLimitedTransport:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def stats(self) -> dict[str, Any]:
        """Counters (calls, sent, rate_limited, paused, calibrated) and the p50/p99 of the
        queue wait and the HTTP time, in seconds."""
        with self._lock:
            out: dict[str, Any] = dict(self._counts)
        for name, h in (("wait", self.wait_histogram), ("http", self.http_histogram)):
            out[f"{name}_p50"], out[f"{name}_p99"] = (
                h.percentiles([50, 99]) if h.count else (0.0, 0.0)
            )
        return out
