"""6. Memory and sessions: what one process costs while it holds or waits.

Each scenario runs in a fresh (spawned) process, which reports its resident
memory (``VmRSS``) and thread count before and while it holds or waits. The
benchmark counts that process's PostgreSQL backends in ``pg_stat_activity``:
every connection of the scenario carries its own ``application_name``.
"""

from __future__ import annotations

import multiprocessing
import os
import threading
import time
from dataclasses import dataclass
from typing import Any

SCENARIOS = (
    ("hold 1,000 advisory locks", "advisory", "hold", 1000),
    ("hold 10,000 leases", "lease", "hold", 10000),
    ("1,000 asyncio tasks waiting on a lease", "lease", "wait", 1000),
    ("100 asyncio tasks waiting on an advisory lock", "advisory", "wait", 100),
)


def _rss_kib() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def _scenario(strategy: str, kind: str, count: int, app: str, out: Any) -> None:
    os.environ["PGAPPNAME"] = app
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.benchmarks.settings")
    import django

    django.setup()
    from django.conf import settings

    settings.DATABASES["default"].setdefault("OPTIONS", {})["application_name"] = app
    import asyncio

    import django_dlock as dlock

    with dlock.lock("bench-memory-warm", strategy=strategy, timeout=0):
        pass
    before = _rss_kib(), threading.active_count()
    if kind == "hold":
        locks = [dlock.lock(f"bench-memory-{i}", strategy=strategy, ttl=600) for i in range(count)]
        for lk in locks:
            if not lk.acquire(timeout=0):
                raise RuntimeError("memory: uncontended acquire failed")
        out.put(("measure", before, (_rss_kib(), threading.active_count())))
        time.sleep(float(os.environ.get("BENCH_MEMORY_DWELL", "1.5")))
        for lk in locks:
            lk.release()
    else:
        holder = dlock.lock("bench-memory-hot", strategy=strategy, ttl=600)
        holder.acquire(timeout=0)

        async def waiters() -> tuple[int, int]:
            async def wait() -> None:
                async with dlock.lock("bench-memory-hot", strategy=strategy, timeout=None):
                    pass

            tasks = [asyncio.ensure_future(wait()) for _ in range(count)]
            await asyncio.sleep(3.0)
            measured = _rss_kib(), threading.active_count()
            out.put(("measure", before, measured))
            await asyncio.sleep(float(os.environ.get("BENCH_MEMORY_DWELL", "1.5")))
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            return measured

        asyncio.run(waiters())
        holder.release()
    out.put(("done", None, None))


@dataclass
class Memory:
    name: str
    count: int
    rss_before_mib: float
    rss_mib: float
    threads_before: int
    threads: int
    backends: int

    @property
    def per_item_kib(self) -> float:
        return (self.rss_mib - self.rss_before_mib) * 1024 / self.count


def _backends(conn: Any, app: str) -> int:
    row = conn.execute(
        "SELECT count(*) FROM pg_stat_activity WHERE application_name = %s", [app]
    ).fetchone()
    return int(row[0])


def run() -> list[Memory]:
    from .common import raw_connection

    conn = raw_connection()
    ctx = multiprocessing.get_context("spawn")
    results = []
    for name, strategy, kind, count in SCENARIOS:
        app = f"dlock-bench-memory-{os.getpid()}-{len(results)}"
        out = ctx.Queue()
        proc = ctx.Process(target=_scenario, args=(strategy, kind, count, app, out))
        proc.start()
        try:
            _, before, during = out.get(timeout=300)
            backends = _backends(conn, app)
            out.get(timeout=300)
        finally:
            proc.join(60)
            if proc.is_alive():
                proc.kill()
        results.append(
            Memory(
                name=name,
                count=count,
                rss_before_mib=before[0] / 1024,
                rss_mib=during[0] / 1024,
                threads_before=before[1],
                threads=during[1],
                backends=backends,
            )
        )
    conn.close()
    return results
