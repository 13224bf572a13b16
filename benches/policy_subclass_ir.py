"""Instructions per ``Policy.try_acquire`` call: the native class against
``ratequeue.Policy`` (its Python subclass since a QuotaLevel became a policy level).

Run under callgrind with N = 0 and N = 20000 and take the difference over N::

    PYTHONHASHSEED=0 valgrind --tool=callgrind python benches/policy_subclass_ir.py native N
    PYTHONHASHSEED=0 valgrind --tool=callgrind python benches/policy_subclass_ir.py subclass N

With ``PYTHONPATH`` naming a copy of an earlier ``ratequeue``, ``native`` measures that one.
"""

from __future__ import annotations

import sys

import ratequeue as rq
from ratequeue import _ratequeue as native


def levels() -> dict[str, rq.KeyedLimiter | rq.Limiter]:
    return {
        "user": rq.KeyedLimiter(rq.Rate(10**9, per="second", burst=10**9)),
        "cluster": rq.Limiter(rq.Rate(10**9, per="second", burst=10**9)),
    }


def main() -> None:
    p = native.Policy(levels()) if sys.argv[1] == "native" else rq.Policy(levels())
    f = p.try_acquire
    for _ in range(int(sys.argv[2])):
        f(user="u")


if __name__ == "__main__":
    main()
