"""The ledger's per-loop client keeps redis-py's own timeouts: ``socket_timeout`` bounds
each socket read on its own (found in review: one bound over a whole ledger step, connect,
handshake and command together, failed every call for good once a round trip was more
than half the timeout). Through a proxy adding latency (RTT 0.4 s) with
``socket_timeout=0.7`` every read fits its timeout, so every call works."""

from __future__ import annotations

import asyncio
import threading
import time

import ratequeue as rq
import redis
from ledger_backends import T0
from ratequeue.ledger import Plan, RedisLedger
from redis_server import RedisServer

DELAY = 0.2  # one way
TIMEOUT = 0.7


class SlowProxy:
    """A TCP proxy on a thread of its own delaying every chunk by ``delay`` (latency,
    not bandwidth: chunks in flight are not delayed one after another)."""

    def __init__(self, upstream: int, delay: float) -> None:
        self.upstream, self.delay = upstream, delay
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.port = 0
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        assert self.ready.wait(10)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)

        async def pump(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            q: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

            async def send() -> None:
                while True:
                    at, data = await q.get()
                    if not data:
                        w.close()
                        return
                    await asyncio.sleep(max(0.0, at - time.monotonic()))
                    w.write(data)
                    await w.drain()

            t = asyncio.ensure_future(send())
            try:
                while True:
                    data = await r.read(65536)
                    q.put_nowait((time.monotonic() + self.delay, data))
                    if not data:
                        break
                await t
            except Exception:
                t.cancel()
                w.close()

        async def handle(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            ur, uw = await asyncio.open_connection("127.0.0.1", self.upstream)
            await asyncio.gather(pump(r, uw), pump(ur, w), return_exceptions=True)

        async def main() -> None:
            server = await asyncio.start_server(handle, "127.0.0.1", 0)
            self.port = server.sockets[0].getsockname()[1]
            self.ready.set()
            await asyncio.Event().wait()

        self.loop.run_until_complete(main())


def test_the_twin_works_where_every_read_fits_the_socket_timeout(server: RedisServer) -> None:
    proxy = SlowProxy(server.port, DELAY)
    client = redis.Redis(
        host="127.0.0.1", port=proxy.port, socket_timeout=TIMEOUT, socket_connect_timeout=5
    )
    led = RedisLedger(client, name="lat", clock=rq.ManualClock(T0))
    led.set_plan("acme", Plan("pro", tokens=1000, calls=100))
    # the blocking client works through the proxy: each read takes one RTT < TIMEOUT
    assert led.charge("s0", "acme", input_tokens=1).tokens == 1

    async def main() -> list[str]:
        out = []
        for k in range(3):
            try:
                await led.charge_async(f"a{k}", "acme", input_tokens=1)
                out.append("ok")
            except redis.exceptions.TimeoutError as e:
                out.append(f"TimeoutError: {e}")
        return out

    got = asyncio.run(main())
    led.close()
    assert got == ["ok", "ok", "ok"], got
