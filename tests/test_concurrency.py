"""Mutual exclusion with real processes, threads and asyncio tasks.

Inside the lock each worker does a deliberately non-atomic read-modify-write
of a counter (read, pause, write): any overlap of two holders loses an
update, so an exact final count proves mutual exclusion. Every holding also
records (counter value, fencing number): ordered by counter value, the
fences must strictly increase.
"""

from __future__ import annotations

import asyncio

import pytest
from django.db import connections

import django_dlock as dlock

from . import procs
from .helpers import run_threads

pytestmark = pytest.mark.django_db(transaction=True, databases=["default", "sqlite", "mysql"])

PROCESSES, ITERATIONS = 8, 100


def _worker(alias: str, counter_path: str, log_path: str, iterations: int) -> None:
    counter = procs.FileCounter(counter_path)
    lk = dlock.lock("counter", using=alias, ttl=60, retry_interval=0.005)
    with open(log_path, "w") as log:
        for _ in range(iterations):
            with lk:
                value = counter.increment(pause=0.0002)
                log.write(f"{value} {lk.fence}\n")


def _check_fences(log_paths: list[str], expected: int) -> None:
    seen: list[tuple[int, int]] = []
    for path in log_paths:
        with open(path) as f:
            seen.extend(tuple(map(int, line.split())) for line in f if line.strip())
    assert sorted(v for v, _ in seen) == list(range(1, expected + 1))
    fences = [fence for _, fence in sorted(seen)]
    assert all(a < b for a, b in zip(fences, fences[1:], strict=False))


@pytest.mark.slow
def test_processes_exclude_each_other(alias, tmp_path):
    counter = procs.FileCounter(str(tmp_path / "counter"))
    counter.reset()
    logs = [str(tmp_path / f"log{i}") for i in range(PROCESSES)]
    procs.run_all(_worker, [(alias, counter.path, log, ITERATIONS) for log in logs])
    assert counter.read() == PROCESSES * ITERATIONS
    _check_fences(logs, PROCESSES * ITERATIONS)


def test_threads_exclude_each_other(alias, tmp_path):
    counter = procs.FileCounter(str(tmp_path / "counter"))
    counter.reset()
    logs = [str(tmp_path / f"log{i}") for i in range(8)]
    run_threads(_worker, [(alias, counter.path, log, 50) for log in logs])
    assert counter.read() == 400
    _check_fences(logs, 400)


def test_asyncio_tasks_exclude_each_other(alias):
    state = {"counter": 0, "fences": []}
    tasks_count, iterations = 20, 4

    async def task() -> None:
        for _ in range(iterations):
            async with dlock.lock("acounter", using=alias, retry_interval=0.005) as lk:
                value = state["counter"]
                await asyncio.sleep(0)  # let every other task run here
                state["counter"] = value + 1
                state["fences"].append(lk.fence)

    async def main() -> None:
        await asyncio.gather(*(task() for _ in range(tasks_count)))
        from asgiref.sync import sync_to_async

        await sync_to_async(connections.close_all)()

    asyncio.run(main())
    assert state["counter"] == tasks_count * iterations
    fences = state["fences"]
    assert all(a < b for a, b in zip(fences, fences[1:], strict=False))


def test_two_tasks_in_one_thread_contend(alias):
    async def main() -> tuple[bool, bool, bool]:
        first = dlock.lock("tasks", using=alias)
        await first.aacquire()
        other = await asyncio.create_task(dlock.lock("tasks", using=alias).aacquire(timeout=0))
        reentered = await dlock.lock("tasks", using=alias).aacquire(timeout=0)  # same task
        await dlock.lock("tasks", using=alias).arelease()
        await first.aextend(30)
        await first.arelease()
        after = await asyncio.create_task(_try_and_release(alias))
        from asgiref.sync import sync_to_async

        await sync_to_async(connections.close_all)()
        return other, reentered, after

    assert asyncio.run(main()) == (False, True, True)


async def _try_and_release(alias: str) -> bool:
    lk = dlock.lock("tasks", using=alias)
    if await lk.aacquire(timeout=0):
        await lk.arelease()
        return True
    return False


def test_async_waiter_is_woken_by_release(alias):
    async def main() -> list[str]:
        order: list[str] = []
        holder = dlock.lock("awake", using=alias)
        await holder.aacquire()

        async def waiter() -> None:
            async with dlock.lock("awake", using=alias, timeout=30, retry_interval=0.01):
                order.append("waiter")

        task = asyncio.create_task(waiter())
        await asyncio.sleep(0.2)
        order.append("release")
        await holder.arelease()
        await asyncio.wait_for(task, 30)
        from asgiref.sync import sync_to_async

        await sync_to_async(connections.close_all)()
        return order

    assert asyncio.run(main()) == ["release", "waiter"]
