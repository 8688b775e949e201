"""The ``advisory`` strategy: session-level advisory locks on PostgreSQL."""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import threading
import time

import pytest
from django.db import connections, transaction
from django.test.utils import CaptureQueriesContext, override_settings

import django_dlock as dlock
from django_dlock import signals
from django_dlock.keys import hash32, hash64, make_key, pg_locks_ids
from django_dlock.strategies.advisory import sessions
from django_dlock.strategies.connection import close_private_connections

from . import procs
from .helpers import in_thread, run_threads, wait_until

pytestmark = pytest.mark.django_db(transaction=True, databases=["default", "sqlite", "mysql"])

ADV = "advisory"


@pytest.fixture(autouse=True)
def _no_session_left_behind():
    yield
    # Every test gives back what it took: no session of this process may
    # still hold a lock (threads that ended are buried by the watcher).
    gc.collect()
    wait_until(lambda: not sessions.holding_sessions(), timeout=30)
    sessions.close_all()
    close_private_connections()


def pg_locks(key, *, granted: bool | None = True) -> list[tuple[int, str]]:
    """(pid, mode) of the advisory locks on ``key`` in the test database."""
    classid, objid, objsubid = pg_locks_ids(make_key(key) if not hasattr(key, "name") else key)
    sql = (
        "SELECT pid, mode FROM pg_locks WHERE locktype = 'advisory' AND database = "
        "(SELECT oid FROM pg_database WHERE datname = current_database()) AND "
        "classid = %s::bigint::oid AND objid = %s::bigint::oid AND objsubid = %s"
    )
    params = [classid, objid, objsubid]
    if granted is not None:
        sql += " AND granted = %s"
        params.append(granted)
    with connections["default"].cursor() as cur:
        cur.execute(sql, params)
        return sorted(cur.fetchall())


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


def test_acquire_release_and_state():
    lk = dlock.lock("job", strategy=ADV)
    assert not lk.locked()
    assert lk.acquire(timeout=0) is True
    assert lk.held() and lk.owned() and lk.locked()
    assert lk.fence is None  # fencing is opt-in for advisory locks
    [(pid, mode)] = pg_locks("job")
    assert mode == "ExclusiveLock"
    assert try_once("job") is False
    lk.release()
    assert not lk.locked() and not lk.owned() and not lk.held()
    assert pg_locks("job") == []
    assert try_once("job") is True
    from django_dlock.models import Lock as LockRow  # (not at import: spawned workers)

    # Advisory locks write no lease row.
    assert not LockRow.objects.filter(name="lock:job").exists()


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


def test_reentrancy_counts_per_holder():
    outer = dlock.lock("re", strategy=ADV)
    with outer:
        with dlock.lock("re", strategy=ADV), outer:
            pass
        assert outer.owned()
        assert try_once("re") is False
        assert len(pg_locks("re")) == 1  # one lock in the database, counted in Python
    assert try_once("re") is True
    with outer, pytest.raises(dlock.LockReentrantError):
        dlock.lock("re", strategy=ADV, reentrant=False).acquire()


def test_threads_contend_never_sharing_a_session():
    with dlock.lock("a", strategy=ADV):
        [(mine, _)] = pg_locks("a")

        def hold_b() -> int:
            with dlock.lock("b", strategy=ADV):
                [(pid, _)] = pg_locks("b")
                assert dlock.lock("a", strategy=ADV).acquire(timeout=0) is False
                return pid

        assert in_thread(hold_b) != mine
        # The same holder keeps all its locks on one session.
        with dlock.lock("c", strategy=ADV):
            assert pg_locks("c") == [(mine, "ExclusiveLock")]


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


def test_timeout_gives_up_with_lock_timeout_and_leaves_nothing():
    with dlock.lock("busy", strategy=ADV):
        assert in_thread(lambda: dlock.lock("busy", strategy=ADV).acquire(timeout=0.2)) is False
        with pytest.raises(dlock.LockTimeout) as info:
            in_thread(lambda: dlock.lock("busy", strategy=ADV, timeout=0.1).__enter__())
        assert isinstance(info.value, TimeoutError)
        assert pg_locks("busy", granted=False) == []  # no waiter left in the queue
        assert len(pg_locks("busy")) == 1


def test_waiter_gets_the_lock_at_release():
    holder = dlock.lock("handoff", strategy=ADV)
    holder.acquire()
    got = threading.Event()

    def waiter() -> None:
        with dlock.lock("handoff", strategy=ADV, timeout=60):
            got.set()
        connections.close_all()

    thread = threading.Thread(target=waiter)
    thread.start()
    wait_until(lambda: len(pg_locks("handoff", granted=False)) == 1)
    assert not got.is_set()
    holder.release()
    thread.join(60)
    assert got.is_set()


def test_timeout_inside_an_outer_atomic_leaves_it_usable():
    with dlock.lock("held", strategy=ADV):

        def work() -> list[str]:
            from django_dlock.models import Lock as LockRow

            with transaction.atomic():
                LockRow.objects.create(name="data:before", expire_at="2000-01-01T00:00:00Z")
                with (
                    pytest.raises(dlock.LockTimeout),
                    dlock.lock("held", strategy=ADV, timeout=0.2),
                ):
                    pass
                assert dlock.lock("held", strategy=ADV).acquire(timeout=0) is False
                LockRow.objects.create(name="data:after", expire_at="2000-01-01T00:00:00Z")
            return sorted(
                LockRow.objects.filter(name__startswith="data:").values_list("name", flat=True)
            )

        assert in_thread(work) == ["data:after", "data:before"]


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


def test_many_keys_on_one_session_all_or_none():
    with dlock.lock("y", strategy=ADV):
        both = dlock.lock(["x", "y"], strategy=ADV)
        assert in_thread(lambda: both.acquire(timeout=0)) is False
        assert pg_locks("x") == []  # "x" was given back
    with dlock.lock(["y", "x"], strategy=ADV):
        [(pid_x, _)] = pg_locks("x")
        [(pid_y, _)] = pg_locks("y")
        assert pid_x == pid_y


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


def test_two_tasks_in_one_thread_contend():
    async def main() -> tuple[bool, bool, bool]:
        first = dlock.lock("tasks", strategy=ADV)
        await first.aacquire()
        other = await asyncio.create_task(dlock.lock("tasks", strategy=ADV).aacquire(timeout=0))
        reentered = await dlock.lock("tasks", strategy=ADV).aacquire(timeout=0)  # same task
        await dlock.lock("tasks", strategy=ADV).arelease()
        await first.arelease()
        after = await asyncio.create_task(_try_and_release("tasks"))
        return other, reentered, after

    assert asyncio.run(main()) == (False, True, True)


async def _try_and_release(key: str) -> bool:
    lk = dlock.lock(key, strategy=ADV)
    if await lk.aacquire(timeout=0):
        await lk.arelease()
        return True
    return False


def test_async_wait_does_not_block_the_event_loop():
    holder = HeldElsewhere("aloop")

    async def main() -> int:
        ticks = 0
        stop = asyncio.Event()

        async def ticker() -> None:
            nonlocal ticks
            while not stop.is_set():
                ticks += 1
                await asyncio.sleep(0.01)

        ticking = asyncio.create_task(ticker())
        waiter = asyncio.create_task(_hold_briefly("aloop", timeout=60))
        await asyncio.to_thread(wait_until, lambda: len(pg_locks("aloop", granted=False)) == 1)
        during = ticks
        await asyncio.sleep(0.2)
        assert ticks > during  # the loop kept running while the task waited
        await asyncio.to_thread(holder.release)
        assert await asyncio.wait_for(waiter, 60) is True
        stop.set()
        await ticking
        return ticks

    assert asyncio.run(main()) > 0


async def _hold_briefly(key: str, **options) -> bool:
    async with dlock.lock(key, strategy=ADV, **options) as lk:
        return lk.held()


def test_cancelled_async_wait_leaves_nothing_held():
    holder = HeldElsewhere("acancel")

    async def main() -> None:
        waiter = asyncio.create_task(_hold_briefly("acancel", timeout=None))
        await asyncio.to_thread(wait_until, lambda: len(pg_locks("acancel", granted=False)) == 1)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        await asyncio.to_thread(wait_until, lambda: pg_locks("acancel", granted=False) == [])

    asyncio.run(main())
    holder.release()
    wait_until(lambda: not dlock.lock("acancel", strategy=ADV).locked())
    assert try_once("acancel") is True


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


def test_asyncio_tasks_exclude_each_other():
    state = {"counter": 0, "inside": 0, "overlaps": 0}
    tasks_count, iterations = 12, 10

    async def task() -> None:
        for _ in range(iterations):
            async with dlock.lock("acounter", strategy=ADV, timeout=60):
                state["inside"] += 1
                state["overlaps"] += state["inside"] > 1
                value = state["counter"]
                await asyncio.sleep(0)  # let every other task run here
                state["counter"] = value + 1
                state["inside"] -= 1

    async def main() -> None:
        await asyncio.gather(*(task() for _ in range(tasks_count)))

    asyncio.run(main())
    assert state["overlaps"] == 0
    assert state["counter"] == tasks_count * iterations


# -- threads and processes ---------------------------------------------------------


def _counting_worker(counter_path: str, iterations: int, shared_key: str = "counter") -> None:
    counter = procs.FileCounter(counter_path)
    lk = dlock.lock(shared_key, strategy=ADV, timeout=120)
    for _ in range(iterations):
        with lk:
            counter.increment(pause=0.0002)


def test_threads_exclude_each_other(tmp_path):
    counter = procs.FileCounter(str(tmp_path / "counter"))
    counter.reset()
    run_threads(_counting_worker, [(counter.path, 50)] * 8)
    assert counter.read() == 400


@pytest.mark.slow
def test_processes_exclude_each_other(tmp_path):
    counter = procs.FileCounter(str(tmp_path / "counter"))
    counter.reset()
    procs.run_all(_counting_worker, [(counter.path, 200)] * 8)
    assert counter.read() == 8 * 200


# -- faults -------------------------------------------------------------------------------


def _hold_forever(ready_path: str) -> None:
    lk = dlock.lock("crash", strategy=ADV, ttl=3600)
    lk.acquire()
    with open(ready_path, "w") as f:
        f.write(str(os.getpid()))
    time.sleep(600)


def test_sigkill_of_the_holder_frees_the_lock_at_once(tmp_path):
    ready = tmp_path / "ready"
    proc = procs.start(_hold_forever, str(ready))
    try:
        wait_until(ready.exists, timeout=60)
        assert dlock.lock("crash", strategy=ADV).locked()
        assert try_once("crash") is False
        result: dict[str, object] = {}

        def waiter() -> None:
            lk = dlock.lock("crash", strategy=ADV, ttl=3600)
            result["acquired"] = lk.acquire(timeout=60)  # far less than any lease
            if result["acquired"]:
                lk.release()
            connections.close_all()

        thread = threading.Thread(target=waiter)
        thread.start()
        wait_until(lambda: len(pg_locks("crash", granted=False)) == 1)
        os.kill(proc.pid, signal.SIGKILL)
        thread.join(60)
        assert result == {"acquired": True}
    finally:
        proc.kill()
        proc.join(10)


def test_terminated_session_is_detected_as_loss():
    lost_events: list[dlock.LockLost] = []
    signalled: list[tuple[str, str]] = []

    def receiver(sender, name, strategy, reason, **kwargs):
        signalled.append((name, strategy))

    signals.lock_lost.connect(receiver)
    try:
        lk = dlock.lock("victim", strategy=ADV, on_lost=lost_events.append)
        lk.acquire()
        [(pid, _)] = pg_locks("victim")
        with connections["default"].cursor() as cur:
            cur.execute("SELECT pg_terminate_backend(%s)", [pid])
        # The watcher notices the closed session without any statement of ours.
        wait_until(lambda: lk.lost, timeout=30)
        assert len(lost_events) == 1 and isinstance(lost_events[0], dlock.LockLost)
        assert signalled == [("lock:victim", "advisory")]
        assert not lk.held() and not lk.owned()
        assert try_once("victim") is True  # the server freed it with the session
        with pytest.raises(dlock.LockLost):
            lk.release()
        with lk:  # the same holder starts again on a new session
            assert lk.owned()
    finally:
        signals.lock_lost.disconnect(receiver)


def test_loss_found_at_release_without_the_watcher():
    lk = dlock.lock("quiet", strategy=ADV)
    lk.acquire()
    session = sessions.find("default", lk.token)
    assert session is not None
    with session.mutex:  # keep the watcher away, as if it had not looked yet
        with connections["default"].cursor() as cur:
            cur.execute("SELECT pg_terminate_backend(%s)", [session.backend_pid])
        time.sleep(0.3)
    with pytest.raises(dlock.LockLost):
        lk.release()


def test_unlock_returning_false_is_never_ignored():
    lk = dlock.lock("unlocked", strategy=ADV)
    lk.acquire()
    session = sessions.find("default", lk.token)
    assert session is not None
    # Someone released it on our session behind our back.
    with session.mutex:
        session.conn.execute("SELECT pg_advisory_unlock_all()")
    assert not lk.owned()
    with pytest.raises(dlock.LockLost):
        lk.release()


def test_a_switched_server_session_is_refused():
    # What a transaction-mode pooler (PgBouncer) does: the next statement runs
    # on another server session. Simulated by changing the pid we expect.
    keep = dlock.lock("kept", strategy=ADV)
    keep.acquire()
    session = sessions.find("default", keep.token)
    assert session is not None
    session.backend_pid, session.backend_pid_text = -1, b"-1"
    with pytest.raises(dlock.DLockError, match="PgBouncer"):
        dlock.lock("next", strategy=ADV).acquire(timeout=0)
    assert keep.lost  # what the session held is reported lost
    with pytest.raises(dlock.LockLost):
        keep.release()
    assert try_once("kept") is True and try_once("next") is True


def test_a_thread_that_ends_holding_frees_its_locks():
    def leak() -> None:
        dlock.lock("leaked", strategy=ADV).acquire()

    in_thread(leak)
    gc.collect()
    wait_until(lambda: not dlock.lock("leaked", strategy=ADV).locked(), timeout=30)
    assert try_once("leaked") is True


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
