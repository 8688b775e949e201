"""Connection pools: advisory locks never leak to the next borrower of a connection.

* Our own sessions (``django_dlock.sessions``): reused by one holder after
  another, never shared by two at once, only pooled when they hold nothing,
  never used by a forked child.
* Django's connection pool (``OPTIONS["pool"]``, Django 5.1+): a held lock is
  not on any pooled connection, so the next borrower neither holds nor can
  release it; a transaction-scoped lock ends before its connection goes back.
* The system checks that warn about poolers (dlock.W010, dlock.W011).
"""

from __future__ import annotations

import contextlib
import gc
import os
import select
import threading
from collections.abc import Iterator

import django
import pytest
from django.db import connections
from django.test.utils import override_settings

import django_dlock as dlock
from django_dlock import notify
from django_dlock.checks import database_messages
from django_dlock.keys import make_key, pg_locks_ids
from django_dlock.strategies import queue
from django_dlock.strategies.advisory import sessions
from django_dlock.strategies.advisory.sessions import SessionSwitched
from django_dlock.strategies.connection import close_private_connections

from . import pgbouncer, procs
from .helpers import give_back_sessions, in_thread, run_threads, wait_until

pytestmark = pytest.mark.django_db(transaction=True, databases=["default", "sqlite", "mysql"])

ADV = "advisory"

try:
    import psycopg_pool  # noqa: F401

    HAS_POOL = True
except ImportError:  # pragma: no cover
    HAS_POOL = False

needs_django_pool = pytest.mark.skipif(
    django.VERSION < (5, 1) or not HAS_POOL,
    reason="Django's connection pool (OPTIONS['pool']) needs Django >= 5.1 and psycopg-pool; "
    f"this is Django {django.get_version()}",
)


@pytest.fixture(autouse=True)
def _clean():
    yield
    give_back_sessions()


def query(sql: str, params: list | None = None) -> list[tuple]:
    with connections["default"].cursor() as cur:
        cur.execute(sql, params or [])
        return list(cur.fetchall())


def holder_pid(key: str) -> int | None:
    classid, objid, objsubid = pg_locks_ids(make_key(key))
    found = query(
        "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted AND "
        "classid = %s::bigint::oid AND objid = %s::bigint::oid AND objsubid = %s",
        [classid, objid, objsubid],
    )
    return found[0][0] if found else None


def advisory_locks_of(pid: int) -> int:
    return query("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = %s", [pid])[
        0
    ][0]


# -- our sessions ------------------------------------------------------------------------


def test_a_session_is_reused_and_pooled_only_when_it_holds_nothing():
    sessions.close_all()  # idle sessions earlier tests left in the pool
    pids = set()
    for _ in range(3):
        with dlock.lock("p", strategy=ADV):
            pids.add(holder_pid("p"))
    assert len(pids) == 1
    (pid,) = pids
    assert advisory_locks_of(pid) == 0  # idle in our pool, holding nothing
    # (named after its last holder until the next one takes it)
    ((name,),) = query("SELECT application_name FROM pg_stat_activity WHERE pid = %s", [pid])
    assert name.startswith("dlock ")
    # Another holder reuses it (no connect), and is the only one using it.
    assert in_thread(lambda: _pid_while_holding("p")) == pid
    assert sessions.close_all() == 1
    wait_until(lambda: not query("SELECT 1 FROM pg_stat_activity WHERE pid = %s", [pid]))


def _pid_while_holding(key: str) -> int | None:
    with dlock.lock(key, strategy=ADV):
        return holder_pid(key)


def test_concurrent_holders_have_their_own_sessions_and_the_idle_pool_is_bounded():
    count = sessions.MAX_IDLE + 3
    barrier = threading.Barrier(count + 1)
    release = threading.Event()
    pids: list[int | None] = []

    def hold(i: int) -> None:
        try:
            with dlock.lock(f"k{i}", strategy=ADV):
                pids.append(holder_pid(f"k{i}"))
                barrier.wait(30)
                release.wait(30)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=hold, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    barrier.wait(30)
    assert len(set(pids)) == count
    release.set()
    for t in threads:
        t.join(30)
    assert len(sessions.pool("default").idle) == sessions.MAX_IDLE
    for pid in pids:  # pooled or closed, none holds anything
        assert advisory_locks_of(pid) == 0


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
def test_a_forked_child_never_uses_the_parents_sessions():
    with dlock.lock("parent", strategy=ADV):
        parent_pid = holder_pid("parent")
    read_end, write_end = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover (the child reports through the pipe)
        code = 1
        try:
            inherited = len(sessions.pool("default").idle)
            lk = dlock.lock("child", strategy=ADV)
            lk.acquire(timeout=5)
            session = sessions.find("default", lk.token)
            lk.release()
            os.write(write_end, f"{inherited} {session.backend_pid}".encode())
            code = 0
        finally:
            os._exit(code)
    os.close(write_end)
    try:
        ready, _, _ = select.select([read_end], [], [], 60)
        assert ready, "the child did not answer"
        inherited, child_pid = map(int, os.read(read_end, 100).split())
    finally:
        os.close(read_end)
        os.waitpid(child, 0)
    assert inherited == 0
    assert child_pid != parent_pid
    # The parent's pooled session is intact (the child did not close it).
    with dlock.lock("parent", strategy=ADV):
        assert holder_pid("parent") == parent_pid


# -- Django's pool --------------------------------------------------------------------------


@pytest.fixture
def django_pool():
    """Django's connection pool on the default alias, one connection: every
    borrower gets the same server session."""
    wrapper = connections["default"]
    options = wrapper.settings_dict["OPTIONS"]  # shared by every thread's wrapper
    wrapper.close()
    options["pool"] = {"min_size": 1, "max_size": 1, "timeout": 20}
    try:
        yield
    finally:
        connections.close_all()
        wrapper.close_pool()
        del options["pool"]


def _django_backend_pid() -> int:
    return int(query("SELECT pg_backend_pid()")[0][0])


def _row_lock_creating_its_row(key: str) -> int:
    """In a transaction, row-lock a key whose row does not exist yet; the side
    connection's backend pid (it created the row)."""
    from django.db import transaction

    from django_dlock.strategies.connection import lock_connection

    try:
        with transaction.atomic(), dlock.lock(key, strategy="row", timeout=5):
            side = lock_connection("default")  # the thread's private connection
            assert side is not connections["default"]
            return int(side.connection.info.backend_pid)
    finally:
        connections["default"].close()


def test_a_threads_private_connection_is_closed_when_the_thread_ends():
    # The row strategy creates a missing key row on the thread's private
    # connection. When the thread ends, that connection is closed at once
    # (the garbage collector, off here, is not what closes it).
    gc.collect()
    gc.disable()
    try:
        pid = in_thread(_row_lock_creating_its_row, "private:closed")
        wait_until(lambda: not query("SELECT 1 FROM pg_stat_activity WHERE pid = %s", [pid]))
    finally:
        gc.enable()


def test_close_private_connections_closes_the_side_connection():
    def lock_then_close() -> int:
        pid = _row_lock_creating_its_row("private:explicit")
        alive = query("SELECT 1 FROM pg_stat_activity WHERE pid = %s", [pid])
        close_private_connections()
        return pid if alive else -1

    pid = in_thread(lock_then_close)
    assert pid > 0  # it was open until close_private_connections()
    wait_until(lambda: not query("SELECT 1 FROM pg_stat_activity WHERE pid = %s", [pid]))


def test_close_connections_closes_every_connection_django_dlock_opened():
    mine = "SELECT pid FROM pg_stat_activity WHERE datname = current_database() AND pid <> %s"
    me = query("SELECT pg_backend_pid()")[0][0]
    dlock.close_connections()  # what earlier tests opened
    before = {pid for (pid,) in query(mine, [me])}
    with dlock.lock("close:advisory", strategy="advisory", using="default"):
        session = holder_pid("close:advisory")  # it goes back to the pool, idle
    assert notify.listener("default").wait_ready(5)  # the LISTEN of lease waiters
    listening = {pid for (pid,) in query(mine + " AND query LIKE 'LISTEN%%'", [me])}
    opened = {pid for (pid,) in query(mine, [me])} - before
    # the idle session and the listener (a backend that a lingering thread
    # of an earlier test opens meanwhile is not this test's business)
    ours = {session} | listening
    assert len(ours) == 2 and ours <= opened
    dlock.close_connections()
    wait_until(lambda: not ours & {pid for (pid,) in query(mine, [me])})


@needs_django_pool
def test_djangos_pool_never_hands_a_held_lock_to_the_next_borrower(django_pool):
    lk = dlock.lock("pooled", strategy=ADV)
    lk.acquire()
    k = make_key("pooled").advisory[0]
    borrowed = _django_backend_pid()
    connections["default"].close()  # back to Django's pool, the lock still held
    lock_pid = holder_pid("pooled")
    connections["default"].close()
    assert lock_pid != borrowed  # the lock is on our dedicated session

    def next_borrower() -> tuple[int, bool, bool, bool]:
        pid = _django_backend_pid()
        took = query("SELECT pg_try_advisory_lock(%s)", [k])[0][0]
        freed = query("SELECT pg_advisory_unlock(%s)", [k])[0][0]
        acquired = dlock.lock("pooled", strategy=ADV).acquire(timeout=0)
        return pid, took, freed, acquired

    assert in_thread(next_borrower) == (borrowed, False, False, False)
    assert lk.owned()
    lk.release()
    assert in_thread(lambda: _try_and_release("pooled")) is True


def _try_and_release(key: str, strategy: str = ADV, using: str = "default") -> bool:
    lk = dlock.lock(key, strategy=strategy, using=using)
    if lk.acquire(timeout=0):
        lk.release()
        return True
    return False


@needs_django_pool
def test_djangos_pool_and_transaction_scoped_locks(django_pool):
    def locked_in_a_transaction() -> int:
        with dlock.lock_and_atomic("pooled-xact", strategy="advisory_xact"):
            return _django_backend_pid()

    pid = in_thread(locked_in_a_transaction)  # committed, connection back in the pool
    assert in_thread(lambda: (_django_backend_pid(), advisory_locks_of(pid))) == (pid, 0)
    # ... so the next borrower of that server session holds nothing of the previous one

    def borrower_can_lock() -> bool:
        with dlock.lock_and_atomic("pooled-xact", strategy="advisory_xact", timeout=0):
            return True

    assert in_thread(borrower_can_lock) is True


@needs_django_pool
def test_check_w011_warns_with_djangos_pool(django_pool):
    from django_dlock.checks import check_strategy_database

    with override_settings(DLOCK_DEFAULT_STRATEGY="advisory"):
        assert [m.id for m in check_strategy_database()] == ["dlock.W011"]
    with override_settings(DLOCK_DEFAULT_STRATEGY="advisory_xact"):
        assert check_strategy_database() == []


@pytest.fixture
def django_pool_of_4():
    """Django's pool on the default alias: 4 connections, a dry pool fails after 3 s."""
    wrapper = connections["default"]
    options = wrapper.settings_dict["OPTIONS"]
    wrapper.close()
    options["pool"] = {"min_size": 0, "max_size": 4, "timeout": 3}
    try:
        yield
    finally:
        connections.close_all()
        wrapper.close_pool()
        del options["pool"]


def _in_transactions(count: int, body, *, keys) -> list[object]:
    """``count`` threads, each in a transaction that holds a pooled connection, run ``body``."""
    from django.db import transaction

    holding = threading.Barrier(count, timeout=30)
    results: list[object] = [None] * count

    def work(i: int) -> None:
        with transaction.atomic():
            query("SELECT 1")  # the transaction holds one of the pool's connections
            holding.wait()
            results[i] = body(keys[i])

    run_threads(work, [(i,) for i in range(count)], timeout=120)
    return results


@needs_django_pool
@pytest.mark.parametrize("strategy", ["lease", "row"])
def test_djangos_pool_threads_in_transactions_lock_different_keys(django_pool_of_4, strategy):
    together = threading.Barrier(4, timeout=30)

    def lock_it(key: str) -> int | None:
        with dlock.lock(key, strategy=strategy, timeout=5) as lk:
            together.wait()  # all four hold their lock at once
            return lk.fence

    fences = _in_transactions(4, lock_it, keys=[f"pool:{i}" for i in range(4)])
    assert all(isinstance(f, int) for f in fences)


@needs_django_pool
def test_djangos_pool_threads_in_transactions_lock_the_same_key(django_pool_of_4):
    inside: list[int] = []

    def lock_it(key: str) -> bool:
        with dlock.lock(key, timeout=30):
            inside.append(1)
            assert len(inside) == 1
            inside.pop()
        return True

    assert _in_transactions(4, lock_it, keys=["pool:same"] * 4) == [True] * 4


@needs_django_pool
def test_djangos_pool_dry_a_lock_outside_a_transaction_does_not_wait_for_it(django_pool_of_4):
    from django.db import transaction

    dry = threading.Barrier(5, timeout=30)
    done = threading.Event()

    def hold_a_connection(_: int) -> None:
        with transaction.atomic():
            query("SELECT 1")
            dry.wait()
            done.wait(30)

    holders = [threading.Thread(target=hold_a_connection, args=(i,)) for i in range(4)]
    for t in holders:
        t.start()
    try:
        dry.wait()  # the pool's four connections are all taken

        def lock_and_check() -> bool:
            with dlock.lock("pool:dry", timeout=2) as lk:
                return lk.owned()

        assert in_thread(lock_and_check) is True
    finally:
        done.set()
        for t in holders:
            t.join(30)
        connections.close_all()


# -- checks -------------------------------------------------------------------------------


def test_check_w010_pgbouncer_looking_databases():
    def ids(database: dict) -> list[str]:
        return [str(m.id) for m in database_messages("advisory", "x", database, "postgresql")]

    assert ids({"DISABLE_SERVER_SIDE_CURSORS": True}) == ["dlock.W010"]
    assert ids({"PORT": "6432"}) == ["dlock.W010"]
    assert ids({"PORT": 6432, "OPTIONS": {"pool": True}}) == ["dlock.W010", "dlock.W011"]
    assert ids({"PORT": "5432"}) == []
    # Transaction-scoped and lease locks are fine behind a pooler.
    for strategy in ("advisory_xact", "lease"):
        found = database_messages(strategy, "x", {"PORT": "6432"}, "postgresql")
        assert found == []


def test_check_is_registered():
    from django.core import checks

    with override_settings(DLOCK_DEFAULT_STRATEGY="advisory", DLOCK_ADVISORY_FENCING=1):
        found = [m.id for m in checks.run_checks(tags=[checks.Tags.compatibility])]
    assert "dlock.E012" in found


# -- PgBouncer ------------------------------------------------------------------------------

BOUNCER = "bouncer"  # transaction mode, pool of 4 server connections
SESSION_BOUNCER = "bouncer_session"  # session mode


@pytest.fixture(scope="module")
def bouncer(django_db_setup, django_db_blocker):
    # Module scope: the alias must exist before the test case starts.
    with django_db_blocker.unblock(), pgbouncer.attached(BOUNCER, "transaction") as running:
        yield running


@pytest.fixture(scope="module")
def session_bouncer(django_db_setup, django_db_blocker):
    with django_db_blocker.unblock(), pgbouncer.attached(SESSION_BOUNCER, "session") as running:
        yield running


@pytest.mark.django_db(transaction=True, databases=["default", BOUNCER])
def test_lease_through_pgbouncer_without_disabling_server_side_cursors(bouncer):
    # Lease statements are not prepared behind a pooler: no driver errors.
    errors: list[BaseException] = []

    def work(i: int) -> None:
        for n in range(20):
            try:
                with dlock.lock(f"pgb:{i}:{n % 3}", using=BOUNCER, timeout=5):
                    pass
            except BaseException as exc:
                errors.append(exc)

    run_threads(work, [(i,) for i in range(4)])
    assert errors == []


@pytest.mark.django_db(transaction=True, databases=["default", BOUNCER])
def test_read_locks_through_pgbouncer_in_transaction_mode(bouncer):
    # A reader's statements run unprepared there, its release's transaction
    # on one server connection: readers share, a writer waits, no driver error.
    errors: list[BaseException] = []

    def work(i: int) -> None:
        for n in range(15):
            try:
                with dlock.lock("pgb:rw", using=BOUNCER, shared=n % 5 != 0, timeout=10):
                    pass
            except BaseException as exc:
                errors.append(exc)

    run_threads(work, [(i,) for i in range(3)])
    assert errors == []
    with dlock.lock("pgb:rw", using=BOUNCER, shared=True):
        assert in_thread(lambda: dlock.lock("pgb:rw", using=BOUNCER).acquire(timeout=0)) is False
    with dlock.lock("pgb:rw", using=BOUNCER, timeout=0) as writer:  # the last reader freed it
        assert writer.owned()


@pytest.mark.django_db(transaction=True, databases=["default", BOUNCER])
def test_guarded_writes_through_pgbouncer_in_transaction_mode(bouncer):
    # The guard's check goes out with COMMIT unprepared behind a pooler: four
    # threads guard writes on PgBouncer's four server sessions, and a lost
    # lease still rolls its writes back.
    table = "dlock_pgb_guard_probe"
    with connections[BOUNCER].cursor() as cur:
        cur.execute(f"CREATE TABLE IF NOT EXISTS {table} (id INTEGER PRIMARY KEY, n INTEGER)")
        cur.execute(f"DELETE FROM {table}")
        cur.execute(f"INSERT INTO {table} (id, n) VALUES (1, 0)")

    def work(i: int) -> None:
        lk = dlock.lock("pgb:guard", using=BOUNCER, timeout=30)
        for _ in range(10):
            with lk, lk.guard(), connections[BOUNCER].cursor() as cur:
                cur.execute(f"SELECT n FROM {table} WHERE id = 1")
                value = cur.fetchone()[0]
                cur.execute(f"UPDATE {table} SET n = %s WHERE id = 1", [value + 1])

    run_threads(work, [(i,) for i in range(4)])
    lk = dlock.lock("pgb:guard-lost", using=BOUNCER, ttl=30)
    assert lk.acquire(timeout=0)
    with pytest.raises(dlock.LockLost), lk.guard(), connections[BOUNCER].cursor() as cur:
        cur.execute(f"UPDATE {table} SET n = -1 WHERE id = 1")
        with connections["default"].cursor() as other:
            other.execute(
                "UPDATE django_dlock_lock SET token = '' WHERE name = 'lock:pgb:guard-lost'"
            )
    with connections["default"].cursor() as cur:
        cur.execute(f"SELECT n FROM {table} WHERE id = 1")
        assert cur.fetchone()[0] == 40


# -- SQLite inside the caller's transaction -------------------------------------------------

SQLITE = "sqlite"


def _write_something() -> None:
    from django_dlock.models import FenceFloor

    FenceFloor.objects.using(SQLITE).update_or_create(id=1, defaults={"value": 0})


def _hold_sqlite_write(path: str, holding, done) -> None:
    """In another process: hold SQLite's write lock until ``done`` is set."""
    import sqlite3

    db = sqlite3.connect(path, isolation_level=None)
    try:
        db.execute("BEGIN IMMEDIATE")  # the write lock, held
        holding.set()
        done.wait(120)
        db.execute("ROLLBACK")
    finally:
        db.close()


@pytest.mark.slow
@pytest.mark.django_db(transaction=True, databases=["default", SQLITE])
def test_sqlite_a_busy_database_is_contention_not_an_outage():
    # Another process holds SQLite's write lock longer than the lock's
    # timeout: the lease waiter meets "database is locked" (after SQLite's
    # 30 s busy timeout, without care). It is not acquired this round:
    # the waiter retries within its timeout and then times out as usual.
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    holding, done = ctx.Event(), ctx.Event()
    path = connections[SQLITE].settings_dict["NAME"]
    child = procs.start(_hold_sqlite_write, path, holding, done)
    try:
        assert holding.wait(60)
        with pytest.raises(dlock.LockTimeout), dlock.lock("busy", using=SQLITE, timeout=1):
            pass  # (never OperationalError)
        assert dlock.lock("busy", using=SQLITE, timeout=0).acquire() is False
        # The writer finishes while a waiter waits: the waiter gets the lock.
        waiter = threading.Timer(0.3, done.set)
        waiter.start()
        with dlock.lock("busy", using=SQLITE, timeout=30):
            pass
        waiter.join()
    finally:
        done.set()
        child.join(60)
    assert child.exitcode == 0


def test_sqlite_lock_after_a_write_in_the_callers_transaction():
    from django.db import transaction

    with transaction.atomic(using=SQLITE):
        _write_something()  # the caller's connection holds SQLite's write lock
        with dlock.lock("sq:after-write", using=SQLITE, timeout=1) as lk:
            assert lk.owned()
        _write_something()
    # committed and released: anyone can take it now
    assert in_thread(lambda: _try_and_release("sq:after-write", "lease", SQLITE)) is True


def test_sqlite_held_past_the_commit_and_undone_by_a_rollback():
    from django.db import transaction

    lk = dlock.lock("sq:kept", using=SQLITE, timeout=1)
    with transaction.atomic(using=SQLITE):
        _write_something()
        assert lk.acquire()
    # the lease row was committed with the caller's transaction
    assert in_thread(lambda: dlock.lock("sq:kept", using=SQLITE).acquire(timeout=0)) is False
    lk.release()

    class Rollback(Exception):
        pass

    undone = dlock.lock("sq:undone", using=SQLITE, timeout=1)
    with pytest.raises(Rollback), transaction.atomic(using=SQLITE):
        _write_something()
        assert undone.acquire()
        raise Rollback
    assert not dlock.lock("sq:undone", using=SQLITE).locked()
    assert not undone.owned()
    assert in_thread(lambda: _try_and_release("sq:undone", "lease", SQLITE)) is True


def _fresh_listener(alias: str) -> notify.Listener:
    old = notify._listeners.pop(alias, None)
    if old is not None:
        old.stop()
    found = notify.listener(alias)
    assert found.wait_checked(10)
    return found


@pytest.mark.django_db(transaction=True, databases=["default", BOUNCER])
def test_a_listener_behind_pgbouncer_in_transaction_mode_knows_it_cannot_hear(bouncer):
    listen = _fresh_listener(BOUNCER)
    try:
        assert listen.healthy is False  # waiters poll at the retry interval
    finally:
        notify._listeners.pop(BOUNCER, None)
        listen.stop()


@pytest.mark.django_db(transaction=True, databases=["default", BOUNCER])
def test_a_direct_listen_connection_wakes_waiters_behind_pgbouncer(bouncer):
    with override_settings(DLOCK_DIRECT_DATABASES={BOUNCER: "default"}):
        listen = _fresh_listener(BOUNCER)
        try:
            assert listen.healthy is True
            holder = dlock.lock("pgb:wake", using=BOUNCER)
            holder.acquire()
            # a waiter of another thread takes a ticket; a release wakes the
            # head of the queue by its ticket
            queued = dlock.lock("pgb:wake", using=BOUNCER)
            assert in_thread(queued.enqueue) is False
            from django_dlock.models import Waiter  # (not at import: child processes)

            ticket = Waiter.objects.using("default").get(name=make_key("pgb:wake").name).pk
            waiter = notify.Waiter()
            listen.register(queue.wake_payload(ticket), waiter)
            holder.release()  # through PgBouncer: the NOTIFY reaches the direct listener
            assert waiter.thread_event.wait(10)
        finally:
            notify._listeners.pop(BOUNCER, None)
            listen.stop()


@pytest.mark.django_db(transaction=True, databases=["default", SESSION_BOUNCER])
def test_a_listener_behind_pgbouncer_in_session_mode_hears(session_bouncer):
    listen = _fresh_listener(SESSION_BOUNCER)
    try:
        assert listen.healthy is True
    finally:
        notify._listeners.pop(SESSION_BOUNCER, None)
        listen.stop()


def _advisory_locks_on(key: str) -> int:
    classid, objid, objsubid = pg_locks_ids(make_key(key))
    return query(
        "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND "
        "classid = %s::bigint::oid AND objid = %s::bigint::oid AND objsubid = %s",
        [classid, objid, objsubid],
    )[0][0]


@pytest.mark.django_db(transaction=True, databases=["default", BOUNCER])
def test_advisory_through_pgbouncer_in_transaction_mode_is_refused_before_any_lock(bouncer):
    keys = [f"pgb:adv:{i}" for i in range(4)]
    refusals: list[BaseException] = []

    def work(i: int) -> None:
        for _ in range(10):
            try:
                with dlock.lock(keys[i], strategy=ADV, using=BOUNCER, timeout=1):
                    pass
            except dlock.DLockError as exc:
                refusals.append(exc)
            except Exception as exc:  # a driver error: the refusal came too late
                refusals.append(exc)

    run_threads(work, [(i,) for i in range(4)])
    assert refusals and all(isinstance(e, SessionSwitched) for e in refusals), refusals
    assert "transaction mode" in str(refusals[0])
    for key in keys:  # nothing stranded on PgBouncer's server sessions
        assert _advisory_locks_on(key) == 0
        assert _try_and_release(key) is True  # a direct acquire gets it at once


@pytest.mark.django_db(transaction=True, databases=["default", SESSION_BOUNCER])
def test_advisory_through_pgbouncer_in_session_mode_works(session_bouncer):
    lk = dlock.lock("pgb:adv:session", strategy=ADV, using=SESSION_BOUNCER)
    assert lk.acquire(timeout=0)
    try:
        assert _advisory_locks_on("pgb:adv:session") == 1
        assert in_thread(lambda: _try_and_release("pgb:adv:session")) is False  # held
    finally:
        lk.release()
    assert _advisory_locks_on("pgb:adv:session") == 0


def _exclusive_rounds(alias: str, strategy: str, threads: int, rounds: int, **kwargs) -> None:
    """``threads`` threads take one key ``rounds`` times each; never two inside at once."""
    from django.db import transaction

    inside: list[int] = []
    transactional = strategy in ("row", "advisory_xact")

    def once() -> None:
        with dlock.lock(f"pgb:{strategy}", strategy=strategy, using=alias, timeout=30):
            inside.append(1)
            assert len(inside) == 1
            inside.pop()

    def work(_: int) -> None:
        for _round in range(rounds):
            if transactional:
                with transaction.atomic(using=alias):
                    query_on(alias, "SELECT 1")  # the transaction holds a server connection
                    once()
            else:
                once()

    with override_settings(**kwargs):
        run_threads(work, [(i,) for i in range(threads)])


def query_on(alias: str, sql: str) -> list[tuple]:
    with connections[alias].cursor() as cur:
        cur.execute(sql)
        return list(cur.fetchall())


@pytest.mark.django_db(transaction=True, databases=["default", BOUNCER])
@pytest.mark.parametrize("strategy", ["lease", "advisory_xact", "row"])
def test_pgbouncer_transaction_mode_strategies_exclude(bouncer, strategy):
    # 3 threads: the pool of 4 has a server connection to spare for the
    # private connection of a lock taken inside a transaction.
    _exclusive_rounds(BOUNCER, strategy, threads=3, rounds=15)


@pytest.mark.django_db(transaction=True, databases=["default", BOUNCER])
@pytest.mark.parametrize("strategy", ["lease", "row"])
def test_pgbouncer_pool_held_by_transactions_with_a_direct_alias(bouncer, strategy):
    # 4 threads in transactions hold all 4 server connections: a lock
    # statement that must commit on its own goes around PgBouncer.
    from django.db import transaction

    together = threading.Barrier(4, timeout=30)

    def work(i: int) -> None:
        with transaction.atomic(using=BOUNCER):
            query_on(BOUNCER, "SELECT 1")
            together.wait()
            with dlock.lock(f"pgb:full:{i}", strategy=strategy, using=BOUNCER, timeout=5):
                together.wait()

    with override_settings(DLOCK_DIRECT_DATABASES={BOUNCER: "default"}):
        run_threads(work, [(i,) for i in range(4)])


# -- PgBouncer with every server connection busy, no direct route ---------------------------

TINY = "bouncer_tiny"  # transaction mode, 2 server connections, query_wait_timeout 30 s


@pytest.fixture(scope="module")
def tiny_bouncer(django_db_setup, django_db_blocker):
    with (
        django_db_blocker.unblock(),
        pgbouncer.attached(
            TINY, "transaction", pool_size=2, DISABLE_SERVER_SIDE_CURSORS=True
        ) as running,
    ):
        yield running


@contextlib.contextmanager
def pool_held_busy(bouncer: pgbouncer.PgBouncer) -> Iterator[None]:
    """Other clients hold every server connection of ``bouncer`` in open transactions."""
    import psycopg

    template = connections.settings["default"]
    holders = []
    try:
        for _ in range(bouncer.pool_size):
            holder = psycopg.connect(
                host="127.0.0.1", port=bouncer.port, user=template["USER"], dbname=template["NAME"]
            )
            holder.execute("SELECT 1")  # BEGIN: the server connection is this client's now
            holders.append(holder)
        yield
    finally:
        for holder in holders:
            holder.close()


def _lease_insert_running() -> bool:
    return bool(
        query(
            "SELECT 1 FROM pg_stat_activity WHERE state <> 'idle' AND pid <> pg_backend_pid() "
            "AND datname = current_database() AND query LIKE %s",
            ["%INSERT INTO django_dlock_lock%"],
        )
    )


def _lease_rows(name: str) -> list[tuple[str]]:
    return query("SELECT token FROM django_dlock_lock WHERE name = %s", [name])


@pytest.mark.slow
@pytest.mark.django_db(transaction=True, databases=["default", TINY])
@pytest.mark.parametrize("strategy", ["lease", "row", "advisory_xact"])
def test_a_busy_pgbouncer_pool_is_a_lock_timeout_not_a_driver_error(tiny_bouncer, strategy):
    # No direct route: the lock statement waits in PgBouncer's client queue
    # (which ignores a cancel). At the lock's deadline it is given up: a
    # LockTimeout (never PgBouncer's query_wait_timeout error 30 s later).
    from django.db import transaction

    key = f"tiny:{strategy}"
    transactional = strategy != "lease"
    if transactional:  # the caller's connection is open (its transaction begins lazily)
        query_on(TINY, "SELECT 1")
    with pool_held_busy(tiny_bouncer):
        with pytest.raises(dlock.LockTimeout), contextlib.ExitStack() as stack:
            if transactional:
                stack.enter_context(transaction.atomic(using=TINY))
            stack.enter_context(dlock.lock(key, strategy=strategy, using=TINY, timeout=1))
        if not transactional:  # acquire() says False, as for any timeout
            assert dlock.lock(key, strategy=strategy, using=TINY, timeout=0).acquire() is False
    # Nothing was taken for the caller who gave up, and the key works again.
    assert _lease_rows(f"lock:{key}") == []
    assert in_thread(_lock_once_on, TINY, key, strategy) is True


@pytest.mark.slow
@pytest.mark.django_db(transaction=True, databases=["default", TINY])
def test_an_async_acquire_behind_a_busy_pgbouncer_times_out(tiny_bouncer):
    # The async path runs its statements in worker threads: they are
    # watched all the same.
    import asyncio

    async def attempt() -> bool:
        return await dlock.lock("tiny:async", using=TINY, timeout=1).aacquire()

    with pool_held_busy(tiny_bouncer):
        assert asyncio.run(attempt()) is False
    assert _lease_rows("lock:tiny:async") == []
    assert in_thread(_lock_once_on, TINY, "tiny:async", "lease") is True


@pytest.mark.slow
@needs_django_pool
@pytest.mark.django_db(transaction=True, databases=["default", TINY])
@pytest.mark.parametrize("strategy", ["lease", "row"])
def test_djangos_pool_behind_a_busy_pgbouncer_is_a_lock_timeout(tiny_bouncer, strategy):
    # Django's pool in front of PgBouncer: the caller's pooled connection is
    # open, every PgBouncer server connection is busy. The same guarantee:
    # a LockTimeout, and the given-up connection never goes back to the pool.
    from django.db import transaction

    wrapper = connections[TINY]
    settings = wrapper.settings_dict  # (shared by every thread's wrapper of the alias)
    options = settings["OPTIONS"]  # (shared with "default", whose copy this alias is)
    wrapper.close()
    settings["OPTIONS"] = {**options, "pool": {"min_size": 1, "max_size": 2, "timeout": 20}}
    key = f"tiny:pool:{strategy}"
    try:
        query_on(TINY, "SELECT 1")  # a connection of Django's pool, open
        with (
            pool_held_busy(tiny_bouncer),
            pytest.raises(dlock.LockTimeout),
            contextlib.ExitStack() as stack,
        ):
            if strategy == "row":
                stack.enter_context(transaction.atomic(using=TINY))
            stack.enter_context(dlock.lock(key, strategy=strategy, using=TINY, timeout=1))
        assert _lease_rows(f"lock:{key}") == []
        connections[TINY].close()
        for _ in range(3):  # what Django's pool hands out works
            assert query_on(TINY, "SELECT 1") == [(1,)]
            connections[TINY].close()
        assert in_thread(_lock_once_on, TINY, key, strategy) is True
    finally:
        connections.close_all()
        wrapper.close_pool()
        settings["OPTIONS"] = options


def _lock_once_on(alias: str, key: str, strategy: str) -> bool:
    from django.db import transaction

    try:
        with (
            transaction.atomic(using=alias),
            dlock.lock(key, strategy=strategy, using=alias, timeout=10),
        ):
            return True
    finally:
        connections.close_all()
        close_private_connections()


@pytest.mark.slow
@pytest.mark.django_db(transaction=True, databases=["default", TINY])
def test_a_statement_sent_just_before_the_deadline_is_given_up_at_it(tiny_bouncer):
    # A lock wait polls; a statement it sends shortly before its deadline
    # meets a PgBouncer with no free server connection. It is given up at
    # the acquire's deadline, not half a second past it (the least time a
    # try-once gets is counted from the start of the acquire, not per statement).
    import time

    from django_dlock.retry import Deadline
    from django_dlock.strategies.connection import Abandoned, statement_deadline

    query_on(TINY, "SELECT 1")  # connected, and known to go through a pooler
    deadline = Deadline(1.0)
    with statement_deadline(deadline, TINY), pool_held_busy(tiny_bouncer):
        time.sleep(max(0.0, deadline.end - 0.15 - time.monotonic()))
        with pytest.raises(Abandoned):
            query_on(TINY, "SELECT 1")
        late = time.monotonic() - deadline.end
    assert late < 0.25, f"given up {late:.2f} s after the deadline"
    assert query_on(TINY, "SELECT 1") == [(1,)]  # the next statement reconnects


@pytest.mark.django_db(transaction=True, databases=["default", TINY])
def test_a_lease_statement_given_up_on_the_server_never_commits_later(tiny_bouncer):
    # The lease INSERT reaches a server but waits there (another transaction
    # holds the expired lease's row) past the deadline. It is given up, and
    # when the row is free again no lease was taken for the caller.
    key, name = "tiny:late", "lock:tiny:late"
    with connections["default"].cursor() as cur:
        cur.execute(
            "INSERT INTO django_dlock_lock (name, token, owner, fence, acquired_at, expire_at) "
            "VALUES (%s, 'someone', 'someone', 1, now(), now()) "
            "ON CONFLICT (name) DO UPDATE SET token = 'someone', expire_at = now()",
            [name],
        )
    blocker = connections.create_connection("default")
    try:
        blocker.set_autocommit(False)
        with blocker.cursor() as cur:
            cur.execute("SELECT 1 FROM django_dlock_lock WHERE name = %s FOR UPDATE", [name])
        assert dlock.lock(key, using=TINY, timeout=1).acquire() is False
    finally:
        blocker.rollback()
        blocker.close()
    # (a statement that went on running would have taken the row by now)
    wait_until(lambda: not _lease_insert_running())
    assert _lease_rows(name) == [("someone",)]  # still expired, never ours
    assert in_thread(_lock_once_on, TINY, key, "lease") is True


@pytest.mark.django_db(transaction=True, databases=["default", BOUNCER])
def test_checks_w050_w051_name_the_fixes_for_a_pooler(bouncer):
    from django.core import checks

    def ids(alias: str) -> list[str]:
        return sorted(
            str(m.id)
            for m in checks.run_checks(tags=[checks.Tags.database], databases=[alias])
            if str(m.id).startswith("dlock.")
        )

    assert ids(BOUNCER) == ["dlock.W050", "dlock.W051"]
    assert ids("default") == []  # a direct connection
    settings = connections[BOUNCER].settings_dict
    settings["DISABLE_SERVER_SIDE_CURSORS"] = True
    try:
        with override_settings(DLOCK_DIRECT_DATABASES={BOUNCER: "default"}):
            assert ids(BOUNCER) == []
    finally:
        settings["DISABLE_SERVER_SIDE_CURSORS"] = False


def test_check_e050_direct_databases():
    from django_dlock.checks import check_direct_databases

    with override_settings(DLOCK_DIRECT_DATABASES={"default": "sqlite"}):
        assert check_direct_databases() == []
    for bad in ({"default": "nope"}, {"default": "default"}, ["default"], {"x": "default"}):
        with override_settings(DLOCK_DIRECT_DATABASES=bad):
            assert [m.id for m in check_direct_databases()] == ["dlock.E050"]


# -- gunicorn: gthread workers, ATOMIC_REQUESTS, Django's pool ------------------------------


@pytest.fixture
def gunicorn_site():
    import subprocess
    import sys
    import urllib.request

    port = pgbouncer.free_port()
    command = [
        sys.executable, "-m", "gunicorn", "tests.gunicorn_app:application",
        "--worker-class", "gthread", "--workers", "1", "--threads", "4",
        "--bind", f"127.0.0.1:{port}", "--timeout", "120", "--log-level", "warning",
    ]  # fmt: skip
    env = {**os.environ, "DLOCK_TEST_CHILD": "1"}
    server = subprocess.Popen(command, env=env, start_new_session=True)
    base = f"http://127.0.0.1:{port}"

    def up() -> bool:
        try:
            with urllib.request.urlopen(f"{base}/checkout/", timeout=5) as answer:
                return answer.status == 200
        except OSError:
            assert server.poll() is None, "gunicorn exited"
            return False

    try:
        wait_until(up, timeout=60)
        yield base
    finally:
        server.terminate()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(30)


def _get_all(urls: list[str]) -> list[int | str]:
    import urllib.error
    import urllib.request

    answers: list[int | str] = [0] * len(urls)

    def get(i: int) -> None:
        try:
            with urllib.request.urlopen(urls[i], timeout=60) as answer:
                answers[i] = answer.status
        except urllib.error.HTTPError as exc:
            answers[i] = exc.code
        except OSError as exc:
            answers[i] = str(exc)

    run_threads(get, [(i,) for i in range(len(urls))])
    return answers


@pytest.mark.slow
@needs_django_pool
def test_gunicorn_gthread_atomic_requests_with_djangos_pool(gunicorn_site):
    # Four requests at once, each in its transaction (all four pooled
    # connections taken), each locking a different key and holding it
    # until all four are inside.
    assert _get_all([f"{gunicorn_site}/together/{n}/" for n in range(4)]) == [200] * 4
    # Eight requests on one key: they wait their turn (on_contention="wait").
    assert _get_all([f"{gunicorn_site}/invoice/7/wait/"] * 8) == [200] * 8


def test_sqlite_lock_after_a_read_in_the_callers_transaction():
    from django.db import transaction

    from django_dlock.models import FenceFloor

    with transaction.atomic(using=SQLITE):
        list(FenceFloor.objects.using(SQLITE).all())  # the caller holds a read lock
        with dlock.lock("sq:after-read", using=SQLITE, timeout=1) as lk:
            assert lk.owned()
    assert in_thread(lambda: _try_and_release("sq:after-read", "lease", SQLITE)) is True
