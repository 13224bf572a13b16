"""A forked child whose Limiter queue missed the fork handlers (a test hook: as a queue
made behind their back would) inherits its parent's waiters and, when a parent thread
held it at the fork, a queue lock nobody will release. The fast path drops inherited
waiters under that lock; with the GIL held it must never wait for it (real fork)."""

from __future__ import annotations

import threading
import time

import ratequeue as rq
from forking import check_child, fork_child
from ratequeue import _ratequeue

TIMEOUT = 20


def test_fast_path_in_a_child_never_waits_for_an_inherited_queue_lock():
    lim = rq.Limiter(rq.Rate(1, per="second", burst=1))
    assert lim.try_acquire() is True
    _ratequeue._skip_fork_handlers_for_test(lim)
    waiter = threading.Thread(target=lambda: lim.acquire().release())
    waiter.start()
    deadline = time.monotonic() + 10
    while lim.waiting != 1:
        assert time.monotonic() < deadline, "the waiter never queued"
        time.sleep(0.005)
    holder = threading.Thread(target=_ratequeue._hold_locks_for_test, args=(lim, 2.0))
    holder.start()
    time.sleep(0.3)  # the holder has the queue's lock: the child inherits it held

    def child() -> None:
        # The parent's waiter is not here and the lock is never released: both calls
        # answer at once (the waiter still counted: nobody passes it), never hang.
        assert lim.try_acquire() is False
        assert lim.try_acquire(1) is False
        assert lim.waiting == 1

    check_child(fork_child(child, TIMEOUT), TIMEOUT)
    holder.join()
    waiter.join(timeout=30)
    assert not waiter.is_alive(), "the parent's waiter was never granted"
    assert lim.waiting == 0
