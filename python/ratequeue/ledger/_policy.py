"""A ledger account as one more level of a Policy, all or nothing: the policy's permit
and the ledger's hold are taken together and given back together.

``rq.Policy({..., "quota": QuotaLevel(ledger, key="tenant")})`` is a ``LedgerPolicy``: the
native policy of the other levels (every wait, grant and give-back in the core), then
the ledger's hold in the caller's thread or task (the ledger's own I/O, never inside
the core); ``QuotaPolicy(policy, QuotaLevel(...))`` does the same over any policy-like
object (e.g. a ``RedisPolicy``). Both share ``_QuotaGate``."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Generator, Mapping, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any, cast

from .._errors import QuotaExceeded
from .._policy import Policy
from .._ratequeue import Policy as _NativePolicy
from .._threads import fork_safe_lock
from ._base import LedgerBase
from ._model import Charge, Hold, check_id


class QuotaLevel:
    """Which account a request is charged to and which cost keyword is its estimate.

    Give exactly one of ``account`` (a fixed account), ``key`` (the acquire keyword that
    names it, e.g. ``"tenant"``, also passed to the policy) or ``account_fn`` (a function
    of the acquire keywords). ``unit`` is the cost keyword holding the token estimate;
    it is passed on to the policy too unless ``shared=False`` (a policy without that unit).
    As a level of ``rq.Policy`` it is checked after the policy's other levels granted.
    """

    #: What ``rq.Policy`` looks for to make a ``LedgerPolicy``.
    _policy_level = "quota"

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

    def __init__(
        self, quota: QuotaLevel, permit: Any, hold: Hold, counts: _Counts | None = None
    ) -> None:
        self.quota = quota
        self.permit = permit
        self.hold = hold
        self._counts = counts
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
            first = self.charge is None
            if first:
                self.charge = charge
            self._done = True
        if first and self._counts is not None:
            self._counts.add("settled")
        return self.charge  # type: ignore[return-value]

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
        if self._counts is not None:
            self._counts.add("released")
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


class _Counts:
    """A quota level's counters (``stats``)."""

    __slots__ = ("__weakref__", "_lock", "n")

    def __init__(self) -> None:
        self._lock = fork_safe_lock(self)
        self.n = {"held": 0, "refused": 0, "failed": 0, "settled": 0, "released": 0}

    def add(self, what: str) -> None:
        with self._lock:
            self.n[what] += 1

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self.n)


class _QuotaGate:
    """The quota step after a policy's grant: the ledger's hold, or everything given back.

    The policy part is the ``_policy_*`` methods (a wrapped policy, or the native policy
    a ``LedgerPolicy`` is); a refusal or error of the hold cancels the permit, a permit
    never granted (refused, timed out, cancelled) takes no hold."""

    __slots__ = ()
    quota: QuotaLevel
    _counts: _Counts

    if TYPE_CHECKING:  # each subclass defines them (QuotaPolicy, LedgerPolicy)

        def _policy_levels(self) -> Sequence[str]: ...
        def _policy_try_acquire(self, kw: dict[str, Any]) -> Any: ...
        def _policy_acquire(self, timeout: float | None, kw: dict[str, Any]) -> Any: ...
        def _policy_acquire_async(self, timeout: float | None, kw: dict[str, Any]) -> Any: ...

    def _prepare(self, request_id: str | None, kw: dict[str, Any]) -> tuple[str, str, int]:
        rid = uuid.uuid4().hex if request_id is None else check_id("request_id", request_id)
        account, est = self.quota.account_for(kw), self.quota.estimate(kw)
        key = self.quota.key
        if key is not None and key not in self._policy_levels():
            del kw[key]  # names the account only, not a level of the policy
        if not self.quota.shared:
            kw.pop(self.quota.unit, None)
        return rid, account, est

    def _refused(self, e: BaseException) -> None:
        self._counts.add("refused" if isinstance(e, QuotaExceeded) else "failed")

    def _hold(self, permit: Any, rid: str, account: str, est: int) -> QuotaPermit:
        hold = None
        try:
            hold = self.quota.ledger.hold(rid, account, input_tokens=est)
            qp = QuotaPermit(self.quota, permit, hold, self._counts)
        except BaseException as e:
            try:
                if hold is not None:  # interrupted after the hold: give it back too
                    self.quota.ledger.release(rid)
            finally:
                permit.cancel()
                self._refused(e)
            raise
        self._counts.add("held")
        return qp

    async def _hold_async(self, permit: Any, rid: str, account: str, est: int) -> QuotaPermit:
        try:  # cancelled, hold_async leaves no hold standing
            hold = await self.quota.ledger.hold_async(rid, account, input_tokens=est)
        except BaseException as e:
            permit.cancel()
            self._refused(e)
            raise
        self._counts.add("held")
        return QuotaPermit(self.quota, permit, hold, self._counts)

    def try_acquire(self, *, request_id: str | None = None, **kw: Any) -> QuotaPermit | None:
        """None when the policy refuses now; ``QuotaExceeded`` when the quota does (the
        policy's levels given back)."""
        rid, account, est = self._prepare(request_id, kw)
        permit = self._policy_try_acquire(kw)
        if permit is None:
            return None
        return self._hold(permit, rid, account, est)

    def acquire(
        self, *, timeout: float | None = None, request_id: str | None = None, **kw: Any
    ) -> QuotaPermit:
        """Waits for the policy (with ``timeout``), then holds the quota."""
        rid, account, est = self._prepare(request_id, kw)
        permit = self._policy_acquire(timeout, kw)
        return self._hold(permit, rid, account, est)

    def acquire_async(
        self, *, timeout: float | None = None, request_id: str | None = None, **kw: Any
    ) -> QuotaAcquiring:
        """``acquire`` for asyncio: ``await`` it or use ``async with``."""
        rid, account, est = self._prepare(request_id, kw)
        return QuotaAcquiring(self, rid, account, est, timeout, kw)


class QuotaPolicy(_QuotaGate):
    """A policy-like object plus a quota level, all or nothing: a quota refusal after the
    policy granted gives the policy's permit back (anything whose ``try_acquire``/
    ``acquire``/``acquire_async`` give permits with ``settle``/``release``/``cancel``
    works, e.g. a ``RedisPolicy``). For a native policy, ``rq.Policy({..., "quota":
    QuotaLevel(...)})`` is the same as one more level (a ``LedgerPolicy``)."""

    __slots__ = ("_counts", "policy", "quota")

    def __init__(self, policy: Any, quota: QuotaLevel) -> None:
        if not isinstance(quota, QuotaLevel):
            raise TypeError(f"quota must be a QuotaLevel, got {type(quota).__name__}")
        for m in ("try_acquire", "acquire", "acquire_async"):
            if not callable(getattr(policy, m, None)):
                raise TypeError(f"policy must have {m}(), got {type(policy).__name__}")
        self.policy = policy
        self.quota = quota
        self._counts = _Counts()

    def _policy_levels(self) -> Sequence[str]:
        return getattr(self.policy, "levels", ())

    def _policy_try_acquire(self, kw: dict[str, Any]) -> Any:
        return self.policy.try_acquire(**kw)

    def _policy_acquire(self, timeout: float | None, kw: dict[str, Any]) -> Any:
        return self.policy.acquire(timeout=timeout, **kw)

    def _policy_acquire_async(self, timeout: float | None, kw: dict[str, Any]) -> Any:
        return self.policy.acquire_async(timeout=timeout, **kw)

    def stats(self) -> dict[str, int]:
        """The quota step's counts: holds taken, refused (``QuotaExceeded``), failed
        (another error of the ledger), settled and released (incl. cancelled)."""
        return self._counts.snapshot()


# Its acquires give QuotaPermits (settle returns the ledger's Charge), not PolicyPermits.
class LedgerPolicy(_QuotaGate, Policy):  # type: ignore[misc]
    """``rq.Policy`` with one ``QuotaLevel`` among its levels (made by ``rq.Policy``):
    the native policy of the other levels, whose grant is followed by the ledger's hold,
    all or nothing. Its permits (``QuotaPermit``) settle, release or cancel the policy's
    levels and the hold together, exactly once; ``stats()`` counts the quota level as a
    level (``refused``: ``QuotaExceeded``; ``held``, ``failed``, ``settled``,
    ``released``) and ``admitted`` counts requests granted by every level."""

    __slots__ = ("_counts", "_names", "quota", "quota_name")
    quota: QuotaLevel
    quota_name: str
    _names: list[str]
    _counts: _Counts

    def __new__(
        cls, levels: Mapping[str, Any], *, shadow: Sequence[str] | None = None
    ) -> LedgerPolicy:
        if not isinstance(levels, dict):
            raise TypeError(f"levels must be a dict, got {type(levels).__name__}")
        found = [(n, v) for n, v in levels.items() if isinstance(v, QuotaLevel)]
        if len(found) != 1:
            raise ValueError(f"a policy takes at most one QuotaLevel, got {len(found)}")
        name, quota = found[0]
        if shadow is not None and name in (shadow if not isinstance(shadow, str) else ()):
            raise ValueError(f"the quota level {name!r} cannot be a shadow level")
        rest = {n: v for n, v in levels.items() if n != name}
        if not rest:
            raise ValueError("a policy needs a level besides its QuotaLevel")
        self = cast("LedgerPolicy", _NativePolicy.__new__(cls, rest, shadow=shadow))
        self.quota, self.quota_name = quota, name
        self._names = list(levels)
        self._counts = _Counts()
        return self

    def _policy_levels(self) -> Sequence[str]:
        return _NativePolicy.levels.__get__(self)  # type: ignore[no-any-return]

    def _policy_try_acquire(self, kw: dict[str, Any]) -> Any:
        return _NativePolicy.try_acquire(self, **kw)

    def _policy_acquire(self, timeout: float | None, kw: dict[str, Any]) -> Any:
        return _NativePolicy.acquire(self, timeout=timeout, **kw)

    def _policy_acquire_async(self, timeout: float | None, kw: dict[str, Any]) -> Any:
        return _NativePolicy.acquire_async(self, timeout=timeout, **kw)

    def reserve(  # type: ignore[override]
        self, *, max_wait: float | None = None, request_id: str | None = None, **kw: Any
    ) -> QuotaPermit:
        """The policy's reservation (granted in the future, see ``Policy.reserve``), then
        the quota held now; a quota refusal cancels the reservation."""
        rid, account, est = self._prepare(request_id, kw)
        permit = _NativePolicy.reserve(self, max_wait=max_wait, **kw)
        return self._hold(permit, rid, account, est)

    @property
    def levels(self) -> list[str]:
        """The level names in the order given, the quota level's included."""
        return list(self._names)

    def stats(self) -> dict[str, Any]:
        """``Policy.stats()`` with the quota level among the levels."""
        d: dict[str, Any] = _NativePolicy.stats(self)
        q = self._counts.snapshot()
        d["admitted"] = max(0, d["admitted"] - q["refused"] - q["failed"])
        levels = d["levels"]
        d["levels"] = {}
        for n in self._names:
            if n == self.quota_name:
                d["levels"][n] = {"shadow": False, "shadow_refused": 0, **q}
            else:
                d["levels"][n] = levels[n]
        return d


class QuotaAcquiring:
    """An awaited quota-policy acquire: ``await`` it for the ``QuotaPermit``, or ``async
    with`` it (the block's end settles the estimate, or on an exception gives back)."""

    def __init__(
        self,
        gate: _QuotaGate,
        rid: str,
        account: str,
        est: int,
        timeout: float | None,
        kw: dict[str, Any],
    ) -> None:
        self.gate, self.rid, self.account, self.est = gate, rid, account, est
        self.timeout, self.kw = timeout, kw
        self.permit: QuotaPermit | None = None

    async def _run(self) -> QuotaPermit:
        permit = await self.gate._policy_acquire_async(self.timeout, self.kw)
        self.permit = await self.gate._hold_async(permit, self.rid, self.account, self.est)
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
