"""2. Hand-off under contention: 4 processes, one key, ~1 ms of work inside.

Each process loops: acquire (blocking), record the time, busy-work ~1 ms,
record the time, release. Times are CLOCK_MONOTONIC, one clock for every
process of the machine. Sorted by acquisition, a hand-off is a holding
acquired by another process than the previous holding's; its latency is the
acquisition time minus the previous holding's release time. (A releaser
that re-acquires at once is not a hand-off: unfair locks do that often,
"holder changes" says how often the lock did change hands.)
"""

from __future__ import annotations

import multiprocessing
import os
import time
from dataclasses import dataclass
from typing import Any

from .common import percentile

WORK_SECONDS = 0.001


def _busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _make_lock(kind: str) -> tuple[Any, Any]:
    """(acquire(), release()) for one contender, in a worker process."""
    if kind.startswith("redis") or kind == "python-redis-lock":
        import redis

        client = redis.Redis(host="127.0.0.1", port=6379)
        if kind == "python-redis-lock":
            import redis_lock

            prl = redis_lock.Lock(client, "bench:handoff-prl", expire=60)
            return (lambda: prl.acquire(blocking=True)), prl.release
        lk = client.lock("bench:handoff-redis-py", timeout=60)  # default 0.1 s polling
        return (lambda: lk.acquire(blocking=True)), lk.release
    import django_dlock as dlock

    strategy = {"lease": "lease", "advisory": "advisory"}[kind]
    ours = dlock.lock(f"bench-handoff-{kind}", strategy=strategy, ttl=60, timeout=None)
    return ours.acquire, ours.release


def _worker(kind: str, seconds: float, start_at: float, out: Any) -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.benchmarks.settings")
    import django

    django.setup()
    from django.db import connections

    acquire, release = _make_lock(kind)
    spans: list[tuple[int, int, int]] = []
    pid = os.getpid()
    while time.monotonic() < start_at:
        time.sleep(0.001)
    end = start_at + seconds
    while time.monotonic() < end:
        acquire()
        got = time.monotonic_ns()
        _busy(WORK_SECONDS)
        left = time.monotonic_ns()
        release()
        spans.append((got, left, pid))
    connections.close_all()
    out.put(spans)


@dataclass
class Handoff:
    name: str
    acquisitions_per_second: float
    holder_changes: float  # share of hand-offs that went to another process
    p50_ms: float
    p99_ms: float
    worst_ms: float


def run_one(kind: str, processes: int = 4, seconds: float = 4.0) -> Handoff:
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    start_at = time.monotonic() + 3.0  # every process imported and connected
    procs = [
        ctx.Process(target=_worker, args=(kind, seconds, start_at, out)) for _ in range(processes)
    ]
    for proc in procs:
        proc.start()
    spans = sorted(span for _ in procs for span in out.get(timeout=seconds + 120))
    for proc in procs:
        proc.join(30)
    pairs = list(zip(spans, spans[1:], strict=False))
    # a hand-off: one process releases, another acquires
    gaps = [(b[0] - a[1]) / 1e6 for a, b in pairs if a[2] != b[2]]
    changes = len(gaps)
    return Handoff(
        name=kind,
        acquisitions_per_second=len(spans) / seconds,
        holder_changes=changes / max(1, len(spans) - 1),
        p50_ms=percentile(gaps, 50),
        p99_ms=percentile(gaps, 99),
        worst_ms=max(gaps) if gaps else float("nan"),
    )


def run(seconds: float = 4.0) -> list[Handoff]:
    return [
        run_one(kind, seconds=seconds)
        for kind in ("advisory", "lease", "python-redis-lock", "redis-py")
    ]
