"""Background responses (``background=True``) are charged exactly once, what they used.

The creation answers ``queued``, before the response has run: no usage yet. It stays
charged its estimate (its ledger hold held, its budget sub-call reserved) until a poll
or a cancel reports the usage: then the creation is settled to it and the poll itself is
charged nothing, as is any later poll of it. Bounded (``max_background``), forgotten by a
forked child, settled at the estimate when the transport closes.
"""

from __future__ import annotations

import asyncio
import gc
import importlib
import json
import os
from typing import Any

import pytest
import ratequeue as rq
from background_helpers import (
    _BODY,
    _COMPLETED,
    BURST,
    MODS,
    SPENT,
    USED,
    Chunks,
    Ledger,
    Provider,
    _Once,
    _open,
    _sse,
    _started,
    _stream,
    close_in_a_collection,
    create,
    estimate_of,
    hanging,
    poll_until_done,
    through,
    through_policy,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from ratequeue.httpx import CallBudget, RateLimitedTransport
from ratequeue.httpx._unclosed import DROPPED


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("modname", MODS)
def test_a_background_response_is_charged_once_what_it_used(modname: str, native: bool) -> None:
    mod = importlib.import_module(modname)
    t, client, lim = through(mod, native, Provider())
    created = create(client).extensions["ratequeue"]  # no max_output_tokens: 1,024 held
    estimate = estimate_of(created)
    assert estimate < SPENT
    # Waiting for its usage: the estimate charged, the record not settled.
    assert not created.settled and created.usage is None
    assert lim.available("tokens") == BURST - estimate
    assert t.stats()["background"] == 1
    polls = poll_until_done(client, "resp_1")
    assert len(polls) == 3
    # The creation settled to the usage (the debt over its estimate charged), the polls
    # charged nothing.
    assert created.settled and created.usage == (900, 20_000)
    assert created.charged["tokens"] == SPENT
    assert all(p.settled and p.charged["tokens"] == 0 for p in polls)
    assert lim.available("tokens") == BURST - SPENT
    assert t.stats()["background"] == 0
    # Polled again once it is done: still nothing.
    for _ in range(2):
        again = client.get("http://p/v1/responses/resp_1").extensions["ratequeue"]
        assert again.usage == (0, 0) and again.charged["tokens"] == 0
    assert lim.available("tokens") == BURST - SPENT


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("modname", MODS)
def test_an_estimate_above_the_usage_is_given_back(modname: str, native: bool) -> None:
    mod = importlib.import_module(modname)
    used = {"input_tokens": 100, "output_tokens": 50}
    _t, client, lim = through(mod, native, Provider(usage=used))
    created = create(client, max_output_tokens=4000).extensions["ratequeue"]
    assert lim.available("tokens") == BURST - estimate_of(created)
    poll_until_done(client, "resp_1")
    assert lim.available("tokens") == BURST - 150
    assert created.charged["tokens"] == 150


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("modname", MODS)
def test_a_cancel_reporting_the_usage_settles_the_creation(modname: str, native: bool) -> None:
    mod = importlib.import_module(modname)
    _t, client, lim = through(mod, native, Provider(done=99))
    created = create(client).extensions["ratequeue"]
    client.get("http://p/v1/responses/resp_1")  # in progress: nothing yet
    assert not created.settled
    cancel = client.post("http://p/v1/responses/resp_1/cancel").extensions["ratequeue"]
    assert cancel.charged["tokens"] == 0
    assert created.settled and lim.available("tokens") == BURST - SPENT


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("modname", MODS)
def test_a_streamed_poll_settles_the_creation(modname: str, native: bool) -> None:
    """The poll's body not read yet (as over a network): read by the reference reader."""
    mod = importlib.import_module(modname)
    provider = Provider(done=1)
    _t, client, lim = through(mod, native, provider)
    created = create(client).extensions["ratequeue"]
    provider.streamed = True
    with client.stream("GET", "http://p/v1/responses/resp_1") as r:
        assert json.loads(r.read())["status"] == "completed"
    assert r.extensions["ratequeue"].charged["tokens"] == 0
    assert created.settled and lim.available("tokens") == BURST - SPENT


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("modname", MODS)
def test_a_response_not_created_here_is_charged_what_its_poll_reports(
    modname: str, native: bool
) -> None:
    """Created by another process (or forgotten): its poll is the only place its usage
    shows, so it is charged (never less than used)."""
    mod = importlib.import_module(modname)
    provider = Provider(done=1)
    provider.polls["resp_elsewhere"] = 0
    _t, client, lim = through(mod, native, provider)
    r = client.get("http://p/v1/responses/resp_elsewhere").extensions["ratequeue"]
    assert r.usage == (900, 20_000) and lim.available("tokens") == BURST - SPENT


@pytest.mark.parametrize("native", [True, False])
def test_past_max_background_a_creation_keeps_its_estimate(native: bool) -> None:
    """Bounded: the second creation is not kept (its estimate stays charged, its poll
    is charged its usage: at worst twice, never less); ``max_background=0`` keeps none."""
    mod = importlib.import_module("httpx")
    _t, client, lim = through(mod, native, Provider(done=1), max_background=1)
    first = create(client).extensions["ratequeue"]
    second = create(client).extensions["ratequeue"]
    assert not first.settled and second.settled and second.usage is None
    e1, e2 = estimate_of(first), estimate_of(second)
    assert lim.available("tokens") == BURST - e1 - e2
    client.get("http://p/v1/responses/resp_1")
    client.get("http://p/v1/responses/resp_2")
    assert lim.available("tokens") == BURST - SPENT - e2 - SPENT
    # Room again: a third is kept.
    third = create(client).extensions["ratequeue"]
    assert not third.settled
    _t, client, lim = through(mod, native, Provider(done=1), max_background=0)
    assert create(client).extensions["ratequeue"].settled


def test_max_background_is_checked() -> None:
    mod = importlib.import_module("httpx")
    lim = rq.Limiter(rq.Rate(10, per="second"))
    for bad in (-1, 1.5, True, "3", None):
        with pytest.raises(ValueError, match="max_background"):
            RateLimitedTransport(mod.MockTransport(Provider()), lim, max_background=bad)


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("modname", MODS)
def test_closing_the_transport_settles_what_waits_at_its_estimate(
    modname: str, native: bool
) -> None:
    mod = importlib.import_module(modname)
    ledger = Ledger()
    t, client, lim = through(mod, native, Provider(done=1), ledger=ledger)
    created = create(client).extensions["ratequeue"]
    estimate = estimate_of(created)
    assert ledger.settled == {}
    client.close()  # closes the transport
    assert created.settled and created.usage is None
    assert lim.available("tokens") == BURST - estimate
    assert ledger.settled == {created.request_id: created.estimate}
    assert t.stats()["background"] == 0


@pytest.mark.parametrize("native", [True, False])
def test_the_ledger_and_budget_see_the_usage_once_on_the_creation(native: bool) -> None:
    mod = importlib.import_module("httpx")
    ledger = Ledger()
    _t, client, lim = through(mod, native, Provider(), ledger=ledger)
    with CallBudget(calls=10, tokens=50_000) as budget:
        created = create(client).extensions["ratequeue"]
        assert created.request_id not in ledger.settled  # still held
        polls = poll_until_done(client, "resp_1")
    assert ledger.settled[created.request_id] == (900, 20_000)
    assert all(ledger.settled[p.request_id] == (0, 0) for p in polls)
    assert len(ledger.settled) == 4
    assert budget.tokens_used == SPENT
    assert [s.tokens for s in budget.usage] == [SPENT, 0, 0, 0]
    assert all(s.settled for s in budget.usage)
    assert lim.available("tokens") == BURST - SPENT


@pytest.mark.parametrize("modname", MODS)
def test_asyncio_polls_pay_the_creations_ledger_part(modname: str) -> None:
    mod = importlib.import_module(modname)
    ledger = Ledger()
    t, _client, lim = through(mod, True, Provider(), ledger=ledger)

    async def main() -> Any:
        async with mod.AsyncClient(transport=t) as client:
            body = {"model": "m", "input": "x" * 400, "background": True}
            r = await client.post("http://p/v1/responses", json=body)
            created = r.extensions["ratequeue"]
            while True:
                p = await client.get("http://p/v1/responses/resp_1")
                if p.json()["status"] == "completed":
                    break
            # A second one, left waiting: the client's close settles it off the loop.
            r = await client.post("http://p/v1/responses", json=body)
            return created, r.extensions["ratequeue"]

    created, left = asyncio.run(main())
    assert ledger.settled[created.request_id] == (900, 20_000)
    assert ledger.settled[left.request_id] == left.estimate
    assert len(ledger.settled) == len(ledger.held)
    assert lim.available("tokens") == BURST - SPENT - estimate_of(left)


def test_a_policy_gives_back_its_concurrency_slot_while_the_response_runs() -> None:
    mod = importlib.import_module("httpx")
    client, lim = through_policy(mod, Provider())
    created = create(client).extensions["ratequeue"]
    assert not created.settled
    poll_until_done(client, "resp_1")  # the one slot is free: each poll is granted
    assert created.settled and lim.available("tokens") == BURST - SPENT


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_forgets_the_responses_waiting() -> None:
    mod = importlib.import_module("httpx")
    t, client, _lim = through(mod, True, Provider())
    create(client)
    pid = os.fork()
    if pid == 0:  # the child: its polls are charged what they report
        code = 0 if t.stats()["background"] == 0 and not t._waiting_ids else 1
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert t.stats()["background"] == 1


# -- found by review: each of these failed before its fix ----------------------------------


class Running(Provider):
    """Polls of a response still running report a usage (some compatible servers send
    zeros, or a count so far): only the final status's usage is the response's."""

    def __init__(self, so_far: dict[str, int]) -> None:
        super().__init__(done=3)
        self.so_far = so_far

    def __call__(self, request: Any) -> Any:
        r = super().__call__(request)
        body = json.loads(r.content)
        if body.get("status") == "in_progress":
            mod = importlib.import_module(type(request).__module__.split(".", 1)[0])
            return mod.Response(200, json={**body, "usage": self.so_far})
        return r


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize(
    "so_far", [{"input_tokens": 0, "output_tokens": 0}, {"input_tokens": 900, "output_tokens": 10}]
)
def test_a_poll_still_running_never_settles_the_creation(
    native: bool, so_far: dict[str, int]
) -> None:
    mod = importlib.import_module("httpx")
    _t, client, lim = through(mod, native, Running(so_far))
    created = create(client).extensions["ratequeue"]
    polls = poll_until_done(client, "resp_1")
    assert [p.charged["tokens"] for p in polls] == [0, 0, 0]
    assert created.usage == (900, 20_000) and lim.available("tokens") == BURST - SPENT


class FailingLedger(Ledger):
    def __init__(self) -> None:
        super().__init__()
        self.fail: set[str] = set()

    def settle(self, request_id: str, **kw: Any) -> None:
        if request_id in self.fail:
            raise RuntimeError(f"ledger down for {request_id}")
        super().settle(request_id, **kw)


def test_a_ledger_failing_on_the_creation_leaves_the_poll_settled() -> None:
    """The creation's ledger part raises in the poll: the poll's own permit, budget and
    ledger hold are settled all the same (a Policy's one slot is free again)."""
    mod = importlib.import_module("httpx")
    ledger = FailingLedger()
    client, lim = through_policy(mod, Provider(done=1), ledger=ledger)
    with CallBudget(calls=10) as budget:
        created = create(client).extensions["ratequeue"]
        ledger.fail.add(created.request_id)
        with pytest.raises(RuntimeError, match="ledger down"):
            client.get("http://p/v1/responses/resp_1")
        (poll_id,) = set(ledger.held) - {created.request_id}
        assert ledger.settled[poll_id] == (0, 0)
        assert all(s.settled for s in budget.usage)
        assert created.settled and lim.available("tokens") == BURST - SPENT
        client.post("http://p/v1/chat/completions", json={"model": "m", "messages": []})


@pytest.mark.parametrize("is_async", [False, True])
def test_closing_settles_every_creation_whatever_the_ledger_raises(is_async: bool) -> None:
    mod = importlib.import_module("httpx")
    ledger = FailingLedger()
    t, client, _lim = through(mod, True, Provider(), ledger=ledger)
    ids = [create(client).extensions["ratequeue"].request_id for _ in range(3)]
    ledger.fail.add(ids[1])
    with pytest.raises(RuntimeError, match="ledger down"):
        if is_async:
            asyncio.run(t.aclose())
        else:
            t.close()
    assert set(ledger.settled) == {ids[0], ids[2]} and t.stats()["background"] == 0


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("modname", MODS)
def test_an_id_polled_at_another_host_settles_nothing_here(modname: str, native: bool) -> None:
    """Ids are a provider's own: two providers behind one transport may name responses
    alike, and a poll of one never settles the other's creation."""
    mod = importlib.import_module(modname)
    provider = Provider(done=1)
    t, client, lim = through(mod, native, provider)
    created = create(client).extensions["ratequeue"]
    provider.polls["resp_1"] = 0
    other = client.get("http://q/v1/responses/resp_1").extensions["ratequeue"]
    # The other host's poll is charged what it reports; the creation still waits.
    assert other.usage == (900, 20_000) and other.charged["tokens"] == SPENT
    assert not created.settled and t.stats()["background"] == 1
    polls = poll_until_done(client, "resp_1")
    assert created.settled and created.charged["tokens"] == SPENT
    assert all(p.charged["tokens"] == 0 for p in polls)
    assert lim.available("tokens") == BURST - 2 * SPENT


def test_a_creation_kept_drops_its_request() -> None:
    """What waits is bounded by its count: the request (and its body) is not kept."""
    mod = importlib.import_module("httpx")
    _t, client, _lim = through(mod, True, Provider())
    created = create(client, input="x" * 100_000).extensions["ratequeue"]
    assert created._request is None and created._pending is None
    assert created.model == "m" and created.estimate.input_tokens >= 25_000


def test_the_response_just_settled_is_remembered_first() -> None:
    """Past the bound the oldest settled ids are forgotten, never the one just settled."""
    mod = importlib.import_module("httpx")
    _t, client, lim = through(mod, True, Provider(done=1), max_background=2)
    create(client)
    create(client)
    client.get("http://p/v1/responses/resp_2")
    create(client)
    client.get("http://p/v1/responses/resp_1")  # settled: resp_2 is forgotten instead
    before = lim.available("tokens")
    again = client.get("http://p/v1/responses/resp_1").extensions["ratequeue"]
    assert again.charged["tokens"] == 0 and lim.available("tokens") == before


@pytest.mark.parametrize("native", [True, False])
def test_two_creations_named_alike_are_both_charged(native: bool) -> None:
    """A provider (or a proxy) that answers two creations with one id: no poll can tell
    which it settles, so both keep their estimates and the id's polls are charged."""
    mod = importlib.import_module("httpx")
    provider = Provider(done=1)
    _t, client, lim = through(mod, native, provider)
    first = create(client).extensions["ratequeue"]
    provider.made = 0  # the same id again
    second = create(client).extensions["ratequeue"]
    assert first.settled and second.settled and first.usage is None is second.usage
    client.get("http://p/v1/responses/resp_1")
    client.get("http://p/v1/responses/resp_1")
    assert lim.available("tokens") == BURST - estimate_of(first) - estimate_of(second) - 2 * SPENT


# -- the randomized check: any sequence of creations, polls and cancels ----------------------


class Scripted:
    """A provider whose responses each use ``usage_of(k)``; what the next poll finds is
    set by the test (``running``, ``partial``: running with a count so far, ``done``,
    ``failed``: ended without a usage); ``same_id`` answers the next creation with the id
    of an earlier one."""

    def __init__(self) -> None:
        self.made = 0
        self.final: set[str] = set()
        self.failed: set[str] = set()
        self.next = "running"
        self.same_id: str | None = None
        self.last = ""  # the id of the last creation
        self.streamed = 0  # tokens of the usages creations' streams reported

    @staticmethod
    def usage_of(rid: str) -> dict[str, int]:
        k = int(rid.split("_")[1])
        return {"input_tokens": 100 + k, "output_tokens": 1000 * k + 7}

    def __call__(self, request: Any) -> Any:
        mod = importlib.import_module(type(request).__module__.split(".", 1)[0])
        path = request.url.path
        if request.method == "POST" and path.endswith("/responses"):
            self.made += 1
            rid, self.same_id = self.same_id or f"resp_{self.made}", None
            self.last = rid
            headers = {"content-type": "text/event-stream"}
            if b'"open"' in request.content:  # streamed as the test reads it
                return mod.Response(200, headers=headers, stream=self.open_stream(mod, rid))
            if b'"stream"' in request.content:  # named by its stream, cut before its usage
                body = b"data: " + json.dumps(_started(rid)).encode() + b"\n\n"
                return mod.Response(200, headers=headers, stream=_Once(mod, body, cut=True))
            return mod.Response(200, json={"id": rid, "status": "queued", "usage": None})
        rid = path.split("/responses/", 1)[1].split("/")[0]
        if rid not in self.final and (rid in self.failed or self.next == "failed"):
            self.failed.add(rid)
            return mod.Response(200, json={"id": rid, "status": "failed", "usage": None})
        if path.endswith("/cancel") or self.next == "done" or rid in self.final:
            self.final.add(rid)
            status = "cancelled" if path.endswith("/cancel") else "completed"
            return mod.Response(
                200, json={"id": rid, "status": status, "usage": self.usage_of(rid)}
            )
        so_far = {"input_tokens": 1, "output_tokens": 1} if self.next == "partial" else None
        return mod.Response(200, json={"id": rid, "status": "in_progress", "usage": so_far})

    def open_stream(self, mod: Any, rid: str) -> Any:
        """The creation's stream: its first event, then (read on) its completion with
        the usage, reported then."""
        provider = self

        class Open(mod.SyncByteStream):  # type: ignore[misc]
            def __iter__(self) -> Any:
                yield _sse(_started(rid))
                if rid in provider.failed:
                    failed = {"id": rid, "status": "failed", "usage": None}
                    yield _sse({"type": "response.failed", "response": failed})
                    return
                done = {"id": rid, "status": "completed", "usage": provider.usage_of(rid)}
                provider.final.add(rid)
                provider.streamed += sum(provider.usage_of(rid).values())
                yield _sse({"type": "response.completed", "response": done})

        return Open()


_OPS = st.lists(
    st.one_of(
        st.tuples(
            st.just("create"),
            st.sampled_from([None, 10, 5000]),
            st.sampled_from(["json", "cut", "open"]),
        ),
        # An open stream read to its end (True) or closed before its usage.
        st.tuples(st.just("finish"), st.integers(0, 3), st.booleans()),
        # An open stream dropped unclosed (garbage-collected).
        st.tuples(st.just("abandon"), st.integers(0, 3)),
        st.tuples(
            st.just("poll"),
            st.integers(1, 8),
            st.sampled_from(["running", "partial", "done", "failed"]),
        ),
        st.tuples(st.just("cancel"), st.integers(1, 8)),
        st.tuples(st.just("same_id"), st.integers(1, 8)),
    ),
    max_size=25,
)


@settings(max_examples=150, deadline=None)
@given(
    ops=_OPS,
    native=st.booleans(),
    room=st.sampled_from([1, 3, 1000]),
    close_first=st.booleans(),
)
def test_any_sequence_is_charged_at_least_what_was_used_and_settles_once(
    ops: list[tuple[Any, ...]], native: bool, room: int, close_first: bool
) -> None:
    """Never less than used (every final usage charged), each ledger request settled
    once; exactly the usages when every creation was kept under its own id; at worst
    each estimate plus each final report. Creations streamed are polled while their
    streams are open too, dropped unclosed, or outlive the transport's close
    (``close_first``)."""
    mod = importlib.import_module("httpx")
    provider = Scripted()
    ledger = Ledger()  # asserts each request is settled at most once
    t, client, lim = through(mod, native, provider, ledger=ledger, max_background=room)
    estimates: dict[str, int] = {}
    reports = 0  # tokens of every usage a poll reported (what the old rule charged)
    untracked = False  # a creation not kept: the exact rule does not hold
    opened: list[tuple[Any, Any, Any, str]] = []  # open: response, chunks, record, id

    def finish(i: int, to_end: bool) -> None:
        nonlocal untracked
        r, chunks, rec, _rid = opened.pop(i)
        if to_end:
            for _ in chunks:
                pass
        r.close()
        if not to_end and rec.settled and rec.usage is None:
            untracked = True  # closed past the bound: keeps its estimate, polls charged

    for op in ops:
        if op[0] == "finish":
            if opened:
                finish(op[1] % len(opened), op[2])
            continue
        if op[0] == "abandon":
            if opened:
                r, chunks, rec, _rid = opened.pop(op[1] % len(opened))
                del r, chunks, rec
                gc.collect()
                assert DROPPED.flush(10)  # settled as a close would, kept or not
            continue
        if op[0] == "create":
            extra: dict[str, Any] = {} if op[1] is None else {"max_output_tokens": op[1]}
            if op[2] != "json":
                extra["stream"] = True
            if op[2] == "open":
                extra["open"] = True
                if t.stats()["background"] >= room:
                    untracked = True  # past the bound: its polls are charged
                r = client.send(
                    client.build_request("POST", "http://p/v1/responses", json=_BODY | extra),
                    stream=True,
                )
                chunks = r.iter_raw()
                next(chunks)  # named
                rec = r.extensions["ratequeue"]
                opened.append((r, chunks, rec, provider.last))
            elif op[2] == "cut":
                rec = _stream(mod, client, "POST", "http://p/v1/responses", json=_BODY | extra)
            else:
                rec = create(client, **extra).extensions["ratequeue"]
            rid = provider.last
            if rid in {k.split("#")[0] for k in estimates} or rec.settled:
                untracked = True  # named alike, or past the bound
            estimates[f"{rid}#{len(estimates)}"] = estimate_of(rec)
        elif op[0] == "same_id":
            if f"resp_{op[1]}" in {k.split("#")[0] for k in estimates}:
                provider.same_id = f"resp_{op[1]}"
        else:
            rid = f"resp_{op[1]}"
            if rid not in {k.split("#")[0] for k in estimates}:
                continue
            provider.next = op[2] if op[0] == "poll" else "done"
            if rid in provider.final and (b"p", rid) not in t._background._ids:
                untracked = True  # settled, then forgotten past the bound: charged again
            url = f"http://p/v1/responses/{rid}" + ("/cancel" if op[0] == "cancel" else "")
            r = client.request("POST" if op[0] == "cancel" else "GET", url)
            reported = r.json()["usage"]
            if reported:
                reports += sum(reported.values())
    if close_first:
        client.close()  # open streams outlive it: each one's end settles it
    while opened:
        finish(0, False)
    reports += provider.streamed
    if close_first:
        assert t.stats()["background"] == 0
    charged = BURST - lim.available("tokens")
    used = sum(sum(Scripted.usage_of(rid).values()) for rid in provider.final)
    waiting_estimates = sum(
        e for k, e in estimates.items() if k.split("#")[0] not in provider.final
    )
    assert charged >= used
    assert charged <= sum(estimates.values()) + reports
    if not untracked:
        assert charged == used + waiting_estimates
        if not close_first:
            # Waiting: the creations not ended (a stream dropped unclosed was settled as
            # cut, so it waits as any creation: a poll that says it ended settles it).
            rids = {k.split("#")[0] for k in estimates}
            waiting = rids - (provider.final | provider.failed)
            assert t.stats()["background"] == len(waiting)
    client.close()
    assert t.stats()["background"] == 0
    assert set(ledger.settled) == set(ledger.held)
    assert BURST - lim.available("tokens") == charged  # the waiting kept their estimates


class Odd(Provider):
    """The final poll answers ``final`` (a status, with or without a usage)."""

    def __init__(self, final: dict[str, Any]) -> None:
        super().__init__(done=2)
        self.final = final

    def __call__(self, request: Any) -> Any:
        r = super().__call__(request)
        body = json.loads(r.content)
        if request.method == "GET" and body.get("status") == "completed":
            mod = importlib.import_module(type(request).__module__.split(".", 1)[0])
            return mod.Response(200, json={**body, **self.final})
        return r


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("status", [["completed"], {"a": 1}, 7, None])
def test_a_poll_with_an_odd_status_is_not_final(native: bool, status: Any) -> None:
    """Not a final status: the poll is charged nothing and the creation waits on."""
    mod = importlib.import_module("httpx")
    t, client, lim = through(mod, native, Odd({"status": status}))
    created = create(client).extensions["ratequeue"]
    for _ in range(3):
        assert client.get("http://p/v1/responses/resp_1").extensions["ratequeue"].settled
    assert not created.settled and t.stats()["background"] == 1
    assert lim.available("tokens") == BURST - estimate_of(created)


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("status", ["failed", "cancelled", "incomplete"])
def test_a_final_status_without_a_usage_settles_the_creation_at_its_estimate(
    native: bool, status: str
) -> None:
    mod = importlib.import_module("httpx")
    t, client, lim = through(mod, native, Odd({"status": status, "usage": None}))
    created = create(client).extensions["ratequeue"]
    while client.get("http://p/v1/responses/resp_1").json()["status"] == "in_progress":
        pass
    assert created.settled and created.usage is None and t.stats()["background"] == 0
    assert lim.available("tokens") == BURST - estimate_of(created)
    again = client.get("http://p/v1/responses/resp_1").extensions["ratequeue"]
    assert again.charged["tokens"] == 0


@pytest.mark.parametrize("modname", MODS)
def test_a_close_inside_a_garbage_collection_leaves_the_waiting_to_the_thread(
    modname: str,
) -> None:
    """Found in stop 41: an SDK client's ``__del__`` closes the transport wherever the
    collector runs, possibly in a thread holding the transport's background lock (a
    plain lock): the close drained the waiting creations there and hung that thread for
    good. Now the settling thread drains them; the close waits for nothing."""
    import threading

    from ratequeue.httpx._unclosed import ready

    mod = importlib.import_module(modname)
    ledger = Ledger()
    t, client, lim = through(mod, True, Provider(done=1), ledger=ledger)
    created = create(client).extensions["ratequeue"]
    estimate = estimate_of(created)
    ready()  # the settling thread runs (started with a process's first stream)

    class Closer:  # an SDK client's wrapper, in a reference cycle
        def __init__(self) -> None:
            self.me = self

        def __del__(self) -> None:
            t.close()

    def collect_holding_the_lock() -> None:
        Closer()
        with t._background._lock:  # as in keep(), where an allocation may collect
            gc.collect()

    worker = threading.Thread(target=collect_holding_the_lock, daemon=True)
    worker.start()
    worker.join(10)
    assert not worker.is_alive(), "the close inside the collection hung its thread"
    assert DROPPED.flush(10)
    assert created.settled and created.usage is None
    assert lim.available("tokens") == BURST - estimate
    assert ledger.settled == {created.request_id: created.estimate}
    assert t.stats()["background"] == 0


def _run_script(tmp_path: Any, name: str, code: str) -> str:
    """``code`` in a fresh interpreter (tests/ on its path); its output."""
    import subprocess
    import sys

    script = tmp_path / name
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script.write_text(f"import sys; sys.path.insert(0, {here!r})\n" + code)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


_GC_CLOSE = """
import gc, importlib, threading
from background_helpers import Ledger, Provider, through, create
from ratequeue.httpx._unclosed import DROPPED

mod = importlib.import_module("httpx")
ledger = Ledger()
t, client, lim = through(mod, True, Provider(done=5), ledger=ledger)
created = create(client).extensions["ratequeue"]

class SDKClient:
    def __init__(self): self.me = self
    def __del__(self): t.close()
"""


def test_a_close_inside_a_collection_in_a_process_that_never_streamed(tmp_path: Any) -> None:
    """Found by review (stop 41): the settling thread started only with a first stream,
    and the collector hook with it; a process whose creations were JSON answers closed
    inline inside the collection, and hung there on the background lock."""
    out = _run_script(
        tmp_path,
        "never_streamed.py",
        _GC_CLOSE
        + """
def collect_holding_the_lock():
    SDKClient()
    with t._background._lock:
        gc.collect()

w = threading.Thread(target=collect_holding_the_lock, daemon=True)
w.start(); w.join(10)
assert not w.is_alive(), "hung"
assert DROPPED.flush(10)
assert created.settled and set(ledger.settled) == set(ledger.held)
print("ok")
""",
    )
    assert out.strip() == "ok"


def test_a_close_inside_a_collection_just_before_exit_is_settled(tmp_path: Any) -> None:
    """Found by review (stop 41): a close the collector ran left the waiting creations
    to the settling thread, which the exit did not wait for: the ledger hold was never
    settled. The exit now flushes that thread first."""
    log = tmp_path / "ledger.log"
    script = f"""
import gc, importlib
from background_helpers import Provider, through, create

class FileLedger:
    def hold(self, request_id, account, **kw):
        open({str(log)!r}, "a").write("hold\\n")
    def settle(self, request_id, **kw):
        open({str(log)!r}, "a").write("settle\\n")
    def release(self, request_id):
        open({str(log)!r}, "a").write("release\\n")

mod = importlib.import_module("httpx")
t, client, lim = through(mod, True, Provider(done=5), ledger=FileLedger())
created = create(client).extensions["ratequeue"]
assert not created.settled

class SDKClient:
    def __init__(self): self.me = self
    def __del__(self): t.close()

SDKClient()
del created
gc.collect()  # the program's last allocations collect the client
"""
    for _ in range(3):
        log.unlink(missing_ok=True)
        _run_script(tmp_path, "at_exit.py", script)
        assert log.read_text() == "hold\nsettle\n"


def test_a_close_inside_a_collection_settles_readers_the_thread_was_not_given() -> None:
    """Found by review (stop 41): a stream dropped while the settling thread could not
    take it (not started yet) waits in its transport; a close the collector ran left
    only the background drain to the thread, which let its creation go: never settled."""
    from ratequeue.httpx._unclosed import ready

    mod = importlib.import_module("httpx")
    ledger = Ledger()
    t, client, _ = through(mod, True, Chunks(_started("resp_7"), _COMPLETED), ledger=ledger)
    r, chunks, created = _open(client)
    ready()
    DROPPED.running = False  # as if the thread had not started yet at the drop
    try:
        del r, chunks
        gc.collect()
    finally:
        DROPPED.running = True
    assert len(t._unclosed.readers) == 1

    close_in_a_collection(t)
    assert DROPPED.flush(10)
    assert created.settled and set(ledger.settled) == set(ledger.held)


def test_a_close_racing_the_end_of_a_kept_creation_pays_its_ledger_part(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Found by review (stop 41): a close in another thread while a JSON body's end kept
    its creation finished the reader a second time; that second settle took the call for
    its own twin and left its ledger part owed to nobody."""
    import threading

    mod = importlib.import_module("httpx")
    answer = json.dumps({"id": "resp_1", "status": "queued", "usage": None}).encode()

    def provider(request: Any) -> Any:
        if request.method == "POST":  # a body of unknown length: read as a stream
            headers = {"content-type": "application/json"}
            return mod.Response(200, headers=headers, stream=_Once(mod, answer))
        return mod.Response(200, json={"id": "resp_1", "status": "completed", "usage": USED})

    ledger = Ledger()
    t, client, _ = through(mod, True, provider, ledger=ledger)
    r = client.send(client.build_request("POST", "http://p/v1/responses", json=_BODY), stream=True)
    created = r.extensions["ratequeue"]
    real_keep, first = type(t._background).keep, [True]

    def keep(self: Any, *a: Any, **kw: Any) -> Any:
        out = real_keep(self, *a, **kw)
        if first.pop() if first else False:
            closer = threading.Thread(target=r.close)  # between keep and the rest
            closer.start()
            closer.join(10)
        return out

    monkeypatch.setattr(type(t._background), "keep", keep)
    r.read()
    monkeypatch.undo()
    r.close()
    client.get("http://p/v1/responses/resp_1")
    assert created.settled and created._owed is None
    assert set(ledger.settled) == set(ledger.held)


def test_a_ledger_hanging_in_a_collected_close_holds_up_no_other_transport() -> None:
    """Found by review (stop 41): the settling thread paid a collected close's ledger
    parts itself: a ledger that never answered there stopped the settle of every other
    transport's dropped streams (a Policy's slot held for good). They go to the
    ledger's worker threads, as a dropped stream's do."""
    import sys
    import threading

    sys.path.insert(0, os.path.dirname(__file__))
    from ratequeue.httpx._unclosed import ready
    from test_httpx_dropped import BODY, CHAT, open_and_drop, policy_transport

    ready()
    mod = importlib.import_module("httpx")
    release, entered = threading.Event(), threading.Event()

    ledger = hanging(Ledger, entered, release)
    slow_t, slow_client, _ = through(mod, True, Provider(done=5), ledger=ledger)
    create(slow_client)
    quick = mod.Client(transport=policy_transport(mod))  # one concurrency slot
    try:
        close_in_a_collection(slow_t)  # queued to the settling thread
        assert entered.wait(10)
        record = open_and_drop(quick)
        gc.collect()
        passed = threading.Event()
        DROPPED.put(passed.set)
        assert passed.wait(5) and record.settled
        quick.post(CHAT, json=BODY)  # its one slot is free
    finally:
        release.set()
        DROPPED.flush(10)


@pytest.mark.parametrize("in_gc", [False, True])
def test_a_waiting_creation_whose_settle_fails_at_the_close_is_paid(in_gc: bool) -> None:
    """Found by review (stop 41): a close the collector ran paid a creation's ledger part
    only when its settle at the estimate returned; one that raised after leaving it owed
    kept its hold for good (the plain close pays it in a ``finally``)."""
    from ratequeue.httpx._unclosed import ready

    mod = importlib.import_module("httpx")
    ledger = Ledger()
    t, client, _ = through(mod, True, Provider(done=5), ledger=ledger)
    create(client)
    assert len(ledger.held) == 1 and not ledger.settled
    ready()
    real = t._at_estimate

    def at_estimate(call: Any) -> None:
        real(call)  # settled, its ledger part left owed
        raise RuntimeError("a permit's settle failed")

    t._at_estimate = at_estimate  # type: ignore[method-assign]
    if in_gc:
        close_in_a_collection(t)
        assert DROPPED.flush(10)
    else:
        with pytest.raises(RuntimeError):
            t.close()
    assert set(ledger.settled) == set(ledger.held)
