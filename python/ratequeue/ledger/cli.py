"""``ratequeue quota``: set an account's plan, show it, list or export its usage, run a
compensation.

The ledger is ``--db FILE`` (SQLite) or ``--redis URL`` (with ``--name``). Times are
Unix seconds or ISO 8601 (UTC unless the text names an offset).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from datetime import datetime, timezone
from typing import Any

from ._base import LedgerBase
from ._model import UNITS, Daily, Every, LedgerError, Monthly, Period, Plan, check_units, utc


def _when(text: str) -> float:
    try:
        v = float(text)
        if math.isfinite(v) and v >= 0:
            return v
    except ValueError:
        pass
    try:
        d = datetime.fromisoformat(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected Unix seconds or an ISO 8601 time, got {text!r}"
        ) from None
    if d.tzinfo is None:
        d = d.replace(tzinfo=timezone.utc)
    return d.timestamp()


def _share(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a share like 0.25, got {text!r}") from None
    if not math.isfinite(v) or v < 0 or v > 100:
        raise argparse.ArgumentTypeError(f"a share must be within [0, 100], got {text}")
    return v


def _limit(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an int, got {text!r}") from None
    if not 1 <= v <= 10_000:
        raise argparse.ArgumentTypeError(f"limit must be from 1 to 10000, got {v}")
    return v


def _amount(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an int, got {text!r}") from None
    if not 0 <= v <= 2**63 - 1:
        raise argparse.ArgumentTypeError(f"a quota must be from 0 to 2**63-1, got {v}")
    return v


def _unit_quota(text: str) -> tuple[str, int]:
    name, eq, amount = text.partition("=")
    if not eq:
        raise argparse.ArgumentTypeError(f"expected NAME=QUOTA, e.g. images=100, got {text!r}")
    v = _amount(amount)
    try:
        check_units({name: 1})
    except (TypeError, ValueError) as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return name, v


def _fractions(text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected shares like 0.8,0.95, got {text!r}") from None


def _period(text: str) -> Period:
    kind, _, rest = text.partition(":")
    if kind == "monthly" and not rest:
        return Monthly()
    if kind == "anchored" and not rest:
        return Monthly(anchored=True)
    if kind == "daily" and not rest:
        return Daily()
    if kind == "every":
        try:
            return Every(float(rest))
        except (TypeError, ValueError):
            pass
    raise argparse.ArgumentTypeError(
        f"expected monthly, anchored, daily or every:SECONDS, got {text!r}"
    )


def open_ledger(args: argparse.Namespace, *, create: bool = False) -> LedgerBase:
    """The ledger the options name (``create``: a new SQLite file is fine)."""
    if args.db and args.redis:
        raise ValueError("give --db or --redis, not both")
    if args.db:
        from ._sqlite import SqliteLedger

        if not create and not os.path.isfile(args.db):
            raise ValueError(f"no ledger file at {args.db}")
        return SqliteLedger(args.db)
    if args.redis:
        import redis

        from ..redis import RedisLedger

        return RedisLedger(redis.Redis.from_url(args.redis), name=args.name)
    raise ValueError("give --db FILE or --redis URL")


def _table(rows: list[list[Any]], head: list[str]) -> str:
    cells = [head, *[[str(c) for c in r] for r in rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _show(led: LedgerBase, args: argparse.Namespace) -> int:
    b = led.balance(args.account)
    print(f"account {b.account}  plan {b.plan}  period {b.period}")
    print(f"period {utc(b.period_start)} .. {utc(b.reset_at)} (resets then)")
    rem = b.remaining
    rows = [
        [
            u,
            q,
            b.used.get(u, 0),
            b.held.get(u, 0),
            b.bonus.get(u, 0),
            rem[u],
            f"{100 * b.used.get(u, 0) / q:.1f}%" if q else "-",
        ]
        for u, q in b.quota.items()
    ]
    print(_table(rows, ["unit", "quota", "used", "held", "bonus", "remaining", "used%"]))
    return 0


def _usage(led: LedgerBase, args: argparse.Namespace) -> int:
    page = led.usage(
        args.account, start=args.since, end=args.until, limit=args.limit, cursor=args.cursor
    )
    rows = [
        [
            utc(c.at),
            c.request_id,
            c.parent_id or "",
            c.model or "",
            c.input_tokens,
            c.output_tokens,
            c.calls,
            " ".join(f"{u}={v}" for u, v in c.units.items()),
        ]
        for c in page.rows
    ]
    head = ["time (UTC)", "request", "parent", "model", "input", "output", "calls", "units"]
    if not any(c.units for c in page.rows):
        head.pop()
        rows = [r[:-1] for r in rows]
    print(_table(rows, head))
    if page.cursor is not None:
        print(f"more: --cursor {page.cursor}")
    return 0


def _export(led: LedgerBase, args: argparse.Namespace) -> int:
    if args.out in (None, "-"):
        n = led.export_csv(args.account, sys.stdout, start=args.since, end=args.until)
    else:
        with open(args.out, "w", newline="") as f:
            n = led.export_csv(args.account, f, start=args.since, end=args.until)
        print(f"wrote {n} rows to {args.out}", file=sys.stderr)
    return 0


def _compensate(led: LedgerBase, args: argparse.Namespace) -> int:
    accounts: list[str] | None = list(args.account) if args.account else None
    if args.accounts_file:
        with open(args.accounts_file) as f:
            accounts = (accounts or []) + [line.strip() for line in f if line.strip()]
    report = led.compensate(
        args.campaign,
        accounts,
        reset_usage=not args.no_reset,
        bonus=args.bonus,
        credit=args.credit,
        dry_run=args.dry_run,
        progress=sys.stderr.isatty() if args.progress is None else args.progress,
    )
    verb = "would change" if report.dry_run else "changed"
    print(
        f"campaign {report.campaign_id}: {report.accounts} accounts, {verb} {report.changed}, "
        f"already done {report.already_done}, skipped {report.skipped}"
    )
    units = sorted(set(report.credited) | set(report.bonus_added))
    if units:
        rows = [[u, report.credited.get(u, 0), report.bonus_added.get(u, 0)] for u in units]
        print(_table(rows, ["unit", "usage removed", "bonus added"]))
    return 0


def _set_plan(led: LedgerBase, args: argparse.Namespace) -> int:
    try:
        old, anchor, own = led.settings(args.account)
    except LookupError:
        old, anchor, own = None, None, None
    quota: dict[str, int] = {}
    if old is not None and not args.replace:
        quota.update(old.quota)
    for u in UNITS:
        v = getattr(args, u)
        if v is not None:
            quota[u] = v
    for u, v in args.unit or ():
        quota[u] = v
    period = args.period or (old.period if old is not None and not args.replace else Monthly())
    if args.tz is not None:
        d = period.to_dict()
        if "tz" not in d:
            raise ValueError("--tz applies to monthly, anchored and daily periods")
        d["tz"] = args.tz
        try:
            period = Period.from_dict(d)
        except LookupError:
            raise ValueError(f"unknown time zone {args.tz!r}") from None
    thresholds = args.thresholds
    if thresholds is None:
        thresholds = old.thresholds if old is not None and not args.replace else (0.8, 0.95)
    name = args.plan or (old.name if old is not None else "default")
    builtin = {u: v for u, v in quota.items() if u in UNITS}
    mine = {u: v for u, v in quota.items() if u not in UNITS}
    plan = Plan(name, period=period, thresholds=thresholds, units=mine or None, **builtin)
    if args.anchor is not None:
        anchor = args.anchor
    elif args.replace:
        anchor = None
    if args.account_thresholds is not None:
        own = tuple(args.account_thresholds) or None
    elif args.replace:
        own = None
    led.set_plan(args.account, plan, anchor=anchor, thresholds=own)
    print(f"{'updated' if old is not None else 'created'} account {args.account}: plan {name}")
    rows = [[u, q] for u, q in plan.quota.items()]
    print(_table(rows, ["unit", "quota"]))
    print(f"period {period!r}" + (f", anchor {utc(anchor)}" if anchor is not None else ""))
    shown = own if own is not None else plan.thresholds
    print("warnings at " + ", ".join(f"{t:g}" for t in shown) + (" (account's own)" if own else ""))
    return 0


def _run(args: argparse.Namespace) -> int:
    led = open_ledger(args, create=args.quota_func is _set_plan)
    try:
        code: int = args.quota_func(led, args)
        return code
    except (LookupError, LedgerError) as e:
        print(f"ratequeue quota: {e}", file=sys.stderr)
        return 1
    finally:
        led.close()


def add_quota_parser(sub: Any) -> None:
    """Adds ``quota`` and its subcommands to the ``ratequeue`` command line."""
    q = sub.add_parser("quota", help="the quota ledger: set-plan, show, usage, export, compensate")
    q.add_argument("--db", help="SQLite ledger file")
    q.add_argument("--redis", help="Redis URL of a Redis ledger")
    q.add_argument("--name", default="default", help="Redis ledger name (default)")
    qs = q.add_subparsers(dest="quota_command", required=True)

    sp = qs.add_parser(
        "set-plan",
        help="create or update an account's plan (options not given keep their values)",
    )
    sp.add_argument("account")
    sp.add_argument("--plan", default=None, help="the plan's name (default: kept, or default)")
    for u in UNITS:
        sp.add_argument(
            "--" + u.replace("_", "-"), dest=u, type=_amount, default=None, help=f"{u} per period"
        )
    sp.add_argument(
        "--unit",
        action="append",
        type=_unit_quota,
        default=None,
        metavar="NAME=QUOTA",
        help="a quota in a unit of your own per period (repeat), e.g. images=100",
    )
    sp.add_argument(
        "--period", type=_period, default=None, help="monthly, anchored, daily or every:SECONDS"
    )
    sp.add_argument("--tz", default=None, help="time zone of the period (default UTC)")
    sp.add_argument("--anchor", type=_when, default=None, help="start of anchored periods")
    sp.add_argument(
        "--thresholds", type=_fractions, default=None, help="the plan's warnings (0.8,0.95)"
    )
    sp.add_argument(
        "--account-thresholds",
        type=_fractions,
        default=None,
        help="this account's own warnings ('' = the plan's)",
    )
    sp.add_argument("--replace", action="store_true", help="start from nothing, not the old plan")
    sp.set_defaults(quota_func=_set_plan)

    s = qs.add_parser("show", help="an account's quota, usage, holds and bonus")
    s.add_argument("account")
    s.set_defaults(quota_func=_show)

    for name, fn, helptext in (
        ("usage", _usage, "an account's usage rows as a table"),
        ("export", _export, "an account's usage rows as CSV"),
    ):
        p = qs.add_parser(name, help=helptext)
        p.add_argument("account")
        p.add_argument("--since", type=_when, default=None, help="from this time")
        p.add_argument("--until", type=_when, default=None, help="before this time")
        if name == "usage":
            p.add_argument("--limit", type=_limit, default=50, help="rows per page (50)")
            p.add_argument("--cursor", default=None, help="the page after this cursor")
        else:
            p.add_argument("--out", default=None, help="file to write (default stdout)")
        p.set_defaults(quota_func=fn)

    c = qs.add_parser("compensate", help="run (or --dry-run) a compensation campaign")
    c.add_argument("campaign", help="campaign id: a rerun resumes and never credits twice")
    c.add_argument("--account", action="append", help="an account (repeat; default all)")
    c.add_argument("--accounts-file", help="a file of accounts, one per line")
    c.add_argument("--bonus", type=_share, default=None, help="bonus share of the quota (0.25)")
    c.add_argument("--credit", type=_share, default=None, help="credit this share instead")
    c.add_argument("--no-reset", action="store_true", help="keep usage (bonus only)")
    c.add_argument("--dry-run", action="store_true", help="report, change nothing")
    g = c.add_mutually_exclusive_group()
    g.add_argument("--progress", dest="progress", action="store_true", default=None)
    g.add_argument("--no-progress", dest="progress", action="store_false")
    c.set_defaults(quota_func=_compensate)
    q.set_defaults(func=_run)
