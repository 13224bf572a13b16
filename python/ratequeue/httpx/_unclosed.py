"""Streams dropped unclosed.

A response dropped without a close (a ``break`` out of an SDK stream, then garbage) ends
neither its body nor a close: its reader would hold the call's permit (a Policy's
concurrency slot), ledger hold and budget sub-call for good. The stream's finalizer hands
the reader over (:func:`hand_over`): to its transport's :class:`Unclosed` (``close()``
settles what is left there, in its own thread) and to a thread of this process's own
(:data:`DROPPED`), woken by the drop, which settles it as a close would. Whichever claims
a reader first settles it. The finalizer itself settles nothing: it may run inside any
code of this thread (a collection at any allocation), which may hold the very locks a
settle takes; so does a close the garbage collector runs (:func:`collecting`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import gc
import logging
import sys
import threading
import time
from collections.abc import Callable, Iterator
from queue import SimpleQueue
from threading import get_ident
from typing import Any, NoReturn

from .._errors import each
from .._threads import AfterFork, exit_time_left
from ._ledger import _worker

__all__ = [
    "DROPPED",
    "Unclosed",
    "collecting",
    "hand_over",
    "ready",
    "settle_closed",
    "settle_unclosed",
    "settle_unclosed_async",
]

_log = logging.getLogger("ratequeue.httpx")

#: Seconds a close (and the interpreter's exit) waits for the settling thread.
FLUSH_TIMEOUT = 5.0

_FORK = AfterFork("_after_fork_in_child")


class Unclosed:
    """A transport's readers handed over and not settled yet, each claimed once (by the
    settling thread or by ``close()``) and, while it settles, kept in ``claims`` by the
    thread that claimed it. Each change is one dict operation under a C-level lock (no
    Python frame between taking the lock and the change: a Ctrl-C cannot leave it
    held)."""

    __slots__ = ("__weakref__", "_cv", "_lock", "claims", "readers")

    def __init__(self) -> None:
        self.readers: dict[int, Any] = {}
        self.claims: dict[int, int] = {}  # id(reader) -> the claiming thread
        # Reentrant: a finalizer run inside a claim may close the transport.
        self._lock = threading.RLock()
        self._cv = threading.Condition(self._lock)  # wait and notify only
        _FORK.add(self)

    def add(self, reader: Any) -> None:
        """From a finalizer: one dict store (no lock)."""
        self.readers[id(reader)] = reader

    def claim(self, reader: Any) -> bool:
        """``reader`` is this thread's to settle (then :meth:`done`): False when another
        claimed it."""
        with self._lock:
            if self.readers.pop(id(reader), None) is None:
                return False
            self.claims[id(reader)] = get_ident()
            return True

    def take(self) -> Any:
        """A reader not claimed yet, claimed by this thread (then :meth:`done`), or
        None."""
        with self._lock:
            try:
                key, reader = self.readers.popitem()
            except KeyError:
                return None
            self.claims[key] = get_ident()
            return reader

    def done(self, reader: Any) -> None:
        with self._lock:
            self.claims.pop(id(reader), None)  # after a fork: not the child's
            self._cv.notify_all()

    @contextlib.contextmanager
    def settling(self, reader: Any) -> Iterator[None]:
        """Around the settle of a reader this thread claimed: :meth:`done` after; an
        interrupt (a Ctrl-C, a cancel) puts the reader back first (settled once whoever
        settles it again: ``_once``)."""
        try:
            yield
        except BaseException:
            self.add(reader)
            raise
        finally:
            self.done(reader)

    def others(self) -> bool:
        """Readers being settled by another thread than this one."""
        me = get_ident()
        return any(t != me for t in list(self.claims.values()))

    def wait(self, timeout: float) -> bool:
        """Wait (at most ``timeout`` s) until no other thread settles a reader (this
        thread's own claims, a close inside a settle, are not waited for)."""
        with self._lock:
            return self._cv.wait_for(lambda: not self.others(), timeout)

    def _after_fork_in_child(self) -> None:
        # The parent settles its own; the child's copies were finalized already.
        self.readers, self.claims = {}, {}
        self._lock = threading.RLock()
        self._cv = threading.Condition(self._lock)


def settle(reader: Any, pay: bool = True) -> None:
    """Settle the call of a stream dropped unclosed (claimed) as a close would, from what
    was read, its ledger part paid here (``pay`` False: left owed whatever thread or loop
    made the call, for the caller to pay off this one); a failure is logged (the code
    that dropped it is gone), and counted in ``stats()["unclosed"]``."""
    call, transport = reader.call, reader.transport
    if not pay:
        call._async = True  # the settle leaves the ledger part owed
    try:
        try:
            reader.finish()
        finally:
            if pay and call._owed is not None:
                transport._pay(call)
    except Exception:
        _log.exception(
            "the call %s, its stream dropped unclosed, failed to settle", call.request_id
        )
    transport._count("unclosed")


#: Set in a worker thread while it pays a dropped stream's ledger part: a close there (a
#: ledger callback) does not wait for the claim that waits for it.
_PAYING = threading.local()


def _pay_logged(transport: Any, call: Any, owed: object = None) -> None:
    """What ``call`` owes the ledger paid (``owed``: that, taken from it before), a
    failure logged, never handed off again."""
    _PAYING.active = True
    try:
        if owed is None:
            transport._pay(call, hand_off=False)
        else:
            transport._pay_owed(call, owed)
    except Exception:
        _log.exception("the call %s failed to pay its ledger part", call.request_id)
    finally:
        _PAYING.active = False


def settle_unclosed(transport: Any, timeout: float) -> None:
    """``close()``: the transport's dropped streams not claimed yet settled in this
    thread (none inside a garbage collection: the settling thread keeps them), then those
    another thread is settling waited for (at most ``timeout`` s; not inside a collection
    nor at interpreter exit, when that thread cannot run). A Ctrl-C puts the reader it
    interrupted back."""
    if collecting():
        return
    unclosed = transport._unclosed
    while (reader := unclosed.take()) is not None:
        with unclosed.settling(reader):
            settle(reader)
    if unclosed.claims and not sys.is_finalizing() and not getattr(_PAYING, "active", False):
        unclosed.wait(timeout)


async def settle_unclosed_async(transport: Any, timeout: float) -> None:
    """``aclose()``: as :func:`settle_unclosed`, the ledger and the wait off the loop."""
    unclosed = transport._unclosed
    while (reader := unclosed.take()) is not None:
        with unclosed.settling(reader):
            settle(reader, pay=False)
            if reader.call._owed is not None:
                try:
                    await transport._pay_async(reader.call)
                except Exception:
                    _log.exception("the call %s failed to settle", reader.call.request_id)
    if unclosed.others():
        loop = asyncio.get_running_loop()
        with contextlib.suppress(RuntimeError):  # no thread to wait in: not waited for
            await loop.run_in_executor(_worker(), unclosed.wait, timeout)


def _settle_claiming(reader: Any) -> None:
    """In the settling thread: settle ``reader`` unless a close claimed it first, its
    ledger part paid by the ledger's worker threads (a slow ledger holds up no other
    transport's streams), the claim kept until it is paid."""
    transport = reader.transport
    unclosed = transport._unclosed
    if not unclosed.claim(reader):
        return
    paying = False
    try:
        settle(reader, pay=False)
        paying = _pay_off_thread(transport, reader.call, lambda: unclosed.done(reader))
    finally:
        if not paying:
            unclosed.done(reader)


def _pay_off_thread(
    transport: Any, call: Any, then: Callable[[], object] | None, owed: object = None
) -> bool:
    """What ``call`` owes the ledger (``owed``: that, taken from it before) paid by the
    ledger's worker threads (a ledger that never answers holds up nothing else), ``then``
    called after; False when it is not (nothing owed; paid here at exit, the workers
    gone)."""
    if owed is None and call._owed is None and call._linked is None:
        return False
    try:
        fut = _worker().submit(_pay_logged, transport, call, owed)
    except RuntimeError:  # the workers are shut down (interpreter exit): paid here
        _pay_logged(transport, call, owed)
        return False
    DROPPED.paying.add(fut)
    fut.add_done_callback(lambda f: _paid(f, then))
    return True


def raise_held(transport: Any, call: Any, held: list[BaseException]) -> NoReturn:
    """Raise the interrupt in ``held`` (a Ctrl-C held back while a settle's steps ran: it
    wins over an error of a later step, which becomes its context); the ledger part an
    asyncio caller would have awaited after goes to the worker threads (the interrupt
    may skip that await; a caller that still pays races them, and one of them takes
    it). ``held`` is emptied (no reference cycle through the caller's frame)."""
    interrupted = held.pop()
    try:
        if call._owed is not None or call._linked is not None:
            _pay_off_thread(transport, call, None)
        raise interrupted
    finally:
        del interrupted


def _paid(fut: Any, then: Callable[[], object] | None) -> None:
    DROPPED.paying.discard(fut)
    if then is not None:
        then()


def settle_closed(transport: Any) -> None:
    """In the settling thread, for a close the garbage collector ran: the transport's
    dropped readers not claimed yet, then its background creations waiting, at their
    estimate; each whatever fails, every ledger part paid by the worker threads."""

    try:
        each(list(transport._unclosed.readers.values()), _settle_claiming)
    finally:
        transport._drain_background(pay=lambda call: _pay_off_thread(transport, call, None))


class Dropped:
    """The settling thread: one daemon thread per process, started with the process's
    first stream (made again in a forked child: the parent's thread and queue are not
    the child's), settling each reader handed over in turn. ``flush`` waits until every
    reader handed over before it is settled (tests)."""

    def __init__(self) -> None:
        self._queue: SimpleQueue[Any] = SimpleQueue()
        self.running = False
        self._starting = False
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self.paying: set[Any] = set()  # ledger parts being paid (futures)
        self._at_exit = False  # the exit's flush registered
        _FORK.add(self)

    def put(self, item: Any) -> None:
        """From a finalizer: ``SimpleQueue.put`` is reentrant and takes no lock Python
        code holds."""
        self._queue.put(item)

    def start(self) -> bool:
        """The thread running, started now if it was not: False when it is not (being
        started by another caller, or it cannot be: logged; ``close()`` then settles its
        transport's dropped streams itself). No lock is held while the thread starts (a
        finalizer run meanwhile may come back here)."""
        if not self._lock.acquire(blocking=False):
            return self.running
        try:
            if self.running or self._starting:
                return self.running
            self._starting = True
        finally:
            self._lock.release()
        thread = threading.Thread(
            target=self._run, args=(self._queue,), name="ratequeue-httpx-unclosed", daemon=True
        )
        error: str | None = None
        try:
            thread.start()
        except Exception as e:  # a pids limit; interpreter shutdown
            # The message only: the error's traceback would keep the caller's frames
            # (the response among them) alive in whatever keeps the log record.
            error = str(e)
        with self._lock:
            self._starting = False
            if error is None:
                self._thread, self.running = thread, True
        if error is None and not self._at_exit:
            self._at_exit = True
            with contextlib.suppress(RuntimeError):  # exiting already
                # Before the worker threads are joined, while this thread still runs.
                threading._register_atexit(self._flush_at_exit)  # type: ignore[attr-defined]
        if error is not None:
            _log.warning("no thread to settle the streams dropped unclosed: %s", error)
        return error is None

    def _flush_at_exit(self) -> None:
        """At interpreter exit: what was handed over settled first (a close the collector
        ran left it to this thread), within the exit's one bounded wait."""
        if self.running and not self.flush(exit_time_left()):
            _log.warning("exiting with dropped streams or closes not settled yet")

    def _run(self, queue: SimpleQueue[Any]) -> None:
        try:
            while True:
                item = queue.get()
                # Whatever a settle raises is logged: the thread goes on for the others
                # (a SystemExit or a cancellation a ledger raises is not its to act on).
                try:
                    if callable(item):  # a flush's wake-up
                        item()
                    else:
                        _settle_claiming(item)
                except BaseException:
                    _log.exception("settling a stream dropped unclosed failed")
                del item
        finally:  # never, but a thread gone is started again
            self.running = False

    def flush(self, timeout: float | None = None) -> bool:
        """Wait (at most ``timeout`` s) until the readers handed over so far are settled:
        False if they are not by then, or no thread runs, or this is that thread."""
        if not self.start() or threading.current_thread() is self._thread:
            return False
        deadline = None if timeout is None else time.monotonic() + timeout
        done = threading.Event()
        self._queue.put(done.set)
        if not done.wait(timeout):
            return False
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        return not concurrent.futures.wait(list(self.paying), left).not_done

    def _after_fork_in_child(self) -> None:
        self._queue, self._thread = SimpleQueue(), None
        self.running, self._starting, self._lock = False, False, threading.Lock()
        self.paying = set()
        GENERATION[0] += 1


DROPPED = Dropped()


#: This process's generation (a forked child's is the next): a stream made in another
#: process is that process's to settle.
GENERATION = [0]


def hand_over(reader: Any, generation: int) -> None:
    """``reader``, unfinished, of a stream made in ``generation``, to be settled off this
    thread's stack (from a finalizer, or a close the collector runs): no lock taken.
    Queued for the settling thread when it runs; its transport's ``close()`` settles it
    otherwise."""
    if generation == GENERATION[0] and not reader.finished:
        reader.transport._unclosed.add(reader)
        if DROPPED.running:
            DROPPED.put(reader)


#: The thread collecting garbage (its ident; 0 when none): the collector runs one
#: collection at a time, its finalizers in the thread that triggered it.
_COLLECTOR = [0]


def _gc_phase(phase: str, info: dict[str, int]) -> None:
    _COLLECTOR[0] = get_ident() if phase == "start" else 0


def collecting() -> bool:
    """This thread is running a garbage collection (its finalizers)."""
    return _COLLECTOR[0] == get_ident()


def ready() -> None:
    """Before a reader is put on a stream: the collector hook first in ``gc.callbacks``
    (put back if user code removed it; first, so that a callback removing itself before
    it cannot make the collector skip it) and the settling thread started."""
    callbacks = gc.callbacks
    if not callbacks or callbacks[0] is not _gc_phase:
        while _gc_phase in callbacks:
            callbacks.remove(_gc_phase)
        callbacks.insert(0, _gc_phase)
        _COLLECTOR[0] = 0  # a collection's end it may have missed
    if not DROPPED.running:
        DROPPED.start()
