"""The ledger tests' fixtures: ``make`` (a fresh ledger of each backend, SQLite and
Redis) and ``clock`` (a manual clock at 2025-12-01T00:00:00Z). Defined in
``tests/ledger_backends.py``."""

from ledger_backends import clock, make

__all__ = ["clock", "make"]
