"""A ledger account as one more level of a Policy, all or nothing: the policy's permit
and the ledger's hold are taken together and given back together."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Generator, Mapping
from types import TracebackType
from typing import Any

from ._base import LedgerBase
from ._model import Charge, Hold, check_id


class QuotaLevel:
    """Which account a request is charged to and which cost keyword is its estimate.

    Give exactly one of ``account`` (a fixed account), ``key`` (the acquire keyword that
    names it, e.g. ``"tenant"``, also passed to the policy) or ``account_fn`` (a function
    of the acquire keywords). ``unit`` is the cost keyword holding the token estimate;
    it is passed on to the policy too unless ``shared=False`` (a policy without that unit).
    """

    def __init__(
        self,
        ledger: LedgerBase,
        account: str | None = None,
        *,
        key: str | None = None,
        account_fn: Callable[[Mapping[str, Any]], str] | None = None,
        unit: str = "tokens",
        shared: bool = True,
    ) -> None:
        if not isinstance(ledger, LedgerBase):
            raise TypeError(f"ledger must be a ledger, got {type(ledger).__name__}")
        if sum(x is not None for x in (account, key, account_fn)) != 1:
            raise ValueError("give exactly one of account, key= or account_fn=")
        if account is not None:
            check_id("account", account)
        if key is not None:
            check_id("key", key)
        if account_fn is not None and not callable(account_fn):
            raise TypeError("account_fn must be callable")
        self.ledger = ledger
        self.account = account
        self.key = key
        self.account_fn = account_fn
        self.unit = check_id("unit", unit)
        self.shared = bool(shared)

    def account_for(self, kw: Mapping[str, Any]) -> str:
        """The account a request with these keywords is charged to."""
        if self.account is not None:
            return self.account
        if self.key is not None:
            if self.key not in kw:
                raise TypeError(f"missing keyword {self.key}= naming the quota account")
            return check_id(self.key, kw[self.key])
        assert self.account_fn is not None
        return check_id("account", self.account_fn(kw))

    def estimate(self, kw: Mapping[str, Any]) -> int:
        """The token estimate a hold reserves (the ``unit`` keyword, default 0)."""
        v = kw.get(self.unit, 0)
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"{self.unit} must be an int, got {type(v).__name__}")
        return v


class QuotaPermit:
    """A policy permit plus a ledger hold; ``settle`` corrects both exactly once (a retry
    after an error or a cancellation only finishes the ledger's part, with the first
    call's amounts), ``release`` and ``cancel`` give an unsettled hold back, leaving the
    block settles the estimate (or on an exception gives the hold back)."""

    def __init__(self, quota: QuotaLevel, permit: Any, hold: Hold) -> None:
        self.quota = quota
        self.permit = permit
        self.hold = hold
        self.charge: Charge | None = None
        self._done = False
        # the ledger amounts of the settle begun (the policy permit settled already)
        self._settling: tuple[int, int] | None = None
        self._lock = threading.Lock()

    @property
    def request_id(self) -> str:
        """The ledger request id of the hold."""
        return self.hold.request_id

    def _ledger_costs(
        self, input_tokens: int | None, output_tokens: int | None, costs: dict[str, Any]
    ) -> tuple[int, int]:
        unit = self.quota.unit
        if input_tokens is None and output_tokens is None:
            i, o = costs.get(unit, self.hold.input_tokens + self.hold.output_tokens), 0
        else:
            i, o = input_tokens or 0, output_tokens or 0
            costs.setdefault(unit, i + o)
        if not self.quota.shared:
            costs.pop(unit, None)
        return i, o

    def _begin_settle(
        self, input_tokens: int | None, output_tokens: int | None, costs: dict[str, Any]
    ) -> tuple[int, int]:
        """Settles the policy permit on the first call; the ledger amounts to send (the
        first call's, whatever a retry passes)."""
        with self._lock:
            if self._settling is None:
                i, o = self._ledger_costs(input_tokens, output_tokens, costs)
                self.permit.settle(**costs)
                self._settling = (i, o)
            return self._settling

    def _settled(self, charge: Charge) -> Charge:
        with self._lock:
            if self.charge is None:
                self.charge = charge
            self._done = True
            return self.charge

    def settle(
        self, *, input_tokens: int | None = None, output_tokens: int | None = None, **costs: Any
    ) -> Charge:
        """Settles the policy permit with ``costs`` and the ledger hold with the tokens
        (``input_tokens``/``output_tokens``, or the ``unit`` cost as input tokens), once:
        a later call returns the first one's charge."""
        if self.charge is not None:
            return self.charge
        i, o = self._begin_settle(input_tokens, output_tokens, costs)
        charge = self.quota.ledger.settle(
            self.request_id, input_tokens=i, output_tokens=o, calls=self.hold.calls
        )
        return self._settled(charge)

    async def settle_async(
        self, *, input_tokens: int | None = None, output_tokens: int | None = None, **costs: Any
    ) -> Charge:
        """``settle`` without blocking the event loop on the ledger; cancelled, the ledger's
        settle still completes, and a retry returns its charge."""
        if self.charge is not None:
            return self.charge
        i, o = self._begin_settle(input_tokens, output_tokens, costs)
        charge = await self.quota.ledger.settle_async(
            self.request_id, input_tokens=i, output_tokens=o, calls=self.hold.calls
        )
        return self._settled(charge)

    def _take_hold(self) -> bool:
        """Whether the hold is still ours to give back (no settle begun): once only."""
        with self._lock:
            if self._done or self._settling is not None:
                return False
            self._done = True
            return True

    def _give_back_hold(self) -> None:
        if self._take_hold():
            self.quota.ledger.release(self.request_id)

    def release(self) -> None:
        """Returns concurrency permits and gives an unsettled hold back (a hold whose
        settle began is left to that settle, or to its expiry if it never lands)."""
        try:
            self.permit.release()
        finally:
            self._give_back_hold()

    def cancel(self) -> None:
        """Gives back everything the policy and the ledger took (unless settled)."""
        try:
            self.permit.cancel()
        finally:
            self._give_back_hold()

    async def _give_back_hold_async(self) -> None:
        if self._take_hold():
            await self.quota.ledger.release_async(self.request_id)

    async def release_async(self) -> None:
        """``release`` without blocking the event loop on the ledger."""
        try:
            self.permit.release()
        finally:
            await self._give_back_hold_async()

    async def cancel_async(self) -> None:
        """``cancel`` without blocking the event loop on the ledger."""
        try:
            self.permit.cancel()
        finally:
            await self._give_back_hold_async()

    def __enter__(self) -> QuotaPermit:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            if not self._done:
                if exc_type is None:
                    self.settle()
                else:
                    self._give_back_hold()
        finally:
            self.permit.__exit__(exc_type, exc, tb)

    async def __aenter__(self) -> QuotaPermit:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            if not self._done:
                if exc_type is None:
                    await self.settle_async()
                else:
                    await self._give_back_hold_async()
        finally:
            self.permit.__exit__(exc_type, exc, tb)


class QuotaPolicy:
    """A Policy plus a quota level, all or nothing: a quota refusal after the policy
    granted gives the policy's permit back (anything whose ``try_acquire``/``acquire``/
    ``acquire_async`` give permits with ``settle``/``release``/``cancel`` works too)."""

    def __init__(self, policy: Any, quota: QuotaLevel) -> None:
        if not isinstance(quota, QuotaLevel):
            raise TypeError(f"quota must be a QuotaLevel, got {type(quota).__name__}")
        for m in ("try_acquire", "acquire", "acquire_async"):
            if not callable(getattr(policy, m, None)):
                raise TypeError(f"policy must have {m}(), got {type(policy).__name__}")
        self.policy = policy
        self.quota = quota

    def _prepare(self, request_id: str | None, kw: dict[str, Any]) -> tuple[str, str, int]:
        rid = uuid.uuid4().hex if request_id is None else check_id("request_id", request_id)
        account, est = self.quota.account_for(kw), self.quota.estimate(kw)
        key = self.quota.key
        if key is not None and key not in getattr(self.policy, "levels", (key,)):
            del kw[key]  # names the account only, not a level of the policy
        if not self.quota.shared:
            kw.pop(self.quota.unit, None)
        return rid, account, est

    def _hold(self, permit: Any, rid: str, account: str, est: int) -> QuotaPermit:
        try:
            hold = self.quota.ledger.hold(rid, account, input_tokens=est)
        except BaseException:
            permit.cancel()
            raise
        return QuotaPermit(self.quota, permit, hold)

    def try_acquire(self, *, request_id: str | None = None, **kw: Any) -> QuotaPermit | None:
        """None when the policy refuses now; ``QuotaExceeded`` when the quota does."""
        rid, account, est = self._prepare(request_id, kw)
        permit = self.policy.try_acquire(**kw)
        if permit is None:
            return None
        return self._hold(permit, rid, account, est)

    def acquire(
        self, *, timeout: float | None = None, request_id: str | None = None, **kw: Any
    ) -> QuotaPermit:
        """Waits for the policy (with ``timeout``), then holds the quota."""
        rid, account, est = self._prepare(request_id, kw)
        permit = self.policy.acquire(timeout=timeout, **kw)
        return self._hold(permit, rid, account, est)

    def acquire_async(
        self, *, timeout: float | None = None, request_id: str | None = None, **kw: Any
    ) -> _AsyncQuotaAcquire:
        """``acquire`` for asyncio: ``await`` it or use ``async with``."""
        rid, account, est = self._prepare(request_id, kw)
        return _AsyncQuotaAcquire(self, rid, account, est, timeout, kw)


class _AsyncQuotaAcquire:
    def __init__(
        self,
        qp: QuotaPolicy,
        rid: str,
        account: str,
        est: int,
        timeout: float | None,
        kw: dict[str, Any],
    ) -> None:
        self.qp, self.rid, self.account, self.est = qp, rid, account, est
        self.timeout, self.kw = timeout, kw
        self.permit: QuotaPermit | None = None

    async def _run(self) -> QuotaPermit:
        permit = await self.qp.policy.acquire_async(timeout=self.timeout, **self.kw)
        try:
            hold = await self.qp.quota.ledger.hold_async(
                self.rid, self.account, input_tokens=self.est
            )
        except BaseException:
            permit.cancel()
            raise
        self.permit = QuotaPermit(self.qp.quota, permit, hold)
        return self.permit

    def __await__(self) -> Generator[Any, None, QuotaPermit]:
        return self._run().__await__()

    async def __aenter__(self) -> QuotaPermit:
        return await self._run()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self.permit is not None:
            await self.permit.__aexit__(exc_type, exc, tb)
