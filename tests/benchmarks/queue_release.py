"""7. The holder's release with a long queue: 0 waiters vs 1,000 waiters.

A release with waiters finds the head of the key's queue (the lowest live
ticket, by the ``(name, id)`` index) and notifies it in the same statement.
This measures what that costs the holder when 1,000 tickets are queued, next
to a key nobody waits for. The 1,000 tickets are rows with a long ticket
lease (no processes behind them: only the holder's statement is measured).
Each round takes the lease with a ticket number below every queued one
(the queue lets it in, as it lets in the head) and times the release alone.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

QUEUED = 1_000


@dataclass
class QueueRelease:
    release_us_empty: float  # median release, nobody waiting
    release_us_queued: float  # median release, QUEUED waiters

    @property
    def ratio(self) -> float:
        return self.release_us_queued / self.release_us_empty


def _times(name: str, rounds: int) -> list[float]:
    from django_dlock.keys import make_key
    from django_dlock.strategies.base import Request
    from django_dlock.strategies.lease import lease

    req = Request(
        key=make_key(name),
        alias="default",
        token="bench-q",
        owner="bench",
        ttl=60,
        row=make_key(name).name,
    )
    samples = []
    for _ in range(rounds):
        if lease.try_acquire(req, ticket=0) is None:
            raise RuntimeError("queue benchmark: the holder could not take the lease")
        t0 = time.perf_counter()
        lease.release(req)
        samples.append(time.perf_counter() - t0)
    return samples


def run(rounds: int = 3_000) -> QueueRelease:
    from django.db import connections

    with connections["default"].cursor() as cur:
        cur.execute("DELETE FROM django_dlock_waiter WHERE name LIKE 'lock:bench-queue-%%'", [])
        cur.execute(
            "INSERT INTO django_dlock_waiter (name, token, owner, enqueued_at, expire_at) "
            "SELECT 'lock:bench-queue-queued', 'w' || g, 'bench waiter ' || g, now(), "
            "now() + interval '1 day' FROM generate_series(1, %s) g",
            [QUEUED],
        )
        cur.execute("ANALYZE django_dlock_waiter")
    try:
        empty: list[float] = []
        queued: list[float] = []
        for _ in range(5):  # interleaved, so load on the machine hits both alike
            empty += _times("bench-queue-empty", rounds // 5)
            queued += _times("bench-queue-queued", rounds // 5)
    finally:
        with connections["default"].cursor() as cur:
            cur.execute("DELETE FROM django_dlock_waiter WHERE name LIKE 'lock:bench-queue-%%'", [])
    return QueueRelease(
        release_us_empty=statistics.median(empty) * 1e6,
        release_us_queued=statistics.median(queued) * 1e6,
    )


def table(result: QueueRelease) -> list[str]:
    return [
        "| lease release | median µs |",
        "| --- | ---: |",
        f"| nobody waiting | {result.release_us_empty:,.0f} |",
        f"| {QUEUED:,} waiters queued | {result.release_us_queued:,.0f} |",
        "",
        f"Release with {QUEUED:,} waiters vs none: **{result.ratio:.2f}x**.",
    ]


if __name__ == "__main__":
    from .common import ensure_databases, setup_django

    setup_django()
    ensure_databases()
    print("\n".join(table(run())))
