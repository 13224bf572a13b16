"""Background responses (OpenAI's ``background=True``), charged exactly once.

Such a response answers its creation ``queued`` (or ``in_progress``), before it has run:
its body has an id and no usage. The creation's settle waits for that usage: the call
is kept here by the response's host and id, its estimate still charged (and its ledger
hold still held), its concurrency slots given back, its request dropped. A poll (``GET
…/responses/{id}``) or a cancel (``POST …/responses/{id}/cancel``) whose body reports a
final status (``completed``, ``incomplete``, ``failed``, ``cancelled``) with a usage
settles the creation to it; that poll, and any before it, is charged nothing: the tokens
are counted once, where they were spent. A poll of a response settled that way
(remembered, as many as are kept waiting) is charged nothing again. A creation streamed
is kept as soon as its open stream names the response (:meth:`Background.streaming`):
its polls meanwhile are charged nothing, the first that reports the final usage settles
it (its stream's end then does nothing); otherwise its stream's end settles it to the
usage it read, or makes it wait when the stream dropped before any. A transport closed,
or a second creation named alike, lets an open stream go: its end settles it.

Bounded: at most ``limit`` creations wait (past it a creation keeps its estimate, as any
body without a usage does, and its poll is charged the usage it reports: never less than
used); a second creation answered with the id of one waiting stops the tracking of that
id (both keep their estimates, its polls are charged); the transport's ``close`` settles
those still waiting at their estimate. A forked child forgets them (the parent settles
its own).
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING

from .._errors import each
from .._threads import AfterFork
from ._record import json_object
from ._stream import NONE_USED
from ._unclosed import raise_held, ready
from ._usage import Usage, waiting_response_id

if TYPE_CHECKING:
    from ._record import _Call

__all__ = ["Background"]

_log = logging.getLogger("ratequeue.httpx")

#: ``_Call._rkey`` of a creation let go while it streamed: its stream's end settles it,
#: nothing keeps it.
_LET_GO: tuple[bytes, str] | tuple[()] = ()
#: ``_Call._rkey`` of a creation a poll took while it streamed: the poll settles it, its
#: stream's end does nothing (never a real key: an id is never empty).
_TAKEN: tuple[bytes, str] = (b"", "")

#: A response done: its usage is final.
FINAL = frozenset({"completed", "incomplete", "failed", "cancelled"})

#: A forked child forgets every transport's waiting creations.
_ALL = AfterFork("_forget")


def polled_id(path: str) -> str | None:
    """The response id of a poll or cancel path (``…/responses/{id}``,
    ``…/responses/{id}/cancel``), or None."""
    parts = path.rsplit("/", 3)
    if parts[-1] == "cancel":
        parts.pop()
    if len(parts) < 3 or parts[-2] != "responses":
        return None
    return parts[-1]


def _polled_key(call: _Call) -> tuple[bytes, str] | None:
    """The (host, response id) a poll or cancel ``call`` names, or None."""
    rid = polled_id(call.path)
    return None if rid is None else (call._request.url.netloc, rid)


class Background:
    """The creations waiting for their usage, by response id (see the module)."""

    __slots__ = (
        "__weakref__",
        "_done_keys",
        "_ids",
        "_lock",
        "_waiting",
        "closed",
        "limit",
    )

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._lock = threading.Lock()
        # (host, id) -> the creation waiting, or None once settled (the poll's usage
        # charged). By host too: two providers' ids never settle each other's.
        self._ids: OrderedDict[tuple[bytes, str], _Call | None] = OrderedDict()
        self._waiting = 0
        # Of the creations still streaming, those a poll said ended without a usage.
        self._done_keys: set[tuple[bytes, str]] = set()
        self.closed = False  # drained: nothing is kept any more
        _ALL.add(self)

    def __bool__(self) -> bool:
        return bool(self._ids)

    @property
    def waiting(self) -> int:
        """Creations waiting for their usage."""
        return self._waiting

    def watches(self, call: _Call) -> bool:
        """True when ``call`` polls a response kept here."""
        key = _polled_key(call)
        return key is not None and key in self._ids

    def streaming(self, call: _Call, rid: str) -> None:
        """``call``, a creation whose event stream, still open, named its response
        ``rid``: kept from now on (``call._rkey``). A poll meanwhile that reports the
        final usage settles it (:meth:`take`: its stream's end then does nothing);
        otherwise its stream's end settles it (:meth:`ended`), or its stream's drop makes
        it wait as any creation (:meth:`keep`)."""
        request = call._request
        if not self.limit or request is None or request.method != "POST":
            return
        if not call.path.endswith("/responses"):
            return
        key = (request.url.netloc, rid)
        with self._lock:
            if call._rkey is not None or self.closed or key in self._ids:
                return  # named before, closed, or an id seen before (left to keep)
            if self._waiting >= self.limit:
                return  # no room: not kept
            # Published first, then checked: a settle in another thread (a close) pops
            # ``_once`` first and then reads ``_rkey``, so one of the two sees the other.
            self._ids[key] = call
            self._waiting += 1
            call._rkey = key
            if not call._once or call._done:  # settled meanwhile: not kept
                del self._ids[key]
                self._waiting -= 1
                call._rkey = None

    def ended(self, call: _Call, used: bool) -> bool:
        """The stream of a creation kept while open is over (``used``: it read a usage):
        False when a poll took it (the poll settles it; nothing to do), else True, to
        settle it. A poll after is charged nothing when there was a usage, else what it
        reports (never less than used)."""
        with self._lock:
            key = call._rkey
            if key is _TAKEN:
                return False
            call._rkey = None
            if key:
                self._open_done(key)
            if key and self._ids.get(key) is call:
                self._waiting -= 1
                if used:
                    self._settled(key)
                else:
                    del self._ids[key]
        return True

    def keep(
        self, call: _Call, body: bytes | None, rid: str | None, taken: list[_Call]
    ) -> tuple[bool | None, _Call | None]:
        """Keep ``call``, a creation whose 2xx answer reports no usage (``body``, a JSON
        one; ``rid``, the id an event stream named and the stream dropped before its
        usage), until its usage is polled: (True when kept — a response not run yet,
        room left —, None when a poll took it meanwhile — the poll settles it —, else
        False; the creation waiting with the same id, no longer kept: to settle at its
        estimate, also put in ``taken`` once it left the map, where an interrupt raised
        after, as a call returns, does not lose it)."""
        if not self.limit or call._request.method != "POST":
            return False, None
        if not call.path.endswith("/responses"):
            return False, None
        if rid is None:
            rid = waiting_response_id(json_object(body)) if body else None
        if rid is None:
            return False, None
        key = (call._request.url.netloc, rid)
        with self._lock:
            if call._rkey is not None:
                # Kept while its stream was open: it waits now (taken by a poll, let go
                # or forgotten: not kept again).
                if call._rkey is _TAKEN:
                    return None, None
                if call._rkey != key or self._ids.get(key) is not call:
                    call._rkey = None
                    return False, None
                call._rkey = None
                if self._open_done(key):
                    # A poll said it ended, without a usage: nothing to wait for, the
                    # estimate stays (as for a creation answered in JSON).
                    self._waiting -= 1
                    self._settled(key)
                    return False, None
                return True, None
            if self.closed:
                return False, None
            other = self._ids.get(key)
            if other is call:
                return None, None  # kept already (its settle is another caller's)
            if other is not None:
                # The provider named two responses alike: neither poll can tell which
                # it settles, so neither is kept and the id's polls are charged. One
                # still streaming is let go: its stream's end settles it (one dropped
                # unclosed: the settling thread, or the close, ends it).
                self._waiting -= 1
                del self._ids[key]
                if other._rkey is not None:
                    self._open_done(key)
                    other._rkey = _LET_GO
                    return False, None
                taken.append(other)
                return False, other
            if self._waiting >= self.limit:
                return False, None
            self._ids.pop(key, None)
            self._ids[key] = call
            self._waiting += 1
        return True, None

    def take(
        self, call: _Call, final: bool, usage: Usage | None, taken: list[_Call]
    ) -> tuple[bool, _Call | None]:
        """For a poll ``call`` that reports ``usage`` (``final``: with a final status):
        (False, None) when its response is not kept here; else (True, the creation now to
        settle to it, or None: settled before, not ``final``, or still streaming and no
        usage reported — its stream's end settles it). The id stays, settled, as long as
        room is left. The creation leaves the map and the count in plain stores (where
        no Ctrl-C lands), then is put in ``taken``: an interrupt raised after, as a call
        returns, does not lose it."""
        key = _polled_key(call)
        if key is None:
            return False, None
        with self._lock:
            if key not in self._ids:
                return False, None
            creation = self._ids[key]
            if creation is None or not final:
                return True, None
            if creation._rkey is not None:
                if usage is None:
                    # Its stream may still read one; cut, it settles at its estimate.
                    self._done_keys.add(key)
                    return True, None
                self._open_done(key)
                creation._rkey = _TAKEN
            # Plain stores, where no Ctrl-C lands, then the append: after it returns the
            # creation is out of the map, counted out and in ``taken``.
            self._waiting -= 1
            self._ids[key] = None
            taken.append(creation)
            self._settled(key)
            return True, creation

    def _settled(self, key: tuple[bytes, str]) -> None:
        """``key`` remembered as settled, the newest (the last dropped); settled ids are
        dropped oldest first past the bound (a poll of one dropped is charged what it
        reports: never less than used). Under the lock."""
        ids = self._ids
        ids[key] = None
        ids.move_to_end(key)
        if len(ids) > self.limit:
            for old, c in list(ids.items()):
                if len(ids) <= self.limit:
                    break
                if c is None:
                    del ids[old]

    def drain(self, blocking: bool = True) -> list[_Call] | None:
        """The creations still waiting, taken out (to settle at their estimate); none is
        kept from now on. One still streaming is let go: its stream's end settles it
        (one dropped unclosed: the settling thread, or the close, ends it). Not
        ``blocking``: None when the lock is held."""
        if not blocking:
            # Held by this thread (a collection inside a change), or by another for a
            # moment: nothing is waited for.
            if not self._lock.acquire(False):
                return None
            self._lock.release()
        with self._lock:
            self.closed = True
            calls = []
            for c in self._ids.values():
                if c is None:
                    continue
                if c._rkey is not None:
                    c._rkey = _LET_GO
                    continue
                calls.append(c)
            self._ids.clear()
            self._done_keys.clear()
            self._waiting = 0
        return calls

    def _open_done(self, key: tuple[bytes, str]) -> bool:
        """``key`` no longer open: True when a poll had said its response ended without
        a usage. Under the lock."""
        if key in self._done_keys:
            self._done_keys.discard(key)
            return True
        return False

    def _forget(self) -> None:
        # The same dict emptied: the transport reads it on every call.
        self._lock = threading.Lock()
        self._ids.clear()
        self._done_keys.clear()
        self._waiting = 0


def _final(body: bytes) -> bool:
    """A JSON answer of a response done (its usage final)."""
    b = json_object(body)
    status = b.get("status") if b is not None else None
    return type(status) is str and status in FINAL


class _Settles:
    """The transport's side: a creation kept, a poll settling it (``_settle`` decides)."""

    if TYPE_CHECKING:
        _background: Background
        _is_policy: bool
        _settle_one: Callable[..., None]  # the transport's: settles once
        _pay: Callable[[_Call], None]  # the transport's: pays a ledger part owed

    def _keep(self, call: _Call, body: bytes | None, response_id: str | None) -> bool:
        """A background response's creation (its body an id, no usage) kept until its
        poll reports the usage: its concurrency slots given back and its request dropped
        meanwhile (its estimate and model read first). A creation waiting with the same id
        is settled at its estimate (its ledger part paid with this call's)."""
        taken: list[_Call] = []
        try:
            kept, twin = self._background.keep(call, body, response_id, taken)
            if twin is not None:
                self._settle_linked(call, twin, None)
        finally:
            if taken and taken[0]._once:  # a Ctrl-C before or on the way into its settle
                self._settle_linked(call, taken[0], None)
        if kept is None:
            return True  # a poll took it meanwhile: the poll settles it
        if not kept:
            return False
        # A close the garbage collector runs leaves the waiting to the settling thread:
        # it runs, and a collection is told apart, from now on.
        ready()
        call._done = True
        _ = call.estimate, call.model  # read from the request now: it is dropped
        call._request = None
        if call._permit is not None and self._is_policy:
            call._permit.release()
        return True

    def _polled(
        self,
        call: _Call,
        usage: Usage | None,
        status: int | None,
        body: bytes | None,
        done: bool,
    ) -> bool:
        """A 2xx poll of a background response kept here (False: forgotten meanwhile):
        charged nothing, whatever it reports (running, cut short, settled before); a
        final one (``body``'s status; an event stream's usage is a final event's, or
        ``done``: it told the response ended) settles the creation to its usage, or at
        its estimate without one."""
        if usage is NONE_USED:
            usage = None  # no report: a body without a usage, of a call sent without one
        final = _final(body) if body is not None else usage is not None or done
        taken: list[_Call] = []
        held: list[BaseException] = []
        try:
            kept, creation = self._background.take(call, final, usage, taken)
        except BaseException as e:
            if not taken:
                raise
            kept, creation = True, taken[0]  # taken: settled below, then raised
            held.append(e)
        if not kept:
            return False
        try:
            try:
                if creation is not None:
                    self._settle_linked(call, creation, usage)
            finally:
                try:
                    if creation is not None and creation._once:  # a Ctrl-C on the way in
                        self._settle_linked(call, creation, usage)
                finally:
                    self._settle_one(call, NONE_USED, status, reported=True)
        finally:
            if held:
                raise_held(self, call, held)
        return True

    def _settle_linked(self, call: _Call, other: _Call, usage: Usage | None) -> None:
        """Settle ``other`` (a creation kept) to ``usage`` (None: its estimate); its
        ledger part left for ``call`` to pay after its own."""
        other._async = True  # its ledger part left owed
        try:
            self._settle_one(other, usage, other.status, reported=True)
        finally:
            if other._owed is not None:
                call._linked = other

    def _at_estimate(self, call: _Call) -> None:
        """A creation still waiting when the transport closes: settled at its estimate,
        its ledger part left owed (the closer pays it)."""
        call._async = True
        self._settle_one(call, None, call.status, reported=True)

    def _drain_background(
        self, blocking: bool = True, pay: Callable[[_Call], object] | None = None
    ) -> None:
        """``close()``: the creations still waiting settled at their estimate and paid
        (by ``pay``, else inline), each whatever fails (the first error raised after).
        Not ``blocking`` (a close inside a garbage collection with no settling thread,
        whose thread may hold the lock): none if the lock is held (logged)."""
        pay_one = self._pay if pay is None else pay

        def settle(call: _Call) -> None:
            try:
                self._at_estimate(call)
            finally:
                pay_one(call)

        calls = self._background.drain(blocking)
        if calls is None:
            _log.warning(
                "closed inside a garbage collection, with no thread to settle them: "
                "the background responses waiting keep their holds"
            )
            return
        each(calls, settle)
