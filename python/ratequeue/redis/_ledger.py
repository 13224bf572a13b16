"""``RedisLedger``: the ledger's calls in Redis (accounts, charges and holds with their
asyncio twins, queries, the outbox, compensation), each written once as a flow of
commands over ``_ledger_core``'s drivers."""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Sequence
from typing import Any

from ..ledger._base import quota_exceeded
from ..ledger._campaign import compensation
from ..ledger._model import (
    Balance,
    Charge,
    Hold,
    IdempotencyConflict,
    LedgerError,
    Notice,
    Page,
    Plan,
    Span,
    UnknownRequest,
    conflict,
    custom_units,
    new_charge,
)
from ._ledger_codec import (
    SEP,
    _Ctx,
    _field,
    _flat,
    _Info,
    _ints,
    _meta,
    _notice,
    _record_charge,
    _row_charge,
    _s,
    units_text,
)
from ._ledger_core import (
    _INFO_FIELDS,
    LUA,
    LUA_SHA,
    MAX_REDIS_AMOUNT,
    SWEEP_SECONDS,
    PlanChanging,
    _Flow,
    _RedisLedgerCore,
    _Step,
)

__all__ = ["LUA", "LUA_SHA", "MAX_REDIS_AMOUNT", "RedisLedger"]


class RedisLedger(_RedisLedgerCore):
    """A quota ledger in Redis shared by every process using the same ``name``.

    ``client``: a ``redis.Redis`` or ``redis.cluster.RedisCluster``
    (``ratequeue.redis.connect`` gives short timeouts). The asyncio twins
    (``charge_async``, ``hold_async``, ``settle_async``, ``release_async``,
    ``balance_async``) use ``async_client`` (a ``redis.asyncio`` client), by default one
    made per event loop for the same server. Time comes from ``clock`` (default the wall
    clock of each process), so keep hosts' clocks in sync (periods are calendar-sized;
    seconds of skew only move a boundary).
    """

    # -- accounts ----------------------------------------------------------------------

    def _info_flow(self, account: str, fresh: bool = False) -> _Flow[_Info]:
        if not fresh:
            with self._lock:
                info = self._info.get(account)
                if info is not None:
                    self._info.move_to_end(account)
                    return info
        key = self._pfx(account) + "a"
        fields = yield ("cmd", "HMGET", key, *_INFO_FIELDS)
        if fields[1] is None or fields[0] is None:  # no plan, or one without its version
            if fields[1] is not None:
                plan = self._plan(_s(fields[1]))
            elif self.default_plan is not None:
                plan = self.default_plan
            else:
                raise self._unknown(account)
            yield from self._store_plan_flow(account, plan, None, None, True)
            fields = yield ("cmd", "HMGET", key, *_INFO_FIELDS)
        return self._info_from(account, fields)

    def _info_from(self, account: str, fields: Sequence[Any]) -> _Info:
        ver, pj, anchor, thr = fields
        plan = self._plan(_s(pj))
        info = _Info(
            _s(ver) if ver is not None else "",
            _s(pj),
            float(anchor) if anchor not in (None, b"", "") else None,
            tuple(json.loads(thr)) if thr else plan.thresholds_bp,
            plan,
        )
        with self._lock:
            self._info[account] = info
            while len(self._info) > 100_000:
                self._info.popitem(last=False)
        return info

    def _store_plan_flow(
        self,
        account: str,
        plan: Plan,
        anchor: float | None,
        thr: tuple[int, ...] | None,
        only_new: bool = False,
    ) -> _Flow[None]:
        key = self._pfx(account) + "a"
        anc = "" if anchor is None else repr(anchor)
        tj = "" if thr is None else json.dumps(list(thr))
        # the plan with a new version in one script step (op 'p'): a reader sees the old
        # plan and version or the new ones, never a plan without its version; a reader
        # of the old version is told STALE by the script and reads again
        new = "1" if only_new else ""
        stored = yield ("eval", ["EVALSHA", LUA_SHA, 1, key, "p", new, plan.to_json(), anc, tj])
        # (also when not stored: one who stored it may have stopped before this)
        yield ("cmd", "ZADD", self._prefix + "accounts", 0, account)
        if stored:
            with self._lock:
                self._info.pop(account, None)

    def _set_plan(
        self, account: str, plan: Plan, anchor: float | None, thr: tuple[int, ...] | None
    ) -> None:
        self._drive(self._store_plan_flow(account, plan, anchor, thr))

    def _accounts_after(self, after: str, limit: int) -> list[str]:
        lo = "(" + after if after else "-"
        return [
            _s(a) for a in self.client.zrangebylex(self._prefix + "accounts", lo, "+", 0, limit)
        ]

    def count_accounts(self) -> int:
        """How many accounts have a plan."""
        return int(self.client.zcard(self._prefix + "accounts"))

    def _settings(self, account: str) -> tuple[Plan, float | None, tuple[int, ...] | None]:
        _ver, pj, anchor, thr = self.client.hmget(self._pfx(account) + "a", *_INFO_FIELDS)
        if pj is None:
            raise self._unknown(account)
        a = float(anchor) if anchor not in (None, b"", "") else None
        return self._plan(_s(pj)), a, tuple(json.loads(thr)) if thr else None

    def _plan_of(self, account: str) -> Plan:
        return self._drive(self._info_flow(account, True)).plan

    # -- deduction ---------------------------------------------------------------------

    def _check_big(self, am: dict[str, int]) -> None:
        if (
            am["tokens"] <= MAX_REDIS_AMOUNT
            and am["calls"] <= MAX_REDIS_AMOUNT
            and (len(am) == 4 or max(am.values()) <= MAX_REDIS_AMOUNT)
        ):
            return  # tokens = input + output: each part is below it too
        for u, v in am.items():
            if v > MAX_REDIS_AMOUNT:
                raise ValueError(f"{u}={v} must be < 2**53 in a Redis ledger")

    def _fired(self, account: str, fired: Any) -> _Flow[None]:
        if int(fired):
            yield ("cmd", "SADD", self._prefix + "notify", account)
            self._notice_event.set()

    def _charge_now(self, args: tuple[Any, ...], fp: str) -> Charge:
        """A plain client's charge of a known account without the flow's machinery: its
        script sent straight on this thread's connection; any reply but "charged" goes
        on in the flow (``_charge_call``) from that reply."""
        rid, account, am, model, parent, meta = args
        info = self._info.get(account)
        if info is not None and self._raw:
            self._check_big(am)
            now = self._now()
            span = self._span(info.plan_json, info.plan, info.anchor, now)
            c = self._ctx(account, info, span)
            r = self._exec(self._charge_step(c, now, rid, am, model or "", parent or "", meta, fp))
            if type(r) is not int:
                return self._drive(self._charge_call(rid, account, am, model, parent, meta, fp, r))
            if r:
                self._drive(self._fired(account, r))
            i, o, n = am["input_tokens"], am["output_tokens"], am["calls"]
            mt = _meta(meta) if meta else None
            cu = custom_units(am) if len(am) > 4 else None
            return new_charge(rid, account, span.key, now, i, o, n, model, parent, mt, False, cu)
        return self._drive(self._charge_call(rid, account, am, model, parent, meta, fp))

    def _charge_call(
        self,
        rid: str,
        account: str,
        am: dict[str, int],
        model: str | None,
        parent: str | None,
        meta: str,
        fp: str,
        first: Any = None,
    ) -> _Flow[Charge]:
        """A charge as a flow; ``first``: the reply its plain-charge script already got."""
        self._check_big(am)
        i, o, n = am["input_tokens"], am["output_tokens"], am["calls"]
        extra = (rid, fp, i, o, n, model or "", parent or "", meta, "")
        un, cu = (units_text(am), custom_units(am)) if len(am) > 4 else ("", None)
        fast = True
        for attempt in range(3):
            info = self._info.get(account) if attempt == 0 else None
            if info is None:
                info = yield from self._info_flow(account, attempt > 0)
            now = self._now()
            span = self._span(info.plan_json, info.plan, info.anchor, now)
            if fast:
                if attempt == 0 and first is not None:
                    r = first
                else:
                    c = self._ctx(account, info, span)
                    m, pa = model or "", parent or ""
                    r = yield self._charge_step(c, now, rid, am, m, pa, meta, fp)
                if type(r) is int:  # charged: the thresholds it fired
                    if r:
                        yield from self._fired(account, r)
                    mt = _meta(meta) if meta else None
                    return new_charge(
                        rid, account, span.key, now, i, o, n, model, parent, mt, False, cu
                    )
                if _s(r[0]) == "REPLAY":  # the client tells a replay from a conflict
                    old = _s(r[1])
                    f = old.split(SEP, 3)
                    if f[0] != "charge" or f[2] != fp:
                        raise conflict(rid)
                    return _record_charge(rid, account, old, True)
                if _s(r[0]) == "SLOW":  # the general op decides (nothing was written)
                    fast = False
                    r = yield self._op(
                        "charge", account, info, span, now, "r:" + rid, extra, units=un
                    )
            else:
                r = yield self._op("charge", account, info, span, now, "r:" + rid, extra, units=un)
            tag = r[0]
            if tag == b"OK" or tag == "OK":
                if r[1]:
                    yield from self._fired(account, r[1])
                mt = _meta(meta) if meta else None
                return new_charge(
                    rid, account, span.key, now, i, o, n, model, parent, mt, False, cu
                )
            tag = _s(tag)
            if tag == "STALE":
                continue
            if tag == "REPLAY":
                return _record_charge(rid, account, _s(r[1]), True)
            if tag == "CONFLICT":
                raise conflict(rid)
            if tag == "QUOTA":
                raise quota_exceeded(account, _s(r[1]), int(r[2]), int(r[3]), span, now)
            raise LedgerError(f"unexpected reply from the ledger script: {r!r}")
        raise PlanChanging(f"the plan of account {account!r} keeps changing; try again")

    def _charge_step(
        self,
        c: _Ctx,
        now: float,
        rid: str,
        am: dict[str, int],
        m: str,
        pa: str,
        meta: str,
        fp: str,
    ) -> _Step:
        """The plain charge's script step (op ``c``), packed in one piece on a plain client."""
        i, o, n = am["input_tokens"], am["output_tokens"], am["calls"]
        t = repr(now)
        raw = (
            f"charge\x1fcharged\x1f{fp}\x1f\x1f{t}\x1f{c.span.key}\x1f{i}\x1f{o}\x1f{n}"
            f"\x1f{m}\x1f{pa}\x1f{meta}\x1f\x1f"
        )
        if len(am) > 4:  # the record's 15th field: the units of your own
            raw += "\x1f" + units_text(am)
        ttl = str(max(1, math.ceil(c.expires - now)))
        if c.uidx is not None:
            vals = (i + o, i, o, n)
            needs = [str(vals[k]) for k in c.uidx]
        else:
            needs = [str(am.get(u, 0)) for u in c.units]
        rk = c.rkey + rid
        if self._raw and c.rkey_ascii and rid.isascii() and raw.isascii():
            # one str, encoded once (ASCII: its length is its byte count)
            ns = "".join([f"${len(x)}\r\n{x}\r\n" for x in needs])
            packed: bytes | None = (
                c.fpre
                + (
                    f"${len(rk)}\r\n{rk}\r\n$1\r\nc\r\n${len(t)}\r\n{t}\r\n"
                    f"${len(rid)}\r\n{rid}\r\n${len(raw)}\r\n{raw}\r\n"
                    f"${len(ttl)}\r\n{ttl}\r\n{c.fmid}{ns}"
                ).encode()
                + c.ftail.raw
            )
        else:
            packed = None
        # the command as arguments too, for the asyncio client
        return ("eval", [c.fhead, rk, "c", t, rid, raw, ttl, c.nu, *needs, c.ftail], packed)

    def _charge_many(self, ops: list[Any]) -> list[Charge | Exception]:
        out: list[Any] = list(ops)
        todo = [k for k, op in enumerate(ops) if not isinstance(op, Exception)]
        calls: list[tuple[Any, ...]] = [(*ops[k][0], ops[k][1]) for k in todo]
        got = self._drive_many([self._charge_call(*c) for c in calls])
        for k, r in zip(todo, got, strict=True):
            out[k] = r
        return out

    def _hold_call(
        self,
        rid: str,
        account: str,
        am: dict[str, int],
        model: str | None,
        parent: str | None,
        meta: str,
        fp: str,
    ) -> _Flow[Hold]:
        self._check_big(am)
        i, o, c = am["input_tokens"], am["output_tokens"], am["calls"]
        un = units_text(am)
        for attempt in range(3):
            info = yield from self._info_flow(account, attempt > 0)
            now = self._now()
            span = self._span(info.plan_json, info.plan, info.anchor, now)
            exp = now + self.hold_ttl
            extra = (rid, fp, i, o, c, model or "", parent or "", meta, repr(exp))
            # one server, no slots: the script records the hold's id -> account too
            index = self._prefix + "hold:" + rid if self._raw else None
            r = yield self._op(
                "hold", account, info, span, now, "r:" + rid, extra, account, index, un
            )
            tag = _s(r[0])
            if tag == "STALE":
                continue
            if tag == "CONFLICT":
                raise conflict(rid)
            if tag == "QUOTA":
                raise quota_exceeded(account, _s(r[1]), int(r[2]), int(r[3]), span, now)
            if tag == "REPLAY":
                ch = _record_charge(rid, account, _s(r[1]), True)
                exp = float(_s(r[1]).split(SEP)[12] or 0.0)
                h = Hold(
                    rid,
                    account,
                    ch.period,
                    ch.at,
                    exp,
                    ch.input_tokens,
                    ch.output_tokens,
                    ch.calls,
                    ch.model,
                    ch.parent_id,
                    ch.meta,
                    True,
                    ch.units,
                )
            else:
                yield from self._fired(account, r[1])
                h = Hold(
                    rid,
                    account,
                    span.key,
                    now,
                    exp,
                    i,
                    o,
                    c,
                    model,
                    parent,
                    _meta(meta),
                    False,
                    custom_units(am),
                )
            if not self._raw:  # a cluster: the id's key lives in another slot
                ttl = max(1, int(self.hold_ttl + self.retention))
                yield ("cmd", "SET", self._prefix + "hold:" + rid, account, "EX", ttl)
            self._remember_hold(rid, account, h.expires_at)
            return h
        raise PlanChanging(f"the plan of account {account!r} keeps changing; try again")

    def _remember_hold(self, rid: str, account: str, exp: float) -> None:
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

    def _hold_account(self, rid: str) -> _Flow[str | None]:
        with self._lock:
            hit = self._holds.get(rid)
        if hit is not None:
            return hit[0]
        v = yield ("cmd", "GET", self._prefix + "hold:" + rid)
        return None if v is None else _s(v)

    def _period_op(
        self, op: str, account: str, second: str, extra: Sequence[Any] = (), units: str = ""
    ) -> _Flow[tuple[Any, _Info, Span]]:
        """Runs one op in the current period; reads the plan again when it changed."""
        for attempt in range(3):
            info = yield from self._info_flow(account, attempt > 0)
            now = self._now()
            span = self._span(info.plan_json, info.plan, info.anchor, now)
            r = yield self._op(op, account, info, span, now, second, extra, units=units)
            if _s(r[0]) != "STALE":
                return r, info, span
        raise PlanChanging(f"the plan of account {account!r} keeps changing; try again")

    def _settle_call(
        self, rid: str, am: dict[str, int], model: str | None, account: str | None, sfp: str
    ) -> _Flow[Charge]:
        self._check_big(am)
        acc = (yield from self._hold_account(rid)) if account is None else account
        if acc is None:
            raise UnknownRequest(f"no hold has request id {rid!r}; pass account= to charge it")
        i, o, c = am["input_tokens"], am["output_tokens"], am["calls"]
        extra = (rid, sfp, i, o, c, model or "")
        un = units_text(am)
        r, _info, _span = yield from self._period_op("settle", acc, "r:" + rid, extra, un)
        tag = _s(r[0])
        if tag == "CONFLICT":
            raise conflict(rid)
        if tag == "REPLAY":
            return _record_charge(rid, acc, _s(r[1]), True)
        yield from self._fired(acc, r[1])
        with self._lock:
            self._holds.pop(rid, None)
        return _record_charge(rid, acc, _s(r[2]), False)

    def _release_call(self, rid: str, account: str | None = None) -> _Flow[None]:
        acc = (yield from self._hold_account(rid)) if account is None else account
        if acc is None:
            return
        try:
            yield from self._period_op("release", acc, "r:" + rid, (rid,))
        except LookupError:
            return
        with self._lock:
            self._holds.pop(rid, None)

    def _balance_call(self, account: str) -> _Flow[Balance]:
        r, info, span = yield from self._period_op("balance", account, "r:")
        quota = info.plan.quota
        used, held, bonus = {}, {}, {}
        for k, u in enumerate(quota):
            used[u] = int(r[1 + 3 * k])
            held[u] = int(r[2 + 3 * k])
            bonus[u] = int(r[3 + 3 * k])
        return Balance(
            account, info.plan.name, span.key, span.start, span.end, dict(quota), used, held, bonus
        )

    def expire_holds(self) -> int:
        """Gives back every hold past its expiry now; returns how many (each account is
        also expired lazily whenever it is used)."""
        n = 0
        for acc in self.accounts():
            while True:
                due = int(self.client.zcount(self._pfx(acc) + "h", "-inf", repr(self._now())))
                if not due:
                    break
                self._drive(self._balance_call(acc))  # the script expires up to 100 a call
                n += min(due, 100)
        return n

    # -- asyncio ----------------------------------------------------------------------

    async def aclose(self) -> None:
        """Closes the asyncio client this loop made (one passed in is the caller's)."""
        loop = asyncio.get_running_loop()
        c = self._loop_clients.pop(loop, None)
        if c is not None:
            await c.aclose()

    # -- queries -------------------------------------------------------------------------

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
                before_used = {u: int(_field(p, f"u_{u}", 0)) for u in quota}
                before_bonus = {u: int(_field(a, f"b_{u}", 0)) for u in quota}
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
        steps = [
            self._comp_step(campaign_id, acc, info, span, params) for _, acc, info, span in todo
        ]
        if self._raw:  # one pipeline of scripts (a cluster client refuses scripts there)
            self.client.script_load(LUA)
            for step in steps:
                pipe.execute_command(*_flat(step[1]))
            replies = pipe.execute()
        else:
            replies = [self._exec(step) for step in steps]
        for n, r in enumerate(replies):
            k, acc, _info, span = todo[n]
            if _s(r[0]) == "STALE":  # its plan changed meanwhile: once more, alone
                info = self._drive(self._info_flow(acc, True))
                span = info.plan.period.at(at, info.anchor)
                r = self._exec(self._comp_step(campaign_id, acc, info, span, params))
                if _s(r[0]) == "STALE":
                    raise PlanChanging(f"the plan of account {acc!r} keeps changing")
            rec = _ints(json.loads(r[1]))
            rec["status"] = "done" if _s(r[0]) == "DONE" else "changed"
            out[k] = rec
        return out

    def _comp_step(
        self, campaign_id: str, acc: str, info: _Info, span: Span, params: dict[str, Any]
    ) -> _Step:
        credit = params["credit"]
        spec = ",".join(
            f"{u}={int(q * credit) if credit is not None else 0}={int(q * params['bonus'])}"
            for u, q in info.plan.quota.items()
        )
        extra = (campaign_id, "1" if params["reset_usage"] else "0", spec, acc)
        return self._op("comp", acc, info, span, self._now(), "audit", extra)

    def audit(self, campaign_id: str, account: str) -> dict[str, Any] | None:
        """The audit row a campaign wrote for an account (None if not done)."""
        v = self.client.hget(self._pfx(account) + "audit", campaign_id)
        return None if v is None else _ints(json.loads(v))

    def close(self) -> None:
        """Closes the client's connections and the ledger's own (one per thread that ran
        a script)."""
        self._close_conns()
        self.client.close()
