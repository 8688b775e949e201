"""3. Scale: a lease table with 1,000,000 expired rows, and cleaning it up."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from .common import Series, interleaved, percentile, raw_connection

ROWS = 1_000_000

_FILL = """
INSERT INTO django_dlock_lock (name, token, owner, fence, acquired_at, expire_at)
SELECT 'lock:expired-' || g, '', 'bench', g, now() - interval '2 hours',
       now() - interval '1 hour'
FROM generate_series(1, %s) AS g
"""


def fill(alias: str, rows: int = ROWS) -> None:
    conn = raw_connection(alias)
    conn.execute("DELETE FROM django_dlock_lock WHERE owner = 'bench'")
    conn.execute(_FILL, [rows])
    conn.execute("VACUUM ANALYZE django_dlock_lock")
    conn.close()


def table_size(alias: str) -> int:
    conn = raw_connection(alias)
    count = conn.execute("SELECT count(*) FROM django_dlock_lock").fetchone()[0]
    conn.close()
    return int(count)


def acquisition(rounds: int, seconds: float, rows: int = ROWS) -> dict[str, Series]:
    """Acquire + release on an empty table and on one holding ``rows`` expired rows."""
    import django_dlock as dlock

    fill("big", rows)
    empty = dlock.lock("bench-scale", using="default", ttl=60)
    big = dlock.lock("bench-scale", using="big", ttl=60)

    def pair(lk: dlock.Lock):
        def run() -> None:
            lk.acquire(timeout=0)
            lk.release()

        return run

    return interleaved(
        {"lease, empty table": pair(empty), f"lease, {rows:,} expired rows": pair(big)},
        rounds,
        seconds,
    )


@dataclass
class Cleanup:
    name: str
    seconds: float
    deleted: int
    acquire_p50_ms: float
    acquire_p99_ms: float
    acquire_worst_ms: float


def _during(alias: str, work) -> tuple[float, int, list[float]]:
    """Run ``work()`` while another thread acquires and releases a lock."""
    from django.db import connections

    import django_dlock as dlock

    stop = threading.Event()
    latencies: list[float] = []

    def acquirer() -> None:
        lk = dlock.lock("bench-during-cleanup", using=alias, ttl=60)
        while not stop.is_set():
            t0 = time.perf_counter()
            lk.acquire(timeout=0)
            lk.release()
            latencies.append(time.perf_counter() - t0)
        connections.close_all()

    thread = threading.Thread(target=acquirer)
    thread.start()
    time.sleep(0.2)
    start = time.perf_counter()
    deleted = work()
    took = time.perf_counter() - start
    stop.set()
    thread.join()
    return took, deleted, latencies


def cleanup(rows: int = ROWS) -> list[Cleanup]:
    """``dlock_cleanup`` (batches of 10,000) against one ``DELETE`` of every row."""
    from django_dlock.cleanup import delete_free

    def single_delete() -> int:
        conn = raw_connection("big")
        deleted = conn.execute(
            "DELETE FROM django_dlock_lock WHERE expire_at <= statement_timestamp()"
        ).rowcount
        conn.close()
        return int(deleted)

    results = []
    for name, work in (
        ("one DELETE of every expired row", single_delete),
        ("dlock_cleanup, batches of 10,000", lambda: delete_free("big", batch_size=10_000)),
    ):
        fill("big", rows)
        took, deleted, latencies = _during("big", work)
        ms = [x * 1000 for x in latencies]
        results.append(
            Cleanup(name, took, deleted, percentile(ms, 50), percentile(ms, 99), max(ms))
        )
    return results
