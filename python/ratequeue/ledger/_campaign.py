"""Compensation campaigns over a ledger's accounts: the per-unit arithmetic, the run in
batches with its report and progress bar; each backend writes an account's change and
its audit row atomically (``_compensate_accounts``)."""

from __future__ import annotations

import abc
import sys
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from ._model import CampaignReport, check_fraction, check_id

__all__ = ["MAX_REPORT_ACTIONS", "Campaigns", "compensation"]

#: Kept at most per compensation report (totals always count every account).
MAX_REPORT_ACTIONS = 1000


def compensation(
    quota: dict[str, int],
    used: dict[str, int],
    *,
    reset_usage: bool,
    bonus: float,
    credit: float | None,
) -> tuple[dict[str, int], dict[str, int]]:
    """(new used, bonus to add) per unit: never negative."""
    new_used: dict[str, int] = {}
    add: dict[str, int] = {}
    for u, q in quota.items():
        cur = max(0, used.get(u, 0))
        if credit is not None:
            new_used[u] = max(0, cur - int(q * credit))
        elif reset_usage:
            new_used[u] = 0
        else:
            new_used[u] = cur
        add[u] = max(0, int(q * bonus))
    return new_used, add


class Campaigns(abc.ABC):
    """``compensate`` for a ledger (``LedgerBase`` gives ``accounts``/``count_accounts``)."""

    @abc.abstractmethod
    def accounts(self) -> Iterator[str]: ...

    @abc.abstractmethod
    def count_accounts(self) -> int: ...

    # -- compensation ----------------------------------------------------------------------

    def compensate(
        self,
        campaign_id: str,
        accounts: Iterable[str] | None = None,
        *,
        reset_usage: bool = True,
        bonus: float | None = None,
        credit: float | None = None,
        dry_run: bool = False,
        progress: bool | Callable[[int, int], None] | None = False,
        batch: int = 500,
    ) -> CampaignReport:
        """Compensates accounts (all by default) in their current period, never below 0:
        usage reset to 0 plus a bonus of ``bonus`` (0.25 by default) of the quota, or
        with ``credit`` usage lowered by that share of the quota. Idempotent per
        campaign: a rerun skips accounts done (an audit row each) and resumes."""
        check_id("campaign_id", campaign_id)
        if credit is not None:
            credit = check_fraction("credit", credit)
            reset_usage = False
        b = (
            (0.0 if credit is not None else 0.25)
            if bonus is None
            else check_fraction("bonus", bonus)
        )
        if (credit is not None and credit > 1) or b > 100:
            raise ValueError("credit must be <= 1 and bonus <= 100 (shares of the quota)")
        if isinstance(batch, bool) or not isinstance(batch, int) or not 1 <= batch <= 100_000:
            raise ValueError(f"batch={batch!r} must be an int from 1 to 100000")
        params = {"reset_usage": bool(reset_usage), "bonus": b, "credit": credit}
        at = self._campaign_start(campaign_id, params, dry_run)
        report = CampaignReport(campaign_id, bool(dry_run))
        if accounts is None:
            total = self.count_accounts()
            source: Iterable[str] = self.accounts()
        else:
            acc = list(accounts)
            for a in acc:
                check_id("account", a)
            total, source = len(acc), acc
        bar = _bar(progress, total, campaign_id)
        chunk: list[str] = []
        try:
            for a in source:
                chunk.append(a)
                if len(chunk) >= batch:
                    self._run_chunk(campaign_id, chunk, params, at, dry_run, report, bar)
                    chunk = []
            if chunk:
                self._run_chunk(campaign_id, chunk, params, at, dry_run, report, bar)
        finally:
            if bar is not None:
                bar(report.accounts, total, True)
        if not dry_run:
            self._campaign_finish(campaign_id)
        return report

    def _run_chunk(
        self,
        campaign_id: str,
        chunk: list[str],
        params: dict[str, Any],
        at: float,
        dry_run: bool,
        report: CampaignReport,
        bar: Callable[[int, int, bool], None] | None,
    ) -> None:
        for act in self._compensate_accounts(campaign_id, chunk, params, at, dry_run):
            report.accounts += 1
            status = act["status"]
            if status == "done":
                report.already_done += 1
            elif status == "skipped":
                report.skipped += 1
            else:
                report.changed += 1
                for u, v in act["before"]["used"].items():
                    d = v - act["after"]["used"].get(u, v)
                    report.credited[u] = report.credited.get(u, 0) + d
                for u, v in act["bonus_added"].items():
                    report.bonus_added[u] = report.bonus_added.get(u, 0) + v
            if len(report.actions) < MAX_REPORT_ACTIONS:
                report.actions.append(act)
        if bar is not None:
            bar(report.accounts, -1, False)

    @abc.abstractmethod
    def _campaign_start(self, campaign_id: str, params: dict[str, Any], dry_run: bool) -> float: ...

    @abc.abstractmethod
    def _campaign_finish(self, campaign_id: str) -> None: ...

    @abc.abstractmethod
    def _compensate_accounts(
        self, campaign_id: str, accounts: list[str], params: dict[str, Any], at: float, dry: bool
    ) -> list[dict[str, Any]]: ...

    @abc.abstractmethod
    def audit(self, campaign_id: str, account: str) -> dict[str, Any] | None:
        """The audit row a campaign wrote for an account (None if not done)."""
        ...


def _bar(
    progress: bool | Callable[[int, int], None] | None, total: int, label: str
) -> Callable[[int, int, bool], None] | None:
    if progress is None or progress is False:
        return None
    if progress is not True:
        cb = progress
        last = [-1]

        def call(done: int, _t: int, _end: bool) -> None:
            if done != last[0]:
                last[0] = done
                cb(done, total)

        return call
    width = 30

    def draw(done: int, _t: int, end: bool) -> None:
        frac = done / total if total else 1.0
        filled = round(min(1.0, frac) * width)
        sys.stderr.write(
            f"\r[{'#' * filled}{'.' * (width - filled)}] {frac * 100:5.1f}%  "
            f"{done}/{total} accounts  {label[:30]}"
        )
        if end:
            sys.stderr.write("\n")
        sys.stderr.flush()

    return draw
