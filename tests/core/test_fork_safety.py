"""Fork safety under load, the GIL rule, driver recovery and forks from other threads.

- The core's locks are taken and released in pthread_atfork handlers (no Python runs
  while they are held for a fork), so a fork from any thread, while other threads use
  queues, keyed maps, policies and ``run_until``, never hangs the parent and never
  leaves the child a lock held forever.
- The driver thread recovers from a failed spawn, a panic in a wake and its own death.
- A child forked from a non-main thread checks Ctrl-C in its (new) main thread, and
  starts with every permit free: permits of threads that do not exist in it would
  otherwise leak forever (a pre-fork permit released in the child gives nothing back).

Each child reports through its exit code (and a traceback on a pipe); the parent kills a
child that hangs, the failure holding its Python and native stacks (tests/forking.py).
``RATEQUEUE_FORK_STRESS_RUNS`` repeats the stress test (``make stress-fork`` runs it 200
times).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time
import traceback

import numpy as np
import pytest
import ratequeue as rq
from forking import check_child, fork_child
from ratequeue import _ratequeue

pytestmark = [
    pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork (POSIX)"),
    pytest.mark.filterwarnings("ignore:.*fork.*:DeprecationWarning"),
]

CHILD_TIMEOUT = 20
STRESS_RUNS = int(os.environ.get("RATEQUEUE_FORK_STRESS_RUNS", "1"))


def check(result):
    check_child(result, CHILD_TIMEOUT)


class Objects:
    """One of each lockable thing, with high rates so that waits stay short."""

    def __init__(self):
        self.limiter = rq.Limiter(
            rq.Rate(2000, per="second", burst=4),
            rq.Rate(200_000, per="second", burst=400, unit="tokens"),
            max_wait=5,
        )
        self.single = rq.Limiter(rq.Rate(5000, per="second", burst=2))
        self.keyed = rq.KeyedLimiter(rq.Rate(1000, per="second", burst=3), max_keys=50_000)
        self.keyed_conc = rq.KeyedConcurrency(2)
        self.conc = rq.Concurrency(3)
        self.policy = rq.Policy(
            {"rate": rq.Limiter(rq.Rate(3000, per="second", burst=5)), "conc": rq.Concurrency(2)}
        )
        self.clock = rq.ManualClock()
        self.virtual = rq.Limiter(rq.Rate(100, per="second", burst=1), clock=self.clock)
        self.virtual_keyed = rq.KeyedLimiter(rq.Rate(100, per="second", burst=1), clock=self.clock)
        self.keys = np.arange(20_000, dtype=np.uint64)


def use(acquire, hold=0.0):
    """``with acquire():`` for ``hold`` seconds; a refusal or a timeout is fine here."""
    try:
        with acquire():
            time.sleep(hold)
    except (rq.WaitTimeout, rq.Overloaded):
        pass


def hammer(objs: Objects, which: int, stop: threading.Event, errors: list) -> None:
    rng = random.Random(which)
    try:
        while not stop.is_set():
            kind = which % 7
            if kind == 0:
                use(lambda: objs.limiter.acquire(tokens=rng.randint(1, 50), timeout=0.2))
                objs.limiter.try_acquire(tokens=3)
            elif kind == 1:
                # Many keys at once, the GIL released inside.
                objs.keyed.try_acquire_many(objs.keys[rng.randrange(0, 10_000) :])
                use(lambda: objs.keyed.acquire(rng.randrange(5), timeout=0.2))
            elif kind == 2:
                use(lambda: objs.keyed_conc.acquire(rng.randrange(3), timeout=0.2), 0.0005)
            elif kind == 3:
                use(lambda: objs.conc.acquire(timeout=0.2), 0.0005)
                use(lambda: objs.single.acquire(timeout=0.2))
            elif kind == 4:
                use(lambda: objs.policy.acquire(timeout=0.2), 0.0002)
                p = objs.policy.try_acquire()
                if p is not None:
                    p.release()
            elif kind == 5:
                # Virtual time: run_until (GIL released) while others submit.
                ch = _ratequeue.Channel()
                for _ in range(5):
                    with contextlib.suppress(rq.Overloaded):
                        objs.virtual.submit(ch, timeout=1)
                # Another thread may move the shared clock past `until` meanwhile.
                with contextlib.suppress(ValueError):
                    objs.virtual.run_until(objs.clock.now() + 0.05)
                objs.virtual_keyed.try_acquire(rng.randrange(50))
                with contextlib.suppress(ValueError):
                    objs.virtual_keyed.run_until(objs.clock.now() + 0.05)
                ch.drain()
            else:

                async def waits():
                    for _ in range(5):
                        with contextlib.suppress(rq.WaitTimeout, rq.Overloaded):
                            async with objs.single.acquire_async(timeout=0.2):
                                pass

                asyncio.run(waits())
    except BaseException:
        errors.append(traceback.format_exc())


def use_everything(objs: Objects) -> None:
    """In a child: every object works and nothing waits forever."""
    with objs.limiter.acquire(tokens=10, timeout=5):
        pass
    assert objs.single.acquire(timeout=5)
    out = objs.keyed.try_acquire_many(np.arange(100_000, 100_500, dtype=np.uint64))
    assert out.all()
    with objs.keyed.acquire("child", timeout=5):
        pass
    for _ in range(2):
        # Every permit is free in the child (their holders are not here).
        with objs.keyed_conc.acquire(1, timeout=5), objs.keyed_conc.acquire(1, timeout=5):
            pass
        with (
            objs.conc.acquire(timeout=5),
            objs.conc.acquire(timeout=5),
            objs.conc.acquire(timeout=5),
        ):
            pass
    with objs.policy.acquire(timeout=5):
        pass
    objs.virtual.run_until(objs.clock.now() + 1)
    assert objs.virtual.waiting == 0
    objs.virtual_keyed.run_until(objs.clock.now() + 1)
    assert objs.virtual_keyed.try_acquire("fresh")

    async def waits():
        for _ in range(3):
            async with objs.single.acquire_async(timeout=5):
                pass

    asyncio.run(waits())


@pytest.mark.timeout(300)
@pytest.mark.parametrize("run", range(STRESS_RUNS))
def test_fork_stress_from_many_threads_while_others_hammer_every_lock(run):
    objs = Objects()
    stop = threading.Event()
    errors: list[str] = []
    workers = [
        threading.Thread(target=hammer, args=(objs, i, stop, errors), daemon=True)
        for i in range(14)
    ]
    for t in workers:
        t.start()
    results = []
    lock = threading.Lock()

    def forker(n):
        for _ in range(n):
            time.sleep(random.random() * 0.01)
            r = fork_child(lambda: use_everything(objs), CHILD_TIMEOUT)
            with lock:
                results.append(r)

    try:
        time.sleep(0.1)
        forkers = [threading.Thread(target=forker, args=(12,), daemon=True) for _ in range(3)]
        for t in forkers:
            t.start()
        forker(14)  # and from the main thread
        for t in forkers:
            t.join(120)
            assert not t.is_alive(), "a forking thread hung"
    finally:
        stop.set()
        for t in workers:
            t.join(30)
    assert not any(t.is_alive() for t in workers), "a worker hung in the parent"
    assert not errors, errors[0]
    assert len(results) == 50
    for r in results:
        check(r)


def test_fork_while_a_thread_holds_a_shard_lock_waits_for_it():
    # A thread inside the keyed map (its shard locks held) while another thread forks:
    # the fork waits for the lock, so the child never finds it held by a thread that
    # does not exist there.
    keyed = rq.KeyedLimiter(rq.Rate(10, per="second", burst=5))
    keyed.try_acquire("k")
    holder = threading.Thread(target=_ratequeue._hold_locks_for_test, args=(keyed, 0.5))
    holder.start()
    time.sleep(0.1)
    t0 = time.monotonic()
    check(fork_child(lambda: keyed.try_acquire("k") or sys.exit(3), CHILD_TIMEOUT))
    assert time.monotonic() - t0 >= 0.3
    holder.join()


def test_fork_while_a_thread_holds_a_queue_lock_waits_for_it():
    lim = rq.Limiter(rq.Rate(2, per="second", burst=1), rq.Rate(100, per="second", unit="tokens"))
    holder = threading.Thread(target=_ratequeue._hold_locks_for_test, args=(lim, 0.5))
    holder.start()
    time.sleep(0.1)

    def child():
        with lim.acquire(tokens=1, timeout=5):
            pass
        assert lim.try_acquire(tokens=1) in (True, False)
        lim.poll()

    check(fork_child(child, CHILD_TIMEOUT))
    holder.join()


def _keyed_case():
    keyed = rq.KeyedLimiter(rq.Rate(1000, per="second", burst=5))
    return keyed, [lambda i=i: keyed.try_acquire(i) for i in range(4)]


def _queue_case():
    lim = rq.Limiter(rq.Rate(1000, per="second", burst=5), rq.Rate(10**6, unit="tokens"))
    return lim, [
        lambda: lim.poll(),
        lambda: lim.predicted_wait(tokens=1),
        lambda: lim.acquire(tokens=1, timeout=5).release(),
        lambda: lim.stats(),
    ]


@pytest.mark.parametrize("case", [_keyed_case, _queue_case], ids=["keyed", "queue"])
def test_a_thread_waiting_for_a_core_lock_never_holds_the_gil(case):
    # While one thread holds an object's core locks (GIL released), others that need
    # them wait without the GIL: the main thread keeps running Python meanwhile.
    obj, calls = case()
    holder = threading.Thread(target=_ratequeue._hold_locks_for_test, args=(obj, 0.8))
    holder.start()
    time.sleep(0.05)
    blocked = [threading.Thread(target=c, daemon=True) for c in calls]
    for t in blocked:
        t.start()
    t0 = last = time.monotonic()
    longest = 0.0
    while holder.is_alive():
        time.sleep(0.001)
        now = time.monotonic()
        longest, last = max(longest, now - last), now
    # The GIL kept moving while the others waited for the lock (held ~0.75 s more).
    assert last - t0 > 0.5
    assert longest < 0.35, f"the main thread could not run for {longest:.3f} s"
    holder.join()
    for t in blocked:
        t.join(5)
        assert not t.is_alive()


def _ctrl_c_stops_the_wait(lim):
    """In a forked child: it runs on the main thread, and a Ctrl-C 0.2 s into a wait a
    minute long stops it and leaves no waiter. Ctrl-C is handled as Python's default does
    whatever the child inherited (a test process started with SIGINT ignored passes that
    on); only the main thread may set a handler: this is it."""
    assert threading.current_thread() is threading.main_thread()
    signal.signal(signal.SIGINT, signal.default_int_handler)
    threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGINT)).start()
    t0 = time.monotonic()
    try:
        lim.acquire()  # a minute away: only Ctrl-C ends it
    except KeyboardInterrupt:
        pass
    else:
        raise AssertionError("granted?")
    assert time.monotonic() - t0 < 5
    assert lim.waiting == 0


@pytest.mark.parametrize("inherited", ["handled", "ignored"])
def test_child_forked_from_another_thread_has_its_main_thread_and_ctrl_c(inherited):
    # The child inherits the test process's SIGINT disposition, which is not the test's
    # to assume: pytest started as a background job of a non-interactive shell (`pytest &`,
    # as under some CI runners and agents) starts with SIGINT ignored, and so does every
    # child it forks (which then rightly ignores Ctrl-C). Both are given here; the child
    # installs the handler it tests.
    lim = rq.Limiter(rq.Rate(1, per="minute", burst=1))
    assert lim.try_acquire()
    # The parent's main thread waits once (whatever it caches about "main" is warm).
    warm = rq.Limiter(rq.Rate(50, per="second", burst=1))
    warm.try_acquire()
    warm.acquire(timeout=1)

    out = []
    t = threading.Thread(
        target=lambda: out.append(fork_child(lambda: _ctrl_c_stops_the_wait(lim), CHILD_TIMEOUT))
    )
    given = signal.default_int_handler if inherited == "handled" else signal.SIG_IGN
    old = signal.signal(signal.SIGINT, given)
    try:
        t.start()
        t.join(CHILD_TIMEOUT + 90)  # its timeout, then its stacks if it hangs
    finally:
        signal.signal(signal.SIGINT, old)
    assert out
    check(out[0])


def test_a_thread_that_waited_before_forking_is_the_childs_main_thread_for_ctrl_c():
    # The forking thread waits first, found not to be the main thread (an answer a
    # blocked acquire may remember); in the child it is the main thread, and Ctrl-C
    # must stop its wait there.
    lim = rq.Limiter(rq.Rate(1, per="minute", burst=1))
    assert lim.try_acquire()
    warm = rq.Limiter(rq.Rate(50, per="second", burst=1))

    out = []

    def forker():
        warm.try_acquire()
        assert warm.acquire(timeout=1).waited > 0  # queued: the thread was checked
        out.append(fork_child(lambda: _ctrl_c_stops_the_wait(lim), CHILD_TIMEOUT))

    t = threading.Thread(target=forker)
    t.start()
    t.join(CHILD_TIMEOUT + 10)
    assert out
    check(out[0])


def test_child_forked_from_another_thread_starts_with_every_permit_free():
    conc = rq.Concurrency(3)
    kconc = rq.KeyedConcurrency(1)
    release = threading.Event()
    holding = threading.Barrier(3)

    def hold():
        with conc.acquire(), kconc.acquire("k"):
            holding.wait()
            release.wait()

    holder = threading.Thread(target=hold)
    holder.start()

    def child():
        assert conc.in_use == 0
        assert kconc.in_use("k") == 0
        # A permit from before the fork gives nothing back here (never below zero).
        assert mine[0].release()
        assert conc.in_use == 0
        got = [conc.try_acquire() for _ in range(4)]
        assert [g is not None for g in got] == [True, True, True, False]
        assert (_held1 := kconc.try_acquire("k")) is not None
        assert kconc.try_acquire("k") is None

    out = []
    mine = []

    def forker():
        mine.append(conc.acquire())  # held by the forking thread itself
        holding.wait()
        out.append(fork_child(child, CHILD_TIMEOUT))

    f = threading.Thread(target=forker)
    f.start()
    holding.wait()
    f.join(CHILD_TIMEOUT + 10)
    release.set()
    holder.join()
    check(out[0])
    # The parent still counts its own holders.
    assert conc.in_use == 1
    mine[0].release()
    assert conc.in_use == 0
    assert kconc.in_use("k") == 0


DRIVER_SCRIPT = textwrap.dedent(
    """
    import asyncio, threading, time
    import ratequeue as rq
    from ratequeue import _ratequeue as core

    lim = rq.Limiter(rq.Rate(10, per="second", burst=1))

    def waits_in_thread(in_loop=False, **kw):
        # The thread empties the bucket itself just before it acquires, so its acquire
        # queues however late the thread starts (a loaded machine). A blocked thread
        # times its own grant; a deadline, or an event loop's wait, needs the driver.
        out = []
        async def in_a_loop():
            async with lim.acquire_async(**kw) as permit:
                out.append("granted" if permit.waited > 0 else "not queued")
        def run():
            try:
                lim.try_acquire()
                if in_loop:
                    asyncio.run(in_a_loop())
                    return
                with lim.acquire(**kw) as permit:
                    out.append("granted" if permit.waited > 0 else "not queued")
            except Exception as e:
                out.append(e)
        t = threading.Thread(target=run, daemon=True)
        t.start()
        t.join(30)
        assert not t.is_alive(), "hung"
        return out[0]

    # A driver that cannot start: a blocked thread needs none; a wait that needs one is
    # refused at once with a clear error, never left to hang; the next wait starts it.
    core._driver_fault_for_test("fail_spawn", 1)
    assert waits_in_thread() == "granted"
    for kw in ({"timeout": 5}, {"in_loop": True}):
        core._driver_fault_for_test("fail_spawn", 1)
        e = waits_in_thread(**kw)
        assert isinstance(e, rq.Overloaded) and "driver" in str(e), repr(e)
        assert lim.waiting == 0
    assert waits_in_thread(in_loop=True) == "granted"

    # A panic in a wake: the driver survives it and serves the waiter anyway.
    core._driver_fault_for_test("panic_wake", 1)
    got = waits_in_thread(in_loop=True)
    assert got == "granted", got

    # The driver thread dies: a new one serves what was scheduled.
    core._driver_fault_for_test("exit", 1)
    for kw in ({"in_loop": True}, {"in_loop": True}, {"timeout": 5}):
        got = waits_in_thread(**kw)
        assert got == "granted", (kw, got)  # what it was, should it fail again (stop 41)
    print("ok")
    """
)


def test_driver_recovers_from_a_failed_spawn_a_panicking_wake_and_its_death():
    r = subprocess.run(
        [sys.executable, "-c", DRIVER_SCRIPT], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stdout + r.stderr


def _busy_policy() -> tuple[rq.Policy, rq.Concurrency, object]:
    """A Policy over a Concurrency(1) whose permit is taken: acquires queue there."""
    slots = rq.Concurrency(1)
    policy = rq.Policy({"slots": slots, "api": rq.Limiter(rq.Rate(1000, per="second"))})
    return policy, slots, slots.try_acquire()


def test_fork_while_a_policy_acquire_holds_its_lock_waits_for_it():
    # A thread inside a policy acquire (its lock held) while another thread forks: the
    # fork waits for it, so the child can still give that acquire back (an asyncio
    # acquire stays reachable there) instead of hanging on a lock nobody will release.
    policy, _slots, held = _busy_policy()
    acq = policy.acquire_async(timeout=5)
    holder = threading.Thread(target=_ratequeue._hold_locks_for_test, args=(acq, 0.5))
    holder.start()
    time.sleep(0.1)
    t0 = time.monotonic()

    def child():
        _ratequeue._wait_cancel(acq, 0)
        held.release()
        with policy.acquire(timeout=2):
            pass

    check_child(fork_child(child, 5), 5)
    assert time.monotonic() - t0 >= 0.3
    holder.join()


def test_fork_while_policy_acquires_wait_in_threads_and_a_loop():
    # Blocking and asyncio policy acquires queued on a concurrency level (and one being
    # granted in between) in other threads; a fork meanwhile gives a child where the
    # policy still works and the parent's acquires all end with every permit back.
    policy, slots, held = _busy_policy()
    stop = threading.Event()
    errors: list[BaseException] = []

    def blocking():
        try:
            while not stop.is_set():
                with contextlib.suppress(rq.WaitTimeout), policy.acquire(timeout=0.02):
                    pass
        except BaseException as e:
            errors.append(e)

    def in_loop():
        async def waits():
            while not stop.is_set():
                with contextlib.suppress(rq.WaitTimeout):
                    async with policy.acquire_async(timeout=0.02):
                        await asyncio.sleep(0)

        try:
            asyncio.run(waits())
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=f) for f in (blocking, blocking, in_loop, in_loop)]
    for t in threads:
        t.start()
    try:
        for i in range(6):
            time.sleep(0.05)
            if i == 3:
                held.release()

            def child():
                with policy.acquire(timeout=5):
                    pass

                async def one():
                    async with policy.acquire_async(timeout=5):
                        pass

                asyncio.run(one())

            check_child(fork_child(child, 10), 10)
    finally:
        stop.set()
        for t in threads:
            t.join(10)
    assert not errors, errors
    assert all(not t.is_alive() for t in threads)
    assert (_held2 := slots.try_acquire()) is not None
