"""Review of issue 10 (c5000b4, b7026bc): a policy's overage owed in a level's queue.

A policy debit settled up while a reservation is promised a time on its level owes the
overage in that level's queue; settled back down, it must cancel what it owes, not refund
the unit it used while the overage stays owed (a waiter then shares its slot).
"""

from __future__ import annotations

import pytest
import ratequeue as rq
from ratequeue._ratequeue import Channel


def test_a_policy_settled_up_then_back_down_never_lets_a_waiter_share_its_slot() -> None:
    clock = rq.ManualClock()
    lim = rq.Limiter(rq.Rate(10, burst=1), clock=clock)
    policy = rq.Policy({"api": lim})
    p = policy.try_acquire()  # its unit at 0 s
    assert p is not None
    ch = Channel()
    ticket = lim.submit(ch)  # due at 0.1 s
    assert isinstance(ticket, int)
    r = lim.reserve()
    assert r.delay == pytest.approx(0.2)
    p.settle(requests=2)  # one unit owed behind the reservation
    p.settle(requests=1)  # back to the estimate
    lim.run_until(0.25)
    waited = {t: w / 1e9 for t, ok, w in ch.drain() if ok}
    assert waited == {ticket: pytest.approx(0.1)}, "the waiter shared the policy's slot at 0 s"
    assert lim.stats()["waiting"] == 0
