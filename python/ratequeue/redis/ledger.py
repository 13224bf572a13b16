"""The quota ledger in Redis: ``RedisLedger`` (the same calls as ``SqliteLedger``) and the
script it runs (``ledger.lua``, package data)."""

from __future__ import annotations

from ._ledger import LUA, LUA_SHA, MAX_REDIS_AMOUNT, RedisLedger

__all__ = ["LUA", "LUA_SHA", "MAX_REDIS_AMOUNT", "RedisLedger"]
