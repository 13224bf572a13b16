"""Per-key waiting in virtual time: run_until on a ManualClock grants each key's queue."""

from __future__ import annotations

import threading
import time

import ratequeue as rq


def _wait_for(pred, limit=5.0):
    end = time.monotonic() + limit
    while not pred() and time.monotonic() < end:
        time.sleep(0.001)
    assert pred()


def test_keyed_waiters_granted_in_schedule_time_by_run_until():
    clock = rq.ManualClock()
    kl = rq.KeyedLimiter(rq.Rate(2, per="second", burst=1), clock=clock)
    assert kl.try_acquire("a")
    assert kl.try_acquire("b")
    waited: dict[str, list[float]] = {"a": [], "b": []}

    def wait(key: str) -> None:
        waited[key].append(kl.acquire(key).waited)

    threads = [threading.Thread(target=wait, args=(k,)) for k in ("a", "a", "b")]
    for t in threads:
        t.start()
    # all three queued (a key's gate exists a moment before its waiter is in the queue;
    # retry_after counts the queued waiters)
    _wait_for(lambda: kl.retry_after("a") > 1.4 and kl.retry_after("b") > 0.9)
    assert kl.run_until(2.0) >= 2
    for t in threads:
        t.join(5)
    assert sorted(waited["a"]) == [0.5, 1.0]
    assert waited["b"] == [0.5]
    assert kl.stats()["waiting_keys"] == 0


def test_keyed_concurrency_deadline_expires_on_the_manual_clock():
    clock = rq.ManualClock()
    kc = rq.KeyedConcurrency(1, clock=clock)
    held = kc.try_acquire("t")
    assert held is not None
    errors: list[BaseException] = []

    def wait() -> None:
        try:
            kc.acquire("t", timeout=1.0)
        except rq.WaitTimeout as e:
            errors.append(e)

    th = threading.Thread(target=wait)
    th.start()
    _wait_for(lambda: kc.stats()["waiting_keys"] == 1)
    # the gate can exist a moment before its waiter is queued (dated at the clock's time
    # then): move the clock on until the timeout fires, within a bounded real time
    end = time.monotonic() + 10
    t = 0.0
    while th.is_alive() and time.monotonic() < end:
        t += 2.0
        kc.run_until(t)
        th.join(0.01)
    assert len(errors) == 1
    held.release()
    assert kc.in_use("t") == 0
