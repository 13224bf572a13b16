"""A keyed permit's settle goes through its key's queue, as a Limiter permit's does:
an overage charged while a reservation is promised a time on that key waits behind
the promise (history checker, threads mode: seed 415, two grants at one instant on a
key with burst 1)."""

from __future__ import annotations

import threading
import time

import ratequeue as rq

NS = 1_000_000_000


def _until(cond, what: str) -> None:
    deadline = time.monotonic() + 10
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.005)


def test_a_keyed_settle_overage_never_moves_a_waiter_onto_a_promised_reservation():
    clock = rq.ManualClock()
    klim = rq.KeyedLimiter(rq.Rate(5, per="second", burst=1), clock=clock)
    pol = rq.Policy({"klim": klim})
    p1 = klim.acquire("k0")  # at 0
    pol.reserve(klim="k0")  # at 0.2
    out: dict[str, object] = {}
    w = threading.Thread(target=lambda: out.setdefault("w", klim.acquire("k0", timeout=5)))
    w.start()
    _until(lambda: klim.retry_after("k0") >= 0.6 - 1e-9, "the waiter queued (due at 0.4)")
    p = threading.Thread(target=lambda: out.setdefault("p", pol.acquire(klim="k0", timeout=5)))
    p.start()
    _until(lambda: klim.retry_after("k0") >= 0.8 - 1e-9, "the policy queued (promised 0.6)")
    p1.settle(requests=0)
    p1.settle(requests=1)
    p1.release()
    _until(lambda: bool(klim.run_until(clock.now() + 0.05) or True) and len(out) == 2, "grants")
    w.join(5)
    p.join(5)
    times = sorted([out["w"].granted_at_ns, out["p"].granted_at_ns])  # type: ignore[attr-defined]
    assert times[1] - times[0] >= 0.2 * NS - 2, [t / NS for t in times]
    assert out["p"].granted_at_ns == round(0.6 * NS)  # type: ignore[attr-defined]
