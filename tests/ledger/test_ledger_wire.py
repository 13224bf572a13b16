"""The Redis ledger's own connection per thread (``_Wire``), on a real redis-server: a
server restart, a script flushed (NOSCRIPT), a frozen server, an interrupted read, a
fork, threads, RESP3 and decoded replies; counts stay exact through each."""

from __future__ import annotations

import multiprocessing
import threading
import time
from typing import Any

import pytest
import ratequeue as rq
import redis
from forking import join_or_fail
from ledger_backends import T0
from ledger_blocking import eventually
from ratequeue.ledger import Every, Plan, RedisLedger
from ratequeue.redis._ledger_core import LUA_SHA
from ratequeue.redis._ledger_wire import _More, _parse
from redis.backoff import NoBackoff
from redis.retry import Retry
from redis_server import RedisServer

PLAN = Plan("big", tokens=10**9, calls=10**9, period=Every(3_600))


def ledger(server: RedisServer, *, retries: int = 0, timeout: float = 5.0, **kw: Any) -> Any:
    client = redis.Redis(
        host="127.0.0.1",
        port=server.port,
        socket_timeout=timeout,
        socket_connect_timeout=timeout,
        retry=Retry(NoBackoff(), retries),
        **kw,
    )
    return RedisLedger(client, name="w", clock=rq.ManualClock(T0), default_plan=PLAN)


def test_the_charge_goes_on_the_threads_own_connection(server: RedisServer) -> None:
    led = ledger(server)
    led.charge("a", "acme", input_tokens=5)
    wire = led._thread_conn()
    assert wire.sock is not None and wire.served
    assert led.charge("b", "acme", input_tokens=5).tokens == 5
    assert led._thread_conn() is wire
    assert led.charge("a", "acme", input_tokens=5).replay
    assert led.balance("acme").used["tokens"] == 10
    led.close()
    assert wire.sock is None


def test_a_server_restart_reconnects_without_retries(server: RedisServer) -> None:
    led = ledger(server)
    led.charge("a", "acme", input_tokens=5)
    server.restart()  # no persistence: the plan and usage are gone
    with pytest.raises(redis.exceptions.ConnectionError):
        led.charge("b", "acme", input_tokens=7)
    assert led._thread_conn().sock is None  # closed, opened again on the next call
    assert led.charge("b", "acme", input_tokens=7).tokens == 7
    assert led.balance("acme").used["tokens"] == 7
    led.close()


def test_a_server_restart_is_retried_as_the_client_says(server: RedisServer) -> None:
    led = ledger(server, retries=2)
    led.charge("a", "acme", input_tokens=5)
    server.restart()
    c = led.charge("b", "acme", input_tokens=7)  # the dead socket is retried on a new one
    assert c.tokens == 7 and not c.replay
    assert led.charge("b", "acme", input_tokens=7).replay
    assert led.balance("acme").used["tokens"] == 7
    led.close()


def test_noscript_after_script_flush_loads_it_and_sends_again(server: RedisServer) -> None:
    led = ledger(server)
    led.charge("a", "acme", input_tokens=1)
    for k, call in enumerate(
        (
            lambda: led.charge("b", "acme", input_tokens=2),
            lambda: led.hold("h", "acme", input_tokens=100),
            lambda: led.settle("h", input_tokens=3, output_tokens=0),
            lambda: led.balance("acme"),
            lambda: led.charge_many(
                [{"request_id": f"m{i}", "account": "acme", "input_tokens": 1} for i in range(5)]
            ),
        )
    ):
        led.client.script_flush()
        call()
        assert led.client.script_exists(LUA_SHA)[0], k
    assert led.balance("acme").used == {"tokens": 1 + 2 + 3 + 5, "calls": 8}
    assert led.balance("acme").held["tokens"] == 0
    led.close()


def test_a_frozen_server_times_out_then_the_next_call_reconnects(server: RedisServer) -> None:
    led = ledger(server, timeout=0.5)
    led.charge("a", "acme", input_tokens=1)
    server.pause()
    t0 = time.monotonic()
    try:
        with pytest.raises(redis.exceptions.TimeoutError):
            led.charge("b", "acme", input_tokens=2)
    finally:
        server.resume()
    assert time.monotonic() - t0 < 30
    # whether the timed-out call ran is unknown: the same id tells (once either way)
    led.charge("b", "acme", input_tokens=2)
    assert led.balance("acme").used["tokens"] == 3
    led.close()


class _Interrupting:
    """A socket whose next ``recv`` raises KeyboardInterrupt (Ctrl-C mid-read)."""

    def __init__(self, sock: Any) -> None:
        self.sock = sock

    def sendall(self, data: bytes) -> None:
        self.sock.sendall(data)

    def recv(self, n: int) -> bytes:
        raise KeyboardInterrupt


def test_an_interrupted_read_closes_the_connection(server: RedisServer) -> None:
    led = ledger(server)
    led.charge("a", "acme", input_tokens=1)
    wire = led._thread_conn()
    wire.sock = _Interrupting(wire.sock)
    with pytest.raises(KeyboardInterrupt):
        led.charge("b", "acme", input_tokens=2)
    assert wire.sock is None  # the unread reply can never be taken for the next call's
    assert not led.charge("c", "acme", input_tokens=4).replay
    assert led.charge("b", "acme", input_tokens=2).replay  # it ran before the interrupt
    assert led.balance("acme").used["tokens"] == 7
    led.close()


def _child_charges(led: Any, q: Any) -> None:
    try:
        fresh = led._thread_conn().sock is None  # not the parent's connection
        for i in range(100):
            led.charge(f"c{i}", "acme", input_tokens=2)
        q.put(fresh)
        led.close()
    except BaseException as e:  # pragma: no cover - reported to the parent
        q.put(repr(e))


def test_a_forked_child_never_uses_the_parents_socket(server: RedisServer) -> None:
    led = ledger(server)
    led.charge("p", "acme", input_tokens=1)
    mine = led._thread_conn()
    sock = mine.sock
    ctx = multiprocessing.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=_child_charges, args=(led, q))
    p.start()
    for i in range(100):
        led.charge(f"p{i}", "acme", input_tokens=3)
    join_or_fail([p], 60)
    assert p.exitcode == 0
    assert q.get(timeout=10) is True  # the child opened its own
    # the child closing its ledger never shut the parent's socket down
    assert led._thread_conn() is mine and mine.sock is sock
    led.charge("after", "acme", input_tokens=1)
    assert led.balance("acme").used["tokens"] == 1 + 100 * 3 + 100 * 2 + 1
    led.close()


def test_threads_each_get_their_own_connection_and_their_own_replies(
    server: RedisServer,
) -> None:
    led = ledger(server)
    led.set_plan("acme", PLAN)
    wires: dict[int, Any] = {}
    bad: list[Any] = []
    go = threading.Barrier(8)

    def work(w: int) -> None:
        go.wait()
        for i in range(150):
            c = led.charge(f"{w}-{i}", "acme", input_tokens=w + 1, output_tokens=i)
            if c.request_id != f"{w}-{i}" or c.tokens != w + 1 + i:
                bad.append(c)
        wires[w] = led._thread_conn()

    ts = [threading.Thread(target=work, args=(w,)) for w in range(8)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    assert not bad
    assert len({id(x) for x in wires.values()}) == 8
    expected = sum(w + 1 + i for w in range(8) for i in range(150))
    assert led.balance("acme").used == {"tokens": expected, "calls": 8 * 150}
    led.close()


@pytest.mark.parametrize("kw", [{"protocol": 3}, {"decode_responses": True}])
def test_resp3_and_decoded_replies(server: RedisServer, kw: dict[str, Any]) -> None:
    led = ledger(server, **kw)
    led.charge("a", "acme", input_tokens=5, model="m", meta={"k": "v"})
    r = led.charge("a", "acme", input_tokens=5, model="m", meta={"k": "v"})
    assert r.replay and r.meta == {"k": "v"} and r.model == "m"
    led.hold("h", "acme", input_tokens=50)
    assert led.settle("h", input_tokens=4, output_tokens=1).tokens == 5
    assert led.balance("acme").used["tokens"] == 10
    assert [c.request_id for c in led.usage("acme").rows] == ["a", "h"]
    assert led.request_usage("acme", "a").totals.tokens == 5
    dry = led.compensate("x", dry_run=True)
    assert dry.credited == {"tokens": 10, "calls": 2}
    led.compensate("x")
    assert led.balance("acme").used["tokens"] == 0
    assert led.compensate("x").already_done == 1
    led.close()


def test_the_reply_parser_reads_every_resp_type() -> None:
    enc = None
    assert _parse(b":42\r\n", 0, enc) == (42, 5)
    assert _parse(b"$3\r\nabc\r\n", 0, enc) == (b"abc", 9)
    assert _parse(b"$-1\r\n", 0, enc) == (None, 5)
    assert _parse(b"*2\r\n+OK\r\n:1\r\n", 0, enc)[0] == [b"OK", 1]
    assert _parse(b"_\r\n", 0, enc)[0] is None
    assert _parse(b"#t\r\n", 0, enc)[0] is True
    assert _parse(b",1.5\r\n", 0, enc)[0] == 1.5
    assert _parse(b"%1\r\n+a\r\n:2\r\n", 0, enc)[0] == {b"a": 2}
    err = _parse(b"-NOSCRIPT No matching script\r\n", 0, enc)[0]
    assert isinstance(err, redis.exceptions.NoScriptError)
    for partial in (b":4", b"$3\r\nab", b"*2\r\n:1\r\n"):
        with pytest.raises(_More):
            _parse(partial, 0, enc)


def test_a_reply_the_wire_cannot_read_falls_back_to_redis_py(
    server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    import ratequeue.redis._ledger_wire as wire_mod

    led = ledger(server)
    led.charge("a", "acme", input_tokens=5)  # an integer reply: read without the parser

    def unreadable(buf: bytes, pos: int, decode: Any) -> Any:
        raise redis.exceptions.InvalidResponse("a reply type the ledger does not know")

    monkeypatch.setattr(wire_mod, "_parse", unreadable)
    again = led.charge("a", "acme", input_tokens=5)  # the replay's array reply
    assert again.replay and again.tokens == 5
    assert not led._wire_ok  # redis-py carries the scripts from now on
    led.hold("h", "acme", input_tokens=10)
    led.settle("h", input_tokens=2, output_tokens=0)
    out = led.charge_many(
        [{"request_id": f"m{i}", "account": "acme", "input_tokens": 1} for i in range(3)]
    )
    assert all(not isinstance(c, Exception) for c in out)
    assert led.balance("acme").used == {"tokens": 5 + 2 + 3, "calls": 5}
    led.close()


def test_charge_many_falls_back_when_a_pipelined_reply_is_unreadable(
    server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    import ratequeue.redis._ledger_wire as wire_mod

    led = ledger(server)
    led.charge("seen", "acme", input_tokens=1)
    real = wire_mod._parse

    def picky(buf: bytes, pos: int, decode: Any) -> Any:
        if buf[pos] == 42:  # '*': an array (the replay's reply)
            raise redis.exceptions.InvalidResponse("unreadable")
        return real(buf, pos, decode)

    monkeypatch.setattr(wire_mod, "_parse", picky)
    reqs = [{"request_id": f"n{i}", "account": "acme", "input_tokens": 2} for i in range(4)]
    reqs.insert(2, {"request_id": "seen", "account": "acme", "input_tokens": 1})
    out = led.charge_many(reqs)
    assert [type(c).__name__ for c in out] == ["Charge"] * 5
    # the replies after the unreadable one were lost with the connection: sent again
    # through redis-py, those charges answer as replays (they ran once, in the pipeline)
    assert out[2].replay and not out[0].replay and not out[1].replay
    assert led.balance("acme").used["tokens"] == 1 + 4 * 2
    led.close()


def test_cancelled_calls_finishing_through_an_outage_hold_no_worker_between_tries(
    server: RedisServer,
) -> None:
    """Calls whose asyncio caller was cancelled are finished on the ledger's worker
    threads; while Redis is down, the pauses between their tries hold none of them."""
    from ratequeue.ledger._base import _executor
    from ratequeue.ledger._model import request_fingerprint

    led = ledger(server, retries=1)  # this thread's connection dies with the server
    led.charge("warm", "acme", input_tokens=1)
    server.stop()

    def charge_flow(rid: str) -> Any:
        a = led._request_args(rid, "acme", 2, 0, 1, None, None, None)
        return led._charge_call(*a, request_fingerprint("charge", *a[1:]))

    for i in range(40):  # more than the pool's 16 workers
        _executor().submit(led._finish_cancelled, lambda i=i: charge_flow(f"x{i}"), None)
    time.sleep(0.3)  # their first tries fail (connection refused) and wait for the next
    assert _executor().submit(lambda: "free").result(timeout=10) == "free"
    server.start()  # empty (no persistence): the default plan makes the account again
    landed = eventually(lambda: led.balance("acme").used["tokens"] == 40 * 2, 60)
    # (failed under load, 37-39 of 40 landed: the 40 made the emptied account at once,
    # and a plan stored before its version failed three reads, 'the plan keeps changing':
    # see test_a_new_account_is_never_seen_half_made; the message and the captured
    # ratequeue.ledger log say how many landed and why not)
    assert landed, f"{led.balance('acme').used['tokens'] // 2} of 40 charges landed"
    assert all(led.charge(f"x{i}", "acme", input_tokens=2).replay for i in range(40))
    led.close()


def test_a_cancelled_call_whose_plan_keeps_changing_is_tried_again(server: RedisServer) -> None:
    """'The plan keeps changing' (three plan changes during one call) is transient, as an
    unreachable Redis is: the worker finishing a cancelled call tries it again instead
    of dropping the charge (flaky22's residual risk)."""
    from ratequeue.ledger._base import _executor
    from ratequeue.ledger._model import request_fingerprint
    from ratequeue.redis._ledger_core import PlanChanging

    led = ledger(server)
    led.charge("warm", "acme", input_tokens=1)
    tries: list[int] = []

    def again() -> Any:
        tries.append(1)
        if len(tries) < 3:
            raise PlanChanging("the plan of account 'acme' keeps changing; try again")
        a = led._request_args("y", "acme", 2, 0, 1, None, None, None)
        return led._charge_call(*a, request_fingerprint("charge", *a[1:]))

    _executor().submit(led._finish_cancelled, again, None)
    assert eventually(lambda: led.balance("acme").used["tokens"] == 1 + 2, 30)
    assert len(tries) == 3 and led.charge("y", "acme", input_tokens=2).replay
    led.close()
