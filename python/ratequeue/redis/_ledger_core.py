"""The core of the Redis ledger (``RedisLedger`` is in ``_ledger``): the script, keys,
the per-account command parts and the two drivers. One Lua script per call
(``ledger.lua``, package data) checks the request id, deducts and records threshold
crossings in one round trip.

Keys: ``{prefix}{{tag}}:a`` (account: plan, version, bonus), ``:p:<period>`` (usage,
holds, fired thresholds), ``:r:<request id>`` (the request, kept ``retention``), ``:h``
(hold expiries), ``:rows`` (usage rows, a stream capped at ``max_rows``), ``:o`` (outbox),
``:audit`` (compensation audit); the tag is the account, so one account's keys share a
Redis Cluster slot. Integers must stay below 2**53 (Lua numbers are doubles).

Each call is written once as a generator of Redis commands (``_*_call``, ``_*_flow``);
``_drive`` runs it on the blocking client and ``_adrive`` on a ``redis.asyncio`` client,
so that the asyncio twins (``charge_async``...) wait on the event loop, not on a worker
thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import heapq
import importlib.resources
import itertools
import logging
import os
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Generator, Sequence
from typing import Any, TypeVar

import redis
import redis.asyncio
import redis.exceptions

from .._cancel import cancel_requests, swallowed
from ..ledger._base import LedgerBase, _executor
from ..ledger._model import (
    ClockLike,
    LedgerError,
    Plan,
    Span,
    check_id,
)
from ._connection import cancel_safe
from ._ledger_codec import (
    _Ctx,
    _flat,
    _Info,
    _pack_items,
)
from ._ledger_wire import _Wire


def _script_text() -> str:
    """``ledger.lua`` as sent to Redis, without its comment lines."""
    src = importlib.resources.files(__package__).joinpath("ledger.lua").read_text("utf-8")
    return "".join(
        line for line in src.splitlines(keepends=True) if not line.lstrip().startswith("--")
    )


LUA = _script_text()
LUA_SHA = hashlib.sha1(LUA.encode()).hexdigest()
#: Lua numbers are doubles: amounts and totals stay below this in Redis.
MAX_REDIS_AMOUNT = 2**53 - 1
_INFO_FIELDS = ("ver", "plan", "anchor", "thr")
#: Tries of a cancelled asyncio call finished on the blocking client (about 30 s of
#: pauses in all while Redis is unreachable).
_FINISH_ATTEMPTS = 20
_log = logging.getLogger("ratequeue.ledger")


class PlanChanging(LedgerError):
    """An account's plan changed under one call three times in a row: transient (the call
    may be tried again), as an unreachable Redis is."""


#: Seconds between scans for outboxes whose pending hint was lost (a crash).
SWEEP_SECONDS = 60.0

T = TypeVar("T")
#: A step of a call: ("eval", items[, packed]) runs the script (items: the ``EVALSHA``
#: command as scalars and ``_Seg`` parts; packed: the same in RESP, when made already);
#: ("cmd", *args) any other command.
_Step = tuple[Any, ...]
_Flow = Generator[_Step, Any, T]

_ASYNC_CONN = {
    redis.Connection: redis.asyncio.Connection,
    redis.SSLConnection: redis.asyncio.SSLConnection,
    redis.UnixDomainSocketConnection: redis.asyncio.UnixDomainSocketConnection,
}
_ASYNC_KWARGS = (
    "db",
    "username",
    "password",
    "socket_timeout",
    "socket_connect_timeout",
    "socket_keepalive",
    "socket_keepalive_options",
    "encoding",
    "encoding_errors",
    "decode_responses",
    "client_name",
    "health_check_interval",
    "host",
    "port",
    "path",
    "ssl_keyfile",
    "ssl_certfile",
    "ssl_cert_reqs",
    "ssl_ca_certs",
    "ssl_ca_data",
    "ssl_check_hostname",
)


def _async_twin(client: Any) -> Any:
    """A ``redis.asyncio`` client for the same server(s) as a blocking client, with its
    timeouts; a single server's sends without ``asyncio.wait_for`` (``cancel_safe``)."""
    if isinstance(client, redis.cluster.RedisCluster):
        found = client.get_nodes()  # type: ignore[no-untyped-call]
        nodes = [redis.asyncio.cluster.ClusterNode(n.host, n.port) for n in found]
        return redis.asyncio.cluster.RedisCluster(startup_nodes=nodes)
    pool = getattr(client, "connection_pool", None)
    cls = _ASYNC_CONN.get(getattr(pool, "connection_class", None))  # type: ignore[arg-type]
    if pool is None or cls is None:
        raise TypeError(
            f"cannot derive a redis.asyncio client from {type(client).__name__}: pass async_client="
        )
    kw = {k: v for k, v in pool.connection_kwargs.items() if k in _ASYNC_KWARGS}
    return redis.asyncio.Redis(
        connection_pool=redis.asyncio.ConnectionPool(connection_class=cancel_safe(cls), **kw)
    )


class _RedisLedgerCore(LedgerBase):
    """A quota ledger in Redis shared by every process using the same ``name``.

    ``client``: a ``redis.Redis`` or ``redis.cluster.RedisCluster``
    (``ratequeue.redis.connect`` gives short timeouts). The asyncio twins
    (``charge_async``, ``hold_async``, ``settle_async``, ``release_async``,
    ``balance_async``) use ``async_client`` (a ``redis.asyncio`` client), by default one
    made per event loop for the same server. Time comes from ``clock`` (default the wall
    clock of each process), so keep hosts' clocks in sync (periods are calendar-sized;
    seconds of skew only move a boundary).
    """

    def __init__(
        self,
        client: Any,
        *,
        name: str = "default",
        clock: ClockLike | None = None,
        retention: float | None = None,
        hold_ttl: float = 600.0,
        default_plan: Plan | None = None,
        max_rows: int = 100_000,
        async_client: Any = None,
    ) -> None:
        super().__init__(
            clock=clock, retention=retention, hold_ttl=hold_ttl, default_plan=default_plan
        )
        check_id("name", name)
        if "{" in name or "}" in name:
            raise ValueError(f"name={name!r} must not contain braces")
        if isinstance(max_rows, bool) or not isinstance(max_rows, int) or max_rows < 1:
            raise ValueError(f"max_rows={max_rows!r} must be an int >= 1")
        self.client = client
        self.name = name
        self.max_rows = max_rows
        self._prefix = f"rq:ledger:{name}:"
        self._info: OrderedDict[str, _Info] = OrderedDict()
        self._holds: OrderedDict[str, tuple[str, float]] = OrderedDict()
        self._lock = threading.Lock()
        _LEDGERS.add(self)
        self._last_sweep = float("-inf")
        self._async_client = async_client
        self._loop_clients: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Any] = (
            weakref.WeakKeyDictionary()
        )
        pool = getattr(client, "connection_pool", None)
        self._raw = (
            type(client) is redis.Redis
            and getattr(client, "connection", None) is None
            and isinstance(pool, redis.ConnectionPool)
        )
        # a plain client's scripts go on a connection per thread made like the pool's (no
        # pool get/release per call); ``close`` closes them
        self._wire_ok = self._raw
        self._local = threading.local()
        self._conns: weakref.WeakSet[Any] = weakref.WeakSet()

    # -- keys, the script and the two drivers --------------------------------------------

    def _pfx(self, account: str) -> str:
        braces = "{" in account or "}" in account
        tag = "x:" + account.encode().hex() if braces else "s:" + account
        return f"{self._prefix}{{{tag}}}:"

    def _ctx(self, account: str, info: _Info, span: Span) -> _Ctx:
        """The fixed parts of this account's commands in ``span`` (packed once)."""
        c = info.ctx.get(span.key)
        if c is None:
            pfx = self._pfx(account)
            c = _Ctx(LUA_SHA, pfx, info, span, int(self.retention) + 1, self.max_rows)
            if len(info.ctx) > 8:
                info.ctx.clear()
            info.ctx[span.key] = c
        return c

    def _op(
        self,
        op: str,
        account: str,
        info: _Info,
        span: Span,
        now: float,
        second: str,
        extra: Sequence[Any] = (),
        twelfth: str = "",
        index_key: str | None = None,
        units: str = "",
    ) -> _Step:
        """The script step of ``op`` (ARGV 3-11 from ``extra``, 13 ``units``)."""
        c = self._ctx(account, info, span)
        pad = ("",) * (9 - len(extra))
        if index_key is None:
            items = [c.head, self._pfx(account) + second, c.keys, op, repr(now), *extra, *pad]
        else:  # 7 keys
            p = self._pfx(account)
            items = ["EVALSHA", LUA_SHA, 7, p + "a", p + second, c.keys, index_key, op, repr(now)]
            items += [*extra, *pad]
        return ("eval", [*items, twelfth, units, c.tail])

    def _drive(self, flow: _Flow[T]) -> T:
        """Runs a call on the blocking client."""
        try:
            step = next(flow)
            while True:
                try:
                    reply = self._exec(step)
                except Exception as e:
                    step = flow.throw(e)
                else:
                    step = flow.send(reply)
        except StopIteration as stop:
            return stop.value  # type: ignore[no-any-return]

    def _resume(self, flow: _Flow[T], step: _Step) -> T:
        try:
            self._steps(flow, step, to_script=False)
        except StopIteration as stop:
            return stop.value  # type: ignore[no-any-return]
        raise AssertionError("unreachable")  # pragma: no cover

    def _steps(self, flow: _Flow[Any], step: _Step, *, to_script: bool) -> _Step:
        """Runs ``flow`` from ``step`` until it ends (``StopIteration``), or with
        ``to_script`` until its next step is a script (returned, not run)."""
        while not (to_script and step[0] == "eval"):
            try:
                reply = self._exec(step)
            except Exception as e:
                step = flow.throw(e)
            else:
                step = flow.send(reply)
        return step

    def _drive_many(self, flows: Sequence[_Flow[Any]]) -> list[Any]:
        """Runs several calls, their first scripts pipelined in one round trip (on a
        plain client), each going on alone if it needs more; each one's result or error."""
        out: list[Any] = [None] * len(flows)
        firsts: list[tuple[int, _Step]] = []
        for k, flow in enumerate(flows):
            try:  # e.g. the account's plan read first
                firsts.append((k, self._steps(flow, next(flow), to_script=True)))
            except StopIteration as stop:
                out[k] = stop.value
            except Exception as e:
                out[k] = e
        replies = self._pipeline([step for _, step in firsts])
        for (k, _step), reply in zip(firsts, replies, strict=True):
            flow = flows[k]
            try:
                nxt = flow.throw(reply) if isinstance(reply, Exception) else flow.send(reply)
                out[k] = self._resume(flow, nxt)
            except StopIteration as stop:
                out[k] = stop.value
            except Exception as e:
                out[k] = e
        return out

    def _pipeline(self, steps: Sequence[_Step]) -> list[Any]:
        """Each script step's reply or error: sent together on this thread's connection of
        a plain client (one at a time otherwise); a step refused with NOSCRIPT (not run) is
        sent again alone once the script is loaded."""
        if not self._wire_ok or len(steps) < 2:
            return [self._try(step) for step in steps]
        packed = b"".join(s[2] if s[2] is not None else _pack_items(s[1]) for s in steps)
        out = self._thread_conn().call_many(packed, len(steps))
        for k, r in enumerate(out):
            if isinstance(r, redis.exceptions.InvalidResponse):
                self._wire_ok = False  # a reply it cannot read: redis-py from now on
            if isinstance(r, (redis.exceptions.NoScriptError, redis.exceptions.InvalidResponse)):
                out[k] = self._try(steps[k])
        return out

    def _try(self, step: _Step) -> Any:
        try:
            return self._exec(step)
        except Exception as e:
            return e

    async def _adrive(self, flow: _Flow[T]) -> T:
        """Runs a call on the asyncio client of the running loop; a cancel the client
        swallowed (``_cancel``: a cluster's or the caller's own client) is raised after
        the step it came in, replied or failed."""
        client = self._aclient()
        before = cancel_requests()
        try:
            step = next(flow)
            while True:
                try:
                    reply = await self._aexec(client, step)
                except Exception as e:
                    if swallowed(before):  # then the call failed: still a cancelled call
                        raise asyncio.CancelledError() from e
                    step = flow.throw(e)
                else:
                    if swallowed(before):
                        raise asyncio.CancelledError()
                    step = flow.send(reply)
        except StopIteration as stop:
            return stop.value  # type: ignore[no-any-return]

    def _call(self, call: _Flow[T]) -> T:
        return self._drive(call)

    async def _call_async(
        self,
        call: _Flow[T],
        undo: _Flow[Any] | None = None,
        again: Callable[[], _Flow[Any]] | None = None,
        finish: bool = False,
    ) -> T:
        """Cancelled, whether the script ran is unknown (sent or not, a late reply): the
        same idempotent call runs ``again`` on the blocking client to finish it (or
        replay it), then ``undo``; both without the event loop. A cancel that the client
        swallowed (``_cancel``) counts as one: its reply is dropped, the same ending runs."""
        try:
            return await self._adrive(call)
        except asyncio.CancelledError:
            if again is not None or undo is not None:
                with contextlib.suppress(RuntimeError):  # the interpreter is shutting down
                    _executor().submit(self._finish_cancelled, again, undo)
            raise

    def _finish_cancelled(
        self,
        again: Callable[[], _Flow[Any]] | None,
        undo: _Flow[Any] | None,
        attempt: int = 0,
    ) -> None:
        """A cancelled asyncio call's ending (on a worker thread): ``again()`` run until
        Redis answers (its own refusal counts as an answer), then ``undo``. While Redis is
        unreachable (or the account's plan keeps changing) each try is one call; the next
        is scheduled (``_LATER``), so no worker thread sleeps between tries."""
        if again is not None:
            try:
                self._drive(again())
            except (
                redis.exceptions.ConnectionError,
                redis.exceptions.TimeoutError,
                PlanChanging,  # as transient as an outage: the call is idempotent
            ) as e:
                if attempt + 1 < _FINISH_ATTEMPTS:
                    _LATER.call(
                        min(2.0, 0.05 * 2**attempt),
                        lambda: self._finish_cancelled(again, undo, attempt + 1),
                    )
                    return
                _log.error(
                    "a cancelled ledger call was not finished: Redis unreachable or the plan "
                    "changing for %d tries (%s)",
                    _FINISH_ATTEMPTS,
                    e,
                )
            except Exception:
                _log.exception("a cancelled ledger call was not finished")
        if undo is not None:
            try:
                self._drive(undo)
            except Exception:
                _log.exception("a cancelled ledger call's undo failed")

    def _exec(self, step: _Step) -> Any:
        if step[0] != "eval":
            return self.client.execute_command(*step[1:])
        try:
            return self._send_eval(step)
        except redis.exceptions.NoScriptError:
            self.client.script_load(LUA)
            return self._send_eval(step)

    def _send_eval(self, step: _Step) -> Any:
        if not self._wire_ok:
            return self.client.execute_command(*_flat(step[1]))
        # a plain client's connection of this thread gets the command packed once (its
        # fixed parts per account and period, packed before), without redis-py's work
        # per argument
        packed = step[2] if len(step) > 2 and step[2] is not None else _pack_items(step[1])
        try:
            return self._send_packed(packed)
        except redis.exceptions.InvalidResponse:
            # a reply the ledger cannot read (e.g. RESP3 attributes of client tracking):
            # redis-py from now on; the script is idempotent, so sending it again is safe
            self._wire_ok = False
            return self.client.execute_command(*_flat(step[1]))

    def _send_packed(self, packed: bytes) -> Any:
        """One packed script call on this thread's connection (loaded first if Redis lost
        the script)."""
        try:
            return self._thread_conn().call(packed)
        except redis.exceptions.NoScriptError:
            self.client.script_load(LUA)
            return self._thread_conn().call(packed)

    def _thread_conn(self) -> _Wire:
        """This thread's connection for scripts (made like the client's pool makes its
        own; a forked child makes new ones)."""
        wire = getattr(self._local, "wire", None)
        if wire is None:
            wire = self._local.wire = _Wire(self.client.connection_pool)
            with self._lock:
                self._conns.add(wire)
        return wire

    def _close_conns(self) -> None:
        with self._lock:
            conns, self._conns = list(self._conns), weakref.WeakSet()
        for c in conns:
            c.close()

    async def _aexec(self, client: Any, step: _Step) -> Any:
        if step[0] != "eval":
            return await client.execute_command(*step[1:])
        args = _flat(step[1])
        try:
            return await client.execute_command(*args)
        except redis.exceptions.NoScriptError:
            await client.script_load(LUA)
            return await client.execute_command(*args)

    def _aclient(self) -> Any:
        if self._async_client is not None:
            return self._async_client
        loop = asyncio.get_running_loop()
        c = self._loop_clients.get(loop)
        if c is None:
            c = self._loop_clients[loop] = _async_twin(self.client)
        return c


class _Later:
    """Runs functions on the ledger's worker threads after a delay: one timer thread
    sleeps until the next is due (made again in a forked child)."""

    def __init__(self) -> None:
        self._reset()
        os.register_at_fork(after_in_child=self._reset)

    def _reset(self) -> None:
        self._cv = threading.Condition()
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        self._thread: threading.Thread | None = None

    def call(self, delay: float, fn: Callable[[], None]) -> None:
        """Runs ``fn`` on a worker thread ``delay`` seconds from now."""
        with self._cv:
            heapq.heappush(self._heap, (time.monotonic() + delay, next(self._seq), fn))
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._loop, name="ratequeue-ledger-later", daemon=True
                )
                self._thread.start()
            self._cv.notify()

    def _loop(self) -> None:
        while True:
            with self._cv:
                while True:
                    if not self._heap:
                        self._cv.wait()
                        continue
                    rest = self._heap[0][0] - time.monotonic()
                    if rest <= 0:
                        fn = heapq.heappop(self._heap)[2]
                        break
                    self._cv.wait(rest)
            try:
                _executor().submit(fn)
            except RuntimeError:  # the interpreter is shutting down
                return


_LATER = _Later()
_LEDGERS: weakref.WeakSet[_RedisLedgerCore] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for led in list(_LEDGERS):
        led._lock = threading.Lock()
        led._local = threading.local()  # the parent's sockets are never used here
        led._conns = weakref.WeakSet()


os.register_at_fork(after_in_child=_after_fork_in_child)
