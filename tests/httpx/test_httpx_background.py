"""Background responses (``background=True``) are charged exactly once, what they used.

The creation answers ``queued``, before the response has run: no usage yet. It stays
charged its estimate (its ledger hold held, its budget sub-call reserved) until a poll
or a cancel reports the usage: then the creation is settled to it and the poll itself is
charged nothing, as is any later poll of it. Bounded (``max_background``), forgotten by a
forked child, settled at the estimate when the transport closes.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import importlib
import json
import os
from typing import Any

import pytest
import ratequeue as rq
from hypothesis import given, settings
from hypothesis import strategies as st
from ratequeue.httpx import CallBudget, RateLimitedTransport

MODS = ["httpx", "httpx2"]
BURST = 100_000
USED = {"input_tokens": 900, "output_tokens": 20_000}
STREAM = {"stream": True}
SPENT = 20_900


class Provider:
    """A Responses API: creations answer ``queued``; each response completes at its
    ``done``-th poll (or when cancelled), reporting ``usage``."""

    def __init__(self, done: int = 3, usage: dict[str, int] | None = None) -> None:
        self.done = done
        self.usage = usage or USED
        self.made = 0
        self.polls: dict[str, int] = {}
        self.streamed = False  # answer polls with a stream (not read yet)

    def __call__(self, request: Any) -> Any:
        mod = importlib.import_module(type(request).__module__.split(".", 1)[0])
        path = request.url.path
        if path.endswith("/chat/completions"):
            return mod.Response(200, json={"usage": {"prompt_tokens": 1, "completion_tokens": 1}})
        if request.method == "POST" and path.endswith("/responses"):
            self.made += 1
            rid = f"resp_{self.made}"
            self.polls[rid] = 0
            return mod.Response(200, json={"id": rid, "status": "queued", "usage": None})
        rid = path.split("/responses/", 1)[1].split("/")[0]
        n = self.polls.get(rid, 0) + 1
        self.polls[rid] = n
        if path.endswith("/cancel"):
            body = {"id": rid, "status": "cancelled", "usage": self.usage}
        elif n >= self.done:
            body = {"id": rid, "status": "completed", "usage": self.usage}
        else:
            body = {"id": rid, "status": "in_progress", "usage": None}
        if self.streamed:
            data = json.dumps(body).encode()
            headers = {"content-type": "application/json"}
            return mod.Response(200, headers=headers, stream=_Once(mod, data))
        return mod.Response(200, json=body)


def _Once(mod: Any, data: bytes, cut: bool = False) -> Any:
    """``data`` as one chunk; ``cut``: then the connection drops (a read error)."""

    class Once(mod.SyncByteStream, mod.AsyncByteStream):  # type: ignore[misc]
        def __iter__(self) -> Any:
            yield data
            if cut:
                raise mod.ReadError("connection dropped")

        async def __aiter__(self) -> Any:
            yield data
            if cut:
                raise mod.ReadError("connection dropped")

    return Once()


def through(
    mod: Any, native: bool, provider: Any, **kw: Any
) -> tuple[RateLimitedTransport, Any, rq.Limiter]:
    lim = rq.Limiter(
        rq.Rate(1000, per="second", burst=1000),
        rq.Rate(BURST, per="minute", burst=BURST, unit="tokens"),
        clock=rq.ManualClock(),
    )
    t = RateLimitedTransport(mod.MockTransport(provider), lim, timeout=0.0, **kw)
    if not native:
        t._reader = None
        t._native_settle = False
        t._native_stream = False
    return t, mod.Client(transport=t), lim


_BODY = {"model": "m", "input": "x" * 400, "background": True}


def create(client: Any, **extra: Any) -> Any:
    return client.post("http://p/v1/responses", json=_BODY | extra)


def estimate_of(record: Any) -> int:
    return int(record.estimate.input_tokens + record.estimate.output_tokens)


def poll_until_done(client: Any, rid: str) -> list[Any]:
    records = []
    while True:
        r = client.get(f"http://p/v1/responses/{rid}")
        records.append(r.extensions["ratequeue"])
        if r.json()["status"] == "completed":
            return records


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


class Ledger:
    """Records each request's hold and its one settle (a second settle fails)."""

    def __init__(self) -> None:
        self.held: dict[str, tuple[int, int]] = {}
        self.settled: dict[str, tuple[int, int]] = {}

    def hold(self, request_id: str, account: str, **kw: Any) -> None:
        self.held[request_id] = (kw["input_tokens"], kw["output_tokens"])

    def settle(self, request_id: str, **kw: Any) -> None:
        assert request_id in self.held and request_id not in self.settled
        self.settled[request_id] = (kw["input_tokens"], kw["output_tokens"])

    def release(self, request_id: str) -> None:
        assert request_id in self.held and request_id not in self.settled
        self.settled[request_id] = (0, 0)


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


def through_policy(mod: Any, provider: Any, slots: int = 1, **kw: Any) -> tuple[Any, rq.Limiter]:
    """A client over a Policy of ``slots`` concurrency slots and ``through``'s limiter."""
    lim = rq.Limiter(
        rq.Rate(100, per="second", burst=100),
        rq.Rate(BURST, per="minute", burst=BURST, unit="tokens"),
        clock=rq.ManualClock(),
    )
    policy = rq.Policy({"conc": rq.Concurrency(slots), "cluster": lim})
    t = RateLimitedTransport(
        mod.MockTransport(provider),
        policy,
        upstream=lim,
        units=["requests", "tokens"],
        timeout=0.0,
        **kw,
    )
    return mod.Client(transport=t), lim


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

    abandoned: set[str] = set()
    lost: set[str] = set()  # ledger holds of streams dropped unclosed and not kept
    for op in ops:
        if op[0] == "finish":
            if opened:
                finish(op[1] % len(opened), op[2])
            continue
        if op[0] == "abandon":
            if opened:
                r, chunks, rec, rid = opened.pop(op[1] % len(opened))
                abandoned.add(rid)
                if rec._rkey is None:  # not kept (past the bound): nothing settles it
                    lost.add(rec.request_id)
                del r, chunks, rec
                gc.collect()
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
            # Waiting: the creations not ended, and those dropped unclosed a poll said
            # ended without a usage (still open: the close settles them).
            rids = {k.split("#")[0] for k in estimates}
            ended = provider.final | provider.failed
            waiting = (rids - ended) | (abandoned & provider.failed - provider.final)
            assert t.stats()["background"] == len(waiting)
    client.close()
    assert t.stats()["background"] == 0
    assert set(ledger.settled) == set(ledger.held) - lost
    assert BURST - lim.available("tokens") == charged  # the waiting kept their estimates


# -- a background response streamed from its creation ---------------------------------------


def _sse(*events: dict[str, Any]) -> bytes:
    return b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events)


def _started(rid: str, kind: str = "response.created", background: bool = True) -> dict[str, Any]:
    response = {"id": rid, "status": "queued", "background": background, "usage": None}
    return {"type": kind, "response": response}


class Streamed:
    """``stream=True, background=True``: the creation's stream names the response, then
    the connection drops before its usage; a resumed stream (``GET …?stream=true``) ends
    with it (or drops again: ``resumed_cut``); ``ends``: the creation's stream ends
    there, without a usage (done: a completed event too long to read, say)."""

    def __init__(
        self,
        background: bool = True,
        resumed_cut: bool = False,
        ends: bool = False,
        failed: bool = False,
    ) -> None:
        self.background = background
        self.resumed_cut = resumed_cut
        self.ends = ends
        self.failed = failed  # the resumed stream ends with response.failed, no usage

    def __call__(self, request: Any) -> Any:
        mod = importlib.import_module(type(request).__module__.split(".", 1)[0])
        headers = {"content-type": "text/event-stream"}
        if request.method == "POST":
            body = _sse(_started("resp_7", background=self.background))
            return mod.Response(200, headers=headers, stream=_Once(mod, body, not self.ends))
        done = {"id": "resp_7", "status": "completed", "background": True, "usage": USED}
        events = [_started("resp_7", "response.in_progress")]
        if self.failed:
            failed = {**done, "status": "failed", "usage": None}
            events.append({"type": "response.failed", "response": failed})
        elif not self.resumed_cut:
            events.append({"type": "response.completed", "response": done})
        return mod.Response(
            200, headers=headers, stream=_Once(mod, _sse(*events), self.resumed_cut)
        )


def _stream(mod: Any, client: Any, method: str, url: str, **kw: Any) -> Any:
    """The record of a streamed call read to its end, or to its connection's drop."""
    with client.stream(method, url, **kw) as r, contextlib.suppress(mod.ReadError):
        r.read()
    return r.extensions["ratequeue"]


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


class Chunks:
    """A creation streamed in ``events`` chunks (one event each); a poll answers the
    response ``completed`` with its usage (JSON)."""

    def __init__(self, *events: dict[str, Any], cut: bool = False) -> None:
        self.events = events
        self.cut = cut
        self.running = False  # polls answer in_progress, without a usage
        self.before_first: Any = None  # run before the stream's first chunk

    def __call__(self, request: Any) -> Any:
        mod = importlib.import_module(type(request).__module__.split(".", 1)[0])
        if request.method == "POST" and b'"stream"' not in request.content:
            return mod.Response(200, json={"id": "resp_7", "status": "queued", "usage": None})
        if request.method == "POST":
            chunks = [_sse(e) for e in self.events]
            cut, first = self.cut, self.before_first

            class Stream(mod.SyncByteStream, mod.AsyncByteStream):  # type: ignore[misc]
                def __iter__(self) -> Any:
                    if first is not None:
                        first()
                    yield from chunks
                    if cut:
                        raise mod.ReadError("connection dropped")

                async def __aiter__(self) -> Any:
                    for c in chunks:
                        yield c
                    if cut:
                        raise mod.ReadError("connection dropped")

            headers = {"content-type": "text/event-stream"}
            return mod.Response(200, headers=headers, stream=Stream())
        if self.running:
            return mod.Response(200, json={"id": "resp_7", "status": "in_progress"})
        done = {"id": "resp_7", "status": "completed", "background": True, "usage": USED}
        return mod.Response(200, json=done)


_COMPLETED = {
    "type": "response.completed",
    "response": {"id": "resp_7", "status": "completed", "background": True, "usage": USED},
}


def _open(client: Any, body: dict[str, Any] | None = None) -> tuple[Any, Any, Any]:
    """A creation streamed, read up to its first event (it names the response): the
    response, its chunks left and its record."""
    req = client.build_request("POST", "http://p/v1/responses", json=body or _BODY | STREAM)
    r = client.send(req, stream=True)
    chunks = r.iter_raw()
    next(chunks)
    return r, chunks, r.extensions["ratequeue"]


def _drain(mod: Any, r: Any, chunks: Any) -> None:
    with contextlib.suppress(mod.ReadError):
        for _ in chunks:
            pass
    r.close()


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


# -- an open stream is settled only by its own end (adversarial review, stop 39) ------------


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

    def keep(self: Any, call: Any, body: Any, rid: Any) -> Any:
        if not polls:
            polls.append(client.get("http://p/v1/responses/resp_7").extensions["ratequeue"])
        return real_keep(self, call, body, rid)

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

    def take(self: Any, call: Any, final: bool, usage: Any) -> Any:
        out = real_take(self, call, final, usage)
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
def test_threads_racing_an_open_stream_never_undercharge_it(cut: bool, close: bool) -> None:
    """A poll reporting the final usage (and a close) in other threads race the stream
    being read to its end or cut: the usage is charged, each ledger hold settled once,
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
        _drain(mod, r, chunks)
        for th in others:
            th.join(30)
        if not created.settled:  # cut before the poll: waits for the next one
            assert cut and not close, i
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


# -- third review, stop 39 ----------------------------------------------------------------


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
    assert created.settled and twin.settled and t.stats()["background"] == 0
    assert set(ledger.settled) == set(ledger.held)
    assert lim.available("tokens") == BURST - estimate_of(created) - estimate_of(twin)
