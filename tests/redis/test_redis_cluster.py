"""A real three-node Redis Cluster: a policy's keys share one slot, keyed limits spread
over the nodes, the script is loaded on every primary."""

from __future__ import annotations

import ratequeue as rq
from ratequeue.redis import GCRA_SHA, RedisKeyedLimiter, RedisLimiter, RedisPolicy
from redis.cluster import RedisCluster


def test_policy_in_one_slot_on_a_cluster(cluster: RedisCluster) -> None:
    p = RedisPolicy(
        cluster,
        {
            "user": rq.KeyedLimiter(rq.Rate(2, per=1)),
            "tenant": rq.KeyedLimiter(rq.Rate(10, per=1)),
            "cluster": rq.Limiter(rq.Rate(100, per=1), rq.Rate(1000, per=1, unit="tokens")),
        },
        name="api",
    )
    got = [p.try_acquire(user="a", tenant="t", tokens=10) is not None for _ in range(3)]
    assert got == [True, True, False]
    res = p.reserve(user="b", tenant="t", tokens=10, max_wait=1)
    assert res.delay == 0
    assert cluster.keyslot("rq:{api}:user:a") == cluster.keyslot("rq:{api}:cluster:1")


def test_keyed_limits_spread_over_nodes(cluster: RedisCluster) -> None:
    users = RedisKeyedLimiter(cluster, rq.Rate(1, per=60), name="user")
    keys = [f"u{i}" for i in range(30)]
    assert all(users.try_acquire(k) for k in keys)
    assert not any(users.try_acquire(k) for k in keys)
    nodes = {cluster.get_node_from_key(users.key(k)).name for k in keys}
    assert len(nodes) == 3


def test_noscript_on_a_cluster(cluster: RedisCluster) -> None:
    # one unit an hour: a slow (loaded) flush refills nothing before the refusal
    lim = RedisLimiter(cluster, rq.Rate(1, per="hour", burst=2), name="ns")
    assert lim.try_acquire()
    cluster.script_flush()
    assert lim.try_acquire()
    assert not lim.try_acquire()
    assert all(cluster.script_exists(GCRA_SHA))
    assert 3500 < lim.retry_after() <= 3600
