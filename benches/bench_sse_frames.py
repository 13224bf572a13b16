"""The SSE usage reader's cost per event (``SSEUsage.feed``), against the floor.

    python benches/bench_sse_frames.py [--events 400] [--rounds 7]

Three streams as providers send them: OpenAI chat chunks (the usage chunk last), the
Responses API's events (``response.created`` first, ``response.completed`` with the
usage last) and Anthropic's messages events; each fed one event per chunk (as a slow
generation arrives) and in 64 KiB chunks (as a fast one does). The floor is the same
chunks passed to a function that does nothing: what handing a chunk on costs at all.
ns per event, the median of ``--rounds`` interleaved rounds. Run it under two builds to
compare them (each row is a ratio to its floor measured in the same run).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

from ratequeue.httpx._usage import SSEUsage


def _sse(ev: dict[str, object], name: str | None = None) -> bytes:
    head = f"event: {name}\n" if name else ""
    return f"{head}data: {json.dumps(ev)}\n\n".encode()


def chat(n: int) -> list[bytes]:
    delta = {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "model": "gpt-4o",
        "choices": [{"index": 0, "delta": {"content": "word "}, "finish_reason": None}],
        "usage": None,
    }
    last = {**delta, "choices": [], "usage": {"prompt_tokens": 90, "completion_tokens": n}}
    return [_sse(delta)] * (n - 1) + [_sse(last), b"data: [DONE]\n\n"]


def responses(n: int) -> list[bytes]:
    response = {"id": "resp_1", "object": "response", "status": "in_progress", "usage": None}
    delta = {"type": "response.output_text.delta", "item_id": "msg_1", "delta": "word "}
    done = {**response, "status": "completed", "usage": {"input_tokens": 90, "output_tokens": n}}
    return (
        [_sse({"type": "response.created", "response": response}, "response.created")]
        + [_sse(delta, "response.output_text.delta")] * (n - 2)
        + [_sse({"type": "response.completed", "response": done}, "response.completed")]
    )


def anthropic(n: int) -> list[bytes]:
    start = {
        "type": "message_start",
        "message": {"usage": {"input_tokens": 90, "output_tokens": 1}},
    }
    delta = {
        "type": "content_block_delta",
        "index": 0,
        "delta": {"type": "text_delta", "text": "w "},
    }
    end = {
        "type": "message_delta",
        "delta": {"stop_reason": "end_turn"},
        "usage": {"output_tokens": n},
    }
    return (
        [_sse(start, "message_start")]
        + [_sse(delta, "content_block_delta")] * (n - 2)
        + [_sse(end, "message_delta")]
    )


def _chunks(events: list[bytes], size: int) -> list[bytes]:
    if size == 0:
        return events
    body = b"".join(events)
    return [body[i : i + size] for i in range(0, len(body), size)]


def _time(feed: Callable[[bytes], object], chunks: list[bytes]) -> float:
    t0 = time.perf_counter_ns()
    for c in chunks:
        feed(c)
    return time.perf_counter_ns() - t0


def _nothing(_chunk: bytes) -> None:
    pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--events", type=int, default=400)
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    n = args.events
    print("| stream | chunks | floor ns/event | SSEUsage.feed ns/event | ratio |")
    print("|---|---|--:|--:|--:|")
    for name, make in (("OpenAI chat", chat), ("Responses", responses), ("Anthropic", anthropic)):
        events = make(n)
        for label, size in (("one per event", 0), ("64 KiB", 1 << 16)):
            chunks = _chunks(events, size)
            floor, feed = [], []
            for _ in range(args.rounds):
                for _ in range(20):
                    floor.append(_time(_nothing, chunks))
                    u = SSEUsage()
                    feed.append(_time(u.feed, chunks))
                    assert u.final, name
            f = statistics.median(floor) / len(events)
            s = statistics.median(feed) / len(events)
            print(f"| {name} | {label} | {f:.0f} | {s:.0f} | {s / f:.1f} |")


if __name__ == "__main__":
    main()
