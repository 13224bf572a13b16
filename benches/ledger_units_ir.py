"""Instructions per ledger charge, for callgrind: the SQLite ``charge`` and
``charge_many`` and the Redis ``charge`` (client side: redis-server is another process),
a request without units of your own, on an account whose plan has none.

Run each with N = 0 and N = 2000 and take the difference over N::

    PYTHONHASHSEED=0 valgrind --tool=callgrind python benches/ledger_units_ir.py charge N
    PYTHONHASHSEED=0 valgrind --tool=callgrind python benches/ledger_units_ir.py many N
    PYTHONHASHSEED=0 valgrind --tool=callgrind python benches/ledger_units_ir.py redis N PORT

With ``PYTHONPATH`` naming a copy of an earlier ``ratequeue`` (e.g. main's), the same
for that one, beside.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time

import ratequeue as rq
from ratequeue.ledger import LedgerBase, Plan, SqliteLedger

T0 = 1_764_547_200


def main() -> None:
    kind, n = sys.argv[1], int(sys.argv[2])
    led: LedgerBase
    if kind == "redis":
        import redis
        from ratequeue.ledger import RedisLedger

        client = redis.Redis(port=int(sys.argv[3]))
        led = RedisLedger(client, name=f"ir{time.monotonic_ns()}", clock=rq.ManualClock(T0))
    else:
        path = os.path.join(tempfile.mkdtemp(), "ledger.db")
        led = SqliteLedger(path, clock=rq.ManualClock(T0))
    led.set_plan("acme", Plan("p", tokens=10**15, calls=10**12))
    led.charge("warm", "acme", input_tokens=1)
    if kind == "many":
        for k in range(n // 100):
            batch = [
                {"request_id": f"r{k}-{i}", "account": "acme", "input_tokens": 10}
                for i in range(100)
            ]
            led.charge_many(batch)
    else:
        for i in range(n):
            led.charge(f"r{i}", "acme", input_tokens=10, output_tokens=5, model="m")
    led.close()


if __name__ == "__main__":
    main()
