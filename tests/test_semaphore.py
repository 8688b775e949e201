"""Semaphores of several permits, on every database: at most N holders at once,
served in arrival order, a dead holder's permit freed with its lease, one permit
lost among several, and the count changed while permits are held.

A semaphore of one permit is a lock: the contract suite runs every lock
contract on it (tests/contract), and the loss table walks it (tests/test_loss.py).
"""

from __future__ import annotations

import asyncio
import fcntl
import os
import signal
import threading
import time

import pytest
from django.db import connections
from django.test import override_settings

import django_dlock as dlock
from django_dlock.strategies.connection import close_private_connections

from . import procs
from .helpers import HeldInThread, in_thread, publish, wait_until

pytestmark = pytest.mark.django_db(transaction=True, databases=["default", "sqlite", "mysql"])


class Inside:
    """An exact count of concurrent holders across processes (a file under
    ``flock``), and the most ever seen."""

    def __init__(self, path: str) -> None:
        self.path = path

    def reset(self) -> None:
        with open(self.path, "w") as f:
            f.write("0 0")

    def _change(self, by: int) -> int:
        with open(self.path, "r+") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            now, most = (int(v) for v in f.read().split())
            now += by
            most = max(most, now)
            f.seek(0)
            f.truncate()
            f.write(f"{now} {most}")
            return now

    def enter(self) -> int:
        return self._change(+1)

    def now(self) -> int:
        """How many are inside now (read under the lock, never a half-written file)."""
        return self._change(0)

    def leave(self) -> None:
        self._change(-1)

    def read(self) -> tuple[int, int]:
        with open(self.path) as f:
            now, most = (int(v) for v in f.read().split())
        return now, most


def _hold_permits(alias: str, path: str, iterations: int, permits: int, meet: int = 0) -> None:
    """Take a permit ``iterations`` times; inside, count the holders (a holding
    lasts 20 ms). In its first ``meet`` holdings a holder also waits (up to
    1 s) until every permit is held, so that a semaphore that lets in fewer
    than ``permits`` cannot pass, however slowly a loaded machine (or SQLite's
    one writer at a time) lets the holders in."""
    inside = Inside(path)
    for i in range(iterations):
        with dlock.semaphore(
            "pool", permits=permits, using=alias, ttl=60, timeout=120, retry_interval=0.005
        ):
            inside.enter()
            time.sleep(0.02)
            until = time.monotonic() + 1.0
            while i < meet and inside.now() < permits and time.monotonic() < until:
                time.sleep(0.005)
            inside.leave()


@pytest.mark.slow
def test_processes_never_hold_more_than_the_permits(alias, tmp_path):
    inside = Inside(str(tmp_path / "inside"))
    inside.reset()
    procs.run_all(_hold_permits, [(alias, inside.path, 100, 3, 5) for _ in range(8)])
    assert inside.read() == (0, 3)  # never 4, and 3 was reached


def test_threads_never_hold_more_than_the_permits(alias, tmp_path):
    inside = Inside(str(tmp_path / "inside"))
    inside.reset()

    def work() -> None:
        try:
            _hold_permits(alias, inside.path, 15, 2, meet=15)
        finally:
            close_private_connections()
            connections.close_all()

    threads = [threading.Thread(target=work) for _ in range(5)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert inside.read() == (0, 2)


def test_asyncio_tasks_never_hold_more_than_the_permits(alias):
    state = {"inside": 0, "most": 0}

    async def work() -> None:
        for _ in range(4):
            async with dlock.semaphore("tasks", permits=2, using=alias, timeout=60):
                state["inside"] += 1
                state["most"] = max(state["most"], state["inside"])
                # meet another holder (up to 1 s): a semaphore that let in one
                # at a time would not pass, however slow the machine
                for _ in range(100):
                    if state["inside"] >= 2:
                        break
                    await asyncio.sleep(0.01)
                await asyncio.sleep(0.01)
                state["inside"] -= 1

    async def main() -> None:
        await asyncio.gather(*(work() for _ in range(5)))

    def run() -> None:
        try:
            asyncio.run(main())
        finally:
            close_private_connections()

    in_thread(run)
    assert state == {"inside": 0, "most": 2}


class Holder(HeldInThread):
    """A thread that holds a permit of ``key`` until :meth:`release` (held once made)."""

    def __init__(self, alias: str, key: str, permits: int, **options) -> None:
        super().__init__(dlock.semaphore(key, permits=permits, using=alias, **options))
        self.wait()


def _live_rows(alias: str, key: str) -> list[tuple[str, str]]:
    from django_dlock.models import Lock as LockRow

    rows = LockRow.objects.using(alias).held().filter(name__startswith=f"semaphore:{key}#")
    return list(rows.values_list("name", "token"))


def _queued(alias: str, key: str) -> int:
    from django_dlock.models import Waiter

    return Waiter.objects.using(alias).filter(name=f"semaphore:{key}").count()


def test_each_permit_is_a_lease_row_of_its_own(alias):
    sem = dlock.semaphore("rows", permits=3, using=alias, ttl=30)
    assert repr(sem) == "<Semaphore semaphore:rows permits=3>"
    assert not sem.locked()
    holders = [Holder(alias, "rows", 3, ttl=30) for _ in range(2)]
    try:
        assert sorted(name for name, _ in _live_rows(alias, "rows")) == [
            "semaphore:rows#0",
            "semaphore:rows#1",
        ]
        assert not sem.locked()  # one permit is still free
        with sem:
            assert sem.owned() and sem.held() and sem.fence is not None
            assert sem.locked()  # all three held: an acquire would wait
            assert in_thread(lambda: sem.acquire(timeout=0)) is False
            with sem:  # the holder re-enters its own permit
                assert len(_live_rows(alias, "rows")) == 3
        assert not sem.owned() and not sem.locked()
    finally:
        for holder in holders:
            holder.release()
    assert _live_rows(alias, "rows") == []


def test_waiters_are_served_in_arrival_order(alias):
    """One permit of two circulates among four waiters, in the order they came."""
    kept = Holder(alias, "order", 2, ttl=60)  # holds the other permit throughout
    first = Holder(alias, "order", 2, ttl=60)
    order: list[int] = []
    threads = []

    def wait(i: int) -> None:
        try:
            with dlock.semaphore("order", permits=2, using=alias, timeout=60, retry_interval=0.01):
                order.append(i)
                time.sleep(0.02)
        finally:
            close_private_connections()
            connections.close_all()

    try:
        for i in range(4):
            thread = threading.Thread(target=wait, args=(i,))
            thread.start()
            threads.append(thread)
            wait_until(lambda n=i + 1: _queued(alias, "order") == n)
        first.release()
        for thread in threads:
            thread.join(60)
        assert order == [0, 1, 2, 3]
    finally:
        first.release()
        kept.release()


def test_a_newcomer_never_takes_a_permit_a_waiter_is_queued_for(alias):
    holders = [Holder(alias, "fair", 2, ttl=60) for _ in range(2)]
    waited = threading.Event()
    go = threading.Event()

    def waiter() -> None:
        try:
            sem = dlock.semaphore("fair", permits=2, using=alias, timeout=60, retry_interval=0.01)
            with sem:
                waited.set()
                go.wait(30)
        finally:
            close_private_connections()
            connections.close_all()

    thread = threading.Thread(target=waiter)
    thread.start()
    try:
        wait_until(lambda: _queued(alias, "fair") == 1)
        holders[0].release()  # a permit is free, and the waiter is first in line
        newcomer = dlock.semaphore("fair", permits=2, using=alias, ttl=60)
        assert in_thread(lambda: newcomer.acquire(timeout=0)) is False
        assert waited.wait(30)
        assert in_thread(lambda: newcomer.acquire(timeout=0)) is False  # full again
    finally:
        go.set()
        thread.join(30)
        holders[0].release()
        holders[1].release()


def _hold_then_wait(alias: str, ready_path: str) -> None:
    sem = dlock.semaphore("killed", permits=2, using=alias, ttl=2)
    assert sem.acquire(timeout=10)
    publish(ready_path, str(sem.fence))
    time.sleep(300)


@pytest.mark.slow
def test_a_killed_holders_permit_is_free_when_its_lease_ends(alias, tmp_path):
    from django_dlock.models import Lock as LockRow

    ready = tmp_path / "ready"
    child = procs.start(_hold_then_wait, alias, str(ready))
    try:
        wait_until(ready.exists, timeout=60)  # a new process starts Django first
        kept = Holder(alias, "killed", 2, ttl=60)
        os.kill(child.pid, signal.SIGKILL)
        child.join(10)
        permits = LockRow.objects.using(alias).filter(name__startswith="semaphore:killed#")
        ends = dict(permits.values_list("name", "expire_at"))
        newcomer = dlock.semaphore("killed", permits=2, using=alias, ttl=60)
        # the dead holder's permit is free once its lease (2 s) has run out
        # on the database clock, and not before
        assert newcomer.acquire(timeout=20)
        assert newcomer.fence > int(ready.read_text())
        taken = permits.get(token=newcomer.token)
        assert taken.acquired_at >= ends[taken.name]
        newcomer.release()
        kept.release()
    finally:
        if child.is_alive():
            child.kill()


def test_losing_one_permit_leaves_the_others_held(alias):
    losses: list[dlock.LockLost] = []
    others = [Holder(alias, "loss", 3, ttl=60) for _ in range(2)]
    try:
        sem = dlock.semaphore("loss", permits=3, using=alias, ttl=0.4, on_lost=losses.append)
        assert sem.acquire(timeout=0)
        first = sem.fence
        assert first is not None
        wait_until(lambda: len(_live_rows(alias, "loss")) == 2)  # ours ran out
        taker = Holder(alias, "loss", 3, ttl=60)  # takes the free permit: ours
        assert sem.owned() is False
        with pytest.raises(dlock.LockLost):
            sem.extend()
        with pytest.raises(dlock.LockNotOwned):
            sem.release()
        assert len(losses) == 1
        tokens = {token for _, token in _live_rows(alias, "loss")}
        assert len(tokens) == 3 and sem.token not in tokens  # the others kept theirs
        assert taker.fence is not None and taker.fence > first
        taker.release()
    finally:
        for holder in others:
            holder.release()


def test_changing_the_number_of_permits_while_they_are_held(alias):
    """The count is the caller's: slots 0..N-1."""
    holders = [Holder(alias, "resize", 3, ttl=60) for _ in range(3)]
    try:
        fewer = dlock.semaphore("resize", permits=2, using=alias, ttl=60)
        more = dlock.semaphore("resize", permits=4, using=alias, ttl=60)
        assert fewer.locked() and more.locked() is False
        assert in_thread(lambda: fewer.acquire(timeout=0)) is False
        assert in_thread(lambda: more.acquire(timeout=0)) is True  # a fourth slot
        # the third holder (slot 2) leaving frees nothing for permits=2 ...
        holders[2].release()
        assert in_thread(lambda: fewer.acquire(timeout=0)) is False
        # ... the first (slot 0) does
        holders[0].release()
        assert in_thread(lambda: fewer.acquire(timeout=0)) is True
    finally:
        for holder in holders:
            holder.release()


def test_a_permit_guards_writes_like_a_lock(alias):
    """``guard()`` on a permit: a write commits only while that permit is held."""
    from django.db import transaction

    sem = dlock.semaphore("guarded", permits=2, using=alias, ttl=0.4)
    assert sem.acquire(timeout=0)
    with transaction.atomic(using=alias), sem.guard(using=alias):
        pass  # held: commits
    wait_until(lambda: _live_rows(alias, "guarded") == [])
    taker = Holder(alias, "guarded", 1, ttl=60)  # slot 0: the permit that was ours
    try:
        with pytest.raises(dlock.LockLost), transaction.atomic(using=alias), sem.guard(alias):
            pass
    finally:
        taker.release()
        with pytest.raises(dlock.LockLost):
            sem.release()


def test_other_strategies_and_quorums_are_refused(alias):
    with pytest.raises(dlock.SemaphoreNotSupported, match="cannot count permits"):
        dlock.semaphore("x", permits=2, strategy="row", using=alias)
    with pytest.raises(dlock.SemaphoreNotSupported, match="quorum"):
        dlock.semaphore("x", permits=2, using=["q1", "q2", "q3"])  # type: ignore[arg-type]
    with override_settings(DLOCK_DEFAULT_STRATEGY="row"):
        sem = dlock.semaphore("x", permits=2, using=alias)
        # (SQLite has no row locks at all: a StrategyNotSupported of its own)
        expected = dlock.StrategyNotSupported if alias == "sqlite" else dlock.SemaphoreNotSupported
        with pytest.raises(expected, match="strategy"):
            sem.acquire(timeout=0)


@pytest.mark.parametrize("permits", [0, -1, 1001, True, 2.5, "3", None])
def test_permits_must_be_a_whole_number_from_1_to_1000(permits):
    with pytest.raises(ValueError, match="permits must be"):
        dlock.semaphore("x", permits=permits)


@pytest.mark.django_db(transaction=True, databases=["default"])
def test_a_force_released_permit_wakes_the_semaphores_waiter_on_postgresql():
    import psycopg

    from django_dlock.models import Waiter
    from django_dlock.operations import force_release

    holder = Holder("default", "forced", 1, ttl=60)
    go = threading.Event()

    def wait() -> None:
        try:
            with dlock.semaphore("forced", permits=1, timeout=30):
                go.wait(30)
        finally:
            close_private_connections()
            connections.close_all()

    params = connections["default"].get_connection_params()
    listen = psycopg.connect(**{**params, "autocommit": True})
    waiter = threading.Thread(target=wait)
    try:
        listen.execute("LISTEN django_dlock")
        waiter.start()
        wait_until(lambda: _queued("default", "forced") == 1)
        ticket = Waiter.objects.using("default").get(name="semaphore:forced").id
        assert force_release("default", names=["semaphore:forced#0"], source="test")
        payloads = [n.payload for n in listen.notifies(timeout=10, stop_after=2)]
        assert f"django-dlock-ticket:{ticket}" in payloads
    finally:
        go.set()
        waiter.join(30)
        holder.release()
        listen.close()


def test_a_take_again_with_the_same_token_renews_its_own_permit_not_another(alias):
    """A take whose answer was lost is tried again with the same token: it is
    granted the permit it already holds (a new fencing number), never a
    second one, even when an earlier permit has become free meanwhile."""
    from django_dlock.strategies.lease.permits import permit_strategy

    from .test_fairness_races import _permit_request

    sem = permit_strategy(2)
    first, mine = _permit_request("again", "first", alias), _permit_request("again", "mine", alias)
    assert sem.try_acquire(first) is not None and first.row == "semaphore:again#0"
    fence = sem.try_acquire(mine)
    assert fence is not None and mine.row == "semaphore:again#1"
    assert sem.release(first)  # the first permit is free now
    again = sem.try_acquire(mine)
    assert again is not None and again > fence and mine.row == "semaphore:again#1"
    assert sorted(_live_rows(alias, "again")) == [("semaphore:again#1", "mine")]
    assert sem.release(mine)
