"""How the Redis ledger encodes what it stores: a request record is one string of fields
joined by ``\\x1f``, notices are ``|``-joined; the parts of a command that stay the same
for an account and period are packed in RESP once (``_Seg``)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from ..ledger._model import UNITS, Charge, Notice, Plan, custom_units, threshold_amounts

SEP = "\x1f"


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def _b(v: Any) -> bytes:
    return v if isinstance(v, bytes) else str(v).encode()


class _Seg:
    """Consecutive command arguments, kept as given and as RESP bulk strings."""

    __slots__ = ("args", "n", "raw")

    def __init__(self, args: Sequence[Any]) -> None:
        self.args = tuple(args)
        self.n = len(self.args)
        self.raw = b"".join(b"$%d\r\n%s\r\n" % (len(x), x) for x in map(_b, self.args))


def _pack_items(items: Sequence[Any]) -> bytes:
    """A command of scalars and ``_Seg`` parts, in RESP."""
    n = 0
    out = []
    for it in items:
        t = type(it)
        if t is _Seg:
            n += it.n
            out.append(it.raw)
            continue
        x = it.encode() if t is str else b"%d" % it if t is int else _b(it)
        n += 1
        out.append(b"$%d\r\n%b\r\n" % (len(x), x))
    return b"*%d\r\n%b" % (n, b"".join(out))


def _flat(items: Sequence[Any]) -> list[Any]:
    """A command of scalars and ``_Seg`` parts as plain arguments."""
    out: list[Any] = []
    for it in items:
        if type(it) is _Seg:
            out.extend(it.args)
        else:
            out.append(it)
    return out


class _Ctx:
    """What a command of one account and period always carries: the EVALSHA head with
    the account key, the other keys, and the script's ARGV 13... (plan and period); and
    the same for the plain charge (op ``c``)."""

    __slots__ = (
        "expires",
        "fhead",
        "fmid",
        "fpre",
        "ftail",
        "head",
        "keys",
        "nu",
        "rkey",
        "rkey_ascii",
        "span",
        "tail",
        "uidx",
        "units",
    )

    def __init__(
        self, sha: str, pfx: str, info: _Info, span: Any, retention: int, max_rows: int
    ) -> None:
        self.span = span
        a, p = pfx + "a", pfx + "p:" + span.key
        self.head = _Seg(("EVALSHA", sha, 6, a))
        self.keys = _Seg((pfx + "h", pfx + "rows", pfx + "o", p))
        self.tail = _Seg((info.ver, pfx, retention, span.key, repr(span.end), max_rows, *info.spec))
        units = list(info.plan.quota.items())
        self.nu = len(units)
        self.rkey = pfx + "r:"
        self.rkey_ascii = self.rkey.isascii()
        # a request record lives until this (Unix s): ``retention`` after the period ends
        self.expires = span.end + retention
        self.units = tuple(u for u, _ in units)
        # where each unit's amount is in (tokens, input_tokens, output_tokens, calls);
        # None when the plan has units of your own
        self.uidx = (
            tuple(UNITS.index(u) for u in self.units)
            if all(u in UNITS for u in self.units)
            else None
        )
        self.fhead = _Seg(("EVALSHA", sha, 5, a, p, pfx + "rows", pfx + "o"))
        per_unit: list[Any] = []
        for u, q in units:
            lv = list(zip(info.thr, threshold_amounts(q, info.thr), strict=True)) if q > 0 else []
            per_unit += ["u_" + u, q, len(lv)]
            for bp, level in lv:
                per_unit += [level, bp]
        self.ftail = _Seg((info.ver, max_rows, span.key, *per_unit))
        # the packed command up to its request key: its argument count, then the head
        count = self.fhead.n + 7 + self.nu + self.ftail.n
        self.fpre = b"*%d\r\n%b" % (count, self.fhead.raw)
        # ARGV 6: the unit count
        self.fmid = _Seg((self.nu,)).raw.decode()


class _Info:
    __slots__ = ("anchor", "ctx", "plan", "plan_json", "spec", "thr", "ver")
    spec: list[Any]
    ctx: dict[str, _Ctx]

    def __init__(
        self, ver: str, plan_json: str, anchor: float | None, thr: tuple[int, ...], plan: Plan
    ) -> None:
        self.ver, self.plan_json, self.anchor, self.thr, self.plan = (
            ver,
            plan_json,
            anchor,
            thr,
            plan,
        )
        self.ctx = {}
        # the plan as the script reads it (ARGV 19...): unit count, then per unit its
        # name, quota, threshold count and (basis points, level) pairs
        spec: list[Any] = [len(plan.quota)]
        for u, q in plan.quota.items():
            lv = list(zip(thr, threshold_amounts(q, thr), strict=True)) if q > 0 else []
            spec += [u, q, len(lv)]
            for bp, level in lv:
                spec += [bp, level]
        self.spec = spec


def _ints(rec: dict[str, Any]) -> dict[str, Any]:
    for side in ("before", "after"):
        for what in ("used", "bonus"):
            d = rec.get(side, {}).get(what)
            if isinstance(d, dict):
                rec[side][what] = {u: int(v) for u, v in d.items()}
    if isinstance(rec.get("bonus_added"), dict):
        rec["bonus_added"] = {u: int(v) for u, v in rec["bonus_added"].items()}
    if "at" in rec:
        rec["at"] = float(rec["at"])
    return rec


def _meta(text: str) -> dict[str, Any] | None:
    if not text:
        return None
    v = json.loads(text)
    return v if isinstance(v, dict) else None


def units_text(am: dict[str, int]) -> str:
    """A request's units of your own as the script and its records take them:
    ``name=amount`` joined by ``;`` in name order (``""``: none)."""
    return ";".join(f"{u}={v}" for u, v in custom_units(am).items())


def _units(text: str) -> dict[str, int]:
    if not text:
        return {}
    return {u: int(v) for u, v in (item.split("=", 1) for item in text.split(";"))}


def _record_charge(rid: str, account: str, raw: str, replay: bool) -> Charge:
    """A charge from a request record: kind, status, fp, sfp, at, period, in, out, calls,
    model, parent, meta, exp, parts (and, with units of your own, those) joined by
    \\x1f."""
    f = raw.split(SEP)
    return Charge(
        rid,
        account,
        f[5],
        float(f[4]),
        int(f[6]),
        int(f[7]),
        int(f[8]),
        f[9] or None,
        f[10] or None,
        _meta(f[11]),
        replay,
        _units(f[14]) if len(f) > 14 else {},
    )


def _field(fields: dict[Any, Any], name: str, default: Any = None) -> Any:
    """A hash or stream field by name, whether the client decodes replies or not."""
    v = fields.get(name.encode())
    return fields.get(name, default) if v is None else v


def _row_charge(account: str, fields: dict[Any, Any]) -> Charge:
    return _record_charge(_s(_field(fields, "id")), account, _s(_field(fields, "r")), False)


def _notice(account: str, raw: str) -> Notice:
    unit, bp, used, quota, at, period = raw.split("|", 5)
    return Notice(
        f"{account}|{period}|{unit}|{bp}",
        account,
        period,
        unit,
        int(bp) / 10_000,
        int(used),
        int(quota),
        float(at),
    )
