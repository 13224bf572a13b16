"""The examples of docs/redis.md run, in order, against the test redis-server."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from redis_server import RedisServer

DOC = Path(__file__).resolve().parents[2] / "docs" / "redis.md"


def test_examples_run(redis_server: RedisServer, capsys: pytest.CaptureFixture[str]) -> None:
    # The doc ships in the repository: a missing one is a failure, not a skip.
    assert DOC.exists(), f"{DOC} is missing"
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)
    assert len(blocks) >= 6
    redis_server.client().flushdb()
    namespace: dict[str, object] = {"__name__": "docs_redis"}
    for i, block in enumerate(blocks):
        code = block.replace("redis://127.0.0.1:6379/0", redis_server.url)
        exec(compile(code, f"{DOC.name}[{i}]", "exec"), namespace)
    out = capsys.readouterr().out
    assert "rq:{openai}:openai:0" in out
    assert "'state': 'closed'" in out
