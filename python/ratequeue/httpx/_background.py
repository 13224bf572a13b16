"""Background responses (OpenAI's ``background=True``), charged exactly once.

Such a response answers its creation ``queued`` (or ``in_progress``), before it has run:
its body has an id and no usage. The creation's settle waits for that usage: the call
is kept here by the response's id, its estimate still charged (and its ledger hold still
held), its concurrency slots given back, its request dropped. A poll (``GET
…/responses/{id}``) or a cancel (``POST …/responses/{id}/cancel``) whose body reports a
final status (``completed``, ``incomplete``, ``failed``, ``cancelled``) with a usage
settles the creation to it; that poll, and any before it, is charged nothing: the tokens
are counted once, where they were spent. A poll of a response settled that way
(remembered, as many as are kept waiting) is charged nothing again.

Bounded: at most ``limit`` creations wait (past it a creation keeps its estimate, as any
body without a usage does, and its poll is charged the usage it reports: never less than
used); a second creation answered with the id of one waiting stops the tracking of that
id (both keep their estimates, its polls are charged); the transport's ``close`` settles
those still waiting at their estimate. A forked child forgets them (the parent settles
its own).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import TYPE_CHECKING

from .._threads import AfterFork
from ._record import json_object
from ._usage import waiting_response_id

if TYPE_CHECKING:
    from ._record import _Call

__all__ = ["Background"]

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


class Background:
    """The creations waiting for their usage, by response id (see the module)."""

    __slots__ = ("__weakref__", "_ids", "_lock", "_waiting", "limit")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._lock = threading.Lock()
        # id -> the creation waiting, or None once settled (the poll's usage charged).
        self._ids: OrderedDict[str, _Call | None] = OrderedDict()
        self._waiting = 0
        _ALL.add(self)

    def __bool__(self) -> bool:
        return bool(self._ids)

    @property
    def waiting(self) -> int:
        """Creations waiting for their usage."""
        return self._waiting

    def watches(self, path: str) -> bool:
        """True when ``path`` polls a response kept here."""
        rid = polled_id(path)
        return rid is not None and rid in self._ids

    def keep(self, call: _Call, body: bytes | None, rid: str | None) -> tuple[bool, _Call | None]:
        """Keep ``call``, a creation whose 2xx answer reports no usage (``body``, a JSON
        one; ``rid``, the id an event stream named), until its usage is polled: (True
        when kept — a response not run yet, room left —, the creation waiting with the
        same id, no longer kept: to settle at its estimate)."""
        if not self.limit or call._request.method != "POST":
            return False, None
        if not call.path.endswith("/responses"):
            return False, None
        if rid is None:
            rid = waiting_response_id(json_object(body)) if body else None
        if rid is None:
            return False, None
        with self._lock:
            if self._ids.get(rid) is not None:
                # The provider named two responses alike: neither poll can tell which
                # it settles, so neither is kept and the id's polls are charged.
                self._waiting -= 1
                return False, self._ids.pop(rid)
            if self._waiting >= self.limit:
                return False, None
            self._ids.pop(rid, None)
            self._ids[rid] = call
            self._waiting += 1
        return True, None

    def take(self, path: str, final: bool) -> tuple[bool, _Call | None]:
        """For a poll of ``path`` that reports a usage (``final``: with a final status):
        (False, None) when its response is not kept here; else (True, the creation now to
        settle to it, or None: settled before, or not ``final``). The id stays, settled,
        as long as room is left."""
        rid = polled_id(path)
        if rid is None:
            return False, None
        with self._lock:
            if rid not in self._ids:
                return False, None
            call = self._ids[rid]
            if call is None or not final:
                return True, None
            self._ids[rid] = None
            self._ids.move_to_end(rid)  # the newest settled: the last dropped
            self._waiting -= 1
            # Settled ids are dropped oldest first past the bound (a poll of one dropped
            # is charged what it reports: never less than used).
            if len(self._ids) > self.limit:
                for old, c in list(self._ids.items()):
                    if len(self._ids) <= self.limit:
                        break
                    if c is None:
                        del self._ids[old]
            return True, call

    def drain(self) -> list[_Call]:
        """The creations still waiting, taken out (to settle at their estimate)."""
        with self._lock:
            calls = [c for c in self._ids.values() if c is not None]
            self._ids.clear()
            self._waiting = 0
        return calls

    def _forget(self) -> None:
        # The same dict emptied: the transport reads it on every call.
        self._lock = threading.Lock()
        self._ids.clear()
        self._waiting = 0
