"""Background responses streamed from their creation (``stream=True``): kept from the
event that names the response; a poll's final usage or the stream's own end settles the
creation once, whatever the threads, closes and drops around it (three adversarial
reviews, stop 39, each finding a test here)."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import importlib
import json
from typing import Any

import pytest
import ratequeue as rq
from background_helpers import (
    _BODY,
    _COMPLETED,
    BURST,
    MODS,
    SPENT,
    STREAM,
    USED,
    Chunks,
    Ledger,
    Provider,
    Streamed,
    _drain,
    _Once,
    _open,
    _started,
    _stream,
    create,
    estimate_of,
    through,
    through_policy,
)
from ratequeue.httpx import CallBudget
from ratequeue.httpx._unclosed import DROPPED


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("modname", MODS)
def test_a_streamed_creation_cut_before_its_usage_waits_for_the_resumed_stream(
    modname: str, native: bool
) -> None:
    mod = importlib.import_module(modname)
    t, client, lim = through(mod, native, Streamed())
    created = _stream(mod, client, "POST", "http://p/v1/responses", json=_BODY | STREAM)
    assert not created.settled and t.stats()["background"] == 1
    assert lim.available("tokens") == BURST - estimate_of(created)
    p = _stream(mod, client, "GET", "http://p/v1/responses/resp_7?stream=true")
    assert p.charged["tokens"] == 0
    assert created.settled and created.usage == (900, 20_000)
    assert lim.available("tokens") == BURST - SPENT


@pytest.mark.parametrize("native", [True, False])
def test_a_resumed_stream_cut_again_is_charged_nothing(native: bool) -> None:
    """The creation still holds its estimate: the poll itself generated nothing."""
    mod = importlib.import_module("httpx")
    t, client, lim = through(mod, native, Streamed(resumed_cut=True))
    created = _stream(mod, client, "POST", "http://p/v1/responses", json=_BODY | STREAM)
    p = _stream(mod, client, "GET", "http://p/v1/responses/resp_7?stream=true")
    assert p.charged["tokens"] == 0
    estimate = estimate_of(created)
    assert t.stats()["background"] == 1 and lim.available("tokens") == BURST - estimate


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("streamed", ["not in background", "ended"])
def test_a_stream_without_its_usage_keeps_its_estimate(native: bool, streamed: str) -> None:
    """Not in background: nothing to poll; a background stream that ended (not cut) is
    done, its usage unread (a final event past ``max_event``): nothing to wait for."""
    mod = importlib.import_module("httpx")
    provider = (
        Streamed(background=False) if streamed == "not in background" else Streamed(ends=True)
    )
    t, client, lim = through(mod, native, provider)
    created = _stream(mod, client, "POST", "http://p/v1/responses", json=_BODY | STREAM)
    assert created.settled and t.stats()["background"] == 0
    assert lim.available("tokens") == BURST - estimate_of(created)


@pytest.mark.parametrize("native", [True, False])
def test_a_resumed_stream_ending_without_a_usage_settles_the_creation_at_its_estimate(
    native: bool,
) -> None:
    """``response.failed`` without a usage: the response is done, nothing more to wait
    for; the creation keeps its estimate, the poll is charged nothing."""
    mod = importlib.import_module("httpx")
    t, client, lim = through(mod, native, Streamed(failed=True))
    created = _stream(mod, client, "POST", "http://p/v1/responses", json=_BODY | STREAM)
    p = _stream(mod, client, "GET", "http://p/v1/responses/resp_7?stream=true")
    assert p.charged["tokens"] == 0
    assert created.settled and created.usage is None and t.stats()["background"] == 0
    assert lim.available("tokens") == BURST - estimate_of(created)


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("modname", MODS)
@pytest.mark.parametrize("cut", [False, True])
def test_a_poll_while_the_creation_streams_settles_it_once(
    modname: str, native: bool, cut: bool
) -> None:
    """Polled while its creation's stream is still open (after the stream named it): the
    poll's final usage settles the creation, the poll is charged nothing, and the
    stream's end (or drop) then changes nothing."""
    mod = importlib.import_module(modname)
    events = (_started("resp_7"),) if cut else (_started("resp_7"), _COMPLETED)
    t, client, lim = through(mod, native, Chunks(*events, cut=cut))
    r, chunks, created = _open(client)
    assert not created.settled and t.stats()["background"] == 1
    p = client.get("http://p/v1/responses/resp_7").extensions["ratequeue"]
    assert p.charged["tokens"] == 0
    assert created.settled and created.usage == (900, 20_000)
    _drain(mod, r, chunks)
    assert created.settled and created.usage == (900, 20_000)
    assert t.stats()["background"] == 0
    assert lim.available("tokens") == BURST - SPENT
    again = client.get("http://p/v1/responses/resp_7").extensions["ratequeue"]
    assert again.charged["tokens"] == 0


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("modname", MODS)
def test_a_poll_after_the_creation_streamed_its_usage_is_charged_nothing(
    modname: str, native: bool
) -> None:
    mod = importlib.import_module(modname)
    t, client, lim = through(mod, native, Chunks(_started("resp_7"), _COMPLETED))
    created = _stream(mod, client, "POST", "http://p/v1/responses", json=_BODY | STREAM)
    assert created.usage == (900, 20_000) and t.stats()["background"] == 0
    p = client.get("http://p/v1/responses/resp_7").extensions["ratequeue"]
    assert p.charged["tokens"] == 0
    assert lim.available("tokens") == BURST - SPENT


@pytest.mark.parametrize("native", [True, False])
def test_a_poll_after_a_stream_that_ended_without_its_usage_is_charged(native: bool) -> None:
    """The creation keeps its estimate (its usage unread): the poll that reports the
    usage is charged it, never less than used."""
    mod = importlib.import_module("httpx")
    ended = {"type": "response.failed", "response": {"id": "resp_7", "status": "failed"}}
    t, client, lim = through(mod, native, Chunks(_started("resp_7"), ended))
    created = _stream(mod, client, "POST", "http://p/v1/responses", json=_BODY | STREAM)
    assert created.settled and created.usage is None and t.stats()["background"] == 0
    p = client.get("http://p/v1/responses/resp_7").extensions["ratequeue"]
    assert p.charged["tokens"] == SPENT
    assert lim.available("tokens") == BURST - SPENT - estimate_of(created)


@pytest.mark.parametrize("modname", MODS)
def test_a_second_creation_named_like_an_open_stream_leaves_the_streams_usage(
    modname: str,
) -> None:
    """Two creations answered with one id, one still streaming: neither is kept, and the
    stream's end charges the usage it reads (not its estimate)."""
    mod = importlib.import_module(modname)
    t, client, lim = through(mod, True, Chunks(_started("resp_7"), _COMPLETED))
    r, chunks, created = _open(client)
    twin = create(client).extensions["ratequeue"]
    assert twin.settled and t.stats()["background"] == 0
    _drain(mod, r, chunks)
    assert created.usage == (900, 20_000)
    assert BURST - lim.available("tokens") == SPENT + twin.charged["tokens"]
    p = client.get("http://p/v1/responses/resp_7").extensions["ratequeue"]
    assert p.charged["tokens"] == SPENT  # not tracked: charged (never less than used)


def test_a_poll_of_a_running_response_keeps_its_streams_concurrency_slot_held() -> None:
    """A creation still streaming holds its Policy slot until its stream ends or a poll
    reports it done."""
    mod = importlib.import_module("httpx")
    provider = Chunks(_started("resp_7"), _COMPLETED)
    provider.running = True
    client, _lim = through_policy(mod, provider, slots=2)
    first = _open(client)
    client.get("http://p/v1/responses/resp_7")  # the second slot, given back after
    second = _open(client)
    with pytest.raises(rq.RateQueueError):
        _open(client)  # two streams open: no third
    for r, chunks, rec in (first, second):
        _drain(mod, r, chunks)
        assert rec.usage == (900, 20_000)
    third = _open(client)  # the slots are back
    _drain(mod, third[0], third[1])


@pytest.mark.parametrize("modname", MODS)
def test_closing_while_a_creation_streams_leaves_its_usage_to_its_stream(modname: str) -> None:
    mod = importlib.import_module(modname)
    t, client, lim = through(mod, True, Chunks(_started("resp_7"), _COMPLETED))
    r, chunks, created = _open(client)
    t.close()
    assert not created.settled and t.stats()["background"] == 0
    _drain(mod, r, chunks)
    assert created.usage == (900, 20_000) and lim.available("tokens") == BURST - SPENT


def test_aclosing_while_a_creation_streams_leaves_its_usage_to_its_stream() -> None:
    mod = importlib.import_module("httpx")

    async def main() -> tuple[Any, rq.Limiter]:
        t, _, lim = through(mod, True, Chunks(_started("resp_7"), _COMPLETED))
        client = mod.AsyncClient(transport=t)
        req = client.build_request("POST", "http://p/v1/responses", json=_BODY | STREAM)
        r = await client.send(req, stream=True)
        it = r.aiter_raw()
        await it.__anext__()
        await t.aclose()
        async for _ in it:
            pass
        await r.aclose()
        return r.extensions["ratequeue"], lim

    created, lim = asyncio.run(main())
    assert created.usage == (900, 20_000) and lim.available("tokens") == BURST - SPENT


def test_a_poll_landing_as_the_stream_drops_settles_the_creation_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A poll (another thread's) between the stream's drop and its keep: the poll is
    charged nothing, the creation settles once to the poll's usage, and nothing stays
    counted as waiting."""
    from ratequeue.httpx import _background

    mod = importlib.import_module("httpx")
    t, client, lim = through(mod, True, Chunks(_started("resp_7"), cut=True), max_background=1)
    r, chunks, created = _open(client)
    real_keep = _background.Background.keep
    polls: list[Any] = []

    def keep(self: Any, call: Any, body: Any, rid: Any, taken: Any) -> Any:
        if not polls:
            polls.append(client.get("http://p/v1/responses/resp_7").extensions["ratequeue"])
        return real_keep(self, call, body, rid, taken)

    monkeypatch.setattr(_background.Background, "keep", keep)
    _drain(mod, r, chunks)
    assert polls[0].charged["tokens"] == 0
    assert created.settled and created.usage == (900, 20_000)
    assert t.stats()["background"] == 0 and lim.available("tokens") == BURST - SPENT


def test_a_poll_racing_the_streams_own_settle_leaves_no_ledger_hold(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A poll in another thread while the stream settles itself (between its settle's
    start and its ledger part): each ledger hold is settled once, the usage charged once."""
    import threading

    from ratequeue.httpx import _budget

    mod = importlib.import_module("httpx")
    ledger = Ledger()
    _t, client, lim = through(mod, True, Chunks(_started("resp_7"), _COMPLETED), ledger=ledger)
    with CallBudget(calls=10, tokens=10**6):
        r, chunks, created = _open(client)
    stream_thread = threading.current_thread()
    real_settle = _budget.settle
    polls: list[Any] = []

    def settle(sub: Any, *a: Any, **k: Any) -> Any:
        if threading.current_thread() is stream_thread and not polls:
            poller = threading.Thread(
                target=lambda: polls.append(client.get("http://p/v1/responses/resp_7"))
            )
            poller.start()
            poller.join(30)
        return real_settle(sub, *a, **k)

    monkeypatch.setattr(_budget, "settle", settle)
    _drain(mod, r, chunks)
    assert polls and polls[0].extensions["ratequeue"].charged["tokens"] == 0
    assert created.usage == (900, 20_000) and lim.available("tokens") == BURST - SPENT
    assert set(ledger.settled) == set(ledger.held)


def test_a_stream_left_unclosed_is_settled_by_its_poll() -> None:
    """Its id read, the stream dropped without a close (a ``break`` out of an SDK
    stream, garbage-collected): the poll that reports the usage settles the creation
    (second review, stop 39: it had waited for a stream end that never came)."""
    import gc

    mod = importlib.import_module("httpx")
    t, client, lim = through(mod, True, Chunks(_started("resp_7"), _COMPLETED))
    r, chunks, created = _open(client)
    del r, chunks
    gc.collect()
    p = client.get("http://p/v1/responses/resp_7").extensions["ratequeue"]
    assert p.charged["tokens"] == 0 and created.usage == (900, 20_000)
    assert t.stats()["background"] == 0 and lim.available("tokens") == BURST - SPENT


def test_a_close_racing_the_first_event_keeps_nothing_settled() -> None:
    """Another thread closes the response while its first chunk (which names the
    response) is in flight: the close settles the creation at its estimate, and the
    chunk fed after it keeps nothing; the id's poll is then charged what it reports."""
    import threading

    mod = importlib.import_module("httpx")
    provider = Chunks(_started("resp_7"), _COMPLETED)
    t, client, lim = through(mod, True, provider)
    held: list[Any] = []

    def close_elsewhere() -> None:
        closer = threading.Thread(target=held[0].close)
        closer.start()
        closer.join(30)

    provider.before_first = close_elsewhere
    req = client.build_request("POST", "http://p/v1/responses", json=_BODY | STREAM)
    r = client.send(req, stream=True)
    held.append(r)
    created = r.extensions["ratequeue"]
    next(r.iter_raw())
    assert created.settled and created._rkey is None and t.stats()["background"] == 0
    p = client.get("http://p/v1/responses/resp_7").extensions["ratequeue"]
    assert p.charged["tokens"] == SPENT
    assert lim.available("tokens") == BURST - SPENT - estimate_of(created)


def test_a_stream_ending_while_a_poll_settles_it_leaves_the_settle_to_the_poll(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A poll (another thread) took the open creation and has not settled it yet when the
    stream ends with its own usage: the stream's end does nothing, the poll settles it
    once, its ledger part paid once (first review, stop 39: a hold was never paid)."""
    import threading

    from ratequeue.httpx import _background

    mod = importlib.import_module("httpx")
    ledger = Ledger()
    _t, client, lim = through(mod, True, Chunks(_started("resp_7"), _COMPLETED), ledger=ledger)
    with CallBudget(calls=10, tokens=10**6):
        r, chunks, created = _open(client)
    taken, go = threading.Event(), threading.Event()
    real_take = _background.Background.take

    def take(self: Any, call: Any, final: bool, usage: Any, got: Any) -> Any:
        out = real_take(self, call, final, usage, got)
        if out[1] is not None:
            taken.set()
            go.wait(30)
        return out

    monkeypatch.setattr(_background.Background, "take", take)
    polls: list[Any] = []
    poller = threading.Thread(
        target=lambda: polls.append(client.get("http://p/v1/responses/resp_7"))
    )
    poller.start()
    assert taken.wait(30)
    _drain(mod, r, chunks)  # the stream reads its usage and ends: left to the poll
    assert not created.settled
    go.set()
    poller.join(30)
    assert polls[0].extensions["ratequeue"].charged["tokens"] == 0
    assert created.usage == (900, 20_000) and lim.available("tokens") == BURST - SPENT
    assert set(ledger.settled) == set(ledger.held) and len(ledger.held) == 2


@pytest.mark.parametrize("cut", [False, True])
@pytest.mark.parametrize("close", [False, True])
@pytest.mark.parametrize("drop", [False, True])
def test_threads_racing_an_open_stream_never_undercharge_it(
    cut: bool, close: bool, drop: bool
) -> None:
    """A poll reporting the final usage (and a close) in other threads race the stream
    being read to its end or cut (or ``drop``: dropped unclosed, settled by the thread
    that settles such streams): the usage is charged, each ledger hold settled once,
    nothing left counted as waiting (second review, stop 39)."""
    import threading

    mod = importlib.import_module("httpx")
    events = (_started("resp_7"),) if cut else (_started("resp_7"), _COMPLETED)
    for i in range(100):
        ledger = Ledger()
        t, client, lim = through(
            mod, True, Chunks(*events, cut=cut), max_background=1, ledger=ledger
        )
        r, chunks, created = _open(client)
        go = threading.Barrier(3 if close else 2)

        def poll(client: Any = client, go: threading.Barrier = go) -> None:
            go.wait()
            client.get("http://p/v1/responses/resp_7")

        def shut(t: Any = t, go: threading.Barrier = go) -> None:
            go.wait()
            t.close()

        others = [threading.Thread(target=poll)]
        if close:
            others.append(threading.Thread(target=shut))
        for th in others:
            th.start()
        go.wait()
        if drop:
            del r, chunks
            gc.collect()
        else:
            _drain(mod, r, chunks)
        for th in others:
            th.join(30)
        assert DROPPED.flush(10)
        if not created.settled:  # cut before the poll: waits for the next one
            assert (cut or drop) and not close, i
            client.get("http://p/v1/responses/resp_7")
        assert created.settled and BURST - lim.available("tokens") >= SPENT, i
        assert t.stats()["background"] == 0 and len(t._background._ids) <= 1, i
        assert set(ledger.settled) == set(ledger.held), i


def test_asyncio_a_poll_while_the_creation_streams_pays_its_ledger_part_once() -> None:
    mod = importlib.import_module("httpx")
    ledger = Ledger()

    async def main() -> tuple[Any, Any, rq.Limiter]:
        t, _, lim = through(mod, True, Chunks(_started("resp_7"), _COMPLETED), ledger=ledger)
        client = mod.AsyncClient(transport=t)
        req = client.build_request("POST", "http://p/v1/responses", json=_BODY | STREAM)
        r = await client.send(req, stream=True)
        it = r.aiter_raw()
        await it.__anext__()
        p = await client.get("http://p/v1/responses/resp_7")
        async for _ in it:
            pass
        await r.aclose()
        await client.aclose()
        return r.extensions["ratequeue"], p.extensions["ratequeue"], lim

    created, p, lim = asyncio.run(main())
    assert p.charged["tokens"] == 0 and created.usage == (900, 20_000)
    assert lim.available("tokens") == BURST - SPENT
    assert set(ledger.settled) == set(ledger.held) and len(ledger.held) == 2
    assert ledger.settled[created.request_id] == (900, 20_000)


def test_a_close_settling_the_creation_while_its_stream_names_it_keeps_nothing() -> None:
    """Another thread's close settles the creation at its estimate while the reading
    thread is inside ``streaming`` (past its first checks, before it keeps the call):
    the call is not kept, and the id's poll is charged what it reports."""
    import threading
    from collections import OrderedDict

    mod = importlib.import_module("httpx")
    provider = Chunks(_started("resp_7"), _COMPLETED)
    ledger = Ledger()
    t, client, lim = through(mod, True, provider, ledger=ledger)
    reading = threading.current_thread()
    in_settle, checked, closed = threading.Event(), threading.Event(), threading.Event()

    class Paused(OrderedDict):  # type: ignore[type-arg]
        armed = True

        def __contains__(self, key: object) -> bool:
            if Paused.armed and threading.current_thread() is reading:
                Paused.armed = False  # the reader is in ``streaming``: the close runs now
                checked.set()
                closed.wait(30)
            return super().__contains__(key)

    t._background._ids = t._waiting_ids = Paused()
    real = t._settle

    def settle(call: Any, *a: Any, **k: Any) -> Any:
        if threading.current_thread() is reading:
            return real(call, *a, **k)
        in_settle.set()
        checked.wait(30)
        try:
            return real(call, *a, **k)
        finally:
            closed.set()

    t._settle = settle  # type: ignore[method-assign]
    held: list[Any] = []

    def close_elsewhere() -> None:
        threading.Thread(target=held[0].close).start()
        assert in_settle.wait(30)

    provider.before_first = close_elsewhere
    req = client.build_request("POST", "http://p/v1/responses", json=_BODY | STREAM)
    r = client.send(req, stream=True)
    held.append(r)
    created = r.extensions["ratequeue"]
    for _ in r.iter_raw():
        pass
    assert created.settled and created._rkey is None and t.stats()["background"] == 0
    p = client.get("http://p/v1/responses/resp_7").extensions["ratequeue"]
    assert p.charged["tokens"] == SPENT
    assert lim.available("tokens") == BURST - SPENT - estimate_of(created)
    assert set(ledger.settled) == set(ledger.held)


class FailedPoll(Chunks):
    """The creation's stream names the response (then drops); polls say it failed,
    without a usage."""

    def __call__(self, request: Any) -> Any:
        if request.method == "GET":
            mod = importlib.import_module(type(request).__module__.split(".", 1)[0])
            return mod.Response(200, json={"id": "resp_7", "status": "failed", "usage": None})
        return super().__call__(request)


def test_a_stream_cut_after_a_final_poll_without_a_usage_settles_at_its_estimate() -> None:
    """Nothing to wait for: the response ended, so the creation keeps its estimate, its
    ledger hold and budget sub-call settled, as a creation answered in JSON."""
    mod = importlib.import_module("httpx")
    ledger = Ledger()
    t, client, lim = through(mod, True, FailedPoll(_started("resp_7"), cut=True), ledger=ledger)
    with CallBudget(calls=10) as budget:
        r, chunks, created = _open(client)
        assert client.get("http://p/v1/responses/resp_7").json()["status"] == "failed"
        _drain(mod, r, chunks)
    assert created.settled and created.usage is None and t.stats()["background"] == 0
    assert set(ledger.settled) == set(ledger.held)
    assert all(s.settled for s in budget.usage)
    assert lim.available("tokens") == BURST - estimate_of(created)


def test_closing_settles_a_creation_whose_stream_was_dropped_unclosed() -> None:
    """Its reader gone (garbage-collected), no end will come: the close settles it at its
    estimate, its ledger hold and budget sub-call with it."""
    import gc

    mod = importlib.import_module("httpx")
    ledger = Ledger()
    t, client, lim = through(mod, True, Chunks(_started("resp_7"), _COMPLETED), ledger=ledger)
    with CallBudget(calls=10) as budget:
        r, chunks, created = _open(client)
    del r, chunks
    gc.collect()
    client.close()
    assert created.settled and t.stats()["background"] == 0
    assert set(ledger.settled) == set(ledger.held)
    assert all(s.settled for s in budget.usage)
    assert lim.available("tokens") == BURST - estimate_of(created)


def test_a_twin_of_a_stream_dropped_unclosed_settles_it_at_its_estimate() -> None:
    """Found by the randomized check: a second creation named like one whose stream was
    dropped unclosed (no end will come) settles it now, its ledger hold with it."""
    mod = importlib.import_module("httpx")
    ledger = Ledger()
    t, client, lim = through(mod, True, Chunks(_started("resp_7"), _COMPLETED), ledger=ledger)
    r, chunks, created = _open(client)
    del r, chunks
    gc.collect()
    twin = create(client).extensions["ratequeue"]  # answered resp_7 too
    assert DROPPED.flush(10)  # the dropped stream's end, in the settling thread
    assert created.settled and twin.settled and t.stats()["background"] == 0
    assert set(ledger.settled) == set(ledger.held)
    assert lim.available("tokens") == BURST - estimate_of(created) - estimate_of(twin)


def test_a_stream_end_interrupted_before_its_settle_is_settled_at_its_drop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Found by review (stop 41): a Ctrl-C in a stream's end before its settle (here in
    ``keep``) left the reader finished: dropped, it was not handed over, and the close let
    its creation go for its end to settle; nothing did."""
    mod = importlib.import_module("httpx")
    ledger = Ledger()
    t, client, _ = through(mod, True, Chunks(_started("resp_7"), _COMPLETED), ledger=ledger)
    with CallBudget(calls=10) as budget:
        r, chunks, created = _open(client)
    monkeypatch.setattr(type(t._background), "keep", _interrupt)
    with contextlib.suppress(KeyboardInterrupt):
        r.close()
    monkeypatch.undo()
    assert not created.settled
    del r, chunks
    gc.collect()
    assert DROPPED.flush(10)
    client.close()
    assert created.settled
    assert set(ledger.settled) == set(ledger.held)
    assert all(s.settled for s in budget.usage)


def _interrupt(*args: Any, **kw: Any) -> Any:
    raise KeyboardInterrupt


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("is_async", [False, True])
def test_a_response_whose_settle_is_interrupted_keeps_its_estimate(
    native: bool, is_async: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found in stop 41: a Ctrl-C in the send's own settle (here in ``keep``, a creation
    answered in JSON) left the call unsettled for good, its ledger hold held (a Policy's
    slot, a budget's sub-call with it). Now it keeps its estimate, settled and paid."""
    mod = importlib.import_module("httpx")
    ledger = Ledger()
    t, client, lim = through(mod, native, Provider(done=1), ledger=ledger)
    monkeypatch.setattr(type(t._background), "keep", _interrupt)
    with CallBudget(calls=10) as budget, pytest.raises(KeyboardInterrupt):
        if is_async:

            async def send() -> None:
                async with mod.AsyncClient(transport=t) as aclient:
                    await aclient.post("http://p/v1/responses", json=_BODY)

            asyncio.run(send())
        else:
            client.post("http://p/v1/responses", json=_BODY)
    monkeypatch.undo()
    assert len(ledger.held) == 1 and set(ledger.settled) == set(ledger.held)
    (sub,) = budget.usage
    assert sub.settled and t.stats()["background"] == 0
    assert lim.available("tokens") == BURST - sub.tokens  # the estimate kept


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("with_ledger", [True, False])
def test_a_body_end_interrupted_before_its_settle_is_settled_by_its_close(
    native: bool, with_ledger: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by review (stop 41), for a JSON body read as a stream (the native reader
    defers a creation to ``_stream_deferred``): a Ctrl-C in its end's settle left the
    reader finished, and its close did nothing. Now the close settles it (kept: waiting
    for its poll)."""
    mod = importlib.import_module("httpx")
    answer = json.dumps({"id": "resp_1", "status": "queued", "usage": None}).encode()

    def provider(request: Any) -> Any:
        if request.method == "POST":  # a body of unknown length: not read ahead
            headers = {"content-type": "application/json"}
            return mod.Response(200, headers=headers, stream=_Once(mod, answer))
        return mod.Response(200, json={"id": "resp_1", "status": "completed", "usage": USED})

    ledger = Ledger()  # a ledger's calls take the Python reader, the others the native one
    t, client, _ = through(mod, native, provider, ledger=ledger if with_ledger else None)
    r = client.send(client.build_request("POST", "http://p/v1/responses", json=_BODY), stream=True)
    created = r.extensions["ratequeue"]
    monkeypatch.setattr(type(t._background), "keep", _interrupt)
    with pytest.raises(KeyboardInterrupt):
        r.read()
    monkeypatch.undo()
    assert not created.settled and t.stats()["background"] == 0
    r.close()
    assert t.stats()["background"] == 1
    client.get("http://p/v1/responses/resp_1")
    assert created.settled and created.usage is not None
    assert set(ledger.settled) == set(ledger.held)
    reader = r.stream._stream._reader  # httpx's BoundSyncStream over the transport's
    assert type(reader).__name__ == ("_BodyReader" if native and not with_ledger else "_Reader")
