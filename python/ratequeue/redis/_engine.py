"""What every Redis limiter shares: the client, the breaker, the failure policy, and one
call of the script (EVALSHA, loaded again on NOSCRIPT) with outages told from mistakes."""

from __future__ import annotations

import asyncio
import inspect
from typing import Any, Literal, TypeAlias

import redis
import redis.exceptions

from .._cancel import cancel_requests, swallowed
from .._errors import Overloaded
from .._ratequeue import ManualClock
from ._args import _max_wait_us
from ._breaker import CircuitBreaker
from ._connection import _CONFIG_ERRORS, _DOWN_ERRORS, _is_down_reply, _pack
from ._script import GCRA_LUA, GCRA_SHA, _Clock

OnFailure: TypeAlias = Literal["fail_closed", "fail_open", "local"]


class RedisUnavailable(Overloaded):
    """Refused because Redis is unreachable or slow and the limiter fails closed.

    ``retry_after`` is the time until the circuit breaker lets a call try Redis again.
    """


class _Down(Exception):
    """Redis could not answer (or the breaker did not let the call try)."""


class _Engine:
    """Shared state of every Redis limiter: client, breaker, failure policy, counters."""

    def __init__(
        self,
        client: Any,
        *,
        on_failure: OnFailure,
        local_fraction: float,
        breaker: CircuitBreaker | None,
        clock: ManualClock | None,
    ) -> None:
        if client is None or not callable(getattr(client, "execute_command", None)):
            raise TypeError(
                f"client={client!r} must be a redis-py client (redis.Redis, "
                "redis.asyncio.Redis, a cluster client; see ratequeue.redis.connect)"
            )
        if on_failure not in ("fail_closed", "fail_open", "local"):
            raise ValueError(
                f"on_failure={on_failure!r} must be 'fail_closed', 'fail_open' or 'local'"
            )
        if not (0 < local_fraction <= 1):
            raise ValueError(f"local_fraction={local_fraction!r} must be in (0, 1]")
        self.client = client
        self.on_failure: OnFailure = on_failure
        self.local_fraction = float(local_fraction)
        self.breaker = breaker if breaker is not None else CircuitBreaker()
        self.clock = _Clock(clock)
        self.calls = 0
        self.failures = 0
        self.fallbacks = 0
        # A plain sync client with a pool: commands are sent packed (the hot ones packed once) on a
        # pooled connection, without redis-py's per-command packing and retry wrapper.
        pool = getattr(client, "connection_pool", None)
        self.raw = (
            type(client) is redis.Redis
            and getattr(client, "connection", None) is None
            and isinstance(pool, redis.ConnectionPool)
        )
        self._conn_args: tuple[str, ...] = ()
        if self.raw and pool is not None:
            params = list(inspect.signature(pool.get_connection).parameters.values())
            if params and params[0].default is inspect.Parameter.empty:
                self._conn_args = ("EVALSHA",)

    def head(self, nkeys: int) -> tuple[Any, ...]:
        return ("EVALSHA", GCRA_SHA, nkeys)

    def _send(self, cmd: tuple[Any, ...] | bytes) -> Any:
        if type(cmd) is not bytes:
            if not self.raw:
                return self.client.execute_command(*cmd)
            cmd = _pack(cmd)
        pool = self.client.connection_pool
        conn = pool.get_connection(*self._conn_args)
        try:
            conn.send_packed_command([cmd])
            return conn.read_response()
        finally:
            pool.release(conn)

    def run(self, cmd: tuple[Any, ...] | bytes) -> Any:
        """Runs the script (loading it on NOSCRIPT); raises _Down when Redis can't answer.

        ``cmd``: the arguments of EVALSHA, or (when ``raw``) the command packed in RESP.
        """
        br = self.breaker
        if not br._allow():
            raise _Down()
        self.calls += 1
        try:
            try:
                r = self._send(cmd)
            except redis.exceptions.NoScriptError:
                self.client.script_load(GCRA_LUA)
                r = self._send(cmd)
        except BaseException as e:
            raise self._failed(e)  # noqa: B904 (_failed chains a _Down to its cause)
        br._success()
        return r

    async def arun(self, cmd: tuple[Any, ...] | bytes, *, keep_cancel: bool = False) -> Any:
        """``run`` on an asyncio client. A cancel the client swallowed (``_cancel``) is
        raised after the reply or the failure, as if it had come while the call waited;
        with ``keep_cancel`` a reply is returned and the caller, which can give back what
        it took, checks ``swallowed`` itself."""
        assert type(cmd) is not bytes, "asyncio clients take argument tuples"
        br = self.breaker
        if not br._allow():
            raise _Down()
        self.calls += 1
        asked = cancel_requests()
        try:
            try:
                r = await self.client.execute_command(*cmd)
            except redis.exceptions.NoScriptError:
                await self.client.script_load(GCRA_LUA)
                r = await self.client.execute_command(*cmd)
        except BaseException as e:
            out = self._failed(e)
            if not isinstance(e, asyncio.CancelledError) and swallowed(asked):
                raise asyncio.CancelledError() from e
            raise out  # noqa: B904 (_failed chains a _Down to its cause)
        br._success()
        if not keep_cancel and swallowed(asked):
            raise asyncio.CancelledError()
        return r

    def _failed(self, e: BaseException) -> BaseException:
        """Tells the breaker how a call failed; returns what to raise: ``_Down`` (from
        ``e``) when Redis could not answer, else ``e`` itself (a configuration error, a
        script's own error, a cancellation)."""
        br = self.breaker
        if isinstance(e, _CONFIG_ERRORS):
            br._abandon()  # a wrong password or ACL is a mistake to see, not an outage
            return e
        if isinstance(e, _DOWN_ERRORS) or (
            isinstance(e, redis.exceptions.ResponseError) and _is_down_reply(e)
        ):
            self.failures += 1
            br._failure(e)
            down = _Down()
            down.__cause__ = e
            return down
        if isinstance(e, redis.exceptions.ResponseError):
            br._success()
        else:
            br._abandon()
        return e

    def start_ns(self) -> int:
        m = self.clock.manual
        return 0 if m is None else m.now_ns()

    def unavailable(self, what: str) -> RedisUnavailable:
        """The refusal of a fail-closed limiter; its ``__cause__`` is the Redis error seen
        last (a wrong URL, a refused connection, a timeout), so the reason is never lost."""
        last = self.breaker.last_error
        reason = "" if last is None else f" ({type(last).__name__}: {last})"
        e = RedisUnavailable(
            f"overloaded: Redis is unavailable{reason} and {what} fails closed",
            self.breaker.retry_after(),
        )
        e.__cause__ = last
        return e

    def stats(self) -> dict[str, Any]:
        return {
            "redis_calls": self.calls,
            "redis_failures": self.failures,
            "fallback_decisions": self.fallbacks,
            "on_failure": self.on_failure,
            "breaker": self.breaker.stats(),
        }


class _Named:
    """What every Redis limiter holds besides its levels: the engine, the names its Redis
    keys are made of, and its bound on a wait."""

    _engine: _Engine
    name: str
    prefix: str
    max_wait: float | None

    def _init_named(
        self,
        client: Any,
        *,
        name: str,
        prefix: str,
        max_wait: float | None,
        on_failure: OnFailure,
        local_fraction: float,
        breaker: CircuitBreaker | None,
        clock: ManualClock | None,
    ) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError("name must be a non-empty string (it names the Redis keys)")
        self._engine = _Engine(
            client,
            on_failure=on_failure,
            local_fraction=local_fraction,
            breaker=breaker,
            clock=clock,
        )
        self.name = name
        self.prefix = prefix
        _max_wait_us(max_wait)  # checked now: a bad bound fails at construction
        self.max_wait = max_wait
