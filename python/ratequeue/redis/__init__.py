"""Distributed limits in Redis: the same GCRA decisions as the core, shared by every process.

``RedisLimiter``, ``RedisKeyedLimiter`` and ``RedisPolicy`` (and their asyncio twins
``AsyncRedisLimiter``, ``AsyncRedisKeyedLimiter``, ``AsyncRedisPolicy``) decide inside
Redis, atomically, in one round trip: one Lua script (run by EVALSHA, loaded once and
again after a NOSCRIPT reply) checks and debits every rate, unit and level of a request,
all or nothing, on the server's clock (``TIME``), never a client's.

Storage: a bucket is one string key holding its theoretical arrival time (TAT) in
integer microseconds since the Unix epoch of the server's clock. About 1.8e15 today,
that is exact in a Lua double (below 2**53). Every write sets ``PX`` to the time until
the bucket is full again, and a full bucket has no key: idle keys cost no memory and
dropping one changes no decision. Debits are ``round(cost * T)`` microseconds with
``T = per / amount``: exact (and equal, decision for decision, to the Rust core) when
``T`` is a whole number of microseconds; otherwise each debit is rounded to the
nearest microsecond (an error of at most 0.5 us per request, not a drift of the rate
definition). A bucket's generation key (``b"\\xff" + its name``) changes at every
give-back that is not exact; cancel and settle follow the core's one undo rule
(docs/redis.md, "Cancel, settle and the undo rule").

Modules: the script (``gcra.lua``, package data) and its protocol (``_script``),
connections (``_connection``), the circuit breaker (``_breaker``), the engine that runs
the script (``_engine``), permits, reservations and leases (``_permits``), and the
limiter, keyed limiter and policy (``_limiter``, ``_keyed``, ``_policy``).

Key names: ``{prefix}:{{tag}}:{name}:{i}`` for rate ``i`` of a limiter (``tag``
defaults to ``name``), ``{prefix}:{{tag}}:{name}:{key}`` for a keyed limiter (``tag``
defaults to the key, spreading keys over a cluster), and for a policy the same names
with the policy's tag (default: its name) so that all keys of one policy share a Redis
Cluster slot and one script can touch them all. A key is written with its kind, so that
keys are told apart as locally: ``s:<utf-8>`` (str), ``b:<bytes>`` (bytes), ``i:<decimal>``
(int, bool, numpy integer).

Leases (``RedisLimiter(..., lease=0.05)``): a process takes a slice of each rate's
burst from Redis in one call and serves it from a local Rust bucket (``rq.Limiter``),
then gives back the unused part that is still ahead. Over any window of length ``d``
the units admitted by all processes stay within ``burst + rate * d + N * L`` (``N``
processes holding leases of at most ``L`` units); over a run that starts from a full
bucket they stay within ``burst + rate * d``.

Failures: ``on_failure="fail_closed"`` (refuse; the default), ``"fail_open"`` (admit)
or ``"local"`` (decide on a local ``rq.Limiter`` at ``local_fraction`` of the rate).
A :class:`CircuitBreaker` stops calling a dead or slow Redis: after a failure, calls
take the failure path at once until ``retry_interval`` has passed, then one call probes
Redis; so a dead server costs at most one timeout per interval. Give the client short
timeouts and no retries (see :func:`connect`).

The quota ledger in Redis (``RedisLedger``, ``ratequeue.redis.ledger``; also importable
from ``ratequeue.ledger``): ``ledger.lua`` and its client (``_ledger_core``: the script,
keys and drivers; ``_ledger``: the calls; ``_ledger_codec``: encodings).

Test clocks: ``clock=rq.ManualClock()`` makes the scripts decide at that clock's time
(passed to the script, in microseconds) instead of ``TIME``; it is meant for tests that
compare Redis with the core call by call.
"""

from ._args import Key
from ._breaker import CircuitBreaker
from ._connection import connect, connect_async
from ._engine import OnFailure, RedisUnavailable
from ._keyed import AsyncRedisKeyedLimiter, RedisKeyedLimiter
from ._ledger import RedisLedger
from ._limiter import AsyncRedisLimiter, RedisLimiter
from ._permits import RedisPermit, RedisReservation
from ._policy import AsyncRedisPolicy, PolicyLevel, RedisPolicy
from ._script import GCRA_LUA, GCRA_SHA

__all__ = [
    "GCRA_LUA",
    "GCRA_SHA",
    "AsyncRedisKeyedLimiter",
    "AsyncRedisLimiter",
    "AsyncRedisPolicy",
    "CircuitBreaker",
    "Key",
    "OnFailure",
    "PolicyLevel",
    "RedisKeyedLimiter",
    "RedisLedger",
    "RedisLimiter",
    "RedisPermit",
    "RedisPolicy",
    "RedisReservation",
    "RedisUnavailable",
    "connect",
    "connect_async",
]

for _obj in (
    AsyncRedisKeyedLimiter,
    AsyncRedisLimiter,
    AsyncRedisPolicy,
    CircuitBreaker,
    RedisKeyedLimiter,
    RedisLedger,
    RedisLimiter,
    RedisPermit,
    RedisPolicy,
    RedisReservation,
    RedisUnavailable,
    connect,
    connect_async,
):
    _obj.__module__ = __name__
del _obj
