"""Read-write lease locks (``lock(key, shared=True)`` on ``lease``), on every
database: readers overlap, a writer is alone, a writer queued behind a stream
of readers gets in, readers queued behind a writer all go in when it leaves,
each reader is a lease of its own, and a dead reader's lease runs out.

The loss table walks a reader (tests/test_loss.py), and the paused-holder
test pauses one inside its guard (tests/test_guard.py).
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

import django_dlock as dlock
from django_dlock.strategies.connection import close_private_connections

from . import procs
from .helpers import HeldInThread, in_thread, wait_until

pytestmark = pytest.mark.django_db(transaction=True, databases=["default", "sqlite", "mysql"])


class Room:
    """Who is inside, across processes: readers and writers now, the most
    readers seen at once, and every time a writer was not alone (a file
    under ``flock``)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def reset(self) -> None:
        self._write([0, 0, 0, 0])

    def _write(self, values: list[int]) -> None:
        with open(self.path, "w") as f:
            f.write(" ".join(str(v) for v in values))

    def _change(self, readers: int, writers: int) -> list[int]:
        with open(self.path, "r+") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            now_r, now_w, most_r, clashes = (int(v) for v in f.read().split())
            now_r += readers
            now_w += writers
            most_r = max(most_r, now_r)
            if now_w > 1 or (now_w and now_r):
                clashes += 1
            f.seek(0)
            f.truncate()
            f.write(f"{now_r} {now_w} {most_r} {clashes}")
            return [now_r, now_w, most_r, clashes]

    def enter(self, shared: bool) -> list[int]:
        return self._change(1, 0) if shared else self._change(0, 1)

    def leave(self, shared: bool) -> None:
        self._change(-1, 0) if shared else self._change(0, -1)

    def read(self) -> list[int]:
        return self._change(0, 0)


def _use(alias: str, path: str, shared: bool, iterations: int, counter: str) -> None:
    room = Room(path)
    writes = procs.FileCounter(counter)
    for _ in range(iterations):
        with dlock.lock(
            "rw", shared=shared, using=alias, ttl=60, timeout=120, retry_interval=0.005
        ):
            room.enter(shared)
            if shared:
                time.sleep(0.01)
            else:  # a read-modify-write that two writers at once would get wrong
                writes.increment(pause=0.01)
            room.leave(shared)


@pytest.mark.slow
def test_processes_readers_overlap_and_a_writer_is_alone(alias, tmp_path):
    room = Room(str(tmp_path / "room"))
    room.reset()
    counter = procs.FileCounter(str(tmp_path / "writes"))
    counter.reset()
    readers = [(alias, room.path, True, 40, counter.path)] * 4
    writers = [(alias, room.path, False, 20, counter.path)] * 2
    procs.run_all(_use, readers + writers)
    now_r, now_w, most_r, clashes = room.read()
    assert (now_r, now_w, clashes) == (0, 0, 0)  # a writer was never beside anyone
    assert counter.read() == 40  # no write lost: writers were alone
    assert most_r >= 2  # readers did hold together


class Holder(HeldInThread):
    """A thread that holds ``key`` (shared or not) until :meth:`release`."""

    def __init__(self, alias: str, key: str, shared: bool, **options) -> None:
        super().__init__(dlock.lock(key, using=alias, shared=shared, **options))


def _queued(alias: str, key: str) -> int:
    from django_dlock.models import Waiter

    return Waiter.objects.using(alias).filter(name=f"lock:{key}").count()


def _rows(alias: str, key: str) -> dict[str, tuple[str, int]]:
    from django_dlock.models import Lock as LockRow

    rows = LockRow.objects.using(alias).held().filter(name__startswith=f"lock:{key}")
    found = rows.values_list("name", "token", "fence")
    return {name: (token, fence) for name, token, fence in found}


def test_readers_hold_together_each_a_lease_of_its_own(alias):
    first = Holder(alias, "rows", True, ttl=30).wait()
    try:
        second = dlock.lock("rows", using=alias, shared=True, ttl=30)
        with second:
            assert second.owned() and second.fence is not None
            assert second.fence > first.fence  # every grant a new number
            reader_fence = second.fence
            rows = _rows(alias, "rows")
            assert rows["lock:rows"][0] == "(readers)"  # the key's row: readers hold it
            readers = sorted(name for name in rows if name != "lock:rows")
            assert len(readers) == 2 and all("#reader:" in name for name in readers)
            assert second.locked()
            # a writer cannot get in; another reader can
            assert in_thread(lambda: dlock.lock("rows", using=alias).acquire(timeout=0)) is False
            other = dlock.lock("rows", using=alias, shared=True)
            assert in_thread(lambda: other.acquire(timeout=0) and other.release() is None)
            with second:  # re-entered, not a third reader
                assert len(_rows(alias, "rows")) == 3
            second.extend(60)  # raises LockLost if the read lease were gone
            assert second.owned()
        # the reader's row is gone, the first one still holds
        assert len(_rows(alias, "rows")) == 2
    finally:
        first.release()
    # the last reader out frees the key: a writer gets in at once, above every reader's number
    assert _rows(alias, "rows") == {}
    with dlock.lock("rows", using=alias, timeout=0) as writer:
        assert writer.fence > reader_fence


def test_readers_behind_a_queued_writer_wait(alias):
    reader = Holder(alias, "fifo", True, ttl=60).wait()
    got: list[bool] = []

    def writer() -> None:
        try:
            got.append(dlock.lock("fifo", using=alias, timeout=30, retry_interval=0.01).acquire())
            dlock.lock("fifo", using=alias).release()
        finally:
            close_private_connections()
            connections.close_all()

    thread = threading.Thread(target=writer)
    try:
        thread.start()
        wait_until(lambda: _queued(alias, "fifo") == 1)
        # a reader arriving after the queued writer waits behind it
        late = dlock.lock("fifo", using=alias, shared=True)
        assert in_thread(lambda: late.acquire(timeout=0)) is False
    finally:
        reader.release()
        thread.join(30)
    assert got == [True]


def test_readers_queued_behind_a_writer_all_go_in_when_it_leaves(alias):
    writer = Holder(alias, "wave", False, ttl=60).wait()
    inside = {"now": 0, "most": 0}
    mutex = threading.Lock()

    def read() -> None:
        try:
            with dlock.lock("wave", using=alias, shared=True, timeout=30, retry_interval=0.01):
                with mutex:
                    inside["now"] += 1
                    inside["most"] = max(inside["most"], inside["now"])
                # meet the others inside (bounded: a reader left out makes most < 3)
                until = time.monotonic() + 10
                while inside["most"] < 3 and time.monotonic() < until:
                    time.sleep(0.01)
                with mutex:
                    inside["now"] -= 1
        finally:
            close_private_connections()
            connections.close_all()

    threads = [threading.Thread(target=read) for _ in range(3)]
    try:
        for i, thread in enumerate(threads):
            thread.start()
            wait_until(lambda n=i + 1: _queued(alias, "wave") == n)
    finally:
        writer.release()
        for thread in threads:
            thread.join(30)
    assert inside == {"now": 0, "most": 3}


def test_a_writer_queued_behind_a_stream_of_readers_gets_in(alias):
    """Readers come and go so that one always holds; a writer that queues
    is granted within its timeout (10 s, against readers holding 50 ms
    each), and the readers that came after it wait until it has left."""
    stop = threading.Event()
    log: list[str] = []
    mutex = threading.Lock()

    def stream() -> None:
        try:
            while not stop.is_set():
                reader = dlock.lock(
                    "stream", using=alias, shared=True, timeout=30, retry_interval=0.01
                )
                with reader:
                    with mutex:
                        log.append("r")
                    time.sleep(0.05)
        finally:
            close_private_connections()
            connections.close_all()

    readers = [threading.Thread(target=stream) for _ in range(3)]
    for thread in readers:
        thread.start()
        time.sleep(0.02)
    try:
        wait_until(lambda: log.count("r") >= 6)
        writer = dlock.lock("stream", using=alias, timeout=10, retry_interval=0.01)
        writer.enqueue()
        with mutex:
            log.append("queued")
        assert writer.wait()
        with mutex:
            log.append("w")
        time.sleep(0.1)  # readers keep trying meanwhile
        with mutex:
            log.append("left")
        writer.release()
        wait_until(lambda: log[-1] == "r")
    finally:
        stop.set()
        for thread in readers:
            thread.join(30)
    queued, granted = log.index("queued"), log.index("w")
    # at most the readers already in flight when the ticket was taken went ahead
    assert log[queued + 1 : granted].count("r") <= len(readers)
    assert log[granted + 1] == "left"  # nobody came in while the writer held it


def test_a_shared_holding_is_not_re_entered_exclusively(alias):
    exclusive = dlock.lock("mode", using=alias)
    with dlock.lock("mode", using=alias, shared=True), pytest.raises(dlock.LockReentrantError):
        exclusive.acquire(timeout=0)
    with dlock.lock("mode", using=alias), dlock.lock("mode", using=alias, shared=True):
        pass  # exclusive covers shared


def test_a_force_released_key_loses_its_readers(alias):
    from django_dlock.operations import force_release

    lk = dlock.lock("forced", using=alias, shared=True, ttl=60)
    assert lk.acquire(timeout=0)
    assert force_release(alias, names=["lock:forced"], source="test")
    writer = Holder(alias, "forced", False, timeout=0).wait()  # a writer gets in at once
    try:
        with pytest.raises(dlock.LockLost):
            lk.release()  # its own lease had not run out: the key's row says it is lost
    finally:
        writer.release()
    assert _rows(alias, "forced") == {}


def test_asyncio_readers_hold_together_and_a_writer_waits_for_them(alias):
    from asgiref.sync import sync_to_async

    inside: list[int] = []

    async def read(i: int) -> None:
        async with dlock.lock("async-rw", using=alias, shared=True, timeout=30):
            inside.append(i)
            while len(inside) < 3:  # all three inside at once (bounded by the test's timeout)
                await asyncio.sleep(0.01)

    async def main() -> list[bool]:
        await asyncio.wait_for(asyncio.gather(*(read(i) for i in range(3))), 30)
        writer = dlock.lock("async-rw", using=alias, timeout=0)
        got = await writer.aacquire()
        await writer.arelease()
        await sync_to_async(close_private_connections)()
        return [got]

    assert in_thread(lambda: asyncio.run(main())) == [True]
    assert sorted(inside) == [0, 1, 2]


def _read_then_wait(alias: str, ready_path: str) -> None:
    lk = dlock.lock("killed", using=alias, shared=True, ttl=2)
    assert lk.acquire(timeout=10)
    open(ready_path, "w").close()
    time.sleep(600)


@pytest.mark.slow
def test_a_killed_readers_lease_runs_out_and_a_writer_gets_in(alias, tmp_path):
    ready = tmp_path / "ready"
    proc = procs.start(_read_then_wait, alias, str(ready))
    try:
        wait_until(lambda: ready.exists(), timeout=60)
        assert proc.pid is not None
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(10)
        # bounded by the reader's 2 s lease: the writer's timeout is 15 s
        with dlock.lock("killed", using=alias, timeout=15) as writer:
            assert writer.owned()
    finally:
        if proc.is_alive():
            proc.kill()


@pytest.mark.parametrize(
    ("alias", "strategy"), [("default", "row"), ("mysql", "row"), ("mysql", "advisory")]
)
def test_strategies_without_shared_locks_refuse_them(alias, strategy):
    with pytest.raises(dlock.StrategyNotSupported, match="shared"):
        dlock.lock("nope", using=alias, strategy=strategy, shared=True).acquire(timeout=0)


@pytest.mark.django_db(databases=[])
def test_a_quorum_refuses_shared_locks():
    with pytest.raises(dlock.StrategyNotSupported, match="shared"):
        dlock.lock("nope", using=["q1", "q2", "q3"], shared=True).acquire(timeout=0)


# -- upgradeable read locks ------------------------------------------------------


def test_one_upgradeable_reader_at_a_time_beside_readers(alias):
    upgrader = Holder(alias, "up-one", True, upgradeable=True, ttl=30).wait()
    try:
        assert _rows(alias, "up-one")["lock:up-one#reader:upgradeable"][1] == upgrader.fence
        reader = dlock.lock("up-one", using=alias, shared=True)
        assert in_thread(lambda: reader.acquire(timeout=0) and reader.release() is None)
        other = dlock.lock("up-one", using=alias, upgradeable=True)
        assert in_thread(lambda: other.acquire(timeout=0)) is False
    finally:
        upgrader.release()
    assert in_thread(lambda: other.acquire(timeout=0) and other.release() is None)


def test_an_upgrade_waits_for_the_readers_and_no_writer_gets_in_between(alias):
    """A reader holds; the upgradeable reader asks to upgrade; a writer queues
    during the upgrade, and a newcomer reader is kept out. When the reader
    leaves, the upgrader writes first, and the writer sees its write."""
    log: list[str] = []
    reader = Holder(alias, "up", True, ttl=60).wait()
    asked = threading.Event()
    upgraded: list[bool] = []

    def upgrade() -> None:
        try:
            lk = dlock.lock("up", using=alias, upgradeable=True, ttl=60, retry_interval=0.01)
            with lk:
                fence = lk.fence
                asked.set()
                upgraded.append(lk.upgrade(timeout=30))
                assert lk.owned() and lk.fence > fence
                with dlock.lock("up", using=alias):  # now exclusive: re-entered
                    log.append("upgrader wrote")
                lk.extend(60)
                # (inside the block: once it is left, the writer may log first)
                log.append("upgrader leaves")
        finally:
            close_private_connections()
            connections.close_all()

    def write() -> None:
        try:
            with dlock.lock("up", using=alias, timeout=30, retry_interval=0.01):
                log.append("writer saw: " + ", ".join(log))
        finally:
            close_private_connections()
            connections.close_all()

    threads = [threading.Thread(target=upgrade), threading.Thread(target=write)]
    try:
        threads[0].start()
        assert asked.wait(30)
        wait_until(lambda: _queued(alias, "up") == 1)  # the upgrade waits, with a ticket
        threads[1].start()
        wait_until(lambda: _queued(alias, "up") == 2)  # the writer queues behind it
        late = dlock.lock("up", using=alias, shared=True)
        assert in_thread(lambda: late.acquire(timeout=0)) is False  # kept out
        log.append("reader leaves")
    finally:
        reader.release()
        for thread in threads:
            thread.join(60)
    assert upgraded == [True]
    assert log == [
        "reader leaves",
        "upgrader wrote",
        "upgrader leaves",
        "writer saw: reader leaves, upgrader wrote, upgrader leaves",
    ]


def test_an_upgrade_that_times_out_keeps_the_read_lock(alias):
    reader = Holder(alias, "up-timeout", True, ttl=60).wait()
    try:
        lk = dlock.lock("up-timeout", using=alias, upgradeable=True, ttl=60)
        with lk:
            assert lk.upgrade(timeout=0.2) is False
            assert lk.owned()
            assert _queued(alias, "up-timeout") == 0  # its ticket is given back
    finally:
        reader.release()
    plain = dlock.lock("up-plain", using=alias, shared=True)
    with plain, pytest.raises(dlock.DLockError, match="upgradeable=True"):
        plain.upgrade()


def test_an_upgrade_of_a_lost_read_lock_raises(alias):
    from django_dlock.operations import force_release

    lk = dlock.lock("up-lost", using=alias, upgradeable=True, ttl=60)
    assert lk.acquire(timeout=0)
    assert force_release(alias, names=["lock:up-lost"], source="test")
    with pytest.raises(dlock.LockLost):
        lk.upgrade(timeout=1)
    with pytest.raises(dlock.LockNotOwned):
        lk.release()


@pytest.mark.django_db(transaction=True, databases=["default"])
def test_advisory_locks_refuse_upgradeable():
    with pytest.raises(dlock.StrategyNotSupported, match="upgradeable"):
        dlock.lock("nope", strategy="advisory", upgradeable=True).acquire(timeout=0)


@pytest.mark.django_db(transaction=True, databases=["default"])
def test_readers_with_fast_durability_on_postgresql():
    from django.test import override_settings

    with override_settings(DLOCK_LEASE_SYNCHRONOUS_COMMIT=False):
        first = Holder("default", "fast-rw", True, ttl=30).wait()
        try:
            with dlock.lock("fast-rw", shared=True, ttl=30) as second:
                assert second.owned() and second.fence > first.fence
                assert in_thread(lambda: dlock.lock("fast-rw").acquire(timeout=0)) is False
        finally:
            first.release()
        with dlock.lock("fast-rw", timeout=0) as writer:  # the last reader freed the key
            assert writer.owned()


def test_an_async_upgrade(alias):
    from asgiref.sync import sync_to_async

    async def main() -> tuple[bool, bool, bool]:
        lk = dlock.lock("up-async", using=alias, upgradeable=True, ttl=30)
        async with lk:
            fence = lk.fence
            upgraded = await lk.aupgrade(timeout=10)
            owned = await lk.aowned()
            newer = lk.fence is not None and fence is not None and lk.fence > fence
        await sync_to_async(close_private_connections)()
        return upgraded, owned, newer

    assert in_thread(lambda: asyncio.run(main())) == (True, True, True)
    with dlock.lock("up-async", using=alias, timeout=0) as writer:  # released on leaving
        assert writer.owned()
