"""Review of the Policy queue change (issue 10): what a policy acquire holds while it
waits, and in which order it waits for its concurrency levels."""

from __future__ import annotations

import asyncio
import threading

import pytest
import ratequeue as rq
from history import NS, History, Req


def crossed() -> tuple[rq.Concurrency, rq.Concurrency, rq.Policy, rq.Policy]:
    """Two Concurrency(1) limits and two policies naming them in opposite orders."""
    a, b = rq.Concurrency(1), rq.Concurrency(1)
    return a, b, rq.Policy({"a": a, "b": b}), rq.Policy({"b": b, "a": a})


def test_policies_over_the_same_limits_in_opposite_orders_never_deadlock_async() -> None:
    # Each held one limit while waiting for the other: both waited until their timeouts.
    a, b, p1, p2 = crossed()

    async def main() -> list[str]:
        ha, hb = a.try_acquire(), b.try_acquire()
        assert ha is not None and hb is not None
        done: list[str] = []

        async def use(name: str, p: rq.Policy) -> None:
            async with p.acquire_async(timeout=3):
                await asyncio.sleep(0.01)
            done.append(name)

        tasks = [asyncio.create_task(use("p1", p1)), asyncio.create_task(use("p2", p2))]
        await asyncio.sleep(0.05)
        ha.release()
        await asyncio.sleep(0.05)
        hb.release()
        await asyncio.gather(*tasks)
        return done

    assert sorted(asyncio.run(main())) == ["p1", "p2"]
    assert a.try_acquire() is not None and b.try_acquire() is not None


def test_policies_over_the_same_limits_in_opposite_orders_never_deadlock_threads() -> None:
    a, b, p1, p2 = crossed()
    errors: list[BaseException] = []

    def use(p: rq.Policy) -> None:
        try:
            for _ in range(30):
                with p.acquire(timeout=3):
                    pass
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=use, args=(p,)) for p in (p1, p2, p1, p2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads)
    assert not errors, errors
    assert a.try_acquire() is not None and b.try_acquire() is not None


@pytest.mark.parametrize("keyed", [False, True])
def test_one_wait_order_for_keyed_and_shared_levels(keyed: bool) -> None:
    # The same with a keyed level: the order counts the key too.
    k = rq.KeyedConcurrency(1)
    s = rq.Concurrency(1)
    p1, p2 = rq.Policy({"k": k, "s": s}), rq.Policy({"s": s, "k": k})

    async def main() -> int:
        hk, hs = k.try_acquire("u"), s.try_acquire()
        assert hk is not None and hs is not None

        async def use(p: rq.Policy) -> None:
            async with p.acquire_async(timeout=3, k="u"):
                await asyncio.sleep(0.01)

        tasks = [asyncio.create_task(use(p)) for p in (p1, p2)]
        await asyncio.sleep(0.05)
        (hs if keyed else hk).release()
        await asyncio.sleep(0.05)
        (hk if keyed else hs).release()
        await asyncio.gather(*tasks)
        return len(tasks)

    assert asyncio.run(main()) == 2


# ---------------------------------------------------------------------------------------
# the history checker's rules for policy shares and partial refunds (histories by hand)


def _history() -> History:
    h = History(1)
    h.oplog.append("#0 synthetic")
    return h


def _grant(h: History, level: str, arrival: int, at: int, op: int = 0, kind: str = "try") -> Req:
    t0 = round(h.start * NS)
    key = "k" if h.levels[level].kind == "krate" else None
    q = h.new_req(
        level, key, None, [1] * max(1, len(h.levels[level].rates)), kind, op, t0 + arrival
    )
    h.granted(q, t0 + at)
    return q


def _policy_share(h: History, arrival: int, at: int) -> list[Req]:
    """A policy request's shares on both rate levels, held for one common time."""
    qs = [_grant(h, n, arrival, at, op=7, kind="policy_acquire") for n in ("lim", "klim")]
    for q in qs:
        q.shared = True
    return qs


def test_checker_lets_a_later_arrival_pass_a_policy_share_where_another_level_set_its_time() -> (
    None
):
    h = _history()
    _policy_share(h, 0, 5 * NS)
    _grant(h, "lim", 1, 2 * NS)  # "lim" could serve sooner: "klim" set the time
    h.check_order()
    assert h.violations == []


def test_checker_finds_a_policy_share_passed_on_every_rate_level() -> None:
    h = _history()
    _policy_share(h, 0, 5 * NS)
    _grant(h, "lim", 1, 2 * NS)
    _grant(h, "klim", 1, 2 * NS)  # then no level set its time: held late for nothing
    h.check_order()
    assert [v.kind for v in h.violations] == ["order"]
    assert "every rate level" in h.violations[0].message


def test_checker_orders_arrivals_before_a_partial_refund_behind_the_request() -> None:
    h = _history()
    q = _grant(h, "lim", 0, 5 * NS, kind="reserve")
    q.lead_until_seq = next(h.seq)  # settled in part here
    _grant(h, "lim", 2, 1 * NS)  # after the settle: may take what it freed
    h.check_order()
    assert h.violations == []
    h = _history()
    _grant(h, "lim", 0, 5 * NS, kind="reserve").lead_until_seq = 10**9
    _grant(h, "lim", 1, 1 * NS)  # before its settle: barging
    h.check_order()
    assert [v.kind for v in h.violations] == ["order"]
