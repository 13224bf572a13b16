"""RateLimitMiddleware: a Policy per request for any ASGI app, with the IETF RateLimit
fields, queueing before refusing, and token costs settled from the response."""

from __future__ import annotations

import asyncio
import hashlib
import math
import secrets
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, MutableMapping, Sequence
from typing import Any

from .._errors import CostTooLarge, RateQueueError
from .._ratequeue import Histogram, Policy, PolicyPermit
from ._fields import (
    Level,
    LevelView,
    Quota,
    ceil_seconds,
    policy_field,
    problem_body,
    ratelimit_field,
    sf_bytes,
)
from ._keys import KeyFunc, Scope, header_value
from ._rules import Rule
from ._tokens import UsageScanner

__all__ = ["ASGIApp", "RateLimitMiddleware"]

Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

#: Outcomes counted per rule (and exported by the Prometheus endpoint).
OUTCOMES = ("admitted", "queued", "refused", "too_large", "gone", "exempt")


class _Plan:
    """A rule resolved against the middleware's levels: its Policy and field views."""

    def __init__(
        self, rule: Rule, views: list[LevelView], shadow: list[str], policy: Policy | None
    ) -> None:
        self.rule = rule
        self.policy = policy
        # Every level is evaluated (shadow ones need keys and costs); enforced ones are
        # advertised.
        self.views = [v for v in views if v.name not in shadow]
        self.keyed = [v.name for v in views if v.keyed]
        self.units = {u for v in views for u in v.units()}
        self.level_of = {q.name: v.name for v in self.views for q in v.quotas}
        self.static_policy = policy_field(self.views, {}) if self.views else b""
        self.static_costs: dict[str, int] | None = None
        if rule.cost is None or isinstance(rule.cost, Mapping):
            costs = rule.cost or {}
            self.static_costs = {u: c for u, c in costs.items() if u in self.units}
        self.counts = dict.fromkeys(OUTCOMES, 0)


class RateLimitMiddleware:
    """Pure ASGI middleware: each HTTP request passes the levels its rule names, all or
    nothing, waiting up to its class's ``max_wait`` before a 429; every response carries
    ``RateLimit-Policy`` and ``RateLimit`` (draft-ietf-httpapi-ratelimit-headers) as
    valid Structured Fields. Lifespan and websocket scopes pass through untouched.

    ``levels``: name -> Limiter | KeyedLimiter | Concurrency | KeyedConcurrency, in the
    order they are passed. ``keys``: name of each keyed level -> key function of the
    scope (a request without a key counts against ``anonymous_key``, which no header can
    spell: it holds a NUL). ``rules``: the first rule matching the method and path
    applies; no match passes the request untouched. ``max_wait``: seconds a request may
    queue before a 429 (0: refuse at once).
    ``classes``: class name -> max_wait seconds, chosen by a rule's ``priority`` or by the
    ``class_header`` (only names listed here). ``shadow``: levels evaluated, never
    enforced. ``legacy_headers``: also ``X-RateLimit-Limit/Remaining/Reset`` of the
    tightest quota. ``partition_keys``: send ``pk`` (a keyed hash of the key, never the
    key). ``metrics_path``: serve Prometheus text there (needs prometheus_client).
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        levels: Mapping[str, Level],
        keys: Mapping[str, KeyFunc] | None = None,
        rules: Sequence[Rule] = (Rule(),),
        max_wait: float = 0.0,
        classes: Mapping[str, float] | None = None,
        class_header: str | None = None,
        shadow: Iterable[str] = (),
        legacy_headers: bool = False,
        partition_keys: bool = False,
        pk_secret: bytes | None = None,
        anonymous_key: str = "\x00anonymous",
        metrics_path: str | None = None,
        registry: Any = None,
    ) -> None:
        self.app = app
        if not isinstance(levels, Mapping) or not levels:
            raise TypeError("levels must be a non-empty dict of level name to limit")
        self.views = {name: LevelView(name, lv) for name, lv in levels.items()}
        self.keys = dict(keys or {})
        for name in self.keys:
            if name not in self.views:
                raise ValueError(f"keys names {name!r}, which is not a level")
        self.max_wait = _seconds("max_wait", max_wait)
        self.classes = {c: _seconds(f"classes[{c!r}]", w) for c, w in (classes or {}).items()}
        self.class_header = class_header.lower().encode("latin-1") if class_header else None
        self._class_names = {c.encode("latin-1"): c for c in self.classes}
        self.shadow = list(shadow)
        for s in self.shadow:
            if s not in self.views:
                raise ValueError(f"shadow names {s!r}, which is not a level")
        self.legacy_headers = bool(legacy_headers)
        self.partition_keys = bool(partition_keys)
        self._pk_secret = pk_secret if pk_secret is not None else secrets.token_bytes(16)
        self.anonymous_key = anonymous_key
        self.wait_histogram = Histogram()
        policies: dict[tuple[str, ...], Policy] = {}
        self.plans: list[_Plan] = []
        for rule in rules:
            if not isinstance(rule, Rule):
                raise TypeError(f"rules must be Rule objects, got {type(rule).__name__}")
            names = tuple(self.views) if rule.levels is None else tuple(rule.levels)
            for n in names:
                if n not in self.views:
                    raise ValueError(f"rule {rule.label!r} names level {n!r}, which is not one")
                if self.views[n].keyed and n not in self.keys:
                    raise ValueError(f"keyed level {n!r} needs a key function in keys=")
            if rule.priority is not None and rule.priority not in self.classes:
                raise ValueError(f"rule {rule.label!r}: priority={rule.priority!r} not in classes")
            views = [self.views[n] for n in names]
            policy = None
            if names:
                if names not in policies:
                    policies[names] = Policy(
                        {n: levels[n] for n in names},
                        shadow=[s for s in self.shadow if s in names] or None,
                    )
                policy = policies[names]
            plan = _Plan(rule, views, self.shadow, policy)
            _check_costs(rule, plan.units)
            self.plans.append(plan)
        self.policies = list(policies.values())
        self.metrics_path = metrics_path
        self._metrics: Callable[[], bytes] | None = None
        if metrics_path is not None:
            from ._metrics import metrics_endpoint

            self._metrics = metrics_endpoint(self, registry)

    def stats(self) -> dict[str, dict[str, int]]:
        """Requests per rule (its ``name`` or path) by outcome: admitted (at once), queued,
        refused (429), too_large (413), gone (left while queued), exempt."""
        out: dict[str, dict[str, int]] = {}
        for plan in self.plans:
            counts = out.setdefault(plan.rule.label, dict.fromkeys(OUTCOMES, 0))
            for k, n in plan.counts.items():
                counts[k] += n
        return out

    # -- per request --------------------------------------------------------------------

    def match(self, method: str, path: str) -> _Plan | None:
        """The plan of the first rule matching, or None."""
        for plan in self.plans:
            if plan.rule.matches(method, path):
                return plan
        return None

    def _key(self, name: str, scope: Scope) -> str:
        k = self.keys[name](scope)
        return self.anonymous_key if k is None else k

    def _pk(self, key: str) -> str:
        digest = hashlib.blake2b(key.encode(), digest_size=12, key=self._pk_secret).digest()
        return sf_bytes(digest)

    def _max_wait(self, plan: _Plan, scope: Scope) -> float:
        if plan.rule.max_wait is not None:
            return float(plan.rule.max_wait)
        cls = plan.rule.priority
        if self.class_header is not None:
            v = header_value(scope, self.class_header)
            if v is not None and v.strip() in self._class_names:
                cls = self._class_names[v.strip()]
        if cls is not None:
            return self.classes[cls]
        return self.max_wait

    def _fields(
        self,
        plan: _Plan,
        keys: dict[str, str],
        extra: list[tuple[bytes, bytes]],
        rows: list[tuple[Quota, int, int | None]] | None = None,
    ) -> list[tuple[bytes, bytes]]:
        """RateLimit-Policy, RateLimit (and the legacy fields) for this request, now."""
        if not plan.views:
            return extra
        pks = {n: self._pk(k) for n, k in keys.items()} if self.partition_keys else {}
        if rows is None:
            rows = [row for v in plan.views for row in v.remaining(keys.get(v.name))]
        pol = policy_field(plan.views, pks) if pks else plan.static_policy
        out = [
            (b"ratelimit-policy", pol),
            (b"ratelimit", ratelimit_field(rows, pks, plan.level_of)),
        ]
        if self.legacy_headers and rows:
            qu, r, t = min(rows, key=lambda row: row[1] / max(row[0].q, 1))
            out += [
                (b"x-ratelimit-limit", str(qu.q).encode()),
                (b"x-ratelimit-remaining", str(r).encode()),
                (b"x-ratelimit-reset", str(t or 0).encode()),
            ]
        return out + extra

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path, method = scope["path"], scope["method"]
        if self._metrics is not None and path == self.metrics_path and method == "GET":
            await _respond(send, 200, self._metrics(), b"text/plain; version=0.0.4", [])
            return
        plan = self.match(method, path)
        if plan is None:
            await self.app(scope, receive, send)
            return
        if plan.policy is None:
            plan.counts["exempt"] += 1
            await self.app(scope, receive, send)
            return
        await self._limited(plan, scope, receive, send)

    async def _limited(self, plan: _Plan, scope: Scope, receive: Receive, send: Send) -> None:
        rule = plan.rule
        keys = {n: self._key(n, scope) for n in plan.keyed}
        bodyless = False
        if plan.static_costs is not None:
            costs = plan.static_costs if rule.tokens is None else dict(plan.static_costs)
        else:
            costs = {u: c for u, c in rule.costs(scope).items() if u in plan.units}
        if rule.tokens is not None:
            body = await _read_body(scope, receive, rule.tokens.max_body)
            if body is None:  # the client left
                return
            if isinstance(body, int):
                plan.counts["too_large"] += 1
                detail = f"request body over {rule.tokens.max_body} bytes"
                fields = self._fields(plan, keys, [])
                await _respond(send, 413, problem_body(413, detail, []), _PROBLEM, fields)
                return
            costs[rule.tokens.unit] = rule.tokens.estimate(body, scope.get("path", "/"))
            receive = _replay(body, receive)
            # No body (a GET): settled to nothing when its response reports no usage (it
            # may still stream a generation whose prompt is in its query: usage charged).
            bodyless = not body
        assert plan.policy is not None
        start = time.perf_counter()
        try:
            # Lock-free when admitted at once (it never passes waiters); else the queue.
            permit: PolicyPermit | None = plan.policy.try_acquire(**keys, **costs)
            at_once = permit is not None
            if permit is None:
                timeout = self._max_wait(plan, scope)
                if timeout > 0:
                    permit, receive = await _wait_unless_gone(
                        plan.policy, receive, timeout, {**keys, **costs}
                    )
                    if permit is None:  # the client left while queued: nothing taken
                        plan.counts["gone"] += 1
                        return
                else:
                    permit = await plan.policy.acquire_async(timeout=0.0, **keys, **costs)
        except CostTooLarge as e:
            plan.counts["too_large"] += 1
            violated = [
                q.name
                for v in plan.views
                for q in v.quotas
                if q.burst is not None and costs.get(q.unit, 0) > q.burst
            ]
            body413 = problem_body(413, str(e), violated)
            await _respond(send, 413, body413, _PROBLEM, self._fields(plan, keys, []))
            return
        except RateQueueError as e:
            plan.counts["refused"] += 1
            await self._refuse(plan, scope, send, keys, costs, e, time.perf_counter() - start)
            return
        assert permit is not None
        # Queued means it waited in the policy's queue (its delay, in the clock's time),
        # never that the host was slow to run this coroutine; a queued wait counts its
        # wall time too.
        queued = not at_once and permit.delay > 0
        waited = max(time.perf_counter() - start, permit.delay) if queued else 0.0
        self.wait_histogram.record(waited)
        plan.counts["queued" if queued else "admitted"] += 1
        timing = (b"server-timing", f"queue;dur={waited * 1000:.3f}".encode())
        scanner = UsageScanner() if rule.tokens is not None else None
        status = 0
        # A whole JSON answer (not an event stream) to a request without a body that
        # reports no usage: nothing was generated (it had nothing to generate from).
        whole = False
        json_answer = False

        async def send_with_fields(message: Message) -> None:
            nonlocal status, scanner, whole, json_answer
            if message["type"] == "http.response.start":
                status = int(message["status"])
                headers = list(message.get("headers", ()))
                media = _readable_type(headers)
                if media is None:
                    scanner = None  # the estimate stays
                json_answer = media is not None and (
                    media == b"application/json" or media.endswith(b"+json")
                )
                headers += self._fields(plan, keys, [timing])
                message = {**message, "headers": headers}
            elif message["type"] == "http.response.body":
                if scanner is not None:
                    scanner.feed(message.get("body", b""))
                whole = not message.get("more_body", False)
            await send(message)

        returned = False
        try:
            await self.app(scope, receive, send_with_fields)
            returned = True
        finally:
            try:
                if rule.tokens is not None:
                    actual = scanner.total if scanner is not None else None
                    nothing = (
                        bodyless
                        and returned
                        and whole
                        and json_answer
                        and 200 <= status < 300
                        and scanner is not None
                    )
                    if actual is None and (status >= 400 or nothing):
                        # An error that reports no usage consumed nothing upstream.
                        actual = 0
                    if actual is not None:
                        permit.settle(**{rule.tokens.unit: actual})
            finally:
                permit.release()

    async def _refuse(
        self,
        plan: _Plan,
        scope: Scope,
        send: Send,
        keys: dict[str, str],
        costs: dict[str, int],
        err: RateQueueError,
        waited: float,
    ) -> None:
        violated: list[str] = []
        for v in plan.views:
            violated += v.violated(keys.get(v.name), costs)
        if not violated:
            # Decided in a race since: name the level the policy named, else every one.
            msg = str(err)
            named = [v for v in plan.views if f'level "{v.name}"' in msg]
            violated = [q.name for v in (named or plan.views) for q in v.quotas]
        rows = [row for v in plan.views for row in v.remaining(keys.get(v.name))]
        # Retry-After is never earlier than the reset of a quota it names.
        resets = [t for qu, _, t in rows if t is not None and qu.name in violated]
        retry = max(1, ceil_seconds(err.retry_after), *resets)
        extra = [
            (b"retry-after", str(retry).encode()),
            (b"server-timing", f"queue;dur={waited * 1000:.3f}".encode()),
        ]
        detail = f"over quota; retry after {retry} s"
        body = problem_body(429, detail, violated)
        await _respond(send, 429, body, _PROBLEM, self._fields(plan, keys, extra, rows))


_PROBLEM = b"application/problem+json"


def _seconds(name: str, v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise TypeError(f"{name} must be a number of seconds, got {type(v).__name__}")
    if not (math.isfinite(v) and v >= 0):
        raise ValueError(f"{name}={v!r} must be a finite number >= 0 seconds")
    return float(v)


def _check_costs(rule: Rule, units: set[str]) -> None:
    named = set(rule.cost) if isinstance(rule.cost, Mapping) else set()
    if rule.tokens is not None:
        named.add(rule.tokens.unit)
        if rule.tokens.unit not in units:
            raise ValueError(
                f"rule {rule.label!r} estimates {rule.tokens.unit!r}, which no level counts"
            )
    if callable(rule.cost) and not isinstance(rule.cost, Mapping):
        return
    missing = sorted(u for u in units if u != "requests" and u not in named)
    if missing:
        raise ValueError(f"rule {rule.label!r} gives no cost for unit(s) {missing}: cost={{...}}")


def _readable_type(headers: list[tuple[bytes, bytes]]) -> bytes | None:
    """The media type of an answer whose usage is read (uncompressed JSON or event
    streams: a body of another type may echo text a client wrote, usage included), else
    None."""
    ctype = b""
    for k, v in headers:
        k = k.lower()
        if k == b"content-encoding" and v.strip().lower() not in (b"", b"identity"):
            return None
        if k == b"content-type":
            ctype = v.split(b";", 1)[0].strip().lower()
    return ctype if ctype in _USAGE_TYPES or ctype.endswith(b"+json") else None


_USAGE_TYPES = (b"application/json", b"text/event-stream", b"application/x-ndjson")


async def _respond(
    send: Send, status: int, body: bytes, ctype: bytes, headers: list[tuple[bytes, bytes]]
) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", ctype),
                (b"content-length", str(len(body)).encode()),
                *headers,
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


async def _read_body(scope: Scope, receive: Receive, cap: int) -> bytes | int | None:
    """The whole request body, or its size once over ``cap`` (nothing more is read), or
    None when the client disconnected."""
    cl = (header_value(scope, b"content-length") or b"").strip()
    if cl.isdigit() and (len(cl) > 18 or int(cl) > cap):
        return int(cl) if len(cl) <= 18 else cap + 1
    chunks: list[bytes] = []
    size = 0
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            return None
        chunk = msg.get("body", b"")
        size += len(chunk)
        if size > cap:
            return size
        chunks.append(chunk)
        if not msg.get("more_body", False):
            return b"".join(chunks)


async def _wait_unless_gone(
    policy: Policy, receive: Receive, timeout: float, kw: dict[str, Any]
) -> tuple[PolicyPermit | None, Receive]:
    """Waits in the policy's queues while watching for the client to disconnect.

    Reads at most one request message meanwhile (kept, and replayed to the app), so
    nothing is buffered beyond what the server already holds; after a whole body (one
    message) it goes on watching, as only a disconnect can come next. Returns (None, ...) when
    the client left first: the wait is cancelled, which gives back whatever it held.
    """
    kept: list[Message] = []

    async def acquire() -> PolicyPermit:
        permit: PolicyPermit = await policy.acquire_async(timeout=timeout, **kw)
        return permit

    async def watch() -> None:
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            kept.append(msg)
            if msg.get("more_body", False):
                await asyncio.Event().wait()  # reading on would buffer the body: stop
            # The body is whole: the next message can only be the disconnect.

    waiting = asyncio.ensure_future(acquire())
    watcher = asyncio.ensure_future(watch())
    try:
        await asyncio.wait((waiting, watcher), return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # this request was cancelled (server shutting down, ...)
        watcher.cancel()
        await _abandon(waiting)
        raise
    watcher.cancel()
    if not waiting.done():
        await _abandon(waiting)
        return None, receive
    await asyncio.gather(watcher, return_exceptions=True)
    permit = waiting.result()  # raises the refusal
    if not kept:
        return permit, receive
    first: Message | None = kept[-1]  # at most one http.request message

    async def replay() -> Message:
        nonlocal first
        if first is not None:
            msg, first = first, None
            return msg
        return await receive()

    return permit, replay


async def _abandon(waiting: asyncio.Future[PolicyPermit]) -> None:
    """Ends a wait nobody will use: leaves the queue, or gives back a grant that raced."""
    waiting.cancel()
    await asyncio.wait((waiting,))  # never raises the wait's own outcome
    if not waiting.cancelled() and waiting.exception() is None:
        waiting.result().cancel()


def _replay(body: bytes, receive: Receive) -> Receive:
    """A receive that gives the body already read, then defers to the server's."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
