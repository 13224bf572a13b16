"""A response stream dropped unclosed (a ``break`` out of an SDK stream, the response
garbage-collected without ``close()``): no end and no close will come, so the transport
settles the call as a close would (from what was read; a Policy's concurrency slot, the
ledger hold and the budget sub-call given back), in a thread of its own woken by the drop
(settling in the finalizer could take a lock the interrupted code holds)."""

from __future__ import annotations

import asyncio
import gc
import importlib
import json
import logging
import os
import threading
from typing import Any

import pytest
import ratequeue as rq
from background_helpers import hanging
from ratequeue.httpx import CallBudget, RateLimitedTransport, _unclosed

pytestmark = pytest.mark.timeout(60)

MODS = ["httpx", "httpx2"]
CHAT = "http://p/v1/chat/completions"
BODY = {"model": "m", "max_tokens": 100, "messages": [{"role": "user", "content": "hi"}]}
USAGE = {"prompt_tokens": 5, "completion_tokens": 7}


def _sse(*events: dict[str, Any]) -> bytes:
    return b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events)


def provider(mod: Any, kind: str = "sse") -> Any:
    """Answers every call with a stream of two chunks (an event stream whose usage is in
    its last; chunked JSON; a file's content), not read yet."""
    if kind == "sse":
        chunks = [_sse({"choices": []}), _sse({"choices": [], "usage": USAGE})]
        headers = {"content-type": "text/event-stream"}
    elif kind == "json":
        whole = json.dumps({"choices": [], "usage": USAGE}).encode()
        chunks, headers = [whole[:9], whole[9:]], {"content-type": "application/json"}
    else:
        chunks, headers = [b"abc", b"def"], {"content-type": "application/octet-stream"}

    class Stream(mod.SyncByteStream, mod.AsyncByteStream):  # type: ignore[misc]
        def __iter__(self) -> Any:
            yield from chunks

        async def __aiter__(self) -> Any:
            for c in chunks:
                yield c

    return lambda request: mod.Response(200, headers=headers, stream=Stream())


def limiter() -> rq.Limiter:
    return rq.Limiter(
        rq.Rate(1000, per="second", burst=1000),
        rq.Rate(100_000, per="minute", burst=100_000, unit="tokens"),
        clock=rq.ManualClock(),
    )


def policy_transport(mod: Any, kind: str = "sse", **kw: Any) -> RateLimitedTransport:
    """A transport over a Policy of one concurrency slot."""
    lim = limiter()
    policy = rq.Policy({"conc": rq.Concurrency(1), "cluster": lim})
    kw.setdefault("timeout", 0.0)
    return RateLimitedTransport(
        mod.MockTransport(provider(mod, kind)),
        policy,
        upstream=lim,
        units=["requests", "tokens"],
        **kw,
    )


def settled_dropped() -> None:
    """Every stream dropped so far is settled (the finisher passed them all)."""
    gc.collect()
    assert _unclosed.DROPPED.flush(timeout=10)


def open_and_drop(client: Any, url: str = CHAT) -> Any:
    """A call's stream read up to its first chunk, then dropped unclosed: its record."""
    r = client.send(client.build_request("POST", url, json=BODY), stream=True)
    chunks = r.iter_raw()
    next(chunks)
    record = r.extensions["ratequeue"]
    assert not record.settled
    del r, chunks
    return record


@pytest.mark.parametrize("modname", MODS)
@pytest.mark.parametrize("native", [True, False])
def test_a_dropped_event_stream_gives_its_concurrency_slot_back(modname: str, native: bool) -> None:
    mod = importlib.import_module(modname)
    t = policy_transport(mod)
    if not native:
        t._native_stream = False
    client = mod.Client(transport=t)
    first = open_and_drop(client)
    settled_dropped()
    assert first.settled and first.usage is None  # cut before its usage: the estimate
    with client.stream("POST", CHAT, json=BODY) as r:  # the slot is free again
        r.read()
    assert r.extensions["ratequeue"].usage == (5, 7)
    # httpx2's iterator closes its response when it is dropped (a ``finally``).
    assert t.stats()["unclosed"] == (modname == "httpx")


@pytest.mark.parametrize("modname", MODS)
def test_a_waiter_for_the_slot_is_let_in_when_the_stream_is_dropped(modname: str) -> None:
    """No other call needs to come: the drop itself wakes the settle."""
    mod = importlib.import_module(modname)
    t = policy_transport(mod, timeout=20.0)
    client = mod.Client(transport=t)
    r = client.send(client.build_request("POST", CHAT, json=BODY), stream=True)
    chunks = r.iter_raw()
    next(chunks)
    got: list[Any] = []

    def second() -> None:
        with client.stream("POST", CHAT, json=BODY) as resp:
            resp.read()
            got.append(resp.extensions["ratequeue"])

    th = threading.Thread(target=second)
    th.start()
    th.join(0.2)
    assert th.is_alive()  # waiting for the slot
    del r, chunks
    gc.collect()
    th.join(15)
    assert not th.is_alive() and got and got[0].usage == (5, 7)


@pytest.mark.parametrize("modname", MODS)
def test_a_dropped_file_content_stream_gives_its_slot_back(modname: str) -> None:
    """A tokenless call's body passed on unread: its slot is held until the body ends or
    is dropped."""
    mod = importlib.import_module(modname)
    t = policy_transport(mod, "file")
    client = mod.Client(transport=t)
    req = client.build_request("GET", "http://p/v1/files/file-1/content")
    r = client.send(req, stream=True)
    next(r.iter_raw())
    del r
    settled_dropped()
    assert client.get("http://p/v1/files/file-1/content").status_code == 200


@pytest.mark.parametrize("modname", MODS)
def test_a_dropped_chunked_json_body_is_settled_at_its_estimate(modname: str) -> None:
    """The native reader (a Limiter, a JSON body without a length): settled as a body
    cut short, its estimate kept."""
    mod = importlib.import_module(modname)
    lim = limiter()
    t = RateLimitedTransport(mod.MockTransport(provider(mod, "json")), lim, timeout=0.0)
    client = mod.Client(transport=t)
    record = open_and_drop(client)
    settled_dropped()
    assert record.settled and record.usage is None
    est = record.estimate.input_tokens + record.estimate.output_tokens
    assert lim.available("tokens") == 100_000 - est


class Ledger:
    def __init__(self, fail: bool = False) -> None:
        self.held: dict[str, Any] = {}
        self.settled: dict[str, Any] = {}
        self.fail = fail

    def hold(self, request_id: str, account: str, **kw: Any) -> None:
        self.held[request_id] = kw

    def settle(self, request_id: str, **kw: Any) -> None:
        if self.fail:
            self.fail = False
            raise RuntimeError("ledger down")
        assert request_id in self.held and request_id not in self.settled
        self.settled[request_id] = kw

    def release(self, request_id: str) -> None:
        self.settled[request_id] = None


@pytest.mark.parametrize("modname", MODS)
def test_a_dropped_stream_settles_its_ledger_hold_and_budget_sub_call(modname: str) -> None:
    mod = importlib.import_module(modname)
    ledger = Ledger()
    t = policy_transport(mod, ledger=ledger)
    client = mod.Client(transport=t)
    with CallBudget(calls=5) as budget:
        record = open_and_drop(client)
    settled_dropped()
    assert record.settled
    assert set(ledger.settled) == set(ledger.held) == {record.request_id}
    assert ledger.settled[record.request_id]["output_tokens"] == record.estimate.output_tokens
    assert all(s.settled for s in budget.usage)


def test_a_settle_that_fails_is_logged_and_the_next_is_settled(
    caplog: pytest.LogCaptureFixture,
) -> None:
    mod = importlib.import_module("httpx")
    ledger = Ledger(fail=True)
    t = policy_transport(mod, ledger=ledger)
    client = mod.Client(transport=t)
    with caplog.at_level(logging.ERROR, logger="ratequeue.httpx"):
        first = open_and_drop(client)
        settled_dropped()
    assert first.settled and "failed to pay its ledger part" in caplog.text
    second = open_and_drop(client)  # the slot came back all the same
    settled_dropped()
    assert second.settled and second.request_id in ledger.settled


@pytest.mark.parametrize("modname", MODS)
def test_asyncio_a_dropped_stream_is_settled_and_pays_its_ledger(modname: str) -> None:
    mod = importlib.import_module(modname)
    ledger = Ledger()
    t = policy_transport(mod, ledger=ledger)

    async def main() -> Any:
        async with mod.AsyncClient(transport=t) as client:
            req = client.build_request("POST", CHAT, json=BODY)
            r = await client.send(req, stream=True)
            chunks = r.aiter_raw()
            await chunks.__anext__()
            record = r.extensions["ratequeue"]
            del r, chunks
            # The loop closes each async iterator it finalizes in a task of its own,
            # one layer after the other.
            for _ in range(50):
                await asyncio.sleep(0)
                settled_dropped()
                if record.settled:
                    break
            assert record.settled and record.request_id in ledger.settled
            r2 = await client.post(CHAT, json=BODY)  # the slot is free again
            return r2.extensions["ratequeue"]

    assert asyncio.run(main()).usage == (5, 7)


def test_a_stream_closed_or_read_to_its_end_is_not_settled_again() -> None:
    mod = importlib.import_module("httpx")
    ledger = Ledger()
    t = policy_transport(mod, ledger=ledger)
    client = mod.Client(transport=t)
    with client.stream("POST", CHAT, json=BODY) as r:
        r.read()
    r2 = client.send(client.build_request("POST", CHAT, json=BODY), stream=True)
    next(r2.iter_raw())
    r2.close()
    del r, r2
    settled_dropped()
    assert t.stats()["unclosed"] == 0 and len(ledger.settled) == 2


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork")
def test_a_forked_child_settles_its_own_dropped_streams() -> None:
    """The child makes its own finisher (the parent's thread does not exist there)."""
    mod = importlib.import_module("httpx")
    t = policy_transport(mod)
    client = mod.Client(transport=t)
    open_and_drop(client)
    settled_dropped()  # the parent's finisher runs
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            open_and_drop(client)
            settled_dropped()
            client.post(CHAT, json=BODY)
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


@pytest.mark.parametrize("modname", MODS)
def test_close_settles_the_streams_dropped_before_it(modname: str) -> None:
    mod = importlib.import_module(modname)
    ledger = Ledger()
    t = policy_transport(mod, ledger=ledger)
    client = mod.Client(transport=t)
    record = open_and_drop(client)
    gc.collect()
    client.close()
    assert record.settled and record.request_id in ledger.settled


@pytest.mark.parametrize("modname", MODS)
def test_aclose_settles_the_streams_dropped_before_it(modname: str) -> None:
    mod = importlib.import_module(modname)
    ledger = Ledger()
    t = policy_transport(mod, ledger=ledger)
    records: list[Any] = []

    async def main() -> None:
        client = mod.AsyncClient(transport=t)
        r = await client.send(client.build_request("POST", CHAT, json=BODY), stream=True)
        records.append(r.extensions["ratequeue"])
        # Its stream's iterator never made: dropped with the response, in this thread.
        del r
        gc.collect()
        await client.aclose()

    asyncio.run(main())
    assert records[0].settled and records[0].request_id in ledger.settled


def test_flush_from_the_settling_thread_returns_at_once() -> None:
    """A settle that flushes (a ledger closing its transport, say) does not wait for
    itself."""
    got: list[bool] = []
    _unclosed.DROPPED.put(_Calls(lambda: got.append(_unclosed.DROPPED.flush(10))))
    assert _unclosed.DROPPED.flush(10) and got == [False]


def test_the_settling_thread_outlives_what_a_settle_raises() -> None:
    def boom() -> None:
        raise RuntimeError("boom")

    bad = _Calls(boom)
    del bad.call  # not even a call to name
    _unclosed.DROPPED.put(bad)
    assert _unclosed.DROPPED.flush(10)
    got: list[int] = []
    _unclosed.DROPPED.put(_Calls(lambda: got.append(1)))
    assert _unclosed.DROPPED.flush(10) and got == [1]


class _Calls:
    """A stand-in reader whose finish runs ``fn``."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn
        self.finished = False
        self.transport = self
        self.call = self
        self._owed = None
        self.request_id = "x"
        self._unclosed = _unclosed.Unclosed()
        self._unclosed.add(self)

    def finish(self) -> None:
        self.fn()

    def _count(self, name: str) -> None:
        pass


class Locked(Ledger):
    """Settles under ``lock`` (waiting at most 5 s for it: a settle in the thread that
    holds it fails instead of hanging)."""

    def __init__(self, lock: Any) -> None:
        super().__init__()
        self.lock = lock

    def settle(self, request_id: str, **kw: Any) -> None:
        assert self.lock.acquire(timeout=5), "settled inside the lock's holder"
        try:
            super().settle(request_id, **kw)
        finally:
            self.lock.release()


def drop_in_a_cycle(client: Any) -> Any:
    """A call's stream read up to its first chunk, its iterator then dropped in a
    reference cycle (a collection finalizes it): its record."""
    r = client.send(client.build_request("POST", CHAT, json=BODY), stream=True)
    cycle: list[Any] = [r.iter_raw()]
    next(cycle[0])
    cycle.append(cycle)
    record = r.extensions["ratequeue"]
    del r, cycle
    return record


def test_a_close_from_a_collected_iterator_settles_in_the_settling_thread() -> None:
    """httpx2's iterators close their response in a ``finally``: an iterator in a
    reference cycle is finalized by the garbage collector, which may run inside code
    that holds the lock a settle takes. Settling there would wait on that lock in this
    thread; the settle is left to the thread that settles dropped streams."""
    mod = importlib.import_module("httpx2")
    lock = threading.Lock()
    ledger = Locked(lock)
    t = policy_transport(mod, ledger=ledger)
    client = mod.Client(transport=t)
    record = drop_in_a_cycle(client)
    with lock:  # the code a collection interrupts
        gc.collect()  # the iterator's finally closes the response here
    settled_dropped()
    assert record.settled and record.request_id in ledger.settled


@pytest.mark.parametrize("modname", MODS)
def test_an_iterator_dropped_in_a_with_block_is_settled_at_once(modname: str) -> None:
    """Outside a collection the close settles in place: the record is settled when the
    block ends (httpx2 closes the response as the iterator goes)."""
    mod = importlib.import_module(modname)
    t = policy_transport(mod)
    client = mod.Client(transport=t)
    with client.stream("POST", CHAT, json=BODY) as r:
        next(r.iter_raw())
    assert r.extensions["ratequeue"].settled and t.stats()["unclosed"] == 0


@pytest.mark.parametrize("error", [SystemExit, KeyboardInterrupt, asyncio.CancelledError])
def test_the_settling_thread_outlives_a_base_exception(error: type[BaseException]) -> None:
    """Found by review (stop 40): a ledger that raised a ``SystemExit`` or a cancellation
    killed the thread, and every stream dropped later was never settled."""

    def boom() -> None:
        raise error

    _unclosed.DROPPED.put(_Calls(boom))
    assert _unclosed.DROPPED.flush(10)
    got: list[int] = []
    _unclosed.DROPPED.put(_Calls(lambda: got.append(1)))
    assert _unclosed.DROPPED.flush(10) and got == [1]


def test_without_a_settling_thread_close_settles_the_dropped_streams(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Found by review (stop 40): where no thread can start (a pids limit, interpreter
    shutdown) the call still returns its response, and ``close()`` settles the streams
    dropped before it in its own thread."""
    dropped = _unclosed.Dropped()
    monkeypatch.setattr(_unclosed, "DROPPED", dropped)
    start = threading.Thread.start

    def refuse(self: threading.Thread) -> None:
        if self.name == "ratequeue-httpx-unclosed":
            raise RuntimeError("can't start new thread")
        start(self)

    monkeypatch.setattr(threading.Thread, "start", refuse)
    mod = importlib.import_module("httpx")
    ledger = Ledger()
    client = mod.Client(transport=policy_transport(mod, ledger=ledger))
    record = open_and_drop(client)
    gc.collect()
    assert not dropped.running and not record.settled
    client.close()
    assert record.settled and record.request_id in ledger.settled


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork")
def test_a_forked_child_has_a_free_transport_lock() -> None:
    """Found by review (stop 40): the lock counting ``unclosed`` (taken by the settling
    thread) held at the fork hung the child's ``stats()``."""
    mod = importlib.import_module("httpx")
    t = policy_transport(mod)
    with t._lock:  # held at the fork, as by another thread
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            code = 1
            try:
                import signal

                signal.alarm(10)
                t.stats()
                code = 0
            finally:
                os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


# -- found by the second review (stop 40) --------------------------------------------------


def test_exiting_does_not_wait_on_the_settling_thread(tmp_path: Any) -> None:
    """A client closed at interpreter exit (an SDK's client wrapper's ``__del__``) after a
    stream was used: the exit had waited 5 s for a thread that can no longer run."""
    took, _ = _run_script(
        tmp_path,
        "import httpx, test_httpx_dropped as d\n"
        "class Holder:\n"
        "    def __init__(self):\n"
        "        self.c = httpx.Client(transport=d.policy_transport(httpx))\n"
        "    def __del__(self):\n"
        "        self.c.close()\n"
        "h = Holder()\n"
        "with h.c.stream('POST', d.CHAT, json=d.BODY) as r:\n"
        "    r.read()\n",
    )
    assert took < 4


def test_close_waits_for_its_own_dropped_streams_only() -> None:
    """One transport's slow ledger (its dropped stream being settled) does not hold up
    another transport's close."""
    import time

    mod = importlib.import_module("httpx")
    release = threading.Event()
    entered = threading.Event()

    class Slow(Ledger):
        def settle(self, request_id: str, **kw: Any) -> None:
            entered.set()
            release.wait(20)
            super().settle(request_id, **kw)

    slow = mod.Client(transport=policy_transport(mod, ledger=Slow()))
    other = mod.Client(transport=policy_transport(mod))
    open_and_drop(slow)
    gc.collect()
    assert entered.wait(10)  # the settling thread is in the slow ledger
    t0 = time.monotonic()
    other.close()
    took = time.monotonic() - t0
    release.set()
    slow.close()
    assert took < 2


def test_an_interrupt_while_close_settles_a_dropped_stream_reaches_the_caller(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Without a settling thread ``close()`` settles the dropped streams itself: a Ctrl-C
    there is raised (it had been logged and swallowed), and the close's other steps
    (background creations, the inner transport) run all the same."""
    dropped = _unclosed.Dropped()
    monkeypatch.setattr(_unclosed, "DROPPED", dropped)
    monkeypatch.setattr(dropped, "start", lambda: False)

    class Interrupted(Ledger):
        def settle(self, request_id: str, **kw: Any) -> None:
            raise KeyboardInterrupt

    mod = importlib.import_module("httpx")
    t = policy_transport(mod, ledger=Interrupted())
    client = mod.Client(transport=t)
    record = open_and_drop(client)
    gc.collect()
    closed: list[bool] = []

    class Inner:  # the last step of a close
        def close(self) -> None:
            closed.append(True)

    t.inner = Inner()
    with pytest.raises(KeyboardInterrupt):
        client.close()
    assert record.settled and closed == [True]


def test_a_collection_after_gc_callbacks_were_cleared_still_hands_over() -> None:
    """User code clearing ``gc.callbacks`` removed the collector hook: a close the
    collector ran settled inline again (and could wait on a lock this thread holds).
    The next stream puts the hook back, first."""
    mod = importlib.import_module("httpx2")
    lock = threading.Lock()
    ledger = Locked(lock)
    client = mod.Client(transport=policy_transport(mod, ledger=ledger))
    with client.stream("POST", CHAT, json=BODY) as r:
        r.read()
    saved = list(gc.callbacks)
    gc.callbacks.clear()
    try:
        gc.callbacks.append(lambda phase, info: None)
        record = drop_in_a_cycle(client)
        with lock:
            gc.collect()
        settled_dropped()
        assert record.settled and record.request_id in ledger.settled
        assert gc.callbacks[0] is _unclosed._gc_phase
    finally:
        gc.callbacks[:] = saved + [c for c in gc.callbacks if c not in saved]


def test_a_start_reentered_from_a_finalizer_returns(monkeypatch: pytest.MonkeyPatch) -> None:
    """A collection while the thread starts runs a finalizer that starts it again: no
    lock is held then (it had deadlocked)."""
    dropped = _unclosed.Dropped()
    start = threading.Thread.start
    again: list[bool] = []

    def reenter(self: threading.Thread) -> None:
        if self.name == "ratequeue-httpx-unclosed" and not again:
            again.append(dropped.start())
        start(self)

    monkeypatch.setattr(threading.Thread, "start", reenter)
    assert dropped.start() and again == [False] and dropped.running


# -- found by the third review (stop 40) ---------------------------------------------------


def _no_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """No settling thread: dropped streams wait in their transport for its close."""
    dropped = _unclosed.Dropped()
    monkeypatch.setattr(_unclosed, "DROPPED", dropped)
    monkeypatch.setattr(dropped, "start", lambda: False)


def test_a_close_the_collector_runs_leaves_the_dropped_streams(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An object closing its client in ``__del__``, collected inside ledger code that
    holds the ledger's lock: the close settled the dropped streams there (and waited on
    that lock). It leaves them; a later close settles them."""
    _no_thread(monkeypatch)
    mod = importlib.import_module("httpx")
    lock = threading.Lock()
    ledger = Locked(lock)
    t = policy_transport(mod, ledger=ledger)
    client = mod.Client(transport=t)
    record = open_and_drop(client)
    gc.collect()
    assert len(t._unclosed.readers) == 1

    class Owner:
        def __init__(self) -> None:
            self.me = self  # a cycle: freed by the collector

        def __del__(self) -> None:
            client.close()

    Owner()
    with lock:
        gc.collect()
    assert not record.settled and len(t._unclosed.readers) == 1
    t.close()  # (the client is closed already)
    assert record.settled and record.request_id in ledger.settled


def test_a_close_from_a_ledger_paying_a_dropped_stream_does_not_wait_for_itself() -> None:
    import time

    mod = importlib.import_module("httpx")
    took: list[float] = []

    class Closing(Ledger):
        def settle(self, request_id: str, **kw: Any) -> None:
            super().settle(request_id, **kw)
            t0 = time.monotonic()
            client.close()
            took.append(time.monotonic() - t0)

    client = mod.Client(transport=policy_transport(mod, ledger=Closing()))
    open_and_drop(client)
    settled_dropped()
    assert took and took[0] < 2


def test_aclose_pays_a_sync_calls_dropped_stream_off_the_event_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _no_thread(monkeypatch)
    mod = importlib.import_module("httpx")
    where: list[str] = []

    class Where(Ledger):
        def settle(self, request_id: str, **kw: Any) -> None:
            where.append(threading.current_thread().name)
            super().settle(request_id, **kw)

    t = policy_transport(mod, ledger=Where())
    open_and_drop(mod.Client(transport=t))  # a sync call
    gc.collect()

    async def main() -> None:
        await mod.AsyncClient(transport=t).aclose()

    asyncio.run(main())
    assert where and where[0] != threading.current_thread().name


def test_a_slow_ledger_holds_up_no_other_transports_dropped_streams() -> None:
    """One process-wide thread settles every transport's dropped streams: a ledger that
    hangs is paid by the ledger's worker threads, not by that thread."""
    mod = importlib.import_module("httpx")
    release, entered = threading.Event(), threading.Event()

    slow = mod.Client(transport=policy_transport(mod, ledger=hanging(Ledger, entered, release)))
    quick = mod.Client(transport=policy_transport(mod))
    try:
        open_and_drop(slow)
        gc.collect()
        assert entered.wait(10)
        record = open_and_drop(quick)
        gc.collect()
        barrier = threading.Event()
        _unclosed.DROPPED.put(barrier.set)
        assert barrier.wait(10) and record.settled
        quick.post(CHAT, json=BODY)  # its one slot is free
    finally:
        release.set()
    settled_dropped()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork")
def test_a_stream_open_at_a_fork_is_not_settled_by_the_child() -> None:
    """The parent's call: the child's copy, dropped there, is the parent's to settle
    (both had settled it in a shared ledger)."""
    mod = importlib.import_module("httpx")
    client = mod.Client(transport=policy_transport(mod))
    r = client.send(client.build_request("POST", CHAT, json=BODY), stream=True)
    chunks = r.iter_raw()
    next(chunks)
    record = r.extensions["ratequeue"]
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            del r, chunks
            gc.collect()
            _unclosed.DROPPED.flush(10)
            code = 0 if not record.settled else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    del r, chunks
    settled_dropped()
    assert record.settled


def test_a_ledger_stuck_at_exit_does_not_hang_the_exit(tmp_path: Any) -> None:
    """Found in stop 41: a dropped stream's ledger part paid by a worker thread whose
    ledger never answers (a dead connection without a timeout) hung the interpreter's
    exit for good: the exit joined the worker threads. The exit now waits a bounded time
    for them (logged), then goes."""
    took, done = _run_script(
        tmp_path,
        "import gc, threading, httpx, test_httpx_dropped as d\n"
        "from ratequeue.httpx._unclosed import DROPPED\n"
        "class Stuck(d.Ledger):\n"
        "    def settle(self, request_id, **kw):\n"
        "        print('stuck', flush=True)\n"
        "        threading.Event().wait()\n"
        "client = httpx.Client(transport=d.policy_transport(httpx, ledger=Stuck()))\n"
        "d.open_and_drop(client)\n"
        "gc.collect()\n"
        "DROPPED.flush(0.5)\n",
    )
    assert done.stdout == "stuck\n" and took < 30
    assert "not done at exit" in done.stderr


def _run_script(tmp_path: Any, code: str) -> tuple[float, Any]:
    """``code`` run by a fresh interpreter with this directory and tests/ on its path, which must
    exit 0: (seconds it took, its outcome)."""
    import subprocess
    import sys
    import time

    script = tmp_path / "script.py"
    here = os.path.dirname(os.path.abspath(__file__))
    paths = [here, os.path.dirname(here)]  # this directory, and tests/ (the helpers)
    script.write_text(f"import sys; sys.path[:0] = {paths!r}\n" + code)
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    return time.monotonic() - t0, done


def _interrupted_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The next JSON usage read raises KeyboardInterrupt (a Ctrl-C landing there)."""
    from ratequeue.httpx import _stream

    real, first = _stream._json_usage, [True]

    def json_usage(body: bytes) -> object:
        if first:
            first.pop()
            raise KeyboardInterrupt
        return real(body)

    monkeypatch.setattr(_stream, "_json_usage", json_usage)


@pytest.mark.parametrize("drop", [False, True])
def test_a_stream_end_interrupted_while_reading_its_usage_is_settled_later(
    drop: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by review (stop 41): a Ctrl-C in the end's own reading of the usage (not
    in its settle) left the reader finished: its close and its drop settled nothing, and
    the Policy's one slot was held for good."""
    mod = importlib.import_module("httpx")
    t = policy_transport(mod, kind="json")
    t._native_stream = False  # the Python reader
    client = mod.Client(transport=t)
    _interrupted_once(monkeypatch)
    r = client.send(client.build_request("POST", CHAT, json=BODY), stream=True)
    record = r.extensions["ratequeue"]
    with pytest.raises(KeyboardInterrupt):
        r.read()
    if drop:
        del r
        gc.collect()
        settled_dropped()
    else:
        r.close()
    assert record.settled
    client.post(CHAT, json=BODY)  # the one slot is free (timeout 0: refused otherwise)
