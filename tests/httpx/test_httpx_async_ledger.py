"""The async transport calls its ledger off the event loop (the ledger's asyncio twins,
or a worker thread): the loop keeps serving while a hold, settle or release is slow,
and cancellation still gives everything back."""

from __future__ import annotations

import asyncio
import importlib
import json
import sqlite3
import threading
from pathlib import Path
from typing import Any

import pytest
import ratequeue as rq
from ratequeue.httpx import RateLimitedTransport
from ratequeue.ledger import Plan, SqliteLedger

pytestmark = pytest.mark.timeout(60)

CHAT = "/v1/chat/completions"
BODY = {"model": "gpt-x", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 50}
USAGE = {"usage": {"prompt_tokens": 12, "completion_tokens": 30}}
# How long a gated ledger call waits for the test to open its gate: only reached when
# the event loop is blocked (the test would fail, not hang).
GATE = 10.0


@pytest.fixture(params=["httpx", "httpx2"])
def mod(request: pytest.FixtureRequest) -> Any:
    return importlib.import_module(request.param)


def limiter() -> rq.Limiter:
    return rq.Limiter(
        rq.Rate(600, per="minute", burst=50),
        rq.Rate(600_000, per="minute", burst=100_000, unit="tokens"),
        clock=rq.ManualClock(),
    )


class Gates:
    """Each ledger call, on entering, signals and then waits for the test to let it go."""

    def __init__(self) -> None:
        self.entered = {n: threading.Event() for n in ("hold", "settle", "release")}
        self.go = {n: threading.Event() for n in ("hold", "settle", "release")}
        self.threads: dict[str, int] = {}

    def pass_(self, name: str) -> None:
        self.threads[name] = threading.get_ident()
        self.entered[name].set()
        if not self.go[name].wait(GATE):
            raise AssertionError(f"the event loop did not run while the ledger's {name} ran")

    async def open(self, name: str) -> None:
        """Wait (in a thread: the loop stays free) for ``name`` to start, then let it go."""
        assert await asyncio.to_thread(self.entered[name].wait, GATE), f"{name} never called"
        self.go[name].set()


class PlainLedger:
    """A ledger without asyncio twins: the transport runs it on a worker thread."""

    def __init__(self) -> None:
        self.gates = Gates()
        self.log: list[tuple[str, str, dict[str, Any]]] = []

    def hold(self, request_id: str, account: str, **kw: Any) -> None:
        self.gates.pass_("hold")
        self.log.append(("hold", request_id, kw))

    def settle(self, request_id: str, **kw: Any) -> None:
        self.gates.pass_("settle")
        self.log.append(("settle", request_id, kw))

    def release(self, request_id: str) -> None:
        self.gates.pass_("release")
        self.log.append(("release", request_id, {}))


class TwinLedger(SqliteLedger):
    """A real SQLite ledger that records which of its asyncio twins were used."""

    def __init__(self, path: Path) -> None:
        super().__init__(path, busy_timeout=GATE)
        self.twins: list[str] = []

    async def hold_async(self, request_id: str, account: str, **kw: Any) -> Any:
        self.twins.append("hold")
        return await super().hold_async(request_id, account, **kw)

    async def settle_async(self, request_id: str, **kw: Any) -> Any:
        self.twins.append("settle")
        return await super().settle_async(request_id, **kw)

    async def release_async(self, request_id: str) -> None:
        self.twins.append("release")
        await super().release_async(request_id)


class WriteLock:
    """Another connection holding the database's write lock: the ledger's writes wait
    for it (up to its busy timeout), as they would behind a slow writer."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.conn: sqlite3.Connection | None = None
        self.taken = asyncio.Event()

    def take(self) -> None:
        self.conn = sqlite3.connect(self.path, isolation_level=None)
        self.conn.execute("BEGIN IMMEDIATE")
        self.taken.set()

    def give(self) -> None:
        assert self.conn is not None
        self.conn.execute("COMMIT")
        self.conn.close()


async def blocked_while_the_loop_ticks(task: asyncio.Task[Any], lock: WriteLock) -> int:
    """With the write lock taken, the loop keeps running (counted) while ``task`` waits
    on the ledger; then the lock is given back and ``task`` finishes."""
    await lock.taken.wait()
    ticks = 0
    for _ in range(20):
        await asyncio.sleep(0.01)
        ticks += 1
    assert not task.done()  # its ledger write is waiting for the lock
    lock.give()
    await task
    return ticks


def provider(mod: Any, status: int = 200) -> Any:
    return mod.MockTransport(lambda req: mod.Response(status, json=USAGE if status == 200 else {}))


async def ticking(gates: Gates, names: tuple[str, ...], call: Any) -> tuple[Any, int]:
    """Run ``call`` while the loop counts its own ticks; open each gate in turn."""
    ticks = 0
    stop = asyncio.Event()

    async def tick() -> None:
        nonlocal ticks
        while not stop.is_set():
            ticks += 1
            await asyncio.sleep(0)

    ticker = asyncio.create_task(tick())
    task = asyncio.create_task(call)
    for name in names:
        await gates.open(name)
    result = await task
    stop.set()
    await ticker
    return result, ticks


def test_plain_ledger_runs_on_a_worker_thread_while_the_loop_serves(mod: Any) -> None:
    led = PlainLedger()

    async def main() -> tuple[Any, int, int]:
        t = RateLimitedTransport(provider(mod), limiter(), ledger=led, account="acme")
        async with mod.AsyncClient(transport=t, base_url="http://p") as c:
            r, ticks = await ticking(led.gates, ("hold", "settle"), c.post(CHAT, json=BODY))
            return r, ticks, threading.get_ident()

    r, ticks, loop_thread = asyncio.run(main())
    assert r.status_code == 200 and r.extensions["ratequeue"].usage == (12, 30)
    assert ticks > 0
    assert set(led.gates.threads) == {"hold", "settle"}
    assert loop_thread not in led.gates.threads.values()
    assert [e[0] for e in led.log] == ["hold", "settle"]
    assert led.log[1][2] == {"input_tokens": 12, "output_tokens": 30, "calls": 1, "model": "gpt-x"}


@pytest.mark.parametrize("blocked", ["hold", "settle", "release"])
def test_real_ledger_is_awaited_through_its_asyncio_twins(
    mod: Any, tmp_path: Path, blocked: str
) -> None:
    path = tmp_path / "q.db"
    led = TwinLedger(path)
    led.set_plan("acme", Plan("pro", tokens=1_000))
    lock = WriteLock(path)
    status = 429 if blocked == "release" else 200

    def answer(req: Any) -> Any:
        if blocked != "hold":
            lock.take()  # the settle or release after this response waits for it
        return mod.Response(status, json=USAGE if status == 200 else {})

    async def main() -> Any:
        t = RateLimitedTransport(mod.MockTransport(answer), limiter(), ledger=led, account="acme")
        async with mod.AsyncClient(transport=t, base_url="http://p") as c:
            if blocked == "hold":
                lock.take()
            call = c.post(CHAT, json=BODY, headers={"Idempotency-Key": "req-1"})
            task = asyncio.ensure_future(call)
            assert await blocked_while_the_loop_ticks(task, lock) == 20
            return task.result()

    r = asyncio.run(main())
    assert r.status_code == status
    assert led.twins == ["hold", "release" if status == 429 else "settle"]
    b = led.balance("acme")
    assert b.used == {"tokens": 42 if status == 200 else 0} and b.held == {"tokens": 0}
    led.close()


def test_a_refused_call_releases_its_hold_off_the_loop(mod: Any) -> None:
    led = PlainLedger()
    lim = rq.Limiter(rq.Rate(1, per="minute", burst=1), clock=rq.ManualClock())
    assert lim.try_acquire()

    async def main() -> None:
        t = RateLimitedTransport(provider(mod), lim, ledger=led, timeout=0)
        async with mod.AsyncClient(transport=t, base_url="http://p") as c:
            with pytest.raises(rq.Overloaded):
                await ticking(led.gates, ("hold", "release"), c.post(CHAT, json=BODY))

    asyncio.run(main())
    assert [e[0] for e in led.log] == ["hold", "release"]


def test_cancelled_while_the_hold_runs_gives_the_hold_back(mod: Any) -> None:
    led = PlainLedger()
    sent: list[Any] = []

    def answer(req: Any) -> Any:
        sent.append(req)
        return mod.Response(200, json=USAGE)

    lim = limiter()

    async def main() -> None:
        t = RateLimitedTransport(mod.MockTransport(answer), lim, ledger=led)
        async with mod.AsyncClient(transport=t, base_url="http://p") as c:
            task = asyncio.create_task(c.post(CHAT, json=BODY))
            assert await asyncio.to_thread(led.gates.entered["hold"].wait, GATE)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            led.gates.go["hold"].set()  # the hold completes after its caller left
            led.gates.go["release"].set()
            assert await asyncio.to_thread(led.gates.entered["release"].wait, GATE)

    asyncio.run(main())
    for _ in range(500):  # the release runs on the worker thread right after the hold
        if len(led.log) == 2:
            break
        threading.Event().wait(0.01)
    assert [e[0] for e in led.log] == ["hold", "release"]
    assert sent == [] and lim.available() == 50


def test_async_stream_settles_the_ledger_at_the_final_usage_event(mod: Any) -> None:
    led = PlainLedger()

    class Events(mod.AsyncByteStream):  # type: ignore[misc]
        async def __aiter__(self) -> Any:
            yield b'data: {"choices":[{"delta":{"content":"x"}}],"usage":null}\n\n'
            final = {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 3}}
            yield b"data: " + json.dumps(final).encode() + b"\n\n"
            yield b"data: [DONE]\n\n"

    def answer(req: Any) -> Any:
        return mod.Response(200, headers={"content-type": "text/event-stream"}, stream=Events())

    async def main() -> list[bytes]:
        t = RateLimitedTransport(mod.MockTransport(answer), limiter(), ledger=led)
        async with mod.AsyncClient(transport=t, base_url="http://p") as c:
            led.gates.go["hold"].set()

            async def read() -> list[bytes]:
                async with c.stream("POST", CHAT, json={**BODY, "stream": True}) as r:
                    return [chunk async for chunk in r.aiter_raw()]

            chunks, ticks = await ticking(led.gates, ("settle",), read())
            assert ticks > 0
            return list(chunks)

    chunks = asyncio.run(main())
    assert len(chunks) == 3
    assert [e[0] for e in led.log] == ["hold", "settle"]
    assert led.log[1][2]["input_tokens"] == 7 and led.log[1][2]["output_tokens"] == 3


def test_sync_client_still_calls_the_ledger_inline(mod: Any) -> None:
    led = PlainLedger()
    for g in led.gates.go.values():
        g.set()
    t = RateLimitedTransport(provider(mod), limiter(), ledger=led)
    with mod.Client(transport=t, base_url="http://p") as c:
        c.post(CHAT, json=BODY)
    me = threading.get_ident()
    assert led.gates.threads == {"hold": me, "settle": me}


# -- a body nested past the JSON parser's depth is read, never raised ------------------------


DEEP = 100_000


def test_a_deeply_nested_response_body_keeps_the_estimate(mod: Any) -> None:
    deep = b'{"x":' + b"[" * DEEP + b"]" * DEEP + b"}"
    for body in (deep, b'{"usage":{"a":' + b"[" * DEEP + b"]" * DEEP + b"}}"):
        lim = limiter()
        answer = mod.MockTransport(lambda req, body=body: mod.Response(200, content=body))
        c = mod.Client(transport=RateLimitedTransport(answer, lim), base_url="http://p")
        r = c.post(CHAT, json=BODY)
        rec = r.extensions["ratequeue"]
        assert rec.settled and rec.usage is None
        assert lim.available("tokens") == 100_000 - rec.estimate.tokens


def test_a_deeply_nested_sse_event_is_skipped(mod: Any) -> None:
    event = b'data: {"usage":' + b"[" * DEEP + b"]" * DEEP + b"}\n\n"
    final = b'data: {"choices":[],"usage":{"prompt_tokens":7,"completion_tokens":3}}\n\n'

    def answer(req: Any) -> Any:
        return mod.Response(
            200, headers={"content-type": "text/event-stream"}, content=event + final
        )

    lim = limiter()
    c = mod.Client(transport=RateLimitedTransport(mod.MockTransport(answer), lim))
    r = c.post("http://p" + CHAT, json={**BODY, "stream": True})
    assert r.extensions["ratequeue"].usage == (7, 3)


def test_a_deeply_nested_request_body_is_sent_unparsed(mod: Any) -> None:
    sent: list[bytes] = []

    def answer(req: Any) -> Any:
        sent.append(req.content)
        return mod.Response(200, json=USAGE)

    deep = b'{"messages":' + b"[" * DEEP + b"]" * DEEP + b"}"
    c = mod.Client(transport=RateLimitedTransport(mod.MockTransport(answer), limiter()))
    r = c.post("http://p" + CHAT, content=deep, headers={"content-type": "application/json"})
    assert r.status_code == 200 and sent == [deep]
    assert r.extensions["ratequeue"].usage == (12, 30)
