"""A private redis-server for the tests: loopback, a free port, no persistence.

``RedisServer`` starts ``redis-server`` (found on PATH or in ``$RATEQUEUE_REDIS_SERVER``)
on 127.0.0.1 with ``--save '' --appendonly no`` and stops it afterwards; ``stop()`` and
``start()`` again on the same port let tests kill Redis in the middle of a run.

The fixtures below (``redis_server``, ``own_redis``, ``r``, and ``cluster``: a real
three-node Redis Cluster) reach every test under ``tests/redis/`` through its
``conftest.py`` (``cluster`` also those under ``tests/ledger/``); a test module
elsewhere imports them from here. Without redis-server or redis-py a test that needs
them fails (never skips): CI installs both.
"""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence

import pytest
import redis
import redis.asyncio
from redis.cluster import ClusterNode, RedisCluster


def server_binary() -> str | None:
    return os.environ.get("RATEQUEUE_REDIS_SERVER") or shutil.which("redis-server")


def free_port(bus: bool = False) -> int:
    """A free loopback port; with ``bus``, one whose cluster bus port (+10000) is free too."""
    for _ in range(1000):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if not bus:
            return port
        if port + 10000 > 65535:
            continue
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                s.bind(("127.0.0.1", port + 10000))
            return port
        except OSError:
            continue
    raise RuntimeError("no free port")


class RedisServer:
    """One redis-server process; ``url`` stays the same across stop/start."""

    def __init__(self, binary: str, port: int | None = None, extra: Sequence[str] = ()) -> None:
        self.binary = binary
        self.port = port or free_port(bus="--cluster-enabled" in extra)
        self._dir: str | None = None
        self.extra = list(extra)
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def dir(self) -> str:
        """Its working directory (made on first use; removed by ``cleanup``)."""
        if self._dir is None:
            self._dir = tempfile.mkdtemp(prefix="rq-redis-")
        return self._dir

    def cleanup(self) -> None:
        self.stop()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    @property
    def log(self) -> str:
        return os.path.join(self.dir, "redis.log")

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> None:
        assert self.proc is None, "already running"
        args = [
            self.binary,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            self.dir,
            "--daemonize",
            "no",
            "--protected-mode",
            "yes",
            "--loglevel",
            "warning",
            "--logfile",
            self.log,
            *self.extra,
        ]
        self.proc = subprocess.Popen(
            args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=self.dir
        )
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode() if self.proc.stderr else ""
                self.proc = None
                if os.path.exists(self.log):
                    with open(self.log) as f:
                        err += f.read()
                raise RuntimeError(f"redis-server exited at start: {err.strip()[-2000:]}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"redis-server did not answer on port {self.port}")
            time.sleep(0.02)

    def stop(self) -> None:
        """Stops the server (SIGTERM, then SIGKILL); its data is gone (no persistence)."""
        p = self.proc
        if p is None:
            return
        self.proc = None
        if p.poll() is None:
            p.terminate()
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
        if p.stderr:
            p.stderr.close()

    def pause(self) -> None:
        """Freezes the server (SIGSTOP): connections hang, calls time out."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    def restart(self) -> None:
        self.stop()
        self.start()

    def client(self, timeout: float = 1.0, decode_responses: bool = False) -> redis.Redis:
        """A client with ``timeout`` s socket timeouts and no retries (fail fast)."""
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        return redis.Redis(
            host="127.0.0.1",
            port=self.port,
            socket_timeout=timeout,
            socket_connect_timeout=timeout,
            retry=Retry(NoBackoff(), 0),
            decode_responses=decode_responses,
        )

    def async_client(self, timeout: float = 1.0) -> redis.asyncio.Redis:
        from ratequeue.redis import connect_async

        return connect_async(self.url, timeout=timeout)


_server: RedisServer | None = None


def require_binary() -> str:
    binary = server_binary()
    if binary is None:
        pytest.fail(
            "redis-server not found (apt-get install redis-server, or set "
            "RATEQUEUE_REDIS_SERVER): the Redis tests need one and never skip"
        )
    return binary


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    """A redis-server shared by the session (started once)."""
    global _server
    binary = require_binary()
    if _server is None:
        _server = RedisServer(binary)
        _server.start()
    yield _server


@pytest.fixture
def own_redis() -> Iterator[RedisServer]:
    """A redis-server of its own, for tests that stop, freeze or restart it."""
    server = RedisServer(require_binary())
    server.start()
    try:
        yield server
    finally:
        if server.proc is not None and server.proc.poll() is None:
            server.resume()
        server.cleanup()


@pytest.fixture
def r(redis_server: RedisServer) -> Iterator[redis.Redis]:
    """A client of the shared server, on an empty database."""
    c = redis_server.client()
    c.flushdb()
    try:
        yield c
    finally:
        c.close()


@pytest.fixture(scope="module")
def cluster() -> Iterator[RedisCluster]:
    """A three-node Redis Cluster (no replicas) of the test module's own."""
    binary = require_binary()
    cli = shutil.which("redis-cli")
    if cli is None:
        pytest.fail("redis-cli not found (it comes with redis-server)")
    nodes = [
        RedisServer(binary, extra=["--cluster-enabled", "yes", "--cluster-node-timeout", "2000"])
        for _ in range(3)
    ]
    try:
        for n in nodes:
            n.start()
        subprocess.run(
            [
                *(cli, "--cluster", "create", *(f"127.0.0.1:{n.port}" for n in nodes)),
                *("--cluster-replicas", "0", "--cluster-yes"),
            ],
            check=True,
            capture_output=True,
            timeout=30,
        )
        client = None
        for _ in range(200):  # bounded: the nodes agree within a few hundred ms
            # Every node must see the whole cluster (a loaded machine gossips late), and so
            # must the client's slot map, taken from whichever node it asks first.
            if all(
                b"cluster_state:ok"
                in subprocess.run(
                    [cli, "-p", str(n.port), "cluster", "info"], capture_output=True, timeout=5
                ).stdout
                for n in nodes
            ):
                if client is not None:
                    client.close()
                client = RedisCluster(
                    startup_nodes=[ClusterNode("127.0.0.1", n.port) for n in nodes]
                )
                if len(client.get_primaries()) == len(nodes):
                    break
            time.sleep(0.05)
        else:
            pytest.fail("the cluster did not reach cluster_state:ok on every node and client")
        assert client is not None
        yield client
        client.close()
    finally:
        for n in nodes:
            n.cleanup()


def _stop_shared() -> None:
    if _server is not None:
        _server.cleanup()


atexit.register(_stop_shared)
