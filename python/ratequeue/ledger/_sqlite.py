"""The embedded ledger: one SQLite file (stdlib ``sqlite3``, WAL) shared by threads and
processes, with group commit (concurrent calls share one transaction and one sync)."""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import threading
from collections.abc import Callable, Sequence
from typing import Any

from ._base import LedgerBase, compensation, parse_json_obj, quota_exceeded
from ._model import (
    UNITS,
    Balance,
    Charge,
    ClockLike,
    Hold,
    IdempotencyConflict,
    LedgerError,
    Notice,
    Page,
    Plan,
    Span,
    UnknownRequest,
    fingerprint,
    threshold_amounts,
)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS accounts(
  account TEXT PRIMARY KEY, plan TEXT NOT NULL, anchor REAL, thresholds TEXT,
  b_tokens INTEGER NOT NULL DEFAULT 0, b_input_tokens INTEGER NOT NULL DEFAULT 0,
  b_output_tokens INTEGER NOT NULL DEFAULT 0, b_calls INTEGER NOT NULL DEFAULT 0,
  next_exp REAL);
CREATE TABLE IF NOT EXISTS periods(
  account TEXT NOT NULL, period TEXT NOT NULL, start REAL NOT NULL, end REAL NOT NULL,
  u_tokens INTEGER NOT NULL DEFAULT 0, u_input_tokens INTEGER NOT NULL DEFAULT 0,
  u_output_tokens INTEGER NOT NULL DEFAULT 0, u_calls INTEGER NOT NULL DEFAULT 0,
  h_tokens INTEGER NOT NULL DEFAULT 0, h_input_tokens INTEGER NOT NULL DEFAULT 0,
  h_output_tokens INTEGER NOT NULL DEFAULT 0, h_calls INTEGER NOT NULL DEFAULT 0,
  fired TEXT NOT NULL DEFAULT '', PRIMARY KEY(account, period)) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS periods_end ON periods(end);
CREATE TABLE IF NOT EXISTS requests(
  account TEXT NOT NULL, request_id TEXT NOT NULL, kind TEXT NOT NULL, status TEXT NOT NULL,
  at REAL NOT NULL, period TEXT NOT NULL, input_tokens INTEGER NOT NULL,
  output_tokens INTEGER NOT NULL, calls INTEGER NOT NULL, model TEXT, parent_id TEXT,
  meta TEXT, fp TEXT NOT NULL, sfp TEXT, parts TEXT, expires REAL,
  PRIMARY KEY(account, request_id));
CREATE INDEX IF NOT EXISTS requests_id ON requests(request_id);
CREATE INDEX IF NOT EXISTS requests_at ON requests(account, at, request_id);
CREATE INDEX IF NOT EXISTS requests_parent ON requests(account, parent_id)
  WHERE parent_id IS NOT NULL;
CREATE INDEX IF NOT EXISTS requests_age ON requests(at);
CREATE TABLE IF NOT EXISTS outbox(
  id TEXT PRIMARY KEY, account TEXT NOT NULL, period TEXT NOT NULL, unit TEXT NOT NULL,
  bp INTEGER NOT NULL, used INTEGER NOT NULL, quota INTEGER NOT NULL, at REAL NOT NULL,
  claimed REAL NOT NULL DEFAULT 0);
CREATE TABLE IF NOT EXISTS audit(
  campaign TEXT NOT NULL, account TEXT NOT NULL, at REAL NOT NULL, period TEXT,
  status TEXT NOT NULL, record TEXT NOT NULL, PRIMARY KEY(campaign, account)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS campaigns(
  campaign TEXT PRIMARY KEY, params TEXT NOT NULL, started REAL NOT NULL, finished REAL);
"""

_ROW_COLS = (
    "request_id, account, period, at, input_tokens, output_tokens, calls, model, parent_id, meta"
)
#: Claimed notices are handed to no other deliverer for this long (seconds).
CLAIM_SECONDS = 60.0


class _Op:
    __slots__ = ("event", "exc", "fn", "lead", "result")

    def __init__(self, fn: Callable[[sqlite3.Connection], Any]) -> None:
        self.fn = fn
        self.event = threading.Event()
        self.result: Any = None
        self.exc: BaseException | None = None
        self.lead = False


class _Acct:
    __slots__ = ("anchor", "bonus", "next_exp", "plan", "plan_json", "thr")

    def __init__(self, row: sqlite3.Row | tuple[Any, ...], ledger: LedgerBase) -> None:
        self.plan_json: str = row[0]
        self.plan: Plan = ledger._plan(row[0])
        self.anchor: float | None = row[1]
        self.thr: tuple[int, ...] = (
            tuple(json.loads(row[2])) if row[2] else self.plan.thresholds_bp
        )
        self.bonus = dict(zip(UNITS, row[3:7]))
        self.next_exp: float | None = row[7]


class _Per:
    __slots__ = ("fired", "span", "used", "held")

    def __init__(self, span: Span, row: tuple[Any, ...] | None) -> None:
        self.span = span
        if row is None:
            self.used = dict.fromkeys(UNITS, 0)
            self.held = dict.fromkeys(UNITS, 0)
            self.fired: set[str] = set()
        else:
            self.used = dict(zip(UNITS, row[0:4]))
            self.held = dict(zip(UNITS, row[4:8]))
            self.fired = set(row[8].split(",")) if row[8] else set()


class SqliteLedger(LedgerBase):
    """A quota ledger in one SQLite file; every process opening the file shares it.

    ``synchronous="NORMAL"`` (the default, WAL) survives a process crash and keeps the
    file consistent on power loss; ``"FULL"`` also keeps the last commits on power loss.
    Concurrent calls from threads are committed together (group commit).
    """

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
        self._mu = threading.Lock()
        self._queue: list[_Op] = []
        self._leader = False
        self._conn: sqlite3.Connection | None = None
        self._pid = 0
        self._accts: dict[str, _Acct | None] = {}
        self._pers: dict[tuple[str, str], _Per] = {}
        self._dirty: set[tuple[str, str]] = set()
        self._last_purge = 0.0
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
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        self._conn, self._pid = conn, os.getpid()
        self._queue, self._leader, self._mu = [], False, threading.Lock()
        return conn

    def close(self) -> None:
        """Closes this process's connection (the file stays)."""
        with self._mu:
            if self._conn is not None and self._pid == os.getpid():
                self._conn.close()
            self._conn = None

    def _run(self, fn: Callable[[sqlite3.Connection], Any]) -> Any:
        """Runs ``fn`` in a write transaction shared with the calls that arrive meanwhile
        (group commit); returns its result once committed, or raises its error. A failed
        commit fails every call of that transaction, none of which then counted."""
        if self._pid != os.getpid() or self._conn is None:
            with self._mu:
                self._connect()
        op = _Op(fn)
        with self._mu:
            self._queue.append(op)
            lead = not self._leader
            if lead:
                self._leader = True
        if not lead:
            interrupted: BaseException | None = None
            while True:
                try:
                    op.event.wait()
                    break
                except BaseException as e:  # Ctrl-C while queued
                    with self._mu:
                        if not op.lead and op in self._queue:
                            self._queue.remove(op)
                            raise
                    interrupted = e  # already running or made leader: finish that first
            if op.lead:
                self._lead(op)
            if interrupted is not None:
                raise interrupted
        else:
            self._lead(op)
        if op.exc is not None:
            raise op.exc
        return op.result

    def _lead(self, mine: _Op) -> None:
        with self._mu:
            batch, self._queue = self._queue, []
        try:
            self._commit_batch(batch, mine)
        finally:
            with self._mu:
                nxt = None
                if self._queue:
                    nxt = self._queue[0]
                    nxt.lead = True
                else:
                    self._leader = False
            for op in batch:
                if op is not mine:
                    op.event.set()
            if nxt is not None:
                nxt.event.set()

    def _reset_cache(self) -> None:
        self._accts.clear()
        self._pers.clear()
        self._dirty.clear()

    def _commit_batch(self, batch: Sequence[_Op], mine: _Op) -> None:
        conn = self._conn
        assert conn is not None
        self._reset_cache()
        for op in batch:
            op.lead = False
        try:
            conn.execute("BEGIN IMMEDIATE")
        except Exception as e:
            for op in batch:
                op.exc = e
            return
        try:
            for op in batch:
                conn.execute("SAVEPOINT op")
                try:
                    op.result = op.fn(conn)
                    self._flush(conn)
                except Exception as e:
                    op.exc = e
                    conn.execute("ROLLBACK TO op")
                    self._reset_cache()
                conn.execute("RELEASE op")
            self._maybe_purge(conn)
            conn.execute("COMMIT")
        except BaseException as e:
            with contextlib.suppress(sqlite3.Error):
                conn.execute("ROLLBACK")
            for op in batch:
                op.result = None
                op.exc = (
                    e
                    if op is mine or isinstance(e, Exception)
                    else LedgerError("the transaction was interrupted; nothing was recorded")
                )
            if not isinstance(e, Exception):
                raise
        finally:
            self._reset_cache()

    # -- cached state within one transaction ---------------------------------------------

    def _acct(self, conn: sqlite3.Connection, account: str, *, create: bool = True) -> _Acct:
        a = self._accts.get(account)
        if a is None:
            row = conn.execute(
                "SELECT plan, anchor, thresholds, b_tokens, b_input_tokens, b_output_tokens,"
                " b_calls, next_exp FROM accounts WHERE account=?",
                (account,),
            ).fetchone()
            if row is None:
                if not create or self.default_plan is None:
                    raise self._unknown(account)
                pj = self.default_plan.to_json()
                conn.execute("INSERT INTO accounts(account, plan) VALUES (?, ?)", (account, pj))
                row = (pj, None, None, 0, 0, 0, 0, None)
            a = _Acct(row, self)
            self._accts[account] = a
        return a

    def _per(self, conn: sqlite3.Connection, account: str, span: Span) -> _Per:
        k = (account, span.key)
        p = self._pers.get(k)
        if p is None:
            row = conn.execute(
                "SELECT u_tokens, u_input_tokens, u_output_tokens, u_calls, h_tokens,"
                " h_input_tokens, h_output_tokens, h_calls, fired FROM periods"
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
        return p

    def _per_key(self, conn: sqlite3.Connection, account: str, key: str) -> _Per | None:
        """A past period's counters by key (None once purged)."""
        p = self._pers.get((account, key))
        if p is not None:
            return p
        row = conn.execute(
            "SELECT start, end FROM periods WHERE account=? AND period=?", (account, key)
        ).fetchone()
        if row is None:
            return None
        return self._per(conn, account, Span(key, row[0], row[1]))

    def _flush(self, conn: sqlite3.Connection) -> None:
        for account, key in self._dirty:
            p = self._pers[(account, key)]
            conn.execute(
                "UPDATE periods SET u_tokens=?, u_input_tokens=?, u_output_tokens=?, u_calls=?,"
                " h_tokens=?, h_input_tokens=?, h_output_tokens=?, h_calls=?, fired=?"
                " WHERE account=? AND period=?",
                (
                    *(p.used[u] for u in UNITS),
                    *(p.held[u] for u in UNITS),
                    ",".join(sorted(p.fired)),
                    account,
                    key,
                ),
            )
        self._dirty.clear()

    def _save_bonus(self, conn: sqlite3.Connection, account: str, a: _Acct) -> None:
        conn.execute(
            "UPDATE accounts SET b_tokens=?, b_input_tokens=?, b_output_tokens=?, b_calls=?"
            " WHERE account=?",
            (*(a.bonus[u] for u in UNITS), account),
        )

    # -- the accounting ----------------------------------------------------------------------

    def _current(self, conn: sqlite3.Connection, account: str, now: float) -> tuple[_Acct, _Per]:
        a = self._acct(conn, account)
        if a.next_exp is not None and now >= a.next_exp:
            self._expire_account(conn, account, a, now)
        span = self._span(a.plan_json, a.plan, a.anchor, now)
        return a, self._per(conn, account, span)

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
        parts: dict[str, list[int]] = {}
        quota = a.plan.quota
        for u, q in quota.items():
            need = am[u]
            free = max(0, q - p.used[u])
            from_plan = min(need, free)
            from_bonus = min(need - from_plan, a.bonus[u])
            if not force and from_plan + from_bonus < need:
                raise quota_exceeded(account, u, need, free + a.bonus[u], p.span, now)
            if force:
                from_plan = need - from_bonus
            parts[u] = [from_plan, from_bonus]
        bonus_changed = False
        for u, (fp, fb) in parts.items():
            if p.used[u] + fp > 2**63 - 1:
                raise ValueError(f"usage of {u} would pass 2**63-1")
            p.used[u] += fp
            if fb:
                a.bonus[u] -= fb
                bonus_changed = True
        if bonus_changed:
            self._save_bonus(conn, account, a)
        self._dirty.add((account, p.span.key))
        self._fire(conn, account, a, p, now)
        return parts

    def _give_back(
        self, conn: sqlite3.Connection, account: str, a: _Acct, p: _Per | None, parts: Any
    ) -> None:
        bonus_changed = False
        for u, (fp, fb) in parts.items():
            if p is not None:
                p.used[u] = max(0, p.used[u] - fp)
            if fb:
                a.bonus[u] += fb
                bonus_changed = True
        if p is not None:
            self._dirty.add((account, p.span.key))
        if bonus_changed:
            self._save_bonus(conn, account, a)

    def _fire(self, conn: sqlite3.Connection, account: str, a: _Acct, p: _Per, now: float) -> None:
        for u, q in a.plan.quota.items():
            if q == 0:
                continue
            for bp, level in zip(a.thr, threshold_amounts(q, a.thr)):
                flag = f"{u}:{bp}"
                if p.used[u] >= level and flag not in p.fired:
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

    def _hold_delta(self, p: _Per | None, am: dict[str, int], sign: int) -> None:
        if p is None:
            return
        for u in UNITS:
            p.held[u] = max(0, p.held[u] + sign * am[u])

    def _expire_account(self, conn: sqlite3.Connection, account: str, a: _Acct, now: float) -> int:
        rows = conn.execute(
            "SELECT request_id, period, parts, input_tokens, output_tokens, calls FROM requests"
            " WHERE account=? AND status='held' AND expires<=?",
            (account, now),
        ).fetchall()
        for rid, key, parts, i, o, c in rows:
            p = self._per_key(conn, account, key)
            self._give_back(conn, account, a, p, json.loads(parts))
            self._hold_delta(p, _am(i, o, c), -1)
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

    def _charge(
        self,
        rid: str,
        account: str,
        am: dict[str, int],
        model: str | None,
        parent: str | None,
        meta: str,
        fp: str,
    ) -> Charge:
        args = (rid, account, am, model, parent, meta)
        return self._run(lambda conn: _inline(self, conn, args, fp))  # type: ignore[no-any-return]

    def charge_many(self, requests: Sequence[dict[str, Any]]) -> list[Charge | Exception]:
        """Charges several requests in one transaction (each as ``charge(**request)``);
        returns each one's Charge or the error it raised (the others still count)."""
        ops = []
        for r in requests:
            args = self._request_args(
                r["request_id"],
                r["account"],
                r.get("input_tokens", 0),
                r.get("output_tokens", 0),
                r.get("calls", 1),
                r.get("model"),
                r.get("parent_id"),
                r.get("meta"),
            )
            ops.append((args, fingerprint("charge", *args[1:])))

        def fn(conn: sqlite3.Connection) -> list[Charge | Exception]:
            out: list[Charge | Exception] = []
            for args, fp in ops:
                conn.execute("SAVEPOINT one")
                try:
                    out.append(_inline(self, conn, args, fp))
                    self._flush(conn)
                except Exception as e:
                    conn.execute("ROLLBACK TO one")
                    self._reset_cache()
                    out.append(e)
                conn.execute("RELEASE one")
            return out

        return self._run(fn)  # type: ignore[no-any-return]

    def _hold(
        self,
        rid: str,
        account: str,
        am: dict[str, int],
        model: str | None,
        parent: str | None,
        meta: str,
        fp: str,
    ) -> Hold:
        def fn(conn: sqlite3.Connection) -> Hold:
            now = self._now()
            old = self._existing(conn, account, rid)
            if old is not None:
                if old[0] != "hold" or old[2] != fp:
                    raise _conflict(rid)
                return _hold_of(old[4:14], old[14], True)
            a, p = self._current(conn, account, now)
            parts = self._take(conn, account, a, p, am, now, force=False)
            self._hold_delta(p, am, +1)
            exp = now + self.hold_ttl
            conn.execute(
                "INSERT INTO requests(account, request_id, kind, status, at, period,"
                " input_tokens, output_tokens, calls, model, parent_id, meta, fp, parts, expires)"
                " VALUES (?, ?, 'hold', 'held', ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    account,
                    rid,
                    now,
                    p.span.key,
                    am["input_tokens"],
                    am["output_tokens"],
                    am["calls"],
                    model,
                    parent,
                    meta or None,
                    fp,
                    json.dumps(parts),
                    exp,
                ),
            )
            if a.next_exp is None or exp < a.next_exp:
                a.next_exp = exp
                conn.execute("UPDATE accounts SET next_exp=? WHERE account=?", (exp, account))
            return Hold(
                rid,
                account,
                p.span.key,
                now,
                exp,
                am["input_tokens"],
                am["output_tokens"],
                am["calls"],
                model,
                parent,
                parse_json_obj(meta),
            )

        return self._run(fn)  # type: ignore[no-any-return]

    def _find_hold(self, conn: sqlite3.Connection, rid: str) -> str | None:
        row = conn.execute(
            "SELECT account FROM requests WHERE request_id=? ORDER BY kind DESC, at DESC LIMIT 1",
            (rid,),
        ).fetchone()
        return None if row is None else str(row[0])

    def _settle(
        self,
        rid: str,
        am: dict[str, int],
        model: str | None,
        account: str | None,
        sfp: str,
    ) -> Charge:
        def fn(conn: sqlite3.Connection) -> Charge:
            now = self._now()
            acc = account if account is not None else self._find_hold(conn, rid)
            if acc is None:
                raise UnknownRequest(f"no hold or charge has request id {rid!r}; pass account=")
            old = self._existing(conn, acc, rid)
            if old is not None and old[1] == "charged":
                if (old[3] or old[2]) != sfp and not (
                    old[0] == "charge" and _same_amounts(old, am, model)
                ):
                    raise _conflict(rid)
                return _charge_of(old[4:14], True)
            a, cur = self._current(conn, acc, now)
            if old is None:
                p = cur
                self._take(conn, acc, a, p, am, now, force=True)
                conn.execute(
                    "INSERT INTO requests(account, request_id, kind, status, at, period,"
                    " input_tokens, output_tokens, calls, model, fp, sfp)"
                    " VALUES (?, ?, 'charge', 'charged', ?, ?, ?, ?, ?, ?, ?, ?)",
                    (
                        acc,
                        rid,
                        now,
                        p.span.key,
                        am["input_tokens"],
                        am["output_tokens"],
                        am["calls"],
                        model,
                        sfp,
                        sfp,
                    ),
                )
                return Charge(
                    rid, acc, p.span.key, now, am["input_tokens"], am["output_tokens"],
                    am["calls"], model,
                )
            key = old[6]
            pp = self._per_key(conn, acc, key)
            if old[1] == "held":
                self._give_back(conn, acc, a, pp, json.loads(conn.execute(
                    "SELECT parts FROM requests WHERE account=? AND request_id=?", (acc, rid)
                ).fetchone()[0]))
                self._hold_delta(pp, _am(old[8], old[9], old[10]), -1)
            target = pp if pp is not None else cur
            self._take(conn, acc, a, target, am, now, force=True)
            m = model if model is not None else old[11]
            conn.execute(
                "UPDATE requests SET status='charged', at=?, period=?, input_tokens=?,"
                " output_tokens=?, calls=?, model=?, sfp=?, parts=NULL"
                " WHERE account=? AND request_id=?",
                (
                    now,
                    target.span.key,
                    am["input_tokens"],
                    am["output_tokens"],
                    am["calls"],
                    m,
                    sfp,
                    acc,
                    rid,
                ),
            )
            return Charge(
                rid,
                acc,
                target.span.key,
                now,
                am["input_tokens"],
                am["output_tokens"],
                am["calls"],
                m,
                old[12],
                parse_json_obj(old[13]),
            )

        return self._run(fn)  # type: ignore[no-any-return]

    def _release(self, rid: str) -> None:
        def fn(conn: sqlite3.Connection) -> None:
            rows = conn.execute(
                "SELECT account, period, parts, input_tokens, output_tokens, calls FROM requests"
                " WHERE request_id=? AND status='held'",
                (rid,),
            ).fetchall()
            for acc, key, parts, i, o, c in rows:
                a = self._acct(conn, acc, create=False)
                p = self._per_key(conn, acc, key)
                self._give_back(conn, acc, a, p, json.loads(parts))
                self._hold_delta(p, _am(i, o, c), -1)
                conn.execute(
                    "UPDATE requests SET status='released', parts=NULL"
                    " WHERE account=? AND request_id=?",
                    (acc, rid),
                )

        self._run(fn)

    def expire_holds(self) -> int:
        """Gives back every hold past its expiry now; returns how many."""

        def fn(conn: sqlite3.Connection) -> int:
            now = self._now()
            accts = [
                r[0]
                for r in conn.execute(
                    "SELECT account FROM accounts WHERE next_exp IS NOT NULL AND next_exp<=?",
                    (now,),
                )
            ]
            n = 0
            for acc in accts:
                n += self._expire_account(conn, acc, self._acct(conn, acc, create=False), now)
            return n

        return self._run(fn)  # type: ignore[no-any-return]

    def _maybe_purge(self, conn: sqlite3.Connection) -> None:
        now = self._now()
        if now - self._last_purge < min(3600.0, self.retention / 100):
            return
        self._last_purge = now
        cut = now - self.retention
        conn.execute("DELETE FROM requests WHERE at<? AND status!='held'", (cut,))
        conn.execute("DELETE FROM periods WHERE end<?", (cut,))

    # -- accounts ----------------------------------------------------------------------

    def _set_plan(
        self, account: str, plan: Plan, anchor: float | None, thr: tuple[int, ...] | None
    ) -> None:
        pj = plan.to_json()
        tj = None if thr is None else json.dumps(list(thr))

        def fn(conn: sqlite3.Connection) -> None:
            conn.execute(
                "INSERT INTO accounts(account, plan, anchor, thresholds) VALUES (?, ?, ?, ?)"
                " ON CONFLICT(account) DO UPDATE SET plan=excluded.plan,"
                " anchor=excluded.anchor, thresholds=excluded.thresholds",
                (account, pj, anchor, tj),
            )

        self._run(fn)

    def _read(self, fn: Callable[[sqlite3.Connection], Any]) -> Any:
        return self._run(fn)

    def _accounts_after(self, after: str, limit: int) -> list[str]:
        return self._read(  # type: ignore[no-any-return]
            lambda c: [
                r[0]
                for r in c.execute(
                    "SELECT account FROM accounts WHERE account>? ORDER BY account LIMIT ?",
                    (after, limit),
                )
            ]
        )

    def count_accounts(self) -> int:
        """How many accounts have a plan."""
        return self._read(  # type: ignore[no-any-return]
            lambda c: c.execute("SELECT COUNT(*) FROM accounts").fetchone()[0]
        )

    def _plan_of(self, account: str) -> Plan:
        return self._read(lambda c: self._acct(c, account, create=False).plan)  # type: ignore[no-any-return]

    def _balance(self, account: str) -> Balance:
        def fn(conn: sqlite3.Connection) -> Balance:
            now = self._now()
            a, p = self._current(conn, account, now)
            return Balance(
                account,
                a.plan.name,
                p.span.key,
                p.span.start,
                p.span.end,
                dict(a.plan.quota),
                {u: p.used[u] for u in a.plan.quota},
                {u: p.held[u] for u in a.plan.quota},
                {u: a.bonus[u] for u in a.plan.quota},
            )

        return self._run(fn)  # type: ignore[no-any-return]

    def _usage(self, account: str, lo: float, hi: float, limit: int, cursor: str | None) -> Page:
        after_at, after_id = lo, ""
        strict = False
        if cursor:
            try:
                t, after_id = cursor.split("|", 1)
                after_at = float(t)
            except ValueError:
                raise ValueError(f"cursor={cursor!r} is not a cursor of this ledger") from None
            strict = True

        def fn(conn: sqlite3.Connection) -> Page:
            cond = "(at>? OR (at=? AND request_id>?))" if strict else "at>=?"
            args: tuple[Any, ...] = (after_at, after_at, after_id) if strict else (after_at,)
            rows = conn.execute(
                f"SELECT {_ROW_COLS} FROM requests WHERE account=? AND status='charged'"
                f" AND {cond} AND at<? ORDER BY at, request_id LIMIT ?",
                (account, *args, hi, limit + 1),
            ).fetchall()
            out = [_charge_of(r, False) for r in rows[:limit]]
            nxt = f"{out[-1].at!r}|{out[-1].request_id}" if len(rows) > limit else None
            return Page(out, nxt)

        return self._read(fn)  # type: ignore[no-any-return]

    def _request_rows(self, account: str, request_id: str) -> list[Charge]:
        def fn(conn: sqlite3.Connection) -> list[Charge]:
            rows = conn.execute(
                f"SELECT {_ROW_COLS} FROM requests WHERE account=? AND status='charged'"
                " AND (request_id=? OR parent_id=?) ORDER BY at, request_id",
                (account, request_id, request_id),
            ).fetchall()
            return [_charge_of(r, False) for r in rows]

        return self._read(fn)  # type: ignore[no-any-return]

    # -- outbox --------------------------------------------------------------------------

    def _peek_notices(self, limit: int) -> list[Notice]:
        return self._read(  # type: ignore[no-any-return]
            lambda c: [
                _notice(r)
                for r in c.execute(
                    "SELECT id, account, period, unit, bp, used, quota, at FROM outbox"
                    " ORDER BY at, id LIMIT ?",
                    (limit,),
                )
            ]
        )

    def _claim_notices(self, limit: int) -> list[Notice]:
        def fn(conn: sqlite3.Connection) -> list[Notice]:
            now = self._now()
            rows = conn.execute(
                "SELECT id, account, period, unit, bp, used, quota, at FROM outbox"
                " WHERE claimed<=? ORDER BY at, id LIMIT ?",
                (now, limit),
            ).fetchall()
            conn.executemany(
                "UPDATE outbox SET claimed=? WHERE id=?", [(now + CLAIM_SECONDS, r[0]) for r in rows]
            )
            return [_notice(r) for r in rows]

        return self._run(fn)  # type: ignore[no-any-return]

    def _ack_notice(self, notice: Notice) -> None:
        self._run(lambda c: c.execute("DELETE FROM outbox WHERE id=?", (notice.id,)))

    def _unclaim(self, notices: Sequence[Notice]) -> None:
        self._run(
            lambda c: c.executemany(
                "UPDATE outbox SET claimed=0 WHERE id=?", [(n.id,) for n in notices]
            )
        )

    # -- compensation ----------------------------------------------------------------------

    def _campaign_start(self, campaign_id: str, params: dict[str, Any], dry_run: bool) -> float:
        pj = json.dumps(params, sort_keys=True)

        def fn(conn: sqlite3.Connection) -> float:
            row = conn.execute(
                "SELECT params, started FROM campaigns WHERE campaign=?", (campaign_id,)
            ).fetchone()
            if row is not None:
                if row[0] != pj:
                    raise IdempotencyConflict(
                        f"campaign {campaign_id!r} ran with other parameters: {row[0]}"
                    )
                return float(row[1])
            now = self._now()
            if not dry_run:
                conn.execute(
                    "INSERT INTO campaigns(campaign, params, started) VALUES (?, ?, ?)",
                    (campaign_id, pj, now),
                )
            return now

        return self._run(fn)  # type: ignore[no-any-return]

    def _campaign_finish(self, campaign_id: str) -> None:
        self._run(
            lambda c: c.execute(
                "UPDATE campaigns SET finished=? WHERE campaign=?", (self._now(), campaign_id)
            )
        )

    def _compensate_accounts(
        self, campaign_id: str, accounts: list[str], params: dict[str, Any], at: float, dry: bool
    ) -> list[dict[str, Any]]:
        def fn(conn: sqlite3.Connection) -> list[dict[str, Any]]:
            out = []
            for acc in accounts:
                done = conn.execute(
                    "SELECT record FROM audit WHERE campaign=? AND account=?", (campaign_id, acc)
                ).fetchone()
                if done is not None:
                    rec = json.loads(done[0])
                    rec["status"] = "done"
                    out.append(rec)
                    continue
                try:
                    a = self._acct(conn, acc, create=False)
                except LookupError:
                    out.append({"account": acc, "status": "skipped", "reason": "no plan"})
                    continue
                span = a.plan.period.at(at, a.anchor)
                p = self._per(conn, acc, span)
                quota = a.plan.quota
                used, add = compensation(
                    quota,
                    p.used,
                    reset_usage=params["reset_usage"],
                    bonus=params["bonus"],
                    credit=params["credit"],
                )
                rec = {
                    "account": acc,
                    "campaign": campaign_id,
                    "period": span.key,
                    "status": "would_change" if dry else "changed",
                    "at": self._now(),
                    "before": {
                        "used": {u: p.used[u] for u in quota},
                        "bonus": {u: a.bonus[u] for u in quota},
                    },
                    "after": {
                        "used": used,
                        "bonus": {u: a.bonus[u] + add[u] for u in quota},
                    },
                    "bonus_added": add,
                }
                out.append(rec)
                if dry:
                    continue
                for u in quota:
                    p.used[u] = used[u]
                    a.bonus[u] += add[u]
                self._dirty.add((acc, span.key))
                self._save_bonus(conn, acc, a)
                self._flush(conn)
                conn.execute(
                    "INSERT INTO audit(campaign, account, at, period, status, record)"
                    " VALUES (?, ?, ?, ?, 'changed', ?)",
                    (campaign_id, acc, rec["at"], span.key, json.dumps(rec, sort_keys=True)),
                )
            return out

        return self._run(fn)  # type: ignore[no-any-return]

    def audit(self, campaign_id: str, account: str) -> dict[str, Any] | None:
        """The audit row a campaign wrote for an account (None if not done)."""
        row = self._read(
            lambda c: c.execute(
                "SELECT record FROM audit WHERE campaign=? AND account=?", (campaign_id, account)
            ).fetchone()
        )
        return None if row is None else json.loads(row[0])  # type: ignore[no-any-return]


def _inline(
    led: SqliteLedger, conn: sqlite3.Connection, args: tuple[Any, ...], fp: str
) -> Charge:
    rid, account, am, model, parent, meta = args
    now = led._now()
    old = led._existing(conn, account, rid)
    if old is not None:
        if old[0] != "charge" or old[2] != fp:
            raise _conflict(rid)
        return _charge_of(old[4:14], True)
    a, p = led._current(conn, account, now)
    led._take(conn, account, a, p, am, now, force=False)
    conn.execute(
        "INSERT INTO requests(account, request_id, kind, status, at, period,"
        " input_tokens, output_tokens, calls, model, parent_id, meta, fp)"
        " VALUES (?, ?, 'charge', 'charged', ?, ?, ?, ?, ?, ?, ?, ?, ?)",
        (
            account,
            rid,
            now,
            p.span.key,
            am["input_tokens"],
            am["output_tokens"],
            am["calls"],
            model,
            parent,
            meta or None,
            fp,
        ),
    )
    return Charge(
        rid,
        account,
        p.span.key,
        now,
        am["input_tokens"],
        am["output_tokens"],
        am["calls"],
        model,
        parent,
        parse_json_obj(meta),
    )


def _am(i: int, o: int, c: int) -> dict[str, int]:
    return {"tokens": i + o, "input_tokens": i, "output_tokens": o, "calls": c}


def _same_amounts(old: Any, am: dict[str, int], model: str | None) -> bool:
    return (
        old[8] == am["input_tokens"]
        and old[9] == am["output_tokens"]
        and old[10] == am["calls"]
        and (model is None or model == old[11])
    )


def _conflict(rid: str) -> IdempotencyConflict:
    return IdempotencyConflict(
        f"request id {rid!r} was already used with a different payload or operation"
    )


def _charge_of(r: Any, replay: bool) -> Charge:
    return Charge(
        r[0], r[1], r[2], r[3], r[4], r[5], r[6], r[7], r[8], parse_json_obj(r[9]), replay
    )


def _hold_of(r: Any, expires: float, replay: bool) -> Hold:
    return Hold(
        r[0], r[1], r[2], r[3], expires, r[4], r[5], r[6], r[7], r[8], parse_json_obj(r[9]), replay
    )


def _notice(r: Any) -> Notice:
    return Notice(r[0], r[1], r[2], r[3], r[4] / 10_000, r[5], r[6], r[7])
