"""An arm served by a :class:`~ratequeue.Pool`: acquire, send, report, settle."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from ..pool import Pool, Provider
from ._canary import Reply, _default_usage

__all__ = ["PoolArm"]


class PoolArm:
    """A canary arm whose calls go through ``pool`` (a model's keys or endpoints).

    Each call acquires a permit for ``tokens`` (the estimate) from the pool's best
    provider, runs ``send(provider, request)`` (sync or async), reports the outcome to
    the pool (429 and 5xx start a cooldown, honouring ``Retry-After``), settles the
    permit to the tokens used and returns a :class:`Reply` the canary books. ``send``
    returns a :class:`Reply` (with the HTTP status) or an answer with a ``usage``. A
    pool that cannot serve in time raises :class:`~ratequeue.PoolOverloaded`, which the
    canary counts as rate limited.
    """

    def __init__(
        self,
        pool: Pool,
        send: Callable[[Provider, Any], Any],
        *,
        tokens: int = 0,
        priority: str | None = None,
        timeout: float | None = None,
    ) -> None:
        if not isinstance(pool, Pool):
            raise TypeError(f"pool must be a ratequeue.Pool, got {pool!r}")
        if not callable(send):
            raise TypeError("send must be a callable (provider, request) -> reply")
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
            raise ValueError(f"tokens={tokens!r} must be an int >= 0")
        self.pool = pool
        self.send = send
        self.tokens = tokens
        self.priority = priority
        self.timeout = timeout
        self._async = inspect.iscoroutinefunction(send)
        self._costs = {"tokens": tokens} if "tokens" in pool._units else {}

    @property
    def is_async(self) -> bool:
        """True when calls are coroutines (``send`` is async)."""
        return self._async

    def _settle(self, provider: Provider, permit: Any, result: Any) -> Reply:
        reply = result if isinstance(result, Reply) else Reply(result, _default_usage(result))
        self.pool.report(provider, reply.status, retry_after=reply.retry_after)
        if "tokens" in provider.units:
            permit.settle(tokens=reply.tokens)
        return reply

    def _failed(self, provider: Provider) -> None:
        self.pool.report(provider, ok=False)

    def __call__(self, request: Any) -> Any:
        """One call through the pool (a coroutine when ``send`` is async)."""
        if self._async:
            return self._call_async(request)
        provider, permit = self.pool.acquire(
            priority=self.priority, timeout=self.timeout, **self._costs
        )
        try:
            result = self.send(provider, request)
        except Exception:
            self._failed(provider)
            raise
        return self._settle(provider, permit, result)

    async def _call_async(self, request: Any) -> Reply:
        provider, permit = await self.pool.acquire_async(
            priority=self.priority, timeout=self.timeout, **self._costs
        )
        try:
            result = await self.send(provider, request)
        except Exception:
            self._failed(provider)
            raise
        return self._settle(provider, permit, result)

    def __repr__(self) -> str:
        return f"PoolArm({self.pool!r})"
