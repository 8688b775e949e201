"""Two-phase acquire on the lease strategy: enqueue(), other work, then wait()."""

from __future__ import annotations

import asyncio
import threading

import pytest
from asgiref.sync import sync_to_async
from django.db import connections
from django.test import override_settings

import django_dlock as dlock
from django_dlock.dbclock import now_sql
from django_dlock.exceptions import DLockError, StrategyNotSupported

from .helpers import in_thread, wait_until

pytestmark = pytest.mark.django_db(transaction=True, databases=["default", "sqlite", "mysql"])


def _tickets(alias: str, name: str, live_only: bool = False) -> int:
    connection = connections[alias]
    live = f" AND expire_at > {now_sql(connection)}" if live_only else ""
    with connection.cursor() as cur:
        cur.execute(f"SELECT count(*) FROM django_dlock_waiter WHERE name = %s{live}", [name])
        row = cur.fetchone()
    return int(row[0])


class Holder:
    """Holds a key in a thread of its own until told to let go."""

    def __init__(self, alias: str, key: str, strategy: str = "lease") -> None:
        self.acquired = threading.Event()
        self.let_go = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(alias, key, strategy))
        self.thread.start()
        assert self.acquired.wait(30)

    def _run(self, alias: str, key: str, strategy: str) -> None:
        try:
            with dlock.lock(key, using=alias, ttl=60, strategy=strategy):
                self.acquired.set()
                self.let_go.wait(60)
        finally:
            connections.close_all()

    def release(self) -> None:
        self.let_go.set()
        self.thread.join(30)


def test_enqueue_on_a_free_key_acquires(alias):
    lk = dlock.lock("tp-free", using=alias)
    assert lk.enqueue() is True
    assert lk.owned()
    assert lk.wait() is True
    lk.release()
    assert not lk.locked()


def test_enqueue_other_work_then_wait(alias):
    holder = Holder(alias, "tp-flow")
    lk = dlock.lock("tp-flow", using=alias, ttl=30)
    assert lk.enqueue() is False
    assert _tickets(alias, lk.name, live_only=True) == 1
    assert not lk.owned()
    # "Other work" while queued: a newcomer cannot get past the place.
    assert in_thread(lambda: dlock.lock("tp-flow", using=alias).acquire(timeout=0)) is False
    holder.release()
    assert lk.wait(timeout=30) is True
    assert lk.owned() and lk.fence is not None
    assert _tickets(alias, lk.name) == 0
    lk.release()


def test_wait_timing_out_gives_the_place_up(alias):
    holder = Holder(alias, "tp-timeout")
    lk = dlock.lock("tp-timeout", using=alias)
    assert lk.enqueue() is False
    assert lk.wait(timeout=0.2) is False
    assert _tickets(alias, lk.name) == 0
    assert not lk.owned()
    holder.release()
    # Nobody is queued any more: a try-once gets the free key.
    other = dlock.lock("tp-timeout", using=alias)
    assert in_thread(lambda: other.acquire(timeout=0) and (other.release() or True)) is True


def test_a_place_is_kept_while_the_caller_works(alias):
    # The ticket's own lease is short here; the keeper renews it until wait().
    with override_settings(DLOCK_QUEUE_TICKET_TTL=0.6):
        holder = Holder(alias, "tp-kept")
        lk = dlock.lock("tp-kept", using=alias)
        assert lk.enqueue() is False
        deadline = threading.Event()
        deadline.wait(2.0)  # "other work" lasting several ticket lifetimes
        assert _tickets(alias, lk.name, live_only=True) == 1
        holder.release()
        assert lk.wait(timeout=30) is True
        lk.release()


def test_a_place_taken_by_a_thread_that_ended_without_waiting_is_given_up(alias):
    holder = Holder(alias, "tp-orphan")
    lk = dlock.lock("tp-orphan", using=alias)
    try:
        assert in_thread(lk.enqueue) is False  # that thread ends without wait()
        assert _tickets(alias, lk.name) == 1
        # the keeper stops renewing it and deletes it (it would renew it forever,
        # and the key would stay blocked for everyone behind that place)
        wait_until(lambda: _tickets(alias, lk.name) == 0, timeout=30)
    finally:
        holder.release()
    again = dlock.lock("tp-orphan", using=alias)
    assert again.acquire(timeout=0) is True
    again.release()


def test_wait_without_enqueue_is_an_error(alias):
    holder = Holder(alias, "tp-none")
    try:
        with pytest.raises(DLockError):
            dlock.lock("tp-none", using=alias).wait(timeout=0)
    finally:
        holder.release()


def test_enqueue_twice_is_an_error(alias):
    holder = Holder(alias, "tp-twice")
    lk = dlock.lock("tp-twice", using=alias)
    try:
        assert lk.enqueue() is False
        with pytest.raises(DLockError):
            lk.enqueue()
        assert lk.wait(timeout=0) is False
    finally:
        holder.release()


def test_many_keys_queue_at_the_first_busy_one(alias):
    holder = Holder(alias, "tp-b")
    lk = dlock.lock(["tp-c", "tp-a", "tp-b"], using=alias)
    assert lk.enqueue() is False
    # "a" was free and is held; "c" comes after the busy "b": not taken yet.
    assert dlock.lock("tp-a", using=alias).locked()
    assert not dlock.lock("tp-c", using=alias).locked()
    holder.release()
    assert lk.wait(timeout=30) is True
    assert all(dlock.lock(k, using=alias).locked() for k in ("tp-a", "tp-b", "tp-c"))
    lk.release()
    assert not any(dlock.lock(k, using=alias).locked() for k in ("tp-a", "tp-b", "tp-c"))


def test_many_keys_timing_out_releases_what_enqueue_took(alias):
    holder = Holder(alias, "tp-y")
    lk = dlock.lock(["tp-x", "tp-y"], using=alias)
    assert lk.enqueue() is False
    assert lk.wait(timeout=0.1) is False
    assert not dlock.lock("tp-x", using=alias).locked()
    holder.release()


def test_an_enqueue_that_raises_midway_gives_back_the_keys_it_took(alias):
    # "tp-k2" is already held by this thread, and the lock refuses re-entry:
    # enqueue() takes "tp-k1", then raises at "tp-k2"; "tp-k1" must not stay held.
    with dlock.lock("tp-k2", using=alias):
        lk = dlock.lock(["tp-k1", "tp-k2"], using=alias, reentrant=False)
        with pytest.raises(dlock.LockReentrantError):
            lk.enqueue()
        assert not lk.owned()
        assert not dlock.lock("tp-k1", using=alias).locked()


def test_async_enqueue_then_wait(alias):
    holder = Holder(alias, "tp-async")

    async def main() -> bool:
        lk = dlock.lock("tp-async", using=alias)
        queued = await lk.aenqueue()
        assert queued is False
        await asyncio.get_running_loop().run_in_executor(None, holder.release)
        granted = await lk.await_lock(timeout=30)
        assert await lk.aowned()
        await lk.arelease()
        await sync_to_async(connections.close_all)()
        return bool(granted)

    assert asyncio.run(main()) is True


def test_cancelling_an_async_wait_leaves_no_ticket_and_no_lock(alias):
    holder = Holder(alias, "tp-cancel")
    lk = dlock.lock("tp-cancel", using=alias)

    async def queue_and_wait() -> None:
        assert await lk.aenqueue() is False
        await lk.await_lock(timeout=None)

    async def main() -> None:
        task = asyncio.ensure_future(queue_and_wait())
        while not await asyncio.to_thread(lambda: in_thread(_tickets, alias, lk.name)):
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)  # now in await_lock (or about to be): cancel there
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await sync_to_async(connections.close_all)()

    asyncio.run(main())
    wait_until(lambda: _tickets(alias, lk.name) == 0)
    holder.release()
    # The place was given up: the key is free for anyone, nobody holds it.
    assert not lk.locked()
    other = dlock.lock("tp-cancel", using=alias)
    assert in_thread(lambda: other.acquire(timeout=0) and (other.release() or True)) is True


@pytest.mark.parametrize("strategy", ["row", "advisory_xact"])
def test_strategies_without_a_queue_refuse(pg, strategy):
    with pytest.raises(StrategyNotSupported):
        dlock.lock("tp-refused", using=pg, strategy=strategy).enqueue()


def test_advisory_on_mysql_refuses():
    with pytest.raises(StrategyNotSupported):
        dlock.lock("tp-refused", using="mysql", strategy="advisory").enqueue()


def _advisory_waiting(pg: str) -> int:
    """Sessions waiting for an advisory lock (not granted) in PostgreSQL's queue.

    Only in this test database: ``pg_locks`` shows the whole cluster, where
    other test runs may wait at the same time.
    """
    with connections[pg].cursor() as cur:
        cur.execute(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted "
            "AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
        )
        return int(cur.fetchone()[0])


def test_advisory_enqueue_holds_a_place_in_postgresqls_queue(pg):
    holder = Holder(pg, "tp-adv", strategy="advisory")
    lk = dlock.lock("tp-adv", using=pg, strategy="advisory")
    assert lk.enqueue() is False
    wait_until(lambda: _advisory_waiting(pg) == 1)
    # A newcomer's try-once does not get past the holder (nor the place).
    other = dlock.lock("tp-adv", using=pg, strategy="advisory")
    assert in_thread(lambda: other.acquire(timeout=0)) is False
    holder.release()
    assert lk.wait(timeout=30) is True
    assert lk.owned()
    lk.release()
    assert not lk.locked()


def test_advisory_wait_timing_out_leaves_no_pending_lock(pg):
    holder = Holder(pg, "tp-adv-timeout", strategy="advisory")
    lk = dlock.lock("tp-adv-timeout", using=pg, strategy="advisory")
    assert lk.enqueue() is False
    assert lk.wait(timeout=0.2) is False
    assert _advisory_waiting(pg) == 0
    holder.release()
    assert not lk.locked()
    assert not lk.owned()


def test_advisory_async_wait_cancelled_leaves_no_lock(pg):
    holder = Holder(pg, "tp-adv-cancel", strategy="advisory")
    lk = dlock.lock("tp-adv-cancel", using=pg, strategy="advisory")

    async def queue_and_wait() -> None:
        assert await lk.aenqueue() is False
        await lk.await_lock(timeout=None)

    async def main() -> None:
        task = asyncio.ensure_future(queue_and_wait())
        while not await asyncio.to_thread(lambda: in_thread(_advisory_waiting, pg)):
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await sync_to_async(connections.close_all)()

    asyncio.run(main())
    wait_until(lambda: _advisory_waiting(pg) == 0)
    holder.release()
    assert not lk.locked()


@pytest.mark.parametrize("bad", [0, -1, "6", float("nan"), True, 10**6])
def test_a_bad_ticket_ttl_setting_is_a_named_error(alias, bad):
    holder = Holder(alias, "tp-bad-ttl")
    try:
        with (
            override_settings(DLOCK_QUEUE_TICKET_TTL=bad),
            pytest.raises(ValueError, match="DLOCK_QUEUE_TICKET_TTL"),
        ):
            dlock.lock("tp-bad-ttl", using=alias).acquire(timeout=1)
    finally:
        holder.release()


@pytest.mark.parametrize("bad", [0, -1, "6", float("nan"), float("inf"), True, 10**6])
def test_a_bad_ticket_ttl_setting_is_reported_by_a_system_check(bad):
    from django_dlock.checks import check_settings

    with override_settings(DLOCK_QUEUE_TICKET_TTL=bad):
        found = [error for error in check_settings() if error.id == "dlock.E006"]
    assert len(found) == 1 and "DLOCK_QUEUE_TICKET_TTL" in found[0].msg
    with override_settings(DLOCK_QUEUE_TICKET_TTL=2.5):
        assert not [error for error in check_settings() if error.id == "dlock.E006"]


def test_the_waiters_gauge_counts_this_process_tickets(alias):
    from prometheus_client import REGISTRY

    def waiters() -> float:
        return REGISTRY.get_sample_value("dlock_waiters") or 0.0

    with override_settings(DLOCK_METRICS="prometheus"):
        holder = Holder(alias, "tp-gauge")
        base = waiters()
        lk = dlock.lock("tp-gauge", using=alias, ttl=30)
        assert lk.enqueue() is False  # a place in the queue, not (yet) in wait()
        assert waiters() == base + 1
        # A try-once takes no ticket; a blocked acquire does, until it is served.
        assert in_thread(lambda: dlock.lock("tp-gauge", using=alias).acquire(timeout=0)) is False
        assert waiters() == base + 1
        second = threading.Thread(
            target=lambda: in_thread(
                lambda: dlock.lock("tp-gauge", using=alias, ttl=30).acquire(timeout=30)
            )
        )
        second.start()
        wait_until(lambda: waiters() == base + 2)
        holder.release()
        assert lk.wait(timeout=30) is True
        assert waiters() == base + 1  # the first place was served
        lk.release()
        second.join(30)
        assert waiters() == base
