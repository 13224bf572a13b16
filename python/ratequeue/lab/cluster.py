"""A virtual inference cluster: replicas with dynamic batching, a KV cache, scale-out.

Each replica runs at most ``max_batch`` requests at once and holds each one's KV cache
(prompt + output tokens) until it finishes, within ``kv_capacity`` tokens. Requests wait
in the replica's FIFO queue; admission into the running batch happens at batch
boundaries, ``batch_window`` after the first request that finds room (so requests
arriving together start together). A request admitted into a batch of ``b`` gets its
first token after ``ttft_base + ttft_per_request * b`` seconds and then one token every
``tpot_base * (1 + tpot_growth * (b - 1) / max_batch)`` seconds: bigger batches mean
more throughput and slower answers. The queue is bounded by ``max_waiting``: a request
that finds it full (the KV cache full and every slot taken) is refused (503).

The cluster routes each request to the running replica with the fewest waiting (then
running) requests. Replicas asked for by :meth:`InferenceCluster.scale_out` start after
``scale_out_delay`` seconds, up to ``max_replicas``; :meth:`InferenceCluster.fail` drops a
replica and everything on it (those requests fail with 503).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

from .engine import VirtualTime

__all__ = ["ClusterSpec", "InferenceCluster", "Job", "ReplicaSpec"]


@dataclass(frozen=True)
class ReplicaSpec:
    """One replica of the inference engine (times in seconds, sizes in tokens)."""

    max_batch: int = 16
    batch_window: float = 0.05
    ttft_base: float = 0.15
    ttft_per_request: float = 0.02
    tpot_base: float = 0.02
    tpot_growth: float = 1.0
    kv_capacity: int = 16_000
    max_waiting: int = 256
    #: Waiting requests per replica that count as a full queue for the depth fraction q.
    queue_capacity: int = 4

    def __post_init__(self) -> None:
        for name in ("max_batch", "kv_capacity", "max_waiting", "queue_capacity"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}={v!r} must be an integer >= 1")
        for name in ("batch_window", "ttft_base", "ttft_per_request", "tpot_base", "tpot_growth"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise ValueError(f"{name}={v!r} must be a finite number >= 0")

    def ttft(self, batch: int) -> float:
        """Time to first token of a request admitted into a batch of ``batch``."""
        return self.ttft_base + self.ttft_per_request * batch

    def tpot(self, batch: int) -> float:
        """Seconds per output token in a batch of ``batch``."""
        return self.tpot_base * (1.0 + self.tpot_growth * (batch - 1) / self.max_batch)

    def throughput(self, mean_output: float) -> float:
        """Requests per second of one replica kept full (mean output tokens given): each
        slot waits a batch window, then serves its request at the full batch's speed."""
        b = self.max_batch
        return b / (self.batch_window + self.ttft(b) + mean_output * self.tpot(b))


@dataclass(frozen=True)
class ClusterSpec:
    """The cluster: ``replicas`` at the start, at most ``max_replicas``, each new one
    serving ``scale_out_delay`` seconds after it is asked for."""

    replicas: int = 4
    max_replicas: int = 16
    scale_out_delay: float = 90.0
    replica: ReplicaSpec = field(default_factory=ReplicaSpec)

    def __post_init__(self) -> None:
        if isinstance(self.replicas, bool) or not isinstance(self.replicas, int):
            raise TypeError("replicas must be an integer")
        if not 1 <= self.replicas <= self.max_replicas:
            raise ValueError("need 1 <= replicas <= max_replicas")
        if not (math.isfinite(self.scale_out_delay) and self.scale_out_delay >= 0):
            raise ValueError("scale_out_delay must be a finite number >= 0")


@dataclass(slots=True)
class Job:
    """One request at the cluster: its tokens and what to call when it ends."""

    prompt: int
    output: int
    on_first_token: Callable[[float], None]
    on_done: Callable[[], None]
    on_fail: Callable[[int], None]
    arrived: float = 0.0

    @property
    def kv(self) -> int:
        return self.prompt + self.output


class _Replica:
    __slots__ = ("admit_at", "alive", "index", "kv_used", "running", "waiting")

    def __init__(self, index: int) -> None:
        self.index = index
        self.alive = True
        self.waiting: deque[Job] = deque()
        self.running: set[int] = set()
        self.kv_used = 0
        self.admit_at: float | None = None


class InferenceCluster:
    """The cluster in a :class:`~.engine.VirtualTime` loop."""

    def __init__(self, vt: VirtualTime, spec: ClusterSpec) -> None:
        self.vt = vt
        self.spec = spec
        self.rs = spec.replica
        self.replicas: list[_Replica] = [_Replica(i) for i in range(spec.replicas)]
        self.starting = 0
        self.refused = 0
        self.failed = 0
        self.completed = 0
        self.max_depth = 0
        #: (time, replicas up) at every change.
        self.replica_log: list[tuple[float, int]] = [(vt.now, spec.replicas)]
        self._jobs: dict[int, tuple[_Replica, Job]] = {}
        self._next_id = 0
        self._depth = 0

    # -- gauges ---------------------------------------------------------------------------

    @property
    def up(self) -> int:
        """Replicas serving now."""
        return sum(1 for r in self.replicas if r.alive)

    @property
    def depth(self) -> int:
        """Requests waiting (not yet in a batch) on every replica."""
        return self._depth

    def gauges(self) -> dict[str, float]:
        """What the engine would export: queue depth and capacity, KV-cache use, replicas."""
        up = self.up
        kv = sum(r.kv_used for r in self.replicas if r.alive)
        return {
            "queue_depth": float(self.depth),
            "queue_capacity": float(max(up, 1) * self.rs.queue_capacity),
            "kv_cache": kv / (max(up, 1) * self.rs.kv_capacity),
            "replicas": float(up),
        }

    # -- requests -------------------------------------------------------------------------

    def submit(self, job: Job) -> bool:
        """Route ``job``; False (and ``on_fail(503)`` not called) when it is refused."""
        best: _Replica | None = None
        best_key = (math.inf, math.inf)
        for r in self.replicas:
            if r.alive:
                key = (len(r.waiting), len(r.running))
                if key < best_key:
                    best, best_key = r, key
        if best is None or len(best.waiting) >= self.rs.max_waiting or job.kv > self.rs.kv_capacity:
            self.refused += 1
            return False
        job.arrived = self.vt.now
        best.waiting.append(job)
        self._depth += 1
        if self._depth > self.max_depth:
            self.max_depth = self._depth
        self._schedule_admit(best)
        return True

    def _schedule_admit(self, r: _Replica) -> None:
        if r.admit_at is not None or not r.waiting or len(r.running) >= self.rs.max_batch:
            return
        when = self.vt.now + self.rs.batch_window
        r.admit_at = when
        self.vt.at(when, lambda: self._admit(r))

    def _admit(self, r: _Replica) -> None:
        r.admit_at = None
        if not r.alive:
            return
        rs = self.rs
        admitted: list[Job] = []
        while r.waiting and len(r.running) + len(admitted) < rs.max_batch:
            job = r.waiting[0]
            if r.kv_used + job.kv > rs.kv_capacity:
                break
            r.waiting.popleft()
            self._depth -= 1
            r.kv_used += job.kv
            admitted.append(job)
        if not admitted:
            return
        b = len(r.running) + len(admitted)
        ttft, tpot = rs.ttft(b), rs.tpot(b)
        now = self.vt.now
        for job in admitted:
            jid = self._next_id
            self._next_id += 1
            r.running.add(jid)
            self._jobs[jid] = (r, job)
            job.on_first_token(now + ttft)
            self.vt.at(now + ttft + job.output * tpot, partial(self._done, jid))

    def _done(self, jid: int) -> None:
        entry = self._jobs.pop(jid, None)
        if entry is None:
            return  # its replica failed
        r, job = entry
        r.running.discard(jid)
        r.kv_used -= job.kv
        self.completed += 1
        job.on_done()
        self._schedule_admit(r)

    # -- capacity -------------------------------------------------------------------------

    def scale_out(self, n: int) -> int:
        """Ask for ``n`` more replicas; returns how many will start (0 at the maximum)."""
        room = self.spec.max_replicas - self.up - self.starting
        n = max(0, min(n, room))
        if n:
            self.starting += n
            self.vt.after(self.spec.scale_out_delay, lambda: self._started(n))
        return n

    def _started(self, n: int) -> None:
        self.starting -= n
        for _ in range(n):
            self.replicas.append(_Replica(len(self.replicas)))
        self.replica_log.append((self.vt.now, self.up))

    def fail(self, index: int | None = None) -> int:
        """Replica ``index`` (default: the busiest running one) stops; every request on it
        fails with 503. Returns how many failed."""
        alive = [r for r in self.replicas if r.alive]
        if not alive:
            return 0
        if index is None:
            r = max(alive, key=lambda x: (len(x.running) + len(x.waiting), -x.index))
        else:
            r = self.replicas[index]
        r.alive = False
        lost = list(r.waiting)
        self._depth -= len(lost)
        r.waiting.clear()
        for jid in list(r.running):
            _, job = self._jobs.pop(jid)
            lost.append(job)
        r.running.clear()
        r.kv_used = 0
        self.failed += len(lost)
        self.replica_log.append((self.vt.now, self.up))
        for job in lost:
            job.on_fail(503)
        return len(lost)
