"""The ledger in Redis, for several processes and machines: one Lua script per call
checks the request id, deducts and records threshold crossings in one round trip.

Keys: ``{prefix}{{tag}}:a`` (account: plan, version, bonus), ``:p:<period>`` (usage,
holds, fired thresholds), ``:r:<request id>`` (the request, kept ``retention``), ``:h``
(hold expiries), ``:rows`` (usage rows, a stream capped at ``max_rows``), ``:o`` (outbox),
``:audit`` (compensation audit); the tag is the account, so one account's keys share a
Redis Cluster slot. Integers must stay below 2**53 (Lua numbers are doubles).
"""

from __future__ import annotations

import hashlib
import importlib.resources
import inspect
import json
import os
import threading
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from ._base import LedgerBase, compensation, quota_exceeded
from ._model import (
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
    check_id,
)
from ._redis_codec import (
    SEP,
    _conflict,
    _Info,
    _ints,
    _is_reply_error,
    _meta,
    _notice,
    _pack,
    _record_charge,
    _row_charge,
    _s,
)

LUA = importlib.resources.files(__package__).joinpath("ledger.lua").read_text()
LUA_SHA = hashlib.sha1(LUA.encode()).hexdigest()
#: Lua numbers are doubles: amounts and totals stay below this in Redis.
MAX_REDIS_AMOUNT = 2**53 - 1
_INFO_FIELDS = ("ver", "plan", "anchor", "thr")
_PAD = ("",) * 10
#: Seconds between scans for outboxes whose pending hint was lost (a crash).
SWEEP_SECONDS = 60.0


class RedisLedger(LedgerBase):
    """A quota ledger in Redis shared by every process using the same ``name``.

    ``client``: a ``redis.Redis`` (``ratequeue.redis.connect`` gives short timeouts).
    Time comes from ``clock`` (default the wall clock of each process), so keep hosts'
    clocks in sync (periods are calendar-sized; seconds of skew only move a boundary).
    """

    def __init__(
        self,
        client: Any,
        *,
        name: str = "default",
        clock: ClockLike | None = None,
        retention: float | None = None,
        hold_ttl: float = 600.0,
        default_plan: Plan | None = None,
        max_rows: int = 100_000,
    ) -> None:
        super().__init__(
            clock=clock, retention=retention, hold_ttl=hold_ttl, default_plan=default_plan
        )
        check_id("name", name)
        if "{" in name or "}" in name:
            raise ValueError(f"name={name!r} must not contain braces")
        if isinstance(max_rows, bool) or not isinstance(max_rows, int) or max_rows < 1:
            raise ValueError(f"max_rows={max_rows!r} must be an int >= 1")
        self.client = client
        self.name = name
        self.max_rows = max_rows
        self._prefix = f"rq:ledger:{name}:"
        self._info: OrderedDict[str, _Info] = OrderedDict()
        self._holds: OrderedDict[str, tuple[str, float]] = OrderedDict()
        self._lock = threading.Lock()
        _LEDGERS.add(self)
        self._last_sweep = float("-inf")
        self._raw = False
        self._conn_args: tuple[str, ...] = ()
        try:
            import redis

            pool = getattr(client, "connection_pool", None)
            self._raw = (
                type(client) is redis.Redis
                and getattr(client, "connection", None) is None
                and isinstance(pool, redis.ConnectionPool)
            )
            if self._raw and pool is not None:
                params = list(inspect.signature(pool.get_connection).parameters.values())
                if params and params[0].default is inspect.Parameter.empty:
                    self._conn_args = ("EVALSHA",)
        except ImportError:  # pragma: no cover - a client implies redis-py
            pass

    # -- keys and the script ----------------------------------------------------------

    def _pfx(self, account: str) -> str:
        braces = "{" in account or "}" in account
        tag = "x:" + account.encode().hex() if braces else "s:" + account
        return f"{self._prefix}{{{tag}}}:"

    def _keys(self, account: str, second: str, period: str) -> list[str]:
        p = self._pfx(account)
        return [p + "a", p + second, p + "h", p + "rows", p + "o", p + "p:" + period]

    def _eval(self, keys: Sequence[str], args: Sequence[Any]) -> Any:
        """EVALSHA (loading the script on NOSCRIPT); a plain client's pooled connection
        gets the command packed once, without redis-py's per-argument work."""
        import redis

        cmd = ("EVALSHA", LUA_SHA, len(keys), *keys, *args)
        try:
            return self._send(cmd)
        except redis.exceptions.NoScriptError:
            self.client.script_load(LUA)
            return self._send(cmd)

    def _send(self, cmd: tuple[Any, ...]) -> Any:
        if not self._raw:
            return self.client.execute_command(*cmd)
        pool = self.client.connection_pool
        conn = pool.get_connection(*self._conn_args)
        try:
            conn.send_packed_command([_pack(cmd)])
            return conn.read_response()
        except BaseException as e:
            if not isinstance(e, Exception) or not _is_reply_error(e):
                conn.disconnect()
            raise
        finally:
            pool.release(conn)

    def _account_info(self, account: str, *, fresh: bool = False) -> _Info:
        with self._lock:
            info = self._info.get(account)
            if info is not None and not fresh:
                self._info.move_to_end(account)
                return info
        fields = self.client.hmget(self._pfx(account) + "a", *_INFO_FIELDS)
        if fields[0] is None:
            if self.default_plan is None:
                raise self._unknown(account)
            self._store_plan(account, self.default_plan, None, None, only_new=True)
            return self._account_info(account, fresh=True)
        return self._info_from(account, fields)

    def _info_from(self, account: str, fields: Sequence[Any]) -> _Info:
        ver, pj, anchor, thr = fields
        plan = self._plan(_s(pj))
        info = _Info(
            _s(ver),
            _s(pj),
            float(anchor) if anchor not in (None, b"") else None,
            tuple(json.loads(thr)) if thr else plan.thresholds_bp,
            plan,
        )
        with self._lock:
            self._info[account] = info
            while len(self._info) > 100_000:
                self._info.popitem(last=False)
        return info

    def _common(self, op: str, info: _Info, account: str, span: Span, now: float) -> list[Any]:
        return [
            op,
            repr(now),
            info.ver,
            self._pfx(account),
            int(self.retention) + 1,
            span.key,
            repr(span.end),
            "",
        ]

    def _args(
        self, op: str, info: _Info, account: str, span: Span, now: float, extra: list[Any]
    ) -> list[Any]:
        return [
            *self._common(op, info, account, span, now),
            *extra,
            *_PAD[len(extra) :],
            *info.spec,
        ]

    def _call(
        self, op: str, account: str, second: str, extra: list[Any], *, at: float | None = None
    ) -> tuple[Any, _Info, Span, float]:
        """Runs one op; refreshes the cached plan when the script says it changed."""
        for attempt in range(3):
            info = self._account_info(account, fresh=attempt > 0)
            now = self._now()
            span = self._span(info.plan_json, info.plan, info.anchor, now if at is None else at)
            keys = self._keys(account, second, span.key)
            r = self._eval(keys, self._args(op, info, account, span, now, extra))
            if _s(r[0]) != "STALE":
                return r, info, span, now
        raise LedgerError(f"the plan of account {account!r} keeps changing; try again")

    def _check_big(self, am: dict[str, int]) -> None:
        for u, v in am.items():
            if v > MAX_REDIS_AMOUNT:
                raise ValueError(f"{u}={v} must be < 2**53 in a Redis ledger")

    def _after(self, account: str, fired: Any) -> None:
        if int(fired):
            self.client.sadd(self._prefix + "notify", account)
            self._notice_event.set()

    # -- accounts ----------------------------------------------------------------------

    def _store_plan(
        self,
        account: str,
        plan: Plan,
        anchor: float | None,
        thr: tuple[int, ...] | None,
        *,
        only_new: bool = False,
    ) -> None:
        key = self._pfx(account) + "a"
        mapping = {"plan": plan.to_json(), "anchor": "" if anchor is None else repr(anchor)}
        mapping["thr"] = "" if thr is None else json.dumps(list(thr))
        if only_new and not self.client.hsetnx(key, "plan", mapping["plan"]):
            return
        pipe = self.client.pipeline(transaction=True)
        pipe.hset(key, mapping=mapping)
        pipe.hincrby(key, "ver", 1)
        pipe.execute()
        self.client.zadd(self._prefix + "accounts", {account: 0})
        with self._lock:
            self._info.pop(account, None)

    def _set_plan(
        self, account: str, plan: Plan, anchor: float | None, thr: tuple[int, ...] | None
    ) -> None:
        self._store_plan(account, plan, anchor, thr)

    def _accounts_after(self, after: str, limit: int) -> list[str]:
        lo = "(" + after if after else "-"
        return [
            _s(a) for a in self.client.zrangebylex(self._prefix + "accounts", lo, "+", 0, limit)
        ]

    def count_accounts(self) -> int:
        """How many accounts have a plan."""
        return int(self.client.zcard(self._prefix + "accounts"))

    def _plan_of(self, account: str) -> Plan:
        return self._account_info(account, fresh=True).plan

    # -- deduction ---------------------------------------------------------------------

    def _charge_or_hold(
        self,
        op: str,
        rid: str,
        account: str,
        am: dict[str, int],
        model: str | None,
        parent: str | None,
        meta: str,
        fp: str,
    ) -> tuple[Any, _Info, Span, float, float]:
        self._check_big(am)
        exp_box: list[float] = []

        for attempt in range(3):
            info = self._account_info(account, fresh=attempt > 0)
            now = self._now()
            span = self._span(info.plan_json, info.plan, info.anchor, now)
            exp = now + self.hold_ttl
            extra = [
                rid,
                fp,
                am["input_tokens"],
                am["output_tokens"],
                am["calls"],
                model or "",
                parent or "",
                meta,
                repr(exp),
                self.max_rows,
            ]
            keys = self._keys(account, "r:" + rid, span.key)
            args = self._args(op, info, account, span, now, extra)
            if op == "hold" and self._raw:
                # one server, no slots: the script records the hold's id -> account too
                keys.append(self._prefix + "hold:" + rid)
                args[7] = account
            r = self._eval(keys, args)
            tag = _s(r[0])
            if tag == "STALE":
                continue
            exp_box.append(exp)
            if tag == "CONFLICT":
                raise _conflict(rid)
            if tag == "QUOTA":
                raise quota_exceeded(account, _s(r[1]), int(r[2]), int(r[3]), span, now)
            if tag == "OK":
                self._after(account, r[1])
            return r, info, span, now, exp
        raise LedgerError(f"the plan of account {account!r} keeps changing; try again")

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
        r, _info, span, now, _exp = self._charge_or_hold(
            "charge", rid, account, am, model, parent, meta, fp
        )
        if _s(r[0]) == "REPLAY":
            return _record_charge(rid, account, _s(r[1]), True)
        return Charge(
            rid,
            account,
            span.key,
            now,
            am["input_tokens"],
            am["output_tokens"],
            am["calls"],
            model,
            parent,
            _meta(meta),
        )

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
        r, _info, span, now, exp = self._charge_or_hold(
            "hold", rid, account, am, model, parent, meta, fp
        )
        replay = _s(r[0]) == "REPLAY"
        if replay:
            c = _record_charge(rid, account, _s(r[1]), True)
            exp = float(_s(r[1]).split(SEP)[12] or 0.0)
            h = Hold(
                rid,
                account,
                c.period,
                c.at,
                exp,
                c.input_tokens,
                c.output_tokens,
                c.calls,
                c.model,
                c.parent_id,
                c.meta,
                True,
            )
        else:
            h = Hold(
                rid,
                account,
                span.key,
                now,
                exp,
                am["input_tokens"],
                am["output_tokens"],
                am["calls"],
                model,
                parent,
                _meta(meta),
            )
        self._remember_hold(rid, account, h.expires_at)
        return h

    def _remember_hold(self, rid: str, account: str, exp: float) -> None:
        if not self._raw:  # a cluster: the id's key lives in another slot
            self.client.set(
                self._prefix + "hold:" + rid,
                account,
                ex=max(1, int(self.hold_ttl + self.retention)),
            )
        now = self._now()
        with self._lock:
            self._holds[rid] = (account, exp)
            self._holds.move_to_end(rid)
            while self._holds:
                first = next(iter(self._holds.values()))
                if len(self._holds) > 1_000_000 or first[1] < now - self.hold_ttl:
                    self._holds.popitem(last=False)
                else:
                    break

    def _hold_account(self, rid: str) -> str | None:
        with self._lock:
            hit = self._holds.get(rid)
        if hit is not None:
            return hit[0]
        v = self.client.get(self._prefix + "hold:" + rid)
        return None if v is None else _s(v)

    def _settle(
        self, rid: str, am: dict[str, int], model: str | None, account: str | None, sfp: str
    ) -> Charge:
        self._check_big(am)
        acc = self._hold_account(rid) if account is None else account
        if acc is None:
            raise UnknownRequest(f"no hold has request id {rid!r}; pass account= to charge it")
        extra = [
            rid,
            sfp,
            am["input_tokens"],
            am["output_tokens"],
            am["calls"],
            model or "",
            "",
            "",
            "",
            self.max_rows,
        ]
        r, _info, _span, _now = self._call("settle", acc, "r:" + rid, extra)
        tag = _s(r[0])
        if tag == "CONFLICT":
            raise _conflict(rid)
        if tag == "REPLAY":
            return _record_charge(rid, acc, _s(r[1]), True)
        self._after(acc, r[1])
        with self._lock:
            self._holds.pop(rid, None)
        return _record_charge(rid, acc, _s(r[2]), False)

    def _release(self, rid: str) -> None:
        acc = self._hold_account(rid)
        if acc is None:
            return
        try:
            self._call("release", acc, "r:" + rid, [rid])
        except LookupError:
            return
        with self._lock:
            self._holds.pop(rid, None)

    def expire_holds(self) -> int:
        """Gives back every hold past its expiry now; returns how many (each account is
        also expired lazily whenever it is used)."""
        n = 0
        for acc in self.accounts():
            while True:
                due = int(self.client.zcount(self._pfx(acc) + "h", "-inf", repr(self._now())))
                if not due:
                    break
                self._call("balance", acc, "r:", [])  # the script expires up to 100 a call
                n += min(due, 100)
        return n

    # -- queries -------------------------------------------------------------------------

    def _balance(self, account: str) -> Balance:
        r, info, span, _now = self._call("balance", account, "r:", [])
        quota = info.plan.quota
        used, held, bonus = {}, {}, {}
        for i, u in enumerate(quota):
            used[u] = int(r[1 + 3 * i])
            held[u] = int(r[2 + 3 * i])
            bonus[u] = int(r[3 + 3 * i])
        return Balance(
            account, info.plan.name, span.key, span.start, span.end, dict(quota), used, held, bonus
        )

    def _usage(self, account: str, lo: float, hi: float, limit: int, cursor: str | None) -> Page:
        key = self._pfx(account) + "rows"
        start = "-" if cursor is None else "(" + cursor
        out: list[Charge] = []
        last = None
        while len(out) < limit:
            entries = self.client.xrange(key, start, "+", count=max(limit, 100))
            if not entries:
                return Page(out, None)
            for eid, fields in entries:
                last = _s(eid)
                c = _row_charge(account, fields)
                if lo <= c.at < hi:
                    out.append(c)
                    if len(out) == limit:
                        break
            start = "(" + str(last)
        more = self.client.xrange(key, start, "+", count=1)
        return Page(out, last if more else None)

    def _request_rows(self, account: str, request_id: str) -> list[Charge]:
        key = self._pfx(account) + "rows"
        out: list[Charge] = []
        start = "-"
        while True:
            entries = self.client.xrange(key, start, "+", count=1000)
            if not entries:
                return out
            for _eid, fields in entries:
                c = _row_charge(account, fields)
                if request_id in (c.request_id, c.parent_id):
                    out.append(c)
            start = "(" + _s(entries[-1][0])

    # -- outbox --------------------------------------------------------------------------

    def _outbox_accounts(self) -> list[str]:
        now = self._now()
        if now - self._last_sweep >= SWEEP_SECONDS:
            self._last_sweep = now
            found = []
            for k in self.client.scan_iter(match=self._prefix + "{*}:o", count=1000):
                if self.client.llen(k):
                    found.append(k)
            for k in found:
                acc = self._account_of_key(_s(k))
                if acc is not None:
                    self.client.sadd(self._prefix + "notify", acc)
        return [_s(a) for a in self.client.smembers(self._prefix + "notify")]

    def _account_of_key(self, key: str) -> str | None:
        tag = key[len(self._prefix) + 1 : key.rindex("}")]
        if tag.startswith("s:"):
            return tag[2:]
        if tag.startswith("x:"):
            return bytes.fromhex(tag[2:]).decode()
        return None

    def _read_outbox(self, account: str, limit: int) -> list[Notice]:
        items = self.client.lrange(self._pfx(account) + "o", -limit, -1)
        return [_notice(account, _s(x)) for x in reversed(items)]

    def _peek_notices(self, limit: int) -> list[Notice]:
        out: list[Notice] = []
        for acc in self._outbox_accounts():
            out.extend(self._read_outbox(acc, limit - len(out)))
            if len(out) >= limit:
                break
        return out

    def _claim_notices(self, limit: int) -> list[Notice]:
        out: list[Notice] = []
        for acc in self._outbox_accounts():
            if len(out) >= limit:
                break
            if not self.client.srem(self._prefix + "notify", acc):
                continue  # another deliverer took it
            got = self._read_outbox(acc, limit - len(out))
            out.extend(got)
            if self.client.llen(self._pfx(acc) + "o") > len(got):
                self.client.sadd(self._prefix + "notify", acc)
        return out

    def _ack_notice(self, notice: Notice) -> None:
        raw = "|".join(
            [
                notice.unit,
                str(round(notice.threshold * 10_000)),
                str(notice.used),
                str(notice.quota),
                repr(notice.at),
                notice.period,
            ]
        )
        self.client.lrem(self._pfx(notice.account) + "o", 1, raw)

    def _unclaim(self, notices: Sequence[Notice]) -> None:
        for acc in {n.account for n in notices}:
            self.client.sadd(self._prefix + "notify", acc)

    # -- compensation ----------------------------------------------------------------------

    def _campaign_start(self, campaign_id: str, params: dict[str, Any], dry_run: bool) -> float:
        key = self._prefix + "campaign:" + campaign_id
        pj = json.dumps(params, sort_keys=True)
        now = self._now()
        rec = json.dumps({"params": pj, "started": now})
        if not dry_run:
            self.client.set(key, rec, nx=True)
        old = self.client.get(key)
        if old is None:
            return now
        d = json.loads(old)
        if d["params"] != pj:
            raise IdempotencyConflict(
                f"campaign {campaign_id!r} ran with other parameters: {d['params']}"
            )
        return float(d["started"])

    def _campaign_finish(self, campaign_id: str) -> None:
        key = self._prefix + "campaign:" + campaign_id
        d = json.loads(self.client.get(key))
        d["finished"] = self._now()
        self.client.set(key, json.dumps(d))

    def _compensate_accounts(
        self, campaign_id: str, accounts: list[str], params: dict[str, Any], at: float, dry: bool
    ) -> list[dict[str, Any]]:
        # Pipelined: one round trip reads every account and audit row of the chunk, one
        # more runs the script for each account still to do.
        pipe = self.client.pipeline(transaction=False)
        for acc in accounts:
            pipe.hmget(self._pfx(acc) + "a", *_INFO_FIELDS)
            pipe.hget(self._pfx(acc) + "audit", campaign_id)
        got = pipe.execute()
        out: list[dict[str, Any]] = []
        todo: list[tuple[int, str, _Info, Span]] = []
        for k, acc in enumerate(accounts):
            fields, done = got[2 * k], got[2 * k + 1]
            if fields[0] is None:
                out.append({"account": acc, "status": "skipped", "reason": "no plan"})
            elif done is not None:
                rec = _ints(json.loads(done))
                rec["status"] = "done"
                out.append(rec)
            else:
                info = self._info_from(acc, fields)
                todo.append((len(out), acc, info, info.plan.period.at(at, info.anchor)))
                out.append({})
        if not todo:
            return out
        pipe = self.client.pipeline(transaction=False)
        if dry:
            for _, acc, _info, span in todo:
                pipe.hgetall(self._pfx(acc) + "p:" + span.key)
                pipe.hgetall(self._pfx(acc) + "a")
            got = pipe.execute()
            for n, (k, acc, info, span) in enumerate(todo):
                quota = info.plan.quota
                p, a = got[2 * n], got[2 * n + 1]
                before_used = {u: int(p.get(f"u_{u}".encode(), 0)) for u in quota}
                before_bonus = {u: int(a.get(f"b_{u}".encode(), 0)) for u in quota}
                used, add = compensation(
                    quota,
                    before_used,
                    reset_usage=params["reset_usage"],
                    bonus=params["bonus"],
                    credit=params["credit"],
                )
                out[k] = {
                    "account": acc,
                    "campaign": campaign_id,
                    "period": span.key,
                    "status": "would_change",
                    "at": self._now(),
                    "before": {"used": before_used, "bonus": before_bonus},
                    "after": {"used": used, "bonus": {u: before_bonus[u] + add[u] for u in quota}},
                    "bonus_added": add,
                }
            return out
        replies: list[Any] = []
        if self._raw:  # one pipeline of scripts (a cluster client refuses scripts there)
            self.client.script_load(LUA)
            for _, acc, info, span in todo:
                keys = self._keys(acc, "audit", span.key)
                pipe.evalsha(
                    LUA_SHA,
                    len(keys),
                    *keys,
                    *self._comp_args(campaign_id, acc, info, span, params),
                )
            replies = pipe.execute()
        else:
            for _, acc, info, span in todo:
                keys = self._keys(acc, "audit", span.key)
                replies.append(
                    self._eval(keys, self._comp_args(campaign_id, acc, info, span, params))
                )
        for n, r in enumerate(replies):
            k, acc, _info, span = todo[n]
            if _s(r[0]) == "STALE":  # its plan changed meanwhile: once more, alone
                info = self._account_info(acc, fresh=True)
                span = info.plan.period.at(at, info.anchor)
                keys = self._keys(acc, "audit", span.key)
                r = self._eval(keys, self._comp_args(campaign_id, acc, info, span, params))
                if _s(r[0]) == "STALE":
                    raise LedgerError(f"the plan of account {acc!r} keeps changing")
            rec = _ints(json.loads(r[1]))
            rec["status"] = "done" if _s(r[0]) == "DONE" else "changed"
            out[k] = rec
        return out

    def _comp_args(
        self, campaign_id: str, acc: str, info: _Info, span: Span, params: dict[str, Any]
    ) -> list[Any]:
        credit = params["credit"]
        spec = ",".join(
            f"{u}={int(q * credit) if credit is not None else 0}={int(q * params['bonus'])}"
            for u, q in info.plan.quota.items()
        )
        extra = [campaign_id, "1" if params["reset_usage"] else "0", spec, acc]
        return self._args("comp", info, acc, span, self._now(), extra)

    def audit(self, campaign_id: str, account: str) -> dict[str, Any] | None:
        """The audit row a campaign wrote for an account (None if not done)."""
        v = self.client.hget(self._pfx(account) + "audit", campaign_id)
        return None if v is None else _ints(json.loads(v))

    def close(self) -> None:
        """Closes the client's connections."""
        self.client.close()


_LEDGERS: weakref.WeakSet[RedisLedger] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for led in list(_LEDGERS):
        led._lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)
