"""``ratequeue quota``: show an account, list or export its usage, run a compensation.

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
from ._model import LedgerError, utc


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


def open_ledger(args: argparse.Namespace) -> LedgerBase:
    """The ledger the options name."""
    if args.db and args.redis:
        raise ValueError("give --db or --redis, not both")
    if args.db:
        from ._sqlite import SqliteLedger

        if not os.path.isfile(args.db):
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
        ]
        for c in page.rows
    ]
    print(_table(rows, ["time (UTC)", "request", "parent", "model", "input", "output", "calls"]))
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


def _run(args: argparse.Namespace) -> int:
    led = open_ledger(args)
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
    q = sub.add_parser("quota", help="the quota ledger: show, usage, export, compensate")
    q.add_argument("--db", help="SQLite ledger file")
    q.add_argument("--redis", help="Redis URL of a Redis ledger")
    q.add_argument("--name", default="default", help="Redis ledger name (default)")
    qs = q.add_subparsers(dest="quota_command", required=True)

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
