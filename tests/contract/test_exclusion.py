"""Mutual exclusion, on every cell, with real threads, processes and asyncio tasks.

Inside the lock each worker does a deliberately non-atomic read-modify-write
of a counter (read, pause, write): any overlap of two holders loses an
update, so an exact final count proves mutual exclusion. Every holding also
records (counter value, fencing number): ordered by counter value, the fences
must strictly increase where the cell gives fences, and be None where it
does not.
"""

from __future__ import annotations

import asyncio
import threading

import pytest
from asgiref.sync import sync_to_async
from django.db import connections

import django_dlock as dlock
from django_dlock.strategies.connection import close_private_connections

from .. import procs
from ..helpers import run_threads
from .cells import ALL, BY_ID, CELLS, LOCKS, RELEASED, Cell, off_the_loop, params


def _worker(cell_id: str, counter_path: str, log_path: str, iterations: int) -> None:
    cell = BY_ID[cell_id]
    counter = procs.FileCounter(counter_path)
    with open(log_path, "w") as log:
        for _ in range(iterations):
            with cell.hold("counter", ttl=60, timeout=120, retry_interval=0.005) as lk:
                value = counter.increment(pause=0.0002)
                log.write(f"{value} {lk.fence}\n")


def _check(cell: Cell, log_paths: list[str], expected: int) -> None:
    seen: list[tuple[int, str]] = []
    for path in log_paths:
        with open(path) as f:
            for line in f:
                if line.strip():
                    value, fence = line.split()
                    seen.append((int(value), fence))
    assert sorted(v for v, _ in seen) == list(range(1, expected + 1))
    fences = [fence for _, fence in sorted(seen)]
    if cell.fences:
        numbers = [int(f) for f in fences]
        assert all(a < b for a, b in zip(numbers, numbers[1:], strict=False))
    else:
        assert set(fences) == {"None"}


@pytest.mark.parametrize("cell", ALL)
def test_threads_exclude_each_other(cell, tmp_path):
    counter = procs.FileCounter(str(tmp_path / "counter"))
    counter.reset()
    logs = [str(tmp_path / f"log{i}") for i in range(8)]
    run_threads(_worker, [(cell.id, counter.path, log, 50) for log in logs])
    assert counter.read() == 400
    _check(cell, logs, 400)


@pytest.mark.slow
@pytest.mark.parametrize("cell", LOCKS)
def test_processes_exclude_each_other(cell, tmp_path):
    counter = procs.FileCounter(str(tmp_path / "counter"))
    counter.reset()
    logs = [str(tmp_path / f"log{i}") for i in range(8)]
    procs.run_all(_worker, [(cell.id, counter.path, log, 100) for log in logs])
    assert counter.read() == 800
    _check(cell, logs, 800)


@pytest.mark.parametrize("cell", ALL)
def test_asyncio_tasks_exclude_each_other(cell):
    state = {"counter": 0, "inside": 0, "overlaps": 0, "fences": []}
    tasks_count, iterations = 12, 5

    def enter(fence) -> int:
        state["inside"] += 1
        state["overlaps"] += state["inside"] > 1
        state["fences"].append(fence)
        return state["counter"]

    def leave(value: int) -> None:
        state["counter"] = value + 1
        state["inside"] -= 1

    def in_a_transaction() -> None:
        # A transaction belongs to a thread: each task runs its block in one.
        try:
            with cell.hold("acounter", timeout=60, retry_interval=0.005) as lk:
                value = enter(lk.fence)
                threading.Event().wait(0.001)
                leave(value)
        finally:
            close_private_connections()
            connections.close_all()

    async def task() -> None:
        for _ in range(iterations):
            if cell.transactional:
                await sync_to_async(in_a_transaction, thread_sensitive=False)()
                continue
            async with cell.lock("acounter", timeout=60, retry_interval=0.005) as lk:
                value = enter(lk.fence)
                await asyncio.sleep(0)  # let every other task run here
                leave(value)

    async def main() -> None:
        await asyncio.gather(*(task() for _ in range(tasks_count)))
        await sync_to_async(connections.close_all)()

    asyncio.run(main())
    assert (state["counter"], state["inside"], state["overlaps"]) == (60, 0, 0)
    fences = state["fences"]
    if cell.fences:
        assert all(a < b for a, b in zip(fences, fences[1:], strict=False))
    else:
        assert set(fences) == {None}


def _db_worker(cell_id: str, iterations: int) -> None:
    """Read-modify-write of a counter in the database, committed before the lock goes."""
    from django_dlock.models import Lock as LockRow

    cell = BY_ID[cell_id]
    counter = LockRow.objects.using(cell.alias)
    for _ in range(iterations):
        with dlock.lock_and_atomic(
            "dbcounter", strategy=cell.strategy, using=cell.alias, timeout=120
        ):
            value = counter.get(name="data:counter").fence
            counter.filter(name="data:counter").update(fence=value + 1)


#: SQLite is left out: a deferred transaction that read the counter and then
#: writes while another connection writes fails with "database is locked" at
#: once (SQLite will not wait where waiting could deadlock), lock or no lock.
#: Django's ``"transaction_mode": "IMMEDIATE"`` option (Django 5.1+) avoids it.
WRITERS = params([cell for cell in CELLS if cell.alias != "sqlite"])


@pytest.mark.parametrize("cell", WRITERS)
def test_writes_under_lock_and_atomic_never_lose_an_update(cell):
    from django_dlock.models import Lock as LockRow

    rows = LockRow.objects.using(cell.alias)
    rows.create(name="data:counter", fence=0, expire_at="2000-01-01T00:00:00Z")
    run_threads(_db_worker, [(cell.id, 25)] * 6)
    assert rows.get(name="data:counter").fence == 150


@pytest.mark.parametrize("cell", RELEASED)
def test_two_tasks_in_one_thread_contend(cell):
    async def try_and_release() -> bool:
        lk = cell.lock("tasks")
        if await lk.aacquire(timeout=0):
            await lk.arelease()
            return True
        return False

    async def main() -> tuple[bool, bool, bool]:
        first = cell.lock("tasks")
        await first.aacquire()
        other = await asyncio.create_task(cell.lock("tasks").aacquire(timeout=0))
        reentered = await cell.lock("tasks").aacquire(timeout=0)  # the same task
        await cell.lock("tasks").arelease()
        await first.arelease()
        after = await asyncio.create_task(try_and_release())
        await sync_to_async(connections.close_all)()
        return other, reentered, after

    assert asyncio.run(main()) == (False, True, True)


@pytest.mark.parametrize("cell", RELEASED)
def test_an_async_waiter_is_woken_by_release_and_never_blocks_the_loop(cell):
    async def main() -> tuple[list[str], int]:
        order: list[str] = []
        ticks = 0
        stop = asyncio.Event()

        async def ticker() -> None:
            nonlocal ticks
            while not stop.is_set():
                ticks += 1
                await asyncio.sleep(0.01)

        holder = cell.lock("awake")
        await holder.aacquire()

        async def waiter() -> None:
            async with cell.lock("awake", timeout=60, retry_interval=0.01) as lk:
                assert lk.held()
                order.append("waiter")

        ticking = asyncio.create_task(ticker())
        task = asyncio.create_task(waiter())
        await off_the_loop(cell.wait_for_waiters, "awake", 1)
        during = ticks
        await asyncio.sleep(0.2)
        moved = ticks - during  # the loop kept running while the task waited
        order.append("release")
        await holder.arelease()
        await asyncio.wait_for(task, 60)
        stop.set()
        await ticking
        await sync_to_async(connections.close_all)()
        return order, moved

    order, moved = asyncio.run(main())
    assert order == ["release", "waiter"]
    assert moved > 0
    assert cell.try_once("awake") is True
