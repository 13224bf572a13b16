"""Instructions per call of the native request readers (`_read_request`, `_cap_output`)
on typical bodies, by callgrind's inclusive cost of the core functions they call
(`ratequeue_core::llm::request_facts`, `...::cap::cap_output`) over the calls made:

    valgrind --tool=callgrind --callgrind-out-file=OUT python benches/caps22_reader.py both BODY N
    callgrind_annotate --inclusive=yes OUT | grep -E 'request_facts|cap_output'
"""

from __future__ import annotations

import sys

from ratequeue._ratequeue import _cap_output, _read_request

TEXT = "Summarise the following paragraph in three bullet points. " * 4
BODIES = {
    "chat": (
        b'{"model":"gpt-4o","messages":[{"role":"system","content":"You are terse."},'
        b'{"role":"user","content":"' + TEXT.encode() + b'"}],"max_tokens":4000}'
    ),
    "chat_n": (
        b'{"model":"gpt-4o","messages":[{"role":"user","content":"' + TEXT.encode() + b'"}],'
        b'"n":2,"max_tokens":4000}'
    ),
    "gemini": (
        b'{"contents":[{"role":"user","parts":[{"text":"' + TEXT.encode() + b'"}]}],'
        b'"generationConfig":{"temperature":0.5,"maxOutputTokens":4000}}'
    ),
}


def main() -> None:
    fn, body, n = sys.argv[1], BODIES[sys.argv[2]], int(sys.argv[3])
    if fn in ("read", "both"):
        for _ in range(n):
            _read_request(body, 4, 1024)
    if fn in ("cap", "both"):
        for _ in range(n):
            _cap_output(body, 256, 2)


if __name__ == "__main__":
    main()
