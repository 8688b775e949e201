"""Waiting, on every cell: giving up, being handed the lock, and a holder that dies."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from typing import Any

import pytest
from asgiref.sync import sync_to_async
from django.db import connections, transaction

import django_dlock as dlock
from django_dlock.strategies.connection import close_private_connections

from .. import procs
from ..helpers import in_thread, wait_until
from .cells import ALL, BY_ID, FREED_BY_THE_SERVER, RELEASED, Cell, HeldElsewhere, off_the_loop


def _waiting(
    cell: Cell, key: str, timeout: float | None, **options: Any
) -> tuple[dict[str, bool], threading.Thread]:
    """Another holder, in a thread of its own, waiting for ``key`` (once it
    waits, where the server shows it): what it got, and its thread."""
    result: dict[str, bool] = {}

    def waiter() -> None:
        try:
            with cell.transaction():
                lk = cell.lock(key, **options)
                result["got"] = lk.acquire(timeout=timeout)
                result["owned"] = lk.owned()
                if result["got"] and not cell.transactional:
                    lk.release()
        finally:
            close_private_connections()
            connections.close_all()

    thread = threading.Thread(target=waiter)
    thread.start()
    cell.wait_for_waiters(key, 1)
    return result, thread


@pytest.mark.parametrize("cell", ALL)
def test_a_timeout_gives_up_with_lock_timeout_and_leaves_nothing(cell):
    holder = HeldElsewhere(cell, "busy")
    try:
        owners = cell.holders("busy")

        def attempt(timeout: float) -> bool:
            with cell.transaction():
                return cell.lock("busy").acquire(timeout=timeout)

        assert in_thread(attempt, 0) is False
        assert in_thread(attempt, 0.3) is False

        def enter() -> None:
            with cell.transaction():
                cell.lock("busy", timeout=0.2).__enter__()

        with pytest.raises(dlock.LockTimeout) as info:
            in_thread(enter)
        assert isinstance(info.value, TimeoutError)
        assert cell.holders("busy") == owners  # the holder is untouched
        assert cell.waiters("busy") in (0, None)  # no waiter left behind
    finally:
        holder.release()
    assert cell.try_once("busy") is True


@pytest.mark.parametrize("timeout", [60, None], ids=["timeout", "forever"])
@pytest.mark.parametrize("cell", ALL)
def test_a_waiter_is_handed_the_lock_when_the_holder_lets_go(cell, timeout):
    holder = HeldElsewhere(cell, "handoff")
    result, thread = _waiting(cell, "handoff", timeout)
    assert result == {}  # still held: the waiter waits
    holder.release()  # a release, or the holder's commit
    thread.join(60)
    assert result == {"got": True, "owned": True}
    assert cell.try_once("handoff") is True


@pytest.mark.parametrize("cell", ALL)
def test_a_timeout_inside_an_outer_atomic_leaves_it_usable(cell):
    from django_dlock.models import Lock as LockRow

    holder = HeldElsewhere(cell, "held")
    rows = LockRow.objects.using(cell.alias)

    def work() -> list[str]:
        with transaction.atomic(using=cell.alias):
            rows.create(name="data:before", expire_at="2000-01-01T00:00:00Z")
            with pytest.raises(dlock.LockTimeout):
                cell.lock("held", timeout=0.2).__enter__()
            assert cell.lock("held").acquire(timeout=0) is False
            rows.create(name="data:after", expire_at="2000-01-01T00:00:00Z")
        return sorted(rows.filter(name__startswith="data:").values_list("name", flat=True))

    try:
        assert in_thread(work) == ["data:after", "data:before"]
    finally:
        holder.release()


def _hold_forever(cell_id: str, ready_path: str) -> None:
    cell = BY_ID[cell_id]
    with cell.hold("crash", ttl=3600):
        with open(ready_path, "w") as f:
            f.write(str(os.getpid()))
        time.sleep(600)


@pytest.mark.parametrize("cell", FREED_BY_THE_SERVER)
def test_sigkill_of_the_holder_process_frees_the_lock_at_once(cell, tmp_path):
    ready = tmp_path / "ready"
    proc = procs.start(_hold_forever, cell.id, str(ready))
    try:
        wait_until(ready.exists, timeout=60)
        assert cell.try_once("crash") is False
        if not cell.transactional:
            assert cell.lock("crash").locked()
        result, thread = _waiting(cell, "crash", 60, ttl=3600)  # far less than any lease
        os.kill(proc.pid, signal.SIGKILL)
        thread.join(60)
        assert result == {"got": True, "owned": True}
    finally:
        proc.kill()
        proc.join(10)


@pytest.mark.parametrize("cell", RELEASED)
def test_a_cancelled_async_wait_leaves_nothing_waiting_or_held(cell):
    holder = HeldElsewhere(cell, "acancel")

    async def wait_forever() -> None:
        async with cell.lock("acancel", timeout=None):
            pass

    async def main() -> None:
        waiter = asyncio.create_task(wait_forever())
        await off_the_loop(cell.wait_for_waiters, "acancel", 1)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        if await off_the_loop(cell.waiters, "acancel") is not None:
            # the wait ended in the server too
            await off_the_loop(wait_until, lambda: cell.waiters("acancel") == 0)
        await sync_to_async(connections.close_all)()

    try:
        asyncio.run(main())
    finally:
        holder.release()
    wait_until(lambda: not cell.lock("acancel").locked())
    assert cell.try_once("acancel") is True


@pytest.mark.parametrize("two_phase", [False, True], ids=["acquire", "enqueue-wait"])
@pytest.mark.parametrize("cell", RELEASED)
def test_a_waiter_that_waited_longer_than_its_ttl_keeps_the_lease_it_was_granted(cell, two_phase):
    """A renewed lock granted after a wait longer than its ttl is not reported
    lost: its lease is counted from the statement that granted it, not from
    when the wait began (which would put its end in the past at once)."""
    if two_phase and cell.session and cell.vendor == "mysql":
        pytest.skip("GET_LOCK keeps no place in a queue: no enqueue()/wait()")
    ttl = 2.0
    holder = HeldElsewhere(cell, "long-wait")
    losses: list[dlock.LockLost] = []
    result: dict[str, Any] = {}
    granted, checked, queued = threading.Event(), threading.Event(), threading.Event()

    def waiter() -> None:
        try:
            lk = cell.lock("long-wait", ttl=ttl, renew=True, on_lost=losses.append)
            if two_phase:
                result["queued"] = lk.enqueue() is False
                queued.set()
                result["got"] = lk.wait(60)
            else:
                result["got"] = lk.acquire(timeout=60)
            granted.set()
            checked.wait(60)  # the renewer's first renewals run meanwhile
            result["lost"] = lk.lost
            result["owned"] = lk.owned()
            lk.release()  # raises LockLost if it was reported lost
            result["released"] = True
        finally:
            granted.set()
            queued.set()
            close_private_connections()
            connections.close_all()

    thread = threading.Thread(target=waiter)
    thread.start()
    if two_phase:
        assert queued.wait(60)
    else:
        cell.wait_for_waiters("long-wait", 1)
    time.sleep(ttl + 0.5)  # the waiter now waits for longer than its own ttl
    holder.release()
    assert granted.wait(60)
    # Past its first renewal (a third of the ttl), well before its lease could end.
    time.sleep(ttl / 2)
    checked.set()
    thread.join(60)
    expected = {"got": True, "lost": False, "owned": True, "released": True}
    assert result == ({"queued": True, **expected} if two_phase else expected)
    assert losses == []
