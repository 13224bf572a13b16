"""Levels (DESIGN.md, "Levels"): user quota -> tenant concurrency -> cluster bucket.

Checked and debited all or nothing (under real thread contention, on a frozen
ManualClock, every level's consumed capacity must equal exactly what the admitted
requests cost); a refusal names its level; shadow levels are counted, never enforced;
``reserve`` waits for the latest level (exact numbers on a ManualClock); ``acquire`` and
``acquire_async`` wait in concurrency queues (real clock, wide tolerances) and give
everything back on errors and cancellation. Also the arithmetic of ``settle`` at its
edges (refund capped at the burst, debt repaid by time) on Limiter, KeyedLimiter and
Policy permits.
"""

from __future__ import annotations

import asyncio
import random
import sys
import threading
import time
from collections import Counter

import numpy as np
import pytest
import ratequeue as rq
from hypothesis import given
from hypothesis import strategies as st


async def awaited(awaitable):
    """PolicyAcquire / Acquiring are awaitables, not coroutines: wrap for create_task."""
    return await awaitable


def three_levels(clock, *, user_burst=2, tenant_tokens=1_000, cluster_burst=10):
    user = rq.KeyedLimiter(rq.Rate(2, per="second", burst=user_burst), clock=clock, name="user")
    tenant = rq.KeyedLimiter(
        rq.Rate(1_000, per="second", burst=tenant_tokens, unit="tokens"), clock=clock
    )
    cluster = rq.Limiter(
        rq.Rate(10, per="second", burst=cluster_burst),
        rq.Rate(2_000, per="second", burst=2_000, unit="tokens"),
        clock=clock,
    )
    return user, tenant, cluster


# ---------------------------------------------------------------------------------------
# all or nothing


def test_all_or_nothing_under_thread_contention():
    """Six threads hammer Policy.try_acquire while two more hammer the user level's map
    directly with numpy batches (the GIL released, so the Rust map is really contended),
    with the GIL handed over as often as possible. Nothing refills (frozen clock): at
    the end every level's consumed capacity must be exactly what was admitted on it."""
    clock = rq.ManualClock()
    user = rq.KeyedLimiter(rq.Rate(1, per="hour", burst=300), clock=clock)
    tenant = rq.KeyedLimiter(rq.Rate(1, per="hour", burst=9_000, unit="tokens"), clock=clock)
    slots = rq.KeyedConcurrency(2)
    cluster = rq.Limiter(
        rq.Rate(1, per="hour", burst=150),  # the cluster runs out too
        rq.Rate(1, per="hour", burst=12_000, unit="tokens"),
        clock=clock,
    )
    policy = rq.Policy({"user": user, "tenant": tenant, "slots": slots, "cluster": cluster})
    users = [1, 2, 3, 4, 5, 6]  # int keys: the same buckets as uint64 batch keys
    tenants = ["acme", "globex", "initech", "hooli"]
    # initech's slots are taken for the whole run: its requests pass user and tenant,
    # then are refused on slots, so those debits must be undone
    blockers = [slots.try_acquire("initech") for _ in range(2)]
    # acme has spent most of its tokens already; hooli all of them: its requests pass
    # the user level, then are refused on the tenant level
    assert tenant.try_acquire("acme", 4_000)
    assert tenant.try_acquire("hooli", 9_000)
    # user 0 is spent before the run, so the user level refuses (and the levels behind
    # it are never touched) whatever the schedule: the hot user 1 may run out only
    # after every policy worker has finished
    assert user.try_acquire(0, 300)
    lock = threading.Lock()
    admitted = []
    by_batch = Counter()
    refused_batch = Counter()
    n_policy, n_batch, attempts = 6, 2, 500
    barrier = threading.Barrier(n_policy + n_batch)

    def policy_worker(seed):
        rng = random.Random(seed)
        mine = []
        held = None
        barrier.wait()
        for _ in range(attempts):
            r = rng.random()
            u = 0 if r < 0.05 else 1 if r < 0.35 else rng.choice(users[1:])
            t = rng.choices(tenants, weights=(6, 2, 1, 1))[0]
            tokens = rng.randrange(1, 90)
            p = policy.try_acquire(user=u, tenant=t, slots=t, tokens=tokens)
            if held is not None and rng.random() < 0.3:
                held.release()
                held = None
            if p is not None:
                mine.append((u, t, tokens))
                if held is None:
                    held = p  # keep a tenant slot for a while: others are refused on it
                else:
                    p.release()
        if held is not None:
            held.release()
        with lock:
            admitted.extend(mine)

    def batch_worker(seed):
        rng = np.random.default_rng(seed)
        got, refused = Counter(), Counter()
        barrier.wait()
        for _ in range(150):
            keys = rng.choice(np.array([1, 1, 1, 2], dtype=np.uint64), size=16)
            ok = user.try_acquire_many(keys)
            for k in keys[ok]:
                got[int(k)] += 1
            for k in keys[~ok]:
                refused[int(k)] += 1
        with lock:
            by_batch.update(got)
            refused_batch.update(refused)

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=policy_worker, args=(s,)) for s in range(n_policy)]
        threads += [threading.Thread(target=batch_worker, args=(s,)) for s in range(n_batch)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    finally:
        sys.setswitchinterval(old)
    assert not any(t.is_alive() for t in threads)

    per_user = Counter(u for u, _, _ in admitted)
    per_tenant = Counter()
    for _, t, tokens in admitted:
        per_tenant[t] += tokens
    for u in users:
        assert 300 - user.available(u) == per_user[u] + by_batch[u], u
    # the hot user ran out during the run (at the end a policy's undo, after the batches
    # finished, may have given its last unit back)
    assert refused_batch[1] > 0
    assert per_tenant["initech"] == per_tenant["hooli"] == 0
    for p in blockers:
        p.release()
    for t in tenants:
        spent = {"acme": 4_000, "hooli": 9_000}.get(t, 0)
        assert 9_000 - tenant.available(t) == per_tenant[t] + spent, t
        assert slots.in_use(t) == 0
    assert 150 - cluster.available() == len(admitted) == 150
    assert 12_000 - cluster.available("tokens") == sum(per_tenant.values())
    stats = policy.stats()
    assert stats["admitted"] == len(admitted)
    refused = {name: v["refused"] for name, v in stats["levels"].items()}
    assert stats["admitted"] + sum(refused.values()) == n_policy * attempts
    # every level refused something, so undo ran behind every level
    assert all(n > 0 for n in refused.values()), refused
    assert len(slots) == 0


def test_refusal_on_a_later_level_leaves_earlier_levels_untouched():
    clock = rq.ManualClock()
    user, tenant, cluster = three_levels(clock)
    policy = rq.Policy({"user": user, "tenant": tenant, "cluster": cluster})
    assert cluster.try_acquire(tokens=1_950)
    # the cluster has 50 tokens: refused there, after user and tenant were debited
    assert policy.try_acquire(user="u", tenant="t", tokens=100) is None
    assert user.available("u") == 2.0
    assert tenant.available("t") == 1_000.0
    assert cluster.available() == 9.0
    assert cluster.available("tokens") == 50.0
    s = policy.stats()
    assert s["admitted"] == 0
    assert s["levels"]["cluster"]["refused"] == 1
    permit = policy.try_acquire(user="u", tenant="t", tokens=50)
    assert permit is not None
    assert permit.delay == 0.0
    assert user.available("u") == 1.0
    assert tenant.available("t") == 950.0
    assert cluster.available("tokens") == 0.0


def test_refusal_names_the_level():
    clock = rq.ManualClock()
    user, tenant, cluster = three_levels(clock)
    slots = rq.Concurrency(1)
    policy = rq.Policy({"user": user, "tenant": tenant, "slots": slots, "cluster": cluster})
    assert user.try_acquire("u", 2)
    with pytest.raises(rq.Overloaded, match='level "user"') as e:
        policy.reserve(user="u", tenant="t", tokens=10, max_wait=0.1)
    assert e.value.retry_after > 0
    assert tenant.try_acquire("t2", 1_000)
    with pytest.raises(rq.Overloaded, match='level "tenant"'):
        policy.reserve(user="v", tenant="t2", tokens=10, max_wait=0)
    held = policy.try_acquire(user="w", tenant="t3", tokens=1)
    with pytest.raises(rq.Overloaded, match='level "slots"'):
        policy.reserve(user="x", tenant="t3", tokens=1)
    held.release()
    assert cluster.try_acquire(9, tokens=0)
    with pytest.raises(rq.Overloaded, match='level "cluster"'):
        policy.reserve(user="y", tenant="t4", tokens=1, max_wait=0.01)
    levels = policy.stats()["levels"]
    assert [levels[n]["refused"] for n in ("user", "tenant", "slots", "cluster")] == [1, 1, 1, 1]
    with pytest.raises(rq.CostTooLarge, match='"tenant"'):
        policy.try_acquire(user="z", tenant="t5", tokens=1_001)
    assert user.available("z") == 2.0
    assert slots.in_use == 0


def test_arguments():
    clock = rq.ManualClock()
    user, tenant, cluster = three_levels(clock)
    policy = rq.Policy({"user": user, "tenant": tenant, "cluster": cluster})
    assert policy.levels == ["user", "tenant", "cluster"]
    with pytest.raises(TypeError, match="tokens"):
        policy.try_acquire(user="u", tenant="t")  # tokens have no default
    with pytest.raises(TypeError, match="tenant"):
        policy.try_acquire(user="u", tokens=1)
    with pytest.raises(TypeError, match="bogus"):
        policy.try_acquire(user="u", tenant="t", tokens=1, bogus=1)
    with pytest.raises(TypeError):
        policy.try_acquire(user=1.5, tenant="t", tokens=1)
    with pytest.raises((TypeError, ValueError)):
        policy.try_acquire(user="u", tenant="t", tokens=-1)
    with pytest.raises(ValueError):
        rq.Policy({"user": user}, shadow=["nope"])
    with pytest.raises(TypeError):
        rq.Policy({"user": user}, shadow="user")
    with pytest.raises(TypeError):
        rq.Policy({"user": object()})
    with pytest.raises(ValueError):
        rq.Policy({})
    # nothing was debited by the bad calls
    assert user.available("u") == 2.0
    assert cluster.available() == 10.0


# ---------------------------------------------------------------------------------------
# shadow levels


def test_shadow_level_counts_but_never_enforces():
    clock = rq.ManualClock()
    user, tenant, cluster = three_levels(clock)
    policy = rq.Policy({"user": user, "tenant": tenant, "cluster": cluster}, shadow=("user",))
    got = [policy.try_acquire(user="u", tenant="t", tokens=10) for _ in range(6)]
    assert all(p is not None for p in got)
    s = policy.stats()
    assert s["admitted"] == 6
    assert s["levels"]["user"] == {"refused": 0, "shadow_refused": 4, "shadow": True}
    assert s["levels"]["tenant"]["shadow"] is False
    assert user.available("u") == 0.0  # debited while it admitted, never past empty
    assert cluster.available() == 4.0
    assert tenant.available("t") == 940.0
    # a shadow level's slowness does not delay a reservation
    assert policy.reserve(user="u", tenant="t", tokens=10).delay == 0.0
    # a shadow concurrency level does not refuse either
    slots = rq.Concurrency(1)
    p2 = rq.Policy({"slots": slots, "cluster": cluster}, shadow=["slots"])
    a = p2.try_acquire(tokens=0)
    b = p2.try_acquire(tokens=0)
    assert a is not None
    assert b is not None
    assert p2.stats()["levels"]["slots"]["shadow_refused"] == 1
    a.release()
    b.release()
    assert slots.in_use == 0


def test_shadow_refusals_are_counted_by_reserve_and_acquire():
    clock = rq.ManualClock()
    user, _tenant, cluster = three_levels(clock)
    policy = rq.Policy({"user": user, "cluster": cluster}, shadow=["user"])
    for _ in range(3):
        policy.reserve(user="u", tokens=1)
    for _ in range(2):
        policy.acquire(user="u", tokens=1)
    assert policy.stats()["levels"]["user"]["shadow_refused"] == 3


# ---------------------------------------------------------------------------------------
# reserve: one grant time, the latest any level needs


def test_reserve_waits_for_the_latest_level_exact():
    clock = rq.ManualClock()
    user, tenant, cluster = three_levels(clock)
    policy = rq.Policy({"user": user, "tenant": tenant, "cluster": cluster})
    assert user.try_acquire("u", 2)  # next request in 0.5 s
    assert tenant.try_acquire("t", 900)  # 300 tokens in 0.2 s
    assert cluster.try_acquire(10, tokens=1_900)  # 1 request in 0.1 s, 300 tokens in 0.1 s
    delays = {
        "user": user.retry_after("u"),
        "tenant": tenant.retry_after("t", 300),
        "cluster": cluster.retry_after(tokens=300),
    }
    assert delays == {"user": 0.5, "tenant": 0.2, "cluster": 0.1}
    # refused beyond max_wait, holding nothing
    with pytest.raises(rq.Overloaded, match='"user"'):
        policy.reserve(user="u", tenant="t", tokens=300, max_wait=0.49)
    assert user.available("u") == 0.0
    assert tenant.available("t") == 100.0
    assert cluster.available("tokens") == 100.0

    permit = policy.reserve(user="u", tenant="t", tokens=300, max_wait=0.5)
    assert permit.delay == max(delays.values()) == 0.5
    # all levels are debited for one grant at t = 0.5
    assert user.available("u") == -1.0
    clock.advance(0.5)
    assert user.available("u") == 0.0
    assert tenant.available("t") == 300.0  # 0.9 + 0.3 s of tokens, seen at 0.5
    assert cluster.available() == 4.0
    assert cluster.available("tokens") == 800.0
    # Policy.acquire on a ManualClock: no sleep, the delay tells the wait
    t0 = time.monotonic()
    p2 = policy.acquire(user="u", tenant="t", tokens=1)
    assert time.monotonic() - t0 < 0.5
    assert p2.delay == 0.5


@given(
    steps=st.lists(
        st.tuples(
            st.sampled_from(["a", "b"]),  # user
            st.sampled_from(["x", "y"]),  # tenant
            st.integers(0, 1_000),  # tokens
            st.integers(0, 400),  # advance, ms
        ),
        min_size=1,
        max_size=25,
    )
)
def test_reserve_delay_is_the_max_of_the_levels(steps):
    clock = rq.ManualClock()
    user, tenant, cluster = three_levels(clock)
    policy = rq.Policy({"user": user, "tenant": tenant, "cluster": cluster})
    for u, t, tokens, adv in steps:
        clock.advance(adv / 1000)
        want = max(
            user.retry_after(u),
            tenant.retry_after(t, tokens),
            cluster.retry_after(tokens=tokens),
        )
        before = (user.available(u), tenant.available(t), cluster.available())
        if want > 1.0:
            with pytest.raises(rq.Overloaded):
                policy.reserve(user=u, tenant=t, tokens=tokens, max_wait=1.0)
            assert (user.available(u), tenant.available(t), cluster.available()) == before
            continue
        permit = policy.reserve(user=u, tenant=t, tokens=tokens, max_wait=1.0)
        assert permit.delay == want
        # the slowest level is debited exactly its cost at the grant time
        assert user.available(u) <= before[0] - 1
        assert cluster.available() <= before[2] - 1


def test_reserve_needs_concurrency_free_now_and_cancel_gives_back():
    clock = rq.ManualClock()
    user, _tenant, cluster = three_levels(clock)
    slots = rq.KeyedConcurrency(1)
    policy = rq.Policy({"user": user, "slots": slots, "cluster": cluster})
    assert user.try_acquire("u", 2)
    permit = policy.reserve(user="u", slots="acme", tokens=0)
    assert permit.delay == 0.5
    assert slots.in_use("acme") == 1
    with pytest.raises(rq.Overloaded, match='"slots"'):
        policy.reserve(user="v", slots="acme", tokens=0)
    assert user.available("v") == 2.0
    permit.cancel()
    assert permit.released
    assert slots.in_use("acme") == 0
    assert user.available("u") == 0.0  # the reservation was undone
    assert cluster.available() == 10.0
    permit.cancel()  # idempotent
    assert cluster.available() == 10.0
    # release keeps rate capacity used, returns the slot
    p = policy.reserve(user="v", slots="acme", tokens=0)
    assert p.release()
    assert not p.release()
    assert slots.in_use("acme") == 0
    assert user.available("v") == 1.0


# ---------------------------------------------------------------------------------------
# acquire on the real clock (wide tolerances)


def test_acquire_waits_in_concurrency_queue_and_releases_on_exit_and_errors():
    slots = rq.Concurrency(1)
    tenant = rq.KeyedConcurrency(2)
    cluster = rq.Limiter(rq.Rate(1_000, per="second", burst=1_000))
    policy = rq.Policy({"tenant": tenant, "slots": slots, "cluster": cluster})
    inside = []
    lock = threading.Lock()
    peak = [0]

    def worker():
        for _ in range(5):
            with policy.acquire(tenant="acme", timeout=10):
                with lock:
                    inside.append(1)
                    peak[0] = max(peak[0], len(inside))
                time.sleep(0.002)
                with lock:
                    inside.pop()

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert peak[0] == 1
    assert slots.in_use == 0
    assert tenant.in_use("acme") == 0
    assert policy.stats()["admitted"] == 20

    with pytest.raises(KeyError), policy.acquire(tenant="acme"):
        assert slots.in_use == 1
        raise KeyError
    assert slots.in_use == 0
    assert tenant.in_use("acme") == 0


def test_acquire_timeout_gives_back_everything():
    slots = rq.Concurrency(1)
    cluster = rq.Limiter(rq.Rate(1, per="hour", burst=10))
    policy = rq.Policy({"slots": slots, "cluster": cluster})
    held = policy.acquire()
    before = cluster.available()
    t0 = time.monotonic()
    with pytest.raises((rq.WaitTimeout, rq.Overloaded)):
        policy.acquire(timeout=0.03)
    assert 0.02 < time.monotonic() - t0 < 1.0
    assert slots.in_use == 1
    assert slots.waiting == 0
    assert cluster.available() == pytest.approx(before, abs=1e-3)
    threading.Timer(0.03, held.release).start()
    t0 = time.monotonic()
    with policy.acquire(timeout=2) as p:
        assert 0.01 < p.delay < 1.0
    assert slots.in_use == 0
    # a rate level too slow for the timeout: refused at once, nothing kept
    slow = rq.Limiter(rq.Rate(1, per="hour", burst=1))
    p2 = rq.Policy({"slots": slots, "slow": slow})
    p2.acquire().release()
    t0 = time.monotonic()
    with pytest.raises(rq.Overloaded, match='"slow"'):
        p2.acquire(timeout=0.5)
    assert time.monotonic() - t0 < 0.3
    assert slots.in_use == 0


def test_acquire_sleeps_for_the_latest_rate_level():
    user = rq.KeyedLimiter(rq.Rate(20, per="second", burst=1))
    cluster = rq.Limiter(rq.Rate(1_000, per="second"))
    policy = rq.Policy({"user": user, "cluster": cluster})
    t0 = time.monotonic()
    for _ in range(6):
        policy.acquire(user="u")
    elapsed = time.monotonic() - t0
    assert 0.2 <= elapsed < 1.5  # 5 x 50 ms


def test_acquire_async_and_async_with():
    async def main():
        slots = rq.Concurrency(2)
        user = rq.KeyedLimiter(rq.Rate(50, per="second", burst=1))
        cluster = rq.Limiter(rq.Rate(1_000, per="second"))
        policy = rq.Policy({"user": user, "slots": slots, "cluster": cluster})
        peak = 0

        async def one(u):
            nonlocal peak
            async with policy.acquire_async(user=u, timeout=5) as permit:
                peak = max(peak, slots.in_use)
                await asyncio.sleep(0.005)
                return permit

        t0 = time.monotonic()
        permits = await asyncio.gather(*(one(u) for u in ("a", "b", "c") for _ in range(4)))
        elapsed = time.monotonic() - t0
        assert peak <= 2
        assert slots.in_use == 0
        assert all(p.released for p in permits)
        assert 0.04 <= elapsed < 2.0  # 3 x 20 ms per user at least

        permit = await policy.acquire_async(user="d")
        assert slots.in_use == 1
        permit.release()
        assert slots.in_use == 0

        with pytest.raises(ZeroDivisionError):
            async with policy.acquire_async(user="e"):
                _ = 1 / 0
        assert slots.in_use == 0
        return policy

    policy = asyncio.run(main())
    assert policy.stats()["admitted"] == 14


def test_asyncio_cancellation_gives_everything_back():
    async def main():
        slots = rq.Concurrency(1)
        tenant = rq.KeyedConcurrency(1)
        cluster = rq.Limiter(rq.Rate(1, per="hour", burst=2))
        policy = rq.Policy({"tenant": tenant, "slots": slots, "cluster": cluster})

        # 1) cancelled while queued for a concurrency level
        held = policy.try_acquire(tenant="acme")
        assert held is not None
        task = asyncio.create_task(awaited(policy.acquire_async(tenant="acme")))
        await asyncio.sleep(0.02)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert tenant.in_use("acme") == 1
        assert slots.in_use == 1
        held.release()
        assert (tenant.in_use("acme"), slots.in_use) == (0, 0)
        assert cluster.available() == pytest.approx(1.0, abs=1e-3)

        # 2) cancelled while sleeping for the rate level (concurrency already held)
        assert cluster.try_acquire()  # empty: the next grant is an hour away
        task = asyncio.create_task(awaited(policy.acquire_async(tenant="acme")))
        await asyncio.sleep(0.02)
        assert slots.in_use == 1
        assert tenant.in_use("acme") == 1
        assert cluster.available() == pytest.approx(-1.0, abs=1e-3)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert (tenant.in_use("acme"), slots.in_use) == (0, 0)
        assert cluster.available() == pytest.approx(0.0, abs=1e-3)

        # 3) a timeout too short for the rate level: Overloaded, nothing held
        with pytest.raises(rq.Overloaded):
            await policy.acquire_async(tenant="acme", timeout=0.05)
        assert (tenant.in_use("acme"), slots.in_use) == (0, 0)
        assert cluster.available() == pytest.approx(0.0, abs=1e-3)
        assert len(tenant) == 0

    asyncio.run(main())


# ---------------------------------------------------------------------------------------
# settle


def test_limiter_permit_settle_refund_capped_at_burst():
    clock = rq.ManualClock()
    lim = rq.Limiter(rq.Rate(10, per="second", burst=10, unit="tokens"), clock=clock)
    p = lim.acquire(tokens=8)
    assert p.costs == {"tokens": 8}
    assert lim.available() == 2.0
    p.settle(tokens=3)
    assert lim.available() == 7.0
    assert p.costs == {"tokens": 3}
    clock.advance(0.5)  # 5 refilled: full
    p.settle(tokens=0)  # a refund of 3 on a full bucket changes nothing
    assert lim.available() == 10.0
    # no hidden credit: exactly the burst, then nothing
    assert lim.try_acquire(tokens=10)
    assert not lim.try_acquire(tokens=1)
    with pytest.raises(TypeError):
        p.settle(requests=1)


def test_limiter_permit_settle_overage_is_debt_repaid_by_time():
    clock = rq.ManualClock()
    lim = rq.Limiter(rq.Rate(10, per="second", burst=10, unit="tokens"), clock=clock)
    p = lim.acquire(tokens=5)
    p.settle(tokens=25)  # 20 more than estimated: 15 below empty
    assert lim.available() == -15.0
    assert lim.retry_after(tokens=1) == pytest.approx(1.6)
    assert not lim.try_acquire(tokens=1)
    clock.advance(1.5)  # debt / rate
    assert lim.available() == 0.0
    assert not lim.try_acquire(tokens=1)
    clock.advance(0.1)
    assert lim.try_acquire(tokens=1)
    clock.advance(1.1)
    assert lim.available() == 10.0


def test_keyed_permit_settle():
    clock = rq.ManualClock()
    kl = rq.KeyedLimiter(rq.Rate(100, per="second", burst=100, unit="tokens"), clock=clock)
    p = kl.acquire("k", 60)
    assert p.costs == {"tokens": 60}
    assert kl.available("k") == 40.0
    p.settle(tokens=10)  # refund 50
    assert kl.available("k") == 90.0
    p.settle(tokens=0)  # refund 10 more: full, never beyond
    assert kl.available("k") == 100.0
    clock.advance(1)
    p.settle(tokens=300)  # charge 300 on a full bucket: 200 of debt
    assert kl.available("k") == -200.0
    assert kl.available("other") == 100.0
    assert kl.retry_after("k", 1) == pytest.approx(2.01)
    clock.advance(2.0)
    assert kl.available("k") == 0.0
    clock.advance(1.0)
    assert kl.available("k") == 100.0
    assert kl.try_acquire("k", 100)
    assert not kl.try_acquire("k", 1)
    with pytest.raises(TypeError):
        p.settle(requests=3)


def test_policy_permit_settle():
    clock = rq.ManualClock()
    user, tenant, cluster = three_levels(clock)
    slots = rq.Concurrency(1)
    policy = rq.Policy({"user": user, "tenant": tenant, "slots": slots, "cluster": cluster})
    p = policy.try_acquire(user="u", tenant="t", tokens=700)
    assert tenant.available("t") == 300.0
    assert cluster.available("tokens") == 1_300.0
    p.settle(tokens=200)  # refund 500 on every level counting tokens, not requests
    assert tenant.available("t") == 800.0
    assert cluster.available("tokens") == 1_800.0
    assert cluster.available() == 9.0
    assert user.available("u") == 1.0
    p.settle(tokens=0)  # refund 200 more: tenant full, cluster full, never past
    assert tenant.available("t") == 1_000.0
    assert cluster.available("tokens") == 2_000.0
    p.settle(tokens=2_500)  # charge 2500: tenant 1500 in debt, cluster 500 in debt
    assert tenant.available("t") == -1_500.0
    assert cluster.available("tokens") == -500.0
    assert policy.try_acquire(user="v", tenant="t2", tokens=1) is None  # cluster in debt
    clock.advance(0.25)  # cluster: 500 / 2000 per s
    assert cluster.available("tokens") == 0.0
    assert tenant.available("t") == -1_250.0
    clock.advance(1.25)  # tenant: 1500 / 1000 per s in all
    assert tenant.available("t") == 0.0
    # 1.5 s later user and cluster requests are full again; charge 2 more requests
    p.settle(requests=3)
    assert user.available("u") == 0.0
    assert cluster.available() == 8.0
    with pytest.raises(TypeError):
        p.settle(bogus=1)
    assert slots.in_use == 1
    p.release()
    assert slots.in_use == 0


def test_cancel_after_settle_gives_back_the_settled_cost():
    clock = rq.ManualClock()
    kl = rq.KeyedLimiter(rq.Rate(100, per="second", burst=1_000, unit="tokens"), clock=clock)
    lim = rq.Limiter(rq.Rate(100, per="second", burst=1_000, unit="tokens"), clock=clock)
    policy = rq.Policy({"user": kl, "cluster": lim})
    p = policy.try_acquire(user="u", tokens=100)
    p.settle(tokens=500)
    assert kl.available("u") == lim.available() == 500.0
    p.cancel()
    assert lim.available() == 1_000.0
    assert kl.available("u") == 1_000.0  # 600.0: only the estimate came back


def test_policy_does_not_barge_past_a_keyed_waiter():
    clock = rq.ManualClock()
    kl = rq.KeyedLimiter(rq.Rate(10, per="second", burst=2), clock=clock)
    policy = rq.Policy({"user": kl})
    assert kl.try_acquire("k", 2)
    waiter = threading.Thread(target=kl.acquire, args=("k", 2))
    waiter.start()
    end = time.monotonic() + 10  # queued: retry_after counts it
    while kl.retry_after("k") < 0.3 and time.monotonic() < end:
        time.sleep(0.001)
    try:
        clock.advance(0.13)  # one unit refilled; the waiter (cost 2) is due at 0.2 s
        assert not kl.try_acquire("k", 1)
        assert policy.try_acquire(user="k") is None
    finally:
        kl.run_until(1.0)
        waiter.join(10)


def test_a_permit_dropped_unreleased_gives_its_concurrency_slots_back() -> None:
    """Found in stop 42: a PolicyPermit lost before anyone could release it (a Ctrl-C as
    ``acquire`` returned it to the LLM transport) kept its concurrency slot for good. Now
    its slots go back when it is dropped; its rate capacity stays used; a permit released
    first gives nothing back twice."""
    import gc

    clock = rq.ManualClock()
    rate = rq.Limiter(rq.Rate(10, per="minute", burst=10), clock=clock)
    policy = rq.Policy({"conc": rq.Concurrency(1), "rate": rate})
    p = policy.try_acquire()
    assert p is not None and policy.try_acquire() is None
    del p
    gc.collect()
    q = policy.try_acquire()
    assert q is not None  # the slot came back
    assert rate.available() == 8  # the rate capacity of both stays used
    assert q.release() and not q.release()
    del q
    gc.collect()
    r1 = policy.try_acquire()
    assert r1 is not None and policy.try_acquire() is None  # one slot, not two
