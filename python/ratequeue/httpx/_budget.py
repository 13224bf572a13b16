"""Call budgets: at most N model calls (and T tokens) per user request, across fan-out.

A :class:`CallBudget` is entered with ``with`` or ``async with``; every call the
transport makes inside it — in this task, in asyncio tasks created inside it and in
threads that run a copy of the context (``contextvars.copy_context().run``) — counts
against it and against every budget it is nested in. A call that would exceed one of
them raises :class:`BudgetExceeded` before anything is sent. Tokens are reserved at the
call's estimate and corrected to the real usage when it settles, so the tokens used
never pass the budget.
"""

from __future__ import annotations

import contextlib
import contextvars
import uuid
from dataclasses import dataclass
from types import TracebackType

from .._errors import RateQueueError
from .._threads import fork_safe_lock

__all__ = ["BudgetExceeded", "CallBudget", "SubCall", "current_budget"]

_CURRENT: contextvars.ContextVar[CallBudget | None] = contextvars.ContextVar(
    "ratequeue_call_budget", default=None
)


class BudgetExceeded(RateQueueError):
    """A call would exceed a :class:`CallBudget` (its calls or tokens); nothing was sent."""

    def __init__(self, message: str, budget: CallBudget) -> None:
        super().__init__(message)
        self.budget = budget


@dataclass(slots=True)
class SubCall:
    """One model call made under a budget: tokens reserved, then the real usage."""

    request_id: str
    model: str | None
    input_tokens: int
    output_tokens: int
    status: int | None = None
    settled: bool = False

    @property
    def tokens(self) -> int:
        """Input plus output (reserved at the estimate until settled)."""
        return self.input_tokens + self.output_tokens


def current_budget() -> CallBudget | None:
    """The innermost budget of this context, or None."""
    return _CURRENT.get()


def _limit(name: str, v: int | None) -> int | None:
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"{name}={v!r} must be an int or None")
    if v < 0:
        raise ValueError(f"{name}={v!r} must be >= 0")
    return v


class CallBudget:
    """At most ``calls`` model calls and ``tokens`` tokens inside this block (None: no
    bound), counted across tasks and threads carrying the context; nests."""

    def __init__(
        self, calls: int | None = None, tokens: int | None = None, *, id: str | None = None
    ) -> None:
        self.calls = _limit("calls", calls)
        self.tokens = _limit("tokens", tokens)
        if id is not None and not isinstance(id, str):
            raise TypeError(f"id={id!r} must be a string")
        self.id = id or uuid.uuid4().hex
        self.parent: CallBudget | None = None
        self._lock = fork_safe_lock(self)
        self._calls_used = 0
        self._tokens_used = 0
        self._usage: list[SubCall] = []
        self._token: contextvars.Token[CallBudget | None] | None = None

    # -- entering ----------------------------------------------------------------------

    def __enter__(self) -> CallBudget:
        if self._token is not None:
            raise RuntimeError("a CallBudget is entered once at a time")
        self.parent = _CURRENT.get()
        self._token = _CURRENT.set(self)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        token, self._token = self._token, None
        if token is not None:
            _CURRENT.reset(token)

    async def __aenter__(self) -> CallBudget:
        return self.__enter__()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.__exit__(exc_type, exc, tb)

    # -- reading -----------------------------------------------------------------------

    @property
    def calls_used(self) -> int:
        """Calls counted so far (sent, or in flight)."""
        return self._calls_used

    @property
    def tokens_used(self) -> int:
        """Tokens of settled calls plus the estimates of calls in flight."""
        return self._tokens_used

    @property
    def usage(self) -> list[SubCall]:
        """The calls made under this budget (nested ones included), in order."""
        with self._lock:
            return list(self._usage)

    def chain(self) -> list[CallBudget]:
        """This budget and those it is nested in, outermost first."""
        out: list[CallBudget] = []
        b: CallBudget | None = self
        while b is not None:
            out.append(b)
            b = b.parent
        out.reverse()
        return out

    def __repr__(self) -> str:
        return (
            f"CallBudget(calls={self._calls_used}/{self.calls}, "
            f"tokens={self._tokens_used}/{self.tokens}, id={self.id!r})"
        )

    # -- used by the transport ------------------------------------------------------------

    def _check(self, tokens: int) -> str | None:
        if self.calls is not None and self._calls_used + 1 > self.calls:
            return f"call budget {self.id} allows {self.calls} calls; all are used"
        if self.tokens is not None and self._tokens_used + tokens > self.tokens:
            return (
                f"call budget {self.id} allows {self.tokens} tokens: {self._tokens_used} used "
                f"or reserved, this call may use {tokens}"
            )
        return None


def charge(
    chain: list[CallBudget],
    request_id: str,
    model: str | None,
    input_tokens: int,
    output_tokens: int,
) -> SubCall:
    """Count one call against every budget of ``chain`` (a budget's :meth:`CallBudget.chain`;
    all or none); raises :class:`BudgetExceeded` when one has no room."""
    tokens = input_tokens + output_tokens
    locks = [x._lock for x in chain]
    for lk in locks:  # outermost first: one order, no deadlock
        lk.acquire()
    try:
        for x in chain:
            why = x._check(tokens)
            if why is not None:
                raise BudgetExceeded(why, x)
        sub = SubCall(request_id, model, input_tokens, output_tokens)
        for x in chain:
            x._calls_used += 1
            x._tokens_used += tokens
            x._usage.append(sub)
        return sub
    finally:
        for lk in reversed(locks):
            lk.release()


def settle(
    sub: SubCall,
    budget_chain: list[CallBudget],
    input_tokens: int,
    output_tokens: int,
    status: int | None,
) -> None:
    """Correct a sub-call's reserved tokens to its real usage in every budget it counts in."""
    delta = input_tokens + output_tokens - sub.tokens
    for x in budget_chain:
        with x._lock:
            x._tokens_used = max(0, x._tokens_used + delta)
    sub.input_tokens, sub.output_tokens = input_tokens, output_tokens
    sub.status, sub.settled = status, True


def uncount(sub: SubCall, budget_chain: list[CallBudget], status: int | None) -> None:
    """Take back a call that used nothing (never sent, or refused with 429) from every
    budget it counts in."""
    for x in budget_chain:
        with x._lock:
            x._calls_used = max(0, x._calls_used - 1)
            x._tokens_used = max(0, x._tokens_used - sub.tokens)
            with contextlib.suppress(ValueError):
                x._usage.remove(sub)
    sub.input_tokens = sub.output_tokens = 0
    sub.status, sub.settled = status, True
