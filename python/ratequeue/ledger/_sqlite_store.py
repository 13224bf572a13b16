"""The SQLite side of the embedded ledger: schema, one connection per process, group
commit (calls arriving while a transaction runs share the next one), the account and
period rows cached while no other connection writes, and the accounting on them
(fit, take, give back, thresholds, hold expiry)."""

from __future__ import annotations

import abc
import asyncio
import contextlib
import json
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from ._base import LedgerBase, quota_exceeded
from ._model import (
    UNITS,
    ClockLike,
    LedgerError,
    Plan,
    Span,
    threshold_amounts,
)
from ._sqlite_rows import _ROW_COLS, _SCHEMA, SCHEMA_VERSION, _am, _migrate, _own

#: Claimed notices are handed to no other deliverer for this long (seconds).
CLAIM_SECONDS = 60.0
_MAX_USED = 2**63 - 1
#: At most this many calls share one transaction.
MAX_BATCH = 1000
#: How long the writer waits for as many calls as the last transaction had (seconds):
#: callers woken by a commit come back with their next call meanwhile.
LINGER = 0.002
_NEVER = 1 << 62


#: Connections a forked child inherited: kept referenced so that they are never closed
#: in the child (closing one there could disturb the parent's locks).
_INHERITED: list[sqlite3.Connection] = []


class _Op:
    """One call for the writer thread: its transaction body, and how its caller waits (a
    lock released when done, or an asyncio future resolved on its loop)."""

    __slots__ = (
        "abandoned",
        "charge",
        "done",
        "exc",
        "fn",
        "fut",
        "loop",
        "result",
        "taken",
        "undo",
    )

    def __init__(self, fn: Callable[[sqlite3.Connection], Any], charge: Any = None) -> None:
        self.fn = fn
        self.charge = charge  # a plain charge's arguments: decided with its neighbours
        self.result: Any = None
        self.exc: BaseException | None = None
        self.taken = False  # in a transaction: it can no longer be withdrawn
        self.abandoned = False  # an asyncio caller was cancelled after it was taken
        self.done: Any = None
        self.fut: asyncio.Future[Any] | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.undo: Callable[[sqlite3.Connection], Any] | None = None


def _resolve(ops: Sequence[_Op]) -> None:
    """On an event loop: hands each call its result (its caller may have been cancelled)."""
    for op in ops:
        f = op.fut
        if f is not None and not f.done():
            if op.exc is not None:
                f.set_exception(op.exc)
            else:
                f.set_result(op.result)


class _Acct:
    __slots__ = ("anchor", "bonus", "levels", "next_exp", "own", "plan", "plan_json", "thr")

    def __init__(self, row: sqlite3.Row | tuple[Any, ...], ledger: LedgerBase) -> None:
        self.plan_json: str = row[0]
        self.plan: Plan = ledger._plan(row[0])
        self.anchor: float | None = row[1]
        self.thr: tuple[int, ...] = tuple(json.loads(row[2])) if row[2] else self.plan.thresholds_bp
        self.bonus = dict(zip(UNITS, row[3:7], strict=True))
        if row[8]:
            self.bonus.update(json.loads(row[8]))
        # the plan's units of your own: kept in every counter dict of the account (0 until
        # counted), so that the accounting reads them as it reads the built-in ones
        self.own = tuple(u for u in self.plan.quota if u not in UNITS)
        for u in self.own:
            self.bonus.setdefault(u, 0)
        self.next_exp: float | None = row[7]
        # per unit with a quota: (unit, quota, [(bp, usage at which it fires, flag)], the
        # lowest of those usages: below it, nothing can fire)
        self.levels: list[tuple[str, int, list[tuple[int, int, str]], int]] = []
        for u, q in self.plan.quota.items():
            if q > 0:
                lv = [
                    (bp, lvl, f"{u}:{bp}")
                    for bp, lvl in zip(self.thr, threshold_amounts(q, self.thr), strict=True)
                ]
                self.levels.append((u, q, lv, min((x[1] for x in lv), default=2**63)))


class _Per:
    __slots__ = ("fired", "held", "span", "used")

    def __init__(self, span: Span, row: tuple[Any, ...] | None) -> None:
        self.span = span
        # units of your own beside the built-in ones (those of the account's plan added by
        # ``_per``)
        if row is None:
            self.used = dict.fromkeys(UNITS, 0)
            self.held = dict.fromkeys(UNITS, 0)
            self.fired: set[str] = set()
        else:
            self.used = dict(zip(UNITS, row[0:4], strict=True))
            self.held = dict(zip(UNITS, row[4:8], strict=True))
            self.fired = set(row[8].split(",")) if row[8] else set()
            if row[9]:
                self.used.update(json.loads(row[9]))
            if row[10]:
                self.held.update(json.loads(row[10]))


class SqliteStore(LedgerBase):
    """The SQLite connection of a ledger, its group commit and per-transaction caches."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        clock: ClockLike | None = None,
        retention: float | None = None,
        hold_ttl: float = 600.0,
        default_plan: Plan | None = None,
        synchronous: str = "NORMAL",
        busy_timeout: float = 30.0,
    ) -> None:
        super().__init__(
            clock=clock, retention=retention, hold_ttl=hold_ttl, default_plan=default_plan
        )
        if synchronous not in ("OFF", "NORMAL", "FULL", "EXTRA"):
            raise ValueError(f"synchronous={synchronous!r} must be OFF, NORMAL, FULL or EXTRA")
        self.path = os.fspath(path)
        self._sync = synchronous
        self._busy = float(busy_timeout)
        self._cv = threading.Condition(threading.Lock())
        self._queue: list[_Op] = []
        self._writer: threading.Thread | None = None
        self._closing = False
        self._in_tx = False  # a transaction is running (in the writer or inline)
        self._shared = 0  # calls in the writer's last transaction: > 1 = contended
        self._want = 1  # queued calls at which the writer wants a wake-up
        self._conn: sqlite3.Connection | None = None
        self._pid = 0
        self._accts: dict[str, _Acct | None] = {}
        self._pers: dict[tuple[str, str], _Per] = {}
        self._dirty: set[tuple[str, str]] = set()
        self._last_purge = 0.0
        self._dv: int | None = None
        self._connect()

    # -- connection and group commit ---------------------------------------------------

    def _connect(self) -> sqlite3.Connection:
        if self._conn is not None and self._pid == os.getpid():
            return self._conn
        conn = sqlite3.connect(
            self.path, timeout=self._busy, isolation_level=None, check_same_thread=False
        )
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute(f"PRAGMA synchronous={self._sync}")
        conn.execute(f"PRAGMA busy_timeout={int(self._busy * 1000)}")
        conn.execute("BEGIN IMMEDIATE")
        try:
            for stmt in _SCHEMA.split(";"):
                if stmt.strip():
                    conn.execute(stmt)
            if conn.execute("PRAGMA user_version").fetchone()[0] < SCHEMA_VERSION:
                _migrate(conn)
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        self._conn, self._pid = conn, os.getpid()
        return conn

    # -- the accounting ----------------------------------------------------------------------

    def _current(self, conn: sqlite3.Connection, account: str, now: float) -> tuple[_Acct, _Per]:
        a = self._acct(conn, account)
        if a.next_exp is not None and now >= a.next_exp:
            self._expire_account(conn, account, a, now)
        span = self._span(a.plan_json, a.plan, a.anchor, now)
        return a, self._per(conn, account, span, a.own)

    def _fit(
        self, account: str, a: _Acct, p: _Per, am: dict[str, int], now: float, *, force: bool
    ) -> dict[str, list[int]]:
        """The parts of ``am`` taken from the plan quota, then the bonus (nothing changed);
        ``QuotaExceeded`` if they do not fit (with ``force``, past the quota)."""
        parts: dict[str, list[int]] = {}
        used, bonus = p.used, a.bonus
        for u, q in a.plan.quota.items():
            need = am[u] if u in am else 0  # noqa: SIM401 - no method call
            cur = used[u]
            free = q - cur if q > cur else 0
            from_plan = need if need < free else free
            rest, b = need - from_plan, bonus[u]
            from_bonus = rest if rest < b else b
            if from_plan + from_bonus < need and not force:
                raise quota_exceeded(account, u, need, free + b, p.span, now)
            if force:
                from_plan = need - from_bonus
            if cur + from_plan > _MAX_USED:
                raise ValueError(f"usage of {u} would pass 2**63-1")
            parts[u] = [from_plan, from_bonus]
        return parts

    def _apply(
        self,
        conn: sqlite3.Connection,
        account: str,
        a: _Acct,
        p: _Per,
        parts: dict[str, list[int]],
        now: float,
    ) -> None:
        bonus_changed = False
        for u, (fp, fb) in parts.items():
            p.used[u] += fp
            if fb:
                a.bonus[u] -= fb
                bonus_changed = True
        if bonus_changed:
            self._save_bonus(conn, account, a)
        self._dirty.add((account, p.span.key))
        self._fire(conn, account, a, p, now)

    def _take(
        self,
        conn: sqlite3.Connection,
        account: str,
        a: _Acct,
        p: _Per,
        am: dict[str, int],
        now: float,
        *,
        force: bool,
    ) -> dict[str, list[int]]:
        """Takes ``am`` from the plan quota, then the bonus; returns the parts taken."""
        parts = self._fit(account, a, p, am, now, force=force)
        self._apply(conn, account, a, p, parts, now)
        return parts

    def _give_back(
        self, conn: sqlite3.Connection, account: str, a: _Acct, p: _Per | None, parts: Any
    ) -> None:
        bonus_changed = False
        for u, (fp, fb) in parts.items():
            if p is not None:
                p.used[u] = max(0, p.used.get(u, 0) - fp)
            if fb:
                a.bonus[u] = a.bonus.get(u, 0) + fb
                bonus_changed = True
        if p is not None:
            self._dirty.add((account, p.span.key))
        if bonus_changed:
            self._save_bonus(conn, account, a)

    def _fire(self, conn: sqlite3.Connection, account: str, a: _Acct, p: _Per, now: float) -> None:
        for u, q, levels, lowest in a.levels:
            used = p.used[u]
            if used < lowest:
                continue
            for bp, level, flag in levels:
                if used >= level and flag not in p.fired:
                    p.fired.add(flag)
                    conn.execute(
                        "INSERT OR IGNORE INTO outbox(id, account, period, unit, bp, used, quota,"
                        " at) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                        (
                            f"{account}|{p.span.key}|{u}|{bp}",
                            account,
                            p.span.key,
                            u,
                            bp,
                            p.used[u],
                            q,
                            now,
                        ),
                    )
                    self._notice_event.set()

    def _hold_delta(
        self, p: _Per | None, am: dict[str, int], sign: int, quota: dict[str, int]
    ) -> None:
        """Counts a hold's amounts in (+1) or out of (-1) the period's ``held``: the
        built-in units, and units of your own the plan counts (in) or that were counted
        (out)."""
        if p is None:
            return
        held = p.held
        for u, v in am.items():
            if u in quota or u in held:
                held[u] = max(0, held.get(u, 0) + sign * v)

    def _expire_account(self, conn: sqlite3.Connection, account: str, a: _Acct, now: float) -> int:
        rows = conn.execute(
            "SELECT request_id, period, parts, input_tokens, output_tokens, calls, units"
            " FROM requests WHERE account=? AND status='held' AND expires<=?",
            (account, now),
        ).fetchall()
        for rid, key, parts, i, o, c, un in rows:
            p = self._per_key(conn, account, key, a.own)
            self._give_back(conn, account, a, p, json.loads(parts))
            self._hold_delta(p, _am(i, o, c, un), -1, a.plan.quota)
            conn.execute(
                "UPDATE requests SET status='expired' WHERE account=? AND request_id=?",
                (account, rid),
            )
        nxt = conn.execute(
            "SELECT MIN(expires) FROM requests WHERE account=? AND status='held'", (account,)
        ).fetchone()[0]
        a.next_exp = nxt
        conn.execute("UPDATE accounts SET next_exp=? WHERE account=?", (nxt, account))
        return len(rows)

    def _existing(self, conn: sqlite3.Connection, account: str, rid: str) -> Any:
        return conn.execute(
            "SELECT kind, status, fp, sfp, " + _ROW_COLS + ", expires FROM requests"
            " WHERE account=? AND request_id=?",
            (account, rid),
        ).fetchone()

    @abc.abstractmethod
    def _charge_batch(self, conn: sqlite3.Connection, items: list[Any]) -> list[Any]:
        """Decides several plain charges at once (the ledger's)."""

    def _after_fork(self) -> None:
        """In a forked child: a fresh lock, queue, writer and connection. The parent's
        connection is never used nor closed here (SQLite forbids carrying one across
        fork)."""
        if self._conn is not None:
            _INHERITED.append(self._conn)
        self._cv = threading.Condition(threading.Lock())
        self._queue, self._writer, self._conn, self._closing = [], None, None, False
        self._in_tx, self._want = False, 1
        self._reset_cache()
        self._dv = None
        self._pid = os.getpid()

    def close(self) -> None:
        """Finishes the calls queued, stops the writer thread and closes this process's
        connection (the file stays)."""
        if self._pid != os.getpid():
            self._after_fork()
        with self._cv:
            w, self._closing = self._writer, True
            self._cv.notify_all()
        if w is not None and w is not threading.current_thread():
            w.join()
        with self._cv:
            if self._conn is not None:
                self._conn.close()
            self._conn, self._writer, self._closing = None, None, False

    # -- the writer thread -----------------------------------------------------------------

    def _submit(self, op: _Op) -> None:
        if self._pid != os.getpid():
            self._after_fork()
        with self._cv:
            self._enqueue(op)

    def _enqueue(self, op: _Op) -> None:
        """Queues ``op`` for the writer (under ``_cv``); wakes the writer only when it
        waits for as many calls as are now queued (one wake-up per transaction)."""
        if self._closing:
            raise LedgerError("the ledger is closing")
        if self._writer is None:
            if self._conn is None:
                self._connect()
            self._writer = threading.Thread(
                target=self._write_loop, name="ratequeue-ledger-writer", daemon=True
            )
            self._writer.start()
        q = self._queue
        q.append(op)
        if len(q) >= self._want:
            self._cv.notify()

    def _withdraw(self, op: _Op) -> bool:
        """Takes a queued call back (True) unless a transaction has it already."""
        with self._cv:
            if op.taken:
                return False
            self._queue.remove(op)
            return True

    def _run(self, fn: Callable[[sqlite3.Connection], Any], charge: Any = None) -> Any:
        """Runs ``fn`` in a write transaction of the writer thread, shared with the calls
        queued meanwhile (group commit); returns its result once committed, or raises its
        error. A failed commit fails every call of that transaction, none of which then
        counted. Interrupted (Ctrl-C) while queued, nothing is done; once in a
        transaction, the call waits for its commit, then the interrupt is raised."""
        op = _Op(fn, charge)
        if self._pid != os.getpid():
            self._after_fork()
        with self._cv:
            inline = self._shared <= 1 and not (self._in_tx or self._queue or self._closing)
            if inline:  # uncontended: this thread runs the transaction itself
                self._in_tx = True
                if self._conn is None:
                    try:
                        self._connect()
                    except BaseException:
                        self._in_tx = False
                        raise
            else:
                op.done = done = threading.Lock()
                done.acquire()
                self._enqueue(op)
        if inline:
            try:
                self._commit_batch([op])
            finally:
                with self._cv:
                    self._in_tx = False
                    self._cv.notify()
            if op.exc is not None:
                raise op.exc
            return op.result
        try:
            done.acquire()
        except BaseException:
            if self._withdraw(op):
                raise
            while True:
                try:
                    done.acquire()
                    break
                except BaseException:  # pragma: no cover - a second Ctrl-C
                    continue
            raise
        if op.exc is not None:
            raise op.exc
        return op.result

    def _call(self, call: Any) -> Any:
        """Runs a call (a transaction body, or a plain charge's pair) in the writer."""
        if type(call) is tuple:
            return self._run(*call)
        return self._run(call)

    async def _call_async(
        self, call: Any, undo: Any = None, again: Any = None, finish: bool = False
    ) -> Any:
        """``_call`` for asyncio: the caller awaits a future the writer resolves on its loop
        (one wake-up per loop and transaction). Cancelled while queued, nothing is done
        (with ``finish``, the call stays queued and runs all the same); once in a
        transaction it counts, and then ``undo``, if given, runs in a later transaction
        of the writer (no event loop needed). No ``again``: a queued call's outcome is
        always known."""
        fn, charge = call if type(call) is tuple else (call, None)
        op = _Op(fn, charge)
        op.loop = loop = asyncio.get_running_loop()
        op.fut = fut = loop.create_future()
        self._submit(op)
        try:
            return await fut
        except asyncio.CancelledError:
            if finish:
                raise
            if not self._withdraw(op) and undo is not None:
                with self._cv:
                    finished, op.abandoned = op.loop is None, True
                if finished and op.exc is None:
                    self._submit(_Op(undo))
                elif not finished:
                    op.undo = undo  # run by _finish
            raise

    def _write_loop(self) -> None:
        expected = 1
        while True:
            with self._cv:
                while (self._in_tx or not self._queue) and not self._closing:
                    self._want = 1
                    self._cv.wait()
                while self._in_tx:  # closing: the inline transaction ends first
                    self._cv.wait()
                if not self._queue:
                    return
                if len(self._queue) < expected and not self._closing:
                    # callers woken by the last commit come back with their next call:
                    # one wake-up when they all have, or LINGER after the first
                    self._want = expected
                    end = time.monotonic() + LINGER
                    while len(self._queue) < expected and not self._closing:
                        rest = end - time.monotonic()
                        if rest <= 0 or not self._cv.wait(rest):
                            break
                    while self._in_tx:  # a caller ran its own transaction meanwhile
                        self._cv.wait()
                self._want = _NEVER
                batch = self._queue[:MAX_BATCH]
                del self._queue[:MAX_BATCH]
                for op in batch:
                    op.taken = True
                self._in_tx = True
            expected = self._shared = len(batch)
            try:
                with contextlib.suppress(BaseException):
                    self._commit_batch(batch)
            finally:
                with self._cv:
                    self._in_tx = False
            self._finish(batch)

    def _finish(self, batch: Sequence[_Op]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[_Op]] = {}
        undo: list[_Op] = []
        with self._cv:
            for op in batch:
                if op.done is not None:
                    op.done.release()
                elif op.loop is not None:
                    if op.abandoned:  # its caller was cancelled meanwhile: undo it
                        if op.exc is None:
                            undo.append(op)
                    else:
                        by_loop.setdefault(op.loop, []).append(op)
                    op.loop = None
        for op in undo:
            if op.undo is not None:
                with contextlib.suppress(LedgerError):
                    self._submit(_Op(op.undo))
        for loop, ops in by_loop.items():
            with contextlib.suppress(RuntimeError):  # a closed loop: its callers are gone
                loop.call_soon_threadsafe(_resolve, ops)

    def _reset_cache(self) -> None:
        self._accts.clear()
        self._pers.clear()
        self._dirty.clear()

    def _commit_batch(self, batch: Sequence[_Op]) -> None:
        """One transaction for ``batch`` (in the writer thread): each call's result or
        error set on it; a call that fails alone is rolled back to its savepoint, a
        failed commit (or an interrupt) fails them all, and nothing of them counted."""
        conn = self._conn
        assert conn is not None
        try:
            conn.execute("BEGIN IMMEDIATE")
            # Rows cached by earlier transactions stay valid while no other connection
            # has committed since (data_version unchanged).
            dv = conn.execute("PRAGMA data_version").fetchone()[0]
            if dv != self._dv or len(self._accts) + len(self._pers) > 10_000:
                self._reset_cache()
            self._dv = dv
        except Exception as e:
            self._dv = None
            for op in batch:
                op.exc = e
            return
        running: Sequence[_Op] = ()
        try:
            groups = _groups(batch)
            if len(groups) == 1:
                # one call, or only plain charges: a failure rolls the whole transaction
                # back (no savepoint needed)
                running = group = groups[0]
                try:
                    self._run_group(conn, group)
                    self._flush(conn)
                except Exception as e:
                    for op in group:
                        op.result, op.exc = None, e
                    conn.execute("ROLLBACK")
                    self._reset_cache()
                    self._dv = None
                    return
            else:
                for group in groups:
                    running = group
                    conn.execute("SAVEPOINT op")
                    try:
                        self._run_group(conn, group)
                        self._flush(conn)
                    except Exception as e:
                        for op in group:
                            op.result, op.exc = None, e
                        conn.execute("ROLLBACK TO op")
                        self._reset_cache()
                    conn.execute("RELEASE op")
            running = ()
            self._maybe_purge(conn)
            conn.execute("COMMIT")
        except BaseException as e:
            with contextlib.suppress(sqlite3.Error):
                conn.execute("ROLLBACK")
            for op in batch:
                op.result = None
                op.exc = (
                    e
                    if op in running or isinstance(e, Exception)
                    else LedgerError("the transaction was interrupted; nothing was recorded")
                )
            self._reset_cache()
            self._dv = None

    def _run_group(self, conn: sqlite3.Connection, group: Sequence[_Op]) -> None:
        """Runs one call, or consecutive plain charges decided together."""
        if len(group) == 1:
            op = group[0]
            op.result = op.fn(conn)
            return
        results = self._charge_batch(conn, [op.charge for op in group])
        for op, r in zip(group, results, strict=True):
            if isinstance(r, Exception):
                op.exc = r
            else:
                op.result = r

    def _maybe_purge(self, conn: sqlite3.Connection) -> None:
        now = self._now()
        if now - self._last_purge < min(3600.0, self.retention / 100):
            return
        self._last_purge = now
        cut = now - self.retention
        # A row goes with its period, ``retention`` after the period's end (found on the
        # (account, at) index: no index on time alone slows every insert).
        stale = conn.execute(
            "SELECT account, period, end FROM periods WHERE end<? LIMIT 10000", (cut,)
        ).fetchall()
        for account, period, end in stale:
            conn.execute(
                "DELETE FROM holds WHERE request_id IN (SELECT request_id FROM requests"
                " WHERE account=? AND at<=? AND period=? AND kind='hold' AND status!='held')"
                " AND account=?",
                (account, end, period, account),
            )
            conn.execute(
                "DELETE FROM requests WHERE account=? AND at<=? AND period=? AND status!='held'",
                (account, end, period),
            )
        conn.execute("DELETE FROM periods WHERE end<?", (cut,))
        self._reset_cache()

    # -- cached state within one transaction ---------------------------------------------

    def _acct(self, conn: sqlite3.Connection, account: str, *, create: bool = True) -> _Acct:
        a = self._accts.get(account)
        if a is None:
            row = conn.execute(
                "SELECT plan, anchor, thresholds, b_tokens, b_input_tokens, b_output_tokens,"
                " b_calls, next_exp, b_units FROM accounts WHERE account=?",
                (account,),
            ).fetchone()
            if row is None:
                if not create or self.default_plan is None:
                    raise self._unknown(account)
                pj = self.default_plan.to_json()
                conn.execute("INSERT INTO accounts(account, plan) VALUES (?, ?)", (account, pj))
                row = (pj, None, None, 0, 0, 0, 0, None, None)
            a = _Acct(row, self)
            self._accts[account] = a
        return a

    def _per(
        self, conn: sqlite3.Connection, account: str, span: Span, own: tuple[str, ...] = ()
    ) -> _Per:
        """The period's counters (cached), with ``own`` (the plan's units of your own)
        among them."""
        k = (account, span.key)
        p = self._pers.get(k)
        if p is None:
            row = conn.execute(
                "SELECT u_tokens, u_input_tokens, u_output_tokens, u_calls, h_tokens,"
                " h_input_tokens, h_output_tokens, h_calls, fired, u_units, h_units FROM periods"
                " WHERE account=? AND period=?",
                k,
            ).fetchone()
            if row is None:
                conn.execute(
                    "INSERT INTO periods(account, period, start, end) VALUES (?, ?, ?, ?)",
                    (account, span.key, span.start, span.end),
                )
            p = _Per(span, row)
            self._pers[k] = p
        if own:
            used, held = p.used, p.held
            for u in own:
                if u not in used:
                    used[u] = 0
                if u not in held:
                    held[u] = 0
        return p

    def _per_key(
        self, conn: sqlite3.Connection, account: str, key: str, own: tuple[str, ...] = ()
    ) -> _Per | None:
        """A past period's counters by key (None once purged)."""
        p = self._pers.get((account, key))
        if p is not None:
            return self._per(conn, account, p.span, own) if own else p
        row = conn.execute(
            "SELECT start, end FROM periods WHERE account=? AND period=?", (account, key)
        ).fetchone()
        if row is None:
            return None
        return self._per(conn, account, Span(key, row[0], row[1]), own)

    def _flush(self, conn: sqlite3.Connection) -> None:
        for account, key in self._dirty:
            p = self._pers[(account, key)]
            if len(p.used) == 4 and len(p.held) == 4:  # no unit of your own (no None bound:
                # sqlite3 adapts None through an error it raises and clears, ~1,000
                # instructions a parameter)
                conn.execute(
                    "UPDATE periods SET u_tokens=?, u_input_tokens=?, u_output_tokens=?,"
                    " u_calls=?, h_tokens=?, h_input_tokens=?, h_output_tokens=?, h_calls=?,"
                    " fired=? WHERE account=? AND period=?",
                    (
                        *(p.used[u] for u in UNITS),
                        *(p.held[u] for u in UNITS),
                        ",".join(sorted(p.fired)),
                        account,
                        key,
                    ),
                )
                continue
            conn.execute(
                "UPDATE periods SET u_tokens=?, u_input_tokens=?, u_output_tokens=?, u_calls=?,"
                " h_tokens=?, h_input_tokens=?, h_output_tokens=?, h_calls=?, fired=?,"
                " u_units=?, h_units=? WHERE account=? AND period=?",
                (
                    *(p.used[u] for u in UNITS),
                    *(p.held[u] for u in UNITS),
                    ",".join(sorted(p.fired)),
                    _own(p.used),
                    _own(p.held),
                    account,
                    key,
                ),
            )
        self._dirty.clear()

    def _save_bonus(self, conn: sqlite3.Connection, account: str, a: _Acct) -> None:
        if len(a.bonus) == 4:
            conn.execute(
                "UPDATE accounts SET b_tokens=?, b_input_tokens=?, b_output_tokens=?, b_calls=?"
                " WHERE account=?",
                (*(a.bonus[u] for u in UNITS), account),
            )
            return
        conn.execute(
            "UPDATE accounts SET b_tokens=?, b_input_tokens=?, b_output_tokens=?, b_calls=?,"
            " b_units=? WHERE account=?",
            (*(a.bonus[u] for u in UNITS), _own(a.bonus), account),
        )


def _groups(batch: Sequence[_Op]) -> list[Sequence[_Op]]:
    """``batch`` cut into single calls and runs of consecutive plain charges."""
    out: list[Sequence[_Op]] = []
    k = 0
    while k < len(batch):
        j = k
        while j < len(batch) and batch[j].charge is not None:
            j += 1
        j = max(j, k + 1)
        out.append(batch[k:j])
        k = j
    return out
