"""The ``advisory`` strategy: session-level advisory locks on PostgreSQL."""

from __future__ import annotations

import asyncio
import threading

import pytest
from django.db import connections
from django.test.utils import CaptureQueriesContext, override_settings

import django_dlock as dlock
from django_dlock.keys import hash32, hash64, make_key, pg_locks_ids
from django_dlock.strategies.advisory import sessions

from .helpers import give_back_sessions, in_thread, pg_locks, wait_until

pytestmark = pytest.mark.django_db(transaction=True, databases=["default", "sqlite", "mysql"])

ADV = "advisory"


@pytest.fixture(autouse=True)
def _no_session_left_behind():
    yield
    give_back_sessions()  # every test gives back what it took


class HeldElsewhere:
    """A lock held by a thread of its own until :meth:`release`."""

    def __init__(self, key, strategy: str = ADV, **options) -> None:
        self._acquired = threading.Event()
        self._go = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(key, strategy, options))
        self._thread.start()
        assert self._acquired.wait(30)

    def _run(self, key, strategy: str, options: dict) -> None:
        try:
            with dlock.lock(key, strategy=strategy, **options):
                self._acquired.set()
                self._go.wait(120)
        finally:
            connections.close_all()

    def release(self) -> None:
        self._go.set()
        self._thread.join(60)
        assert not self._thread.is_alive()


def try_once(key, **options) -> bool:
    """In another thread: try once, release if acquired; whether it was acquired."""

    def attempt() -> bool:
        lk = dlock.lock(key, strategy=ADV, **options)
        if lk.acquire(timeout=0):
            lk.release()
            return True
        return False

    return in_thread(attempt)


def test_string_key_is_the_documented_bigint_in_pg_locks():
    key = make_key("invoice:42")
    assert key.advisory == (hash64("lock:invoice:42"),)
    with dlock.lock("invoice:42", strategy=ADV):
        k = key.advisory[0]
        with connections["default"].cursor() as cur:
            cur.execute(
                "SELECT classid::bigint, objid::bigint, objsubid FROM pg_locks "
                "WHERE locktype = 'advisory' AND granted AND database = "
                "(SELECT oid FROM pg_database WHERE datname = current_database())"
            )
            rows = cur.fetchall()
            assert rows == [((k >> 32) & 0xFFFFFFFF, k & 0xFFFFFFFF, 1)]
            # The same lock as the raw bigint function.
            cur.execute("SELECT pg_try_advisory_lock(%s)", [k])
            assert cur.fetchone() == (False,)


@pytest.mark.parametrize(
    ("key", "parts"),
    [
        ((7, -3), (7, -3)),
        ((-(2**31), 2**31 - 1), (-(2**31), 2**31 - 1)),
        (("order", 42), (hash32("order"), 42)),
        (("tenant", "acme"), (hash32("tenant"), hash32("acme"))),
    ],
)
def test_two_part_keys_show_as_classid_objid(key, parts):
    a, b = parts
    with dlock.lock(key, strategy=ADV) as lk:
        assert lk.name.startswith("lock(")
        with connections["default"].cursor() as cur:
            cur.execute(
                "SELECT classid::bigint, objid::bigint, objsubid FROM pg_locks "
                "WHERE locktype = 'advisory' AND granted AND database = "
                "(SELECT oid FROM pg_database WHERE datname = current_database())"
            )
            assert cur.fetchall() == [(a & 0xFFFFFFFF, b & 0xFFFFFFFF, 2)]
            assert pg_locks_ids(make_key(key)) == (a & 0xFFFFFFFF, b & 0xFFFFFFFF, 2)
            # The same lock as pg_advisory_lock(int4, int4) with the documented parts.
            cur.execute(
                "SELECT pg_try_advisory_lock(CAST(%s AS integer), CAST(%s AS integer))", [a, b]
            )
            assert cur.fetchone() == (False,)
    assert pg_locks(key) == []


def test_fencing_is_opt_in_and_increases():
    with override_settings(DLOCK_ADVISORY_FENCING=True):
        fences = []
        lk = dlock.lock("fenced", strategy=ADV)
        for i in range(20):
            if i % 5 == 4:

                def other() -> int:
                    with dlock.lock("fenced", strategy=ADV) as mine:
                        assert mine.fence is not None
                        return mine.fence

                fences.append(in_thread(other))
            with lk:
                fences.append(lk.fence)
        assert all(a < b for a, b in zip(fences, fences[1:], strict=False))
        with dlock.lock("fenced", strategy=ADV, timeout=5) as waited:  # the wait path
            assert waited.fence > fences[-1]


def test_blocking_wait_is_fifo_in_the_server_queue():
    holder = dlock.lock("queue", strategy=ADV)
    holder.acquire()
    order: list[str] = []
    threads = []
    for name in ("first", "second", "third"):

        def wait(name: str = name) -> None:
            try:
                with dlock.lock("queue", strategy=ADV, timeout=60):
                    order.append(name)
            finally:
                connections.close_all()

        thread = threading.Thread(target=wait)
        thread.start()
        threads.append(thread)
        expected = len(threads)
        wait_until(lambda expected=expected: len(pg_locks("queue", granted=False)) == expected)
    # A newcomer's try does not overtake the queue.
    assert try_once("queue") is False
    holder.release()
    for thread in threads:
        thread.join(60)
    assert order == ["first", "second", "third"]


def test_shared_readers_and_one_writer():
    readers_in = threading.Barrier(3)
    done = threading.Event()

    def reader() -> bool:
        with dlock.lock("doc", strategy=ADV, shared=True, timeout=10) as lk:
            readers_in.wait(10)  # all readers hold it at the same time
            assert lk.owned()
            done.wait(10)
        return True

    threads = [
        threading.Thread(target=lambda: (reader(), connections.close_all())) for _ in range(2)
    ]
    for t in threads:
        t.start()
    readers_in.wait(10)
    assert [mode for _, mode in pg_locks("doc")] == ["ShareLock", "ShareLock"]
    assert try_once("doc") is False  # a writer waits for the readers
    assert try_once("doc", shared=True) is True  # another reader does not
    done.set()
    for t in threads:
        t.join(30)
    with dlock.lock("doc", strategy=ADV):  # a writer excludes readers
        assert try_once("doc", shared=True) is False
        assert try_once("doc") is False


def test_a_shared_holding_is_not_re_entered_exclusively():
    with dlock.lock("mode", strategy=ADV, shared=True):
        with pytest.raises(dlock.LockReentrantError, match="held shared"):
            dlock.lock("mode", strategy=ADV).acquire()
        with dlock.lock("mode", strategy=ADV, shared=True):  # shared in shared: fine
            pass
    with dlock.lock("mode", strategy=ADV), dlock.lock("mode", strategy=ADV, shared=True):
        pass  # exclusive covers shared
    assert try_once("mode") is True


def test_decorator_and_skip():
    calls: list[int] = []

    @dlock.lock("nightly", strategy=ADV, timeout=0, on_fail="skip")
    def job(n: int) -> int:
        calls.append(n)
        return n

    assert job(1) == 1
    with dlock.lock("nightly", strategy=ADV):
        assert in_thread(job, 2) is None
    assert calls == [1]


def test_not_supported_on_sqlite():
    # (MySQL/MariaDB run it on GET_LOCK: tests/test_advisory_mysql.py)
    with CaptureQueriesContext(connections["sqlite"]) as queries:
        with pytest.raises(dlock.StrategyNotSupported, match="needs PostgreSQL"):
            dlock.lock("k", strategy=ADV, using="sqlite").acquire()
        with pytest.raises(dlock.StrategyNotSupported):
            asyncio.run(dlock.lock("k", strategy=ADV, using="sqlite").aacquire())
    assert len(queries) == 0


# -- asyncio ------------------------------------------------------------------------


async def _try_and_release(key: str) -> bool:
    lk = dlock.lock(key, strategy=ADV)
    if await lk.aacquire(timeout=0):
        await lk.arelease()
        return True
    return False


async def _hold_briefly(key: str, **options) -> bool:
    async with dlock.lock(key, strategy=ADV, **options) as lk:
        return lk.held()


def test_many_async_waiters_do_not_starve_other_tasks():
    holder = HeldElsewhere("crowded")
    waiters_count = sessions.WAIT_THREADS + 2

    async def main() -> bool:
        waiters = [
            asyncio.create_task(_hold_briefly("crowded", timeout=60)) for _ in range(waiters_count)
        ]
        await asyncio.to_thread(
            wait_until, lambda: len(pg_locks("crowded", granted=False)) == waiters_count
        )
        # Every waiter waits in a thread of its own: a try still runs at once.
        other = await asyncio.wait_for(_try_and_release("elsewhere"), 30)
        await asyncio.to_thread(holder.release)
        assert await asyncio.wait_for(asyncio.gather(*waiters), 60) == [True] * waiters_count
        return other

    assert asyncio.run(main()) is True


# -- threads and processes ---------------------------------------------------------


# -- faults -------------------------------------------------------------------------------


def test_a_failed_statement_is_a_named_error_and_holds_nothing():
    with connections["default"].cursor() as cur:
        cur.execute("ALTER SEQUENCE django_dlock_fence RENAME TO django_dlock_fence_away")
    try:
        with (
            override_settings(DLOCK_ADVISORY_FENCING=True),
            pytest.raises(dlock.DLockError, match="migrate"),
        ):
            dlock.lock("nofence", strategy=ADV).acquire(timeout=0)
        assert pg_locks("nofence") == []  # taken before nextval failed, then given back
    finally:
        with connections["default"].cursor() as cur:
            cur.execute("ALTER SEQUENCE django_dlock_fence_away RENAME TO django_dlock_fence")
    assert try_once("nofence") is True


# -- system checks ----------------------------------------------------------------------


def test_check_e010_advisory_needs_postgresql():
    from django_dlock.checks import database_messages

    for strategy in ("advisory", "advisory_xact"):
        assert [m.id for m in database_messages(strategy, "x", {}, "sqlite")] == ["dlock.E010"]
        assert database_messages(strategy, "x", {}, "postgresql") == []
    # advisory runs on MySQL/MariaDB (GET_LOCK); advisory_xact is dlock.E013 there
    assert database_messages("advisory", "x", {}, "mysql") == []
    assert [m.id for m in database_messages("advisory_xact", "x", {}, "mysql")] == ["dlock.E013"]


class _LocksOnSqlite:
    def db_for_write(self, model, **hints):
        return "sqlite" if model._meta.app_label == "django_dlock" else None


def test_check_e010_follows_the_lock_database_of_the_router():
    from django_dlock.checks import check_strategy_database

    router = f"{__name__}._LocksOnSqlite"
    with override_settings(DLOCK_DEFAULT_STRATEGY="advisory", DATABASE_ROUTERS=[router]):
        assert [m.id for m in check_strategy_database()] == ["dlock.E010"]
    with override_settings(DLOCK_DEFAULT_STRATEGY="advisory"):
        assert check_strategy_database() == []  # the default database is PostgreSQL


def test_check_e012_fencing_must_be_a_bool():
    from django_dlock.checks import check_strategy_database

    with override_settings(DLOCK_ADVISORY_FENCING="yes"):
        assert [m.id for m in check_strategy_database()] == ["dlock.E012"]
    with override_settings(DLOCK_ADVISORY_FENCING=True, DLOCK_DEFAULT_STRATEGY="advisory"):
        assert check_strategy_database() == []


def test_idle_pooled_sessions_the_server_ended_are_not_lent_again(pg):
    # every idle session of the pool terminated (a restart, an administrator):
    # the next lock still gets one that works, not the second dead one
    def hold_both() -> list[int]:
        with dlock.lock("ended-a", strategy="advisory", using=pg):
            pids = [pg_locks("ended-a")[0][0]]
            pids += in_thread(lambda: _held_pid(pg, "ended-b"))
            return pids

    try:
        pids = hold_both()
        assert len(set(pids)) == 2  # two sessions, both idle in the pool now
        with connections[pg].cursor() as cur:
            cur.execute("SELECT count(pg_terminate_backend(pid)) FROM unnest(%s) AS pid", [pids])
        wait_until(lambda: not _alive(pg, pids))
        with dlock.lock("ended-a", strategy="advisory", using=pg) as lk:
            assert lk.owned()
            assert pg_locks("ended-a")[0][0] not in pids
    finally:
        give_back_sessions()


def _held_pid(alias: str, key: str) -> list[int]:
    with dlock.lock(key, strategy="advisory", using=alias):
        return [pg_locks(key)[0][0]]


def _alive(alias: str, pids: list[int]) -> bool:
    with connections[alias].cursor() as cur:
        cur.execute("SELECT count(*) FROM pg_stat_activity WHERE pid = ANY(%s)", [pids])
        return bool(cur.fetchone()[0])
