"""The embedded ledger: one SQLite file (stdlib ``sqlite3``, WAL) shared by threads and
processes, with group commit (concurrent calls share one transaction and one sync)."""

from __future__ import annotations

import dataclasses
import json
import sqlite3
from collections.abc import Callable, Sequence
from typing import Any

from .._errors import QuotaExceeded
from ._base import parse_json_obj
from ._campaign import compensation
from ._model import (
    Balance,
    Charge,
    Hold,
    IdempotencyConflict,
    Notice,
    Page,
    Plan,
    UnknownRequest,
    conflict,
    custom_units,
    new_charge,
)
from ._sqlite_rows import (
    _ROW_COLS,
    _am,
    _charge_of,
    _hold_of,
    _notice,
    _same_amounts,
    units_json,
)
from ._sqlite_store import CLAIM_SECONDS, SqliteStore


class SqliteLedger(SqliteStore):
    """A quota ledger in one SQLite file; every process opening the file shares it.

    ``synchronous="NORMAL"`` (the default, WAL) survives a process crash and keeps the
    file consistent on power loss; ``"FULL"`` also keeps the last commits on power loss.
    Concurrent calls from threads are committed together (group commit).
    """

    def _charge_call(self, *a: Any) -> tuple[Callable[[sqlite3.Connection], Charge], Any]:
        """A plain charge: its transaction body, and its arguments for ``_charge_batch``
        (the writer decides consecutive plain charges together)."""
        args, fp = a[:6], a[6]
        return (lambda conn: _inline(self, conn, args, fp)), (args, fp)

    def _charge_many(self, ops: list[Any]) -> list[Charge | Exception]:
        return self._run(lambda conn: self._charge_batch(conn, ops))  # type: ignore[no-any-return]

    def _charge_batch(self, conn: sqlite3.Connection, ops: list[Any]) -> list[Charge | Exception]:
        """Plain charges decided in order, each exactly as ``charge`` would: ``ops`` are
        (arguments, fingerprint) pairs or the error their validation raised."""
        # One lookup of every id of the batch, the charges decided in order on the
        # cached counters, then one executemany of the new rows.
        out: list[Charge | Exception | None] = [
            item if isinstance(item, Exception) else None for item in ops
        ]
        todo = [(k, item) for k, item in enumerate(ops) if not isinstance(item, Exception)]
        existing: dict[tuple[str, str], Any] = {}
        ids: dict[str, list[str]] = {}
        for _, (args, _fp) in todo:
            ids.setdefault(args[1], []).append(args[0])
        for account, rids in ids.items():
            for i in range(0, len(rids), 500):
                chunk = rids[i : i + 500]
                marks = ",".join("?" * len(chunk))
                for r in conn.execute(
                    f"SELECT kind, status, fp, sfp, {_ROW_COLS}, expires FROM requests"
                    f" WHERE account=? AND request_id IN ({marks})",
                    (account, *chunk),
                ):
                    existing[(r[5], r[4])] = r
        rows: list[tuple[Any, ...]] = []
        unit_rows: list[tuple[Any, ...]] = []  # with units of your own
        fresh: dict[tuple[str, str], tuple[str, Charge]] = {}
        # per account: (account, period) while ``now`` stays in the period and before
        # the next hold expiry (then ``_current`` would do nothing else)
        cur: dict[str, tuple[Any, Any, float, float]] = {}
        clock = self._now
        for k, (args, fp) in todo:
            rid, account, am, model, parent, meta = args
            key = (account, rid)
            old = existing.get(key)
            if old is not None:
                ok = old[0] == "charge" and old[2] == fp
                out[k] = _charge_of(old[4:15], True) if ok else conflict(rid)
                continue
            prior = fresh.get(key)
            if prior is not None:
                ok = prior[0] == fp
                out[k] = dataclasses.replace(prior[1], replay=True) if ok else conflict(rid)
                continue
            now = clock()
            try:
                hit = cur.get(account)
                if hit is not None and hit[3] <= now < hit[2]:
                    a, p = hit[0], hit[1]
                else:
                    a, p = self._current(conn, account, now)
                    nx = a.next_exp
                    end = p.span.end if nx is None else min(nx, p.span.end)
                    cur[account] = (a, p, end, p.span.start)
                parts = self._fit(account, a, p, am, now, force=False)
            except (QuotaExceeded, LookupError, ValueError) as e:
                out[k] = e  # refused before writing anything
                continue
            self._apply(conn, account, a, p, parts, now)
            i_, o_, c_ = am["input_tokens"], am["output_tokens"], am["calls"]
            pk = p.span.key
            row = (account, rid, now, pk, i_, o_, c_, model, parent, meta or None, fp)
            mt = parse_json_obj(meta) if meta else None
            if len(am) == 4:
                rows.append(row)
                c = new_charge(rid, account, pk, now, i_, o_, c_, model, parent, mt)
            else:
                unit_rows.append((*row, units_json(am)))
                cu = custom_units(am)
                c = new_charge(rid, account, pk, now, i_, o_, c_, model, parent, mt, False, cu)
            fresh[key] = (fp, c)
            out[k] = c
        conn.executemany(
            "INSERT INTO requests(account, request_id, kind, status, at, period,"
            " input_tokens, output_tokens, calls, model, parent_id, meta, fp)"
            " VALUES (?, ?, 'charge', 'charged', ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            rows,
        )
        if unit_rows:
            conn.executemany(
                "INSERT INTO requests(account, request_id, kind, status, at, period,"
                " input_tokens, output_tokens, calls, model, parent_id, meta, fp, units)"
                " VALUES (?, ?, 'charge', 'charged', ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                unit_rows,
            )
        return [x for x in out if x is not None]

    def _hold_call(
        self,
        rid: str,
        account: str,
        am: dict[str, int],
        model: str | None,
        parent: str | None,
        meta: str,
        fp: str,
    ) -> Callable[[sqlite3.Connection], Hold]:
        def fn(conn: sqlite3.Connection) -> Hold:
            now = self._now()
            old = self._existing(conn, account, rid)
            if old is not None:
                if old[0] != "hold" or old[2] != fp:
                    raise conflict(rid)
                return _hold_of(old[4:15], old[15], True)
            a, p = self._current(conn, account, now)
            parts = self._take(conn, account, a, p, am, now, force=False)
            self._hold_delta(p, am, +1, a.plan.quota)
            exp = now + self.hold_ttl
            conn.execute(
                "INSERT INTO requests(account, request_id, kind, status, at, period,"
                " input_tokens, output_tokens, calls, model, parent_id, meta, fp, parts, expires,"
                " units) VALUES (?, ?, 'hold', 'held', ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
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
                    units_json(am),
                ),
            )
            conn.execute(
                "INSERT OR REPLACE INTO holds(request_id, account) VALUES (?, ?)", (rid, account)
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
                False,
                custom_units(am),
            )

        return fn

    def _find_hold(self, conn: sqlite3.Connection, rid: str) -> str | None:
        row = conn.execute(
            "SELECT account FROM holds WHERE request_id=?",
            (rid,),
        ).fetchone()
        return None if row is None else str(row[0])

    def _settle_call(
        self,
        rid: str,
        am: dict[str, int],
        model: str | None,
        account: str | None,
        sfp: str,
    ) -> Callable[[sqlite3.Connection], Charge]:
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
                    raise conflict(rid)
                return _charge_of(old[4:15], True)
            a, cur = self._current(conn, acc, now)
            if old is None:
                p = cur
                self._take(conn, acc, a, p, am, now, force=True)
                conn.execute(
                    "INSERT INTO requests(account, request_id, kind, status, at, period,"
                    " input_tokens, output_tokens, calls, model, fp, sfp, units)"
                    " VALUES (?, ?, 'charge', 'charged', ?, ?, ?, ?, ?, ?, ?, ?, ?)",
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
                        units_json(am),
                    ),
                )
                return Charge(
                    rid,
                    acc,
                    p.span.key,
                    now,
                    am["input_tokens"],
                    am["output_tokens"],
                    am["calls"],
                    model,
                    units=custom_units(am),
                )
            key = old[6]
            pp = self._per_key(conn, acc, key, a.own)
            if old[1] == "held":
                self._give_back(
                    conn,
                    acc,
                    a,
                    pp,
                    json.loads(
                        conn.execute(
                            "SELECT parts FROM requests WHERE account=? AND request_id=?",
                            (acc, rid),
                        ).fetchone()[0]
                    ),
                )
                self._hold_delta(pp, _am(old[8], old[9], old[10], old[14]), -1, a.plan.quota)
            target = pp if pp is not None else cur
            self._take(conn, acc, a, target, am, now, force=True)
            m = model if model is not None else old[11]
            conn.execute(
                "UPDATE requests SET status='charged', at=?, period=?, input_tokens=?,"
                " output_tokens=?, calls=?, model=?, sfp=?, parts=NULL, units=?"
                " WHERE account=? AND request_id=?",
                (
                    now,
                    target.span.key,
                    am["input_tokens"],
                    am["output_tokens"],
                    am["calls"],
                    m,
                    sfp,
                    units_json(am),
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
                False,
                custom_units(am),
            )

        return fn

    def _release_call(
        self, rid: str, account: str | None = None
    ) -> Callable[[sqlite3.Connection], None]:
        def fn(conn: sqlite3.Connection) -> None:
            rows = conn.execute(
                "SELECT r.account, r.period, r.parts, r.input_tokens, r.output_tokens, r.calls,"
                " r.units FROM holds h"
                " JOIN requests r ON r.account=h.account AND r.request_id=h.request_id"
                " WHERE h.request_id=? AND r.status='held'",
                (rid,),
            ).fetchall()
            for acc, key, parts, i, o, c, un in rows:
                a = self._acct(conn, acc, create=False)
                p = self._per_key(conn, acc, key, a.own)
                self._give_back(conn, acc, a, p, json.loads(parts))
                self._hold_delta(p, _am(i, o, c, un), -1, a.plan.quota)
                conn.execute(
                    "UPDATE requests SET status='released', parts=NULL"
                    " WHERE account=? AND request_id=?",
                    (acc, rid),
                )

        return fn

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

    # -- accounts ----------------------------------------------------------------------

    def _set_plan(
        self, account: str, plan: Plan, anchor: float | None, thr: tuple[int, ...] | None
    ) -> None:
        pj = plan.to_json()
        tj = None if thr is None else json.dumps(list(thr))

        def fn(conn: sqlite3.Connection) -> None:
            self._accts.pop(account, None)
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

    def _settings(self, account: str) -> tuple[Plan, float | None, tuple[int, ...] | None]:
        def fn(conn: sqlite3.Connection) -> tuple[Plan, float | None, tuple[int, ...] | None]:
            row = conn.execute(
                "SELECT plan, anchor, thresholds FROM accounts WHERE account=?", (account,)
            ).fetchone()
            if row is None:
                raise self._unknown(account)
            return self._plan(row[0]), row[1], tuple(json.loads(row[2])) if row[2] else None

        return self._read(fn)  # type: ignore[no-any-return]

    def _plan_of(self, account: str) -> Plan:
        return self._read(lambda c: self._acct(c, account, create=False).plan)  # type: ignore[no-any-return]

    def _balance_call(self, account: str) -> Callable[[sqlite3.Connection], Balance]:
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

        return fn

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
                "UPDATE outbox SET claimed=? WHERE id=?",
                [(now + CLAIM_SECONDS, r[0]) for r in rows],
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
                p = self._per(conn, acc, span, a.own)
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
        return None if row is None else json.loads(row[0])


_INSERT = (
    "INSERT OR IGNORE INTO requests(account, request_id, kind, status, at, period,"
    " input_tokens, output_tokens, calls, model, parent_id, meta, fp)"
    " VALUES (?, ?, 'charge', 'charged', ?, ?, ?, ?, ?, ?, ?, ?, ?)"
)
#: ``_INSERT`` of a charge with units of your own.
_INSERT_OWN = (
    "INSERT OR IGNORE INTO requests(account, request_id, kind, status, at, period,"
    " input_tokens, output_tokens, calls, model, parent_id, meta, fp, units)"
    " VALUES (?, ?, 'charge', 'charged', ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
)


def _inline(led: SqliteLedger, conn: sqlite3.Connection, args: tuple[Any, ...], fp: str) -> Charge:
    """One charge: the quota checked first, then the request row inserted unless its id
    exists (a replay or a conflict), then the deduction: nothing is written on a refusal."""
    rid, account, am, model, parent, meta = args
    now = led._now()
    a, p = led._current(conn, account, now)
    try:
        parts = led._fit(account, a, p, am, now, force=False)
    except QuotaExceeded:
        old = led._existing(conn, account, rid)
        if old is None:
            raise
        parts = None
    if parts is not None:
        own = len(am) > 4
        cur = conn.execute(
            _INSERT_OWN if own else _INSERT,
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
                *((units_json(am),) if own else ()),
            ),
        )
        if cur.rowcount == 1:
            led._apply(conn, account, a, p, parts, now)
            return new_charge(
                rid,
                account,
                p.span.key,
                now,
                am["input_tokens"],
                am["output_tokens"],
                am["calls"],
                model,
                parent,
                parse_json_obj(meta) if meta else None,
                False,
                custom_units(am) if own else None,
            )
        old = led._existing(conn, account, rid)
    if old[0] != "charge" or old[2] != fp:
        raise conflict(rid)
    return _charge_of(old[4:15], True)
