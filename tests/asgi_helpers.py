"""Helpers of the ASGI tests: call an ASGI app in process, check the RateLimit fields."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from http_sfv import List


@dataclass
class Reply:
    status: int
    headers: list[tuple[str, str]]
    body: bytes
    bodies: list[bytes] = field(default_factory=list)

    def get(self, name: str) -> str | None:
        vals = self.all(name)
        return vals[0] if vals else None

    def all(self, name: str) -> list[str]:
        return [v for k, v in self.headers if k == name.lower()]

    def json(self) -> Any:
        return json.loads(self.body)


def scope(
    method: str = "GET",
    path: str = "/",
    headers: Sequence[tuple[str, str]] = (),
    client: tuple[str, int] | None = ("203.0.113.5", 40000),
) -> dict[str, Any]:
    return {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "root_path": "",
        "query_string": b"",
        "headers": [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers],
        "client": client,
        "server": ("testserver", 80),
    }


async def call(
    app: Any,
    method: str = "GET",
    path: str = "/",
    headers: Sequence[tuple[str, str]] = (),
    body: bytes | Sequence[bytes] = b"",
    client: tuple[str, int] | None = ("203.0.113.5", 40000),
) -> Reply:
    """One request through an ASGI app; the body may be given in chunks."""
    chunks = [body] if isinstance(body, bytes) else list(body)
    incoming: list[dict[str, Any]] = [
        {"type": "http.request", "body": c, "more_body": i < len(chunks) - 1}
        for i, c in enumerate(chunks)
    ]
    done = asyncio.Event()

    async def receive() -> dict[str, Any]:
        if incoming:
            return incoming.pop(0)
        await done.wait()
        return {"type": "http.disconnect"}

    sent: list[dict[str, Any]] = []

    async def send(m: dict[str, Any]) -> None:
        sent.append(m)

    try:
        await app(scope(method, path, headers, client), receive, send)
    finally:
        done.set()
    start = next(m for m in sent if m["type"] == "http.response.start")
    bodies = [m.get("body", b"") for m in sent if m["type"] == "http.response.body"]
    return Reply(
        start["status"],
        [(k.decode("latin-1").lower(), v.decode("latin-1")) for k, v in start["headers"]],
        b"".join(bodies),
        bodies,
    )


def check_fields(get: Any) -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, Any]]]:
    """Parses RateLimit-Policy and RateLimit with http-sfv and checks the draft's types:
    String items; q, w, r, t non-negative Integers (w > 0); qu a String; pk a Byte
    Sequence; every RateLimit item names a policy. Returns {name: params} of each."""
    policies: dict[str, dict[str, Any]] = {}
    limits: dict[str, dict[str, Any]] = {}
    for field_name, out in (("ratelimit-policy", policies), ("ratelimit", limits)):
        raw = get(field_name)
        assert raw, f"{field_name} missing"
        lst = List()
        lst.parse(raw.encode())
        assert len(lst) > 0
        for item in lst:
            assert type(item.value) is str, (field_name, item.value)  # a String, not a Token
            params = dict(item.params)
            out[item.value] = params
            for k, v in params.items():
                if k in ("q", "w", "r", "t"):
                    assert isinstance(v, int) and not isinstance(v, bool) and v >= 0, (k, v)
                if k == "qu":
                    assert type(v) is str
                if k == "pk":
                    assert isinstance(v, bytes)
    for params in policies.values():
        assert "q" in params
        if "w" in params:
            assert params["w"] > 0
    for name, params in limits.items():
        assert name in policies
        assert "r" in params
    return policies, limits


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """A real uvicorn serving ``target`` (module:attr, a factory) on a free loopback port."""

    def __init__(
        self, target: str, *, env: dict[str, str] | None = None, app_dir: str | None = None
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [
            sys.executable,
            "-m",
            "uvicorn",
            "--factory",
            target,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--log-level",
            "warning",
            "--no-access-log",
            "--app-dir",
            app_dir or os.path.dirname(os.path.abspath(__file__)),
        ]
        self.proc = subprocess.Popen(cmd, env={**os.environ, **(env or {})})
        deadline = time.monotonic() + 60
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"uvicorn exited with {self.proc.returncode}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                    break
            except OSError:
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError("uvicorn did not start in 60 s") from None
                time.sleep(0.05)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
