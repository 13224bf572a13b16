"""The SQLite ledger's schema, its migration of older files, and how its rows are read
into records (charges, holds, notices) and amounts."""

from __future__ import annotations

import json
import sqlite3
from typing import Any

from ._base import parse_json_obj
from ._model import UNITS, Charge, Hold, Notice, custom_units

_SCHEMA = """
CREATE TABLE IF NOT EXISTS accounts(
  account TEXT PRIMARY KEY, plan TEXT NOT NULL, anchor REAL, thresholds TEXT,
  b_tokens INTEGER NOT NULL DEFAULT 0, b_input_tokens INTEGER NOT NULL DEFAULT 0,
  b_output_tokens INTEGER NOT NULL DEFAULT 0, b_calls INTEGER NOT NULL DEFAULT 0,
  next_exp REAL, b_units TEXT);
CREATE TABLE IF NOT EXISTS periods(
  account TEXT NOT NULL, period TEXT NOT NULL, start REAL NOT NULL, end REAL NOT NULL,
  u_tokens INTEGER NOT NULL DEFAULT 0, u_input_tokens INTEGER NOT NULL DEFAULT 0,
  u_output_tokens INTEGER NOT NULL DEFAULT 0, u_calls INTEGER NOT NULL DEFAULT 0,
  h_tokens INTEGER NOT NULL DEFAULT 0, h_input_tokens INTEGER NOT NULL DEFAULT 0,
  h_output_tokens INTEGER NOT NULL DEFAULT 0, h_calls INTEGER NOT NULL DEFAULT 0,
  fired TEXT NOT NULL DEFAULT '', u_units TEXT, h_units TEXT,
  PRIMARY KEY(account, period)) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS periods_end ON periods(end);
CREATE TABLE IF NOT EXISTS requests(
  account TEXT NOT NULL, request_id TEXT NOT NULL, kind TEXT NOT NULL, status TEXT NOT NULL,
  at REAL NOT NULL, period TEXT NOT NULL, input_tokens INTEGER NOT NULL,
  output_tokens INTEGER NOT NULL, calls INTEGER NOT NULL, model TEXT, parent_id TEXT,
  meta TEXT, fp TEXT NOT NULL, sfp TEXT, parts TEXT, expires REAL, units TEXT,
  PRIMARY KEY(account, request_id)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS holds(
  request_id TEXT PRIMARY KEY, account TEXT NOT NULL) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS requests_at ON requests(account, at, request_id);
CREATE INDEX IF NOT EXISTS requests_parent ON requests(account, parent_id)
  WHERE parent_id IS NOT NULL;
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

#: The schema's version (``PRAGMA user_version``): 1 added the units of your own
#: (JSON columns ``b_units``, ``u_units``, ``h_units``, ``units``), added in place to a
#: file of version 0 when it is opened.
SCHEMA_VERSION = 1
_MIGRATIONS = (
    ("accounts", "b_units"),
    ("periods", "u_units"),
    ("periods", "h_units"),
    ("requests", "units"),
)
_ROW_COLS = (
    "request_id, account, period, at, input_tokens, output_tokens, calls, model, parent_id,"
    " meta, units"
)


def _migrate(conn: sqlite3.Connection) -> None:
    """Brings a file of an older schema to ``SCHEMA_VERSION`` (in the open transaction)."""
    for table, col in _MIGRATIONS:
        have = {r[1] for r in conn.execute(f"PRAGMA table_info({table})")}
        if col not in have:
            conn.execute(f"ALTER TABLE {table} ADD COLUMN {col} TEXT")
    conn.execute(f"PRAGMA user_version={SCHEMA_VERSION}")


def _own(d: dict[str, int]) -> str | None:
    """The nonzero units of your own in a counter dict, as JSON (None: none)."""
    if len(d) <= 4:
        return None
    own = {u: v for u, v in d.items() if v and u not in UNITS}
    return json.dumps(own, sort_keys=True, separators=(",", ":")) if own else None


def units_json(am: dict[str, int]) -> str | None:
    """A request's units of your own as stored (None: none)."""
    cu = custom_units(am)
    return json.dumps(cu, separators=(",", ":")) if cu else None


def _units(text: str | None) -> dict[str, int]:
    return json.loads(text) if text else {}


def _am(i: int, o: int, c: int, units: str | None = None) -> dict[str, int]:
    am = {"tokens": i + o, "input_tokens": i, "output_tokens": o, "calls": c}
    if units:
        am.update(json.loads(units))
    return am


def _same_amounts(old: Any, am: dict[str, int], model: str | None) -> bool:
    return (
        old[8] == am["input_tokens"]
        and old[9] == am["output_tokens"]
        and old[10] == am["calls"]
        and (model is None or model == old[11])
        and _units(old[14]) == custom_units(am)
    )


def _charge_of(r: Any, replay: bool) -> Charge:
    return Charge(
        r[0],
        r[1],
        r[2],
        r[3],
        r[4],
        r[5],
        r[6],
        r[7],
        r[8],
        parse_json_obj(r[9]),
        replay,
        _units(r[10]),
    )


def _hold_of(r: Any, expires: float, replay: bool) -> Hold:
    return Hold(
        r[0],
        r[1],
        r[2],
        r[3],
        expires,
        r[4],
        r[5],
        r[6],
        r[7],
        r[8],
        parse_json_obj(r[9]),
        replay,
        _units(r[10]),
    )


def _notice(r: Any) -> Notice:
    return Notice(r[0], r[1], r[2], r[3], r[4] / 10_000, r[5], r[6], r[7])
