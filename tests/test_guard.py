"""``Lock.guard()``: writes that commit only while the lock is held.

The writes go to a small table of the test (``dlock_guard_probe``), as a
user's writes go to their own tables, on each database.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from asgiref.sync import async_to_sync, sync_to_async
from celery import Celery
from django.db import DatabaseError, connections, transaction

import django_dlock as dlock
from django_dlock import dbclock
from django_dlock.contrib.celery import SingleInstanceTask
from django_dlock.exceptions import DLockError

from . import procs
from .helpers import end_server_session, in_thread, wait_until
from .test_quorum import QUORUM

pytestmark = pytest.mark.django_db(transaction=True, databases=["default", "sqlite", "mysql"])

PROBE = "dlock_guard_probe"


def _probe(alias: str) -> None:
    """An empty probe table on ``alias`` with one row (id 1, v '-')."""
    with connections[alias].cursor() as cur:
        cur.execute(f"CREATE TABLE IF NOT EXISTS {PROBE} (id INTEGER PRIMARY KEY, v VARCHAR(20))")
        cur.execute(f"DELETE FROM {PROBE}")
        cur.execute(f"INSERT INTO {PROBE} (id, v) VALUES (1, '-')")


def _write(alias: str, value: str) -> None:
    with connections[alias].cursor() as cur:
        cur.execute(f"UPDATE {PROBE} SET v = %s WHERE id = 1", [value])


def _read(alias: str) -> str:
    # a new connection: what is committed, whatever the test's connection holds
    other = connections[alias].copy(alias)
    try:
        with other.cursor() as cur:
            cur.execute(f"SELECT v FROM {PROBE} WHERE id = 1")
            return str(cur.fetchone()[0])
    finally:
        other.close()


@pytest.fixture(params=["default", "sqlite", "mysql"], ids=["postgresql", "sqlite", "mariadb"])
def alias(request: pytest.FixtureRequest) -> Iterator[str]:
    _probe(request.param)
    yield request.param
    dlock.close_connections()


def _elsewhere(alias: str, sql: str, name: str) -> None:
    """Run ``sql`` on the lease row ``name`` from another connection (committed)."""
    other = connections[alias].copy(alias)
    try:
        with other.cursor() as cur:
            cur.execute(sql.format(now=dbclock.now_sql(other)), [name])
            assert cur.rowcount == 1
    finally:
        other.close()


#: how a lease is lost, as another process would leave its row
LOSSES = {
    "expired": "UPDATE django_dlock_lock SET expire_at = {now} WHERE name = %s",
    "taken over": "UPDATE django_dlock_lock SET token = 'someone else' WHERE name = %s",
    "force-released": "UPDATE django_dlock_lock SET token = '' WHERE name = %s",
}


# -- the lease strategy, one process ---------------------------------------------------


def test_guarded_writes_commit_while_the_lock_is_held(alias):
    with dlock.lock("guard:held", using=alias) as lk:
        with lk.guard():
            _write(alias, "A")
        assert _read(alias) == "A"  # committed at the end of the guarded block
        assert lk.owned()


def test_a_guarded_block_marked_for_rollback_commits_nothing(alias):
    # On PostgreSQL the check and COMMIT go out together: a block that asked
    # for a rollback (Django's set_rollback) must never reach that COMMIT.
    with dlock.lock("guard:rollback", using=alias) as lk:
        with lk.guard():
            _write(alias, "A")
            transaction.set_rollback(True, using=alias)
        assert _read(alias) == "-"
        assert lk.owned()
        with lk.guard():  # the next guarded block on the connection is fine
            _write(alias, "B")
        assert _read(alias) == "B"


def test_a_guard_keeps_the_isolation_level_of_the_connection(pg):
    # The guard opens the transaction itself (with its idle bound): the BEGIN
    # is the one the connection's settings ask for.
    connection = connections[pg]
    connection.ensure_connection()
    raw = connection.connection
    import psycopg

    raw.isolation_level = psycopg.IsolationLevel.SERIALIZABLE
    try:
        with dlock.lock("guard:iso", using=pg) as lk, lk.guard(), connection.cursor() as cur:
            cur.execute("SHOW transaction_isolation")
            level = cur.fetchone()[0]
            cur.execute("SHOW idle_in_transaction_session_timeout")
            bound = cur.fetchone()[0]
    finally:
        raw.isolation_level = None
    assert level == "serializable"
    assert bound != "0"  # the idle bound is set in the same transaction


def test_a_check_that_found_the_lease_lost_leaves_the_next_guard_working(alias):
    # On PostgreSQL the check is prepared on the session the first time it
    # goes out, even when it then finds the lease lost; the next guard on
    # the same connection uses it.
    connections[alias].close()  # a new session
    first = dlock.lock("guard:again", using=alias, ttl=30)
    assert first.acquire(timeout=0)
    with pytest.raises(dlock.LockLost), first.guard():
        _elsewhere(alias, LOSSES["taken over"], "lock:guard:again")
        _write(alias, "A")
    second = dlock.lock("guard:again-2", using=alias, ttl=30)
    for value in ("B", "C"):
        with second, second.guard():
            _write(alias, value)
        assert _read(alias) == value


def test_guarded_writes_while_queries_are_logged(alias):
    # With DEBUG's query log on, nothing is prepared: the check goes out as it is.
    from django.test.utils import CaptureQueriesContext

    with CaptureQueriesContext(connections[alias]):
        lk = dlock.lock("guard:logged", using=alias, ttl=30)
        assert lk.acquire(timeout=0)
        with lk.guard():
            _write(alias, "A")
        assert _read(alias) == "A"
        _elsewhere(alias, LOSSES["force-released"], "lock:guard:logged")
        with pytest.raises(dlock.LockLost), lk.guard():
            _write(alias, "B")
        with pytest.raises(dlock.LockLost):
            lk.release()
    assert _read(alias) == "A"


@pytest.mark.parametrize("loss", list(LOSSES))
def test_a_lost_lease_rolls_the_guarded_writes_back(alias, loss):
    lk = dlock.lock("guard:lost", using=alias, ttl=30)
    assert lk.acquire(timeout=0)
    with pytest.raises(dlock.LockLost, match="guarded writes .* were rolled back"), lk.guard():
        _elsewhere(alias, LOSSES[loss], "lock:guard:lost")
        _write(alias, "A")
    assert _read(alias) == "-"  # nothing of the block was written
    assert lk.lost
    with pytest.raises(dlock.LockLost):
        lk.release()


def test_a_guard_needs_the_lock(alias):
    lk = dlock.lock("guard:not-held", using=alias)
    with pytest.raises(dlock.LockNotOwned), lk.guard():
        _write(alias, "A")
    assert _read(alias) == "-"


def test_an_error_in_the_guarded_block_rolls_it_back_and_is_raised(alias):
    with dlock.lock("guard:error", using=alias) as lk:
        with pytest.raises(ZeroDivisionError), lk.guard():
            _write(alias, "A")
            _ = 1 / 0
        assert _read(alias) == "-"
        assert lk.owned()  # the lock is still held, and still usable
        with lk.guard():
            _write(alias, "B")
    assert _read(alias) == "B"


def test_a_guard_of_the_writes_of_another_database_is_refused(alias):
    other = "sqlite" if alias != "sqlite" else "default"
    lk = dlock.lock("guard:other-db", using=alias)
    with lk, pytest.raises(dlock.GuardNotSupported, match="fence"), lk.guard(using=other):
        pass


def test_a_guard_of_a_lock_on_several_keys_checks_every_key(alias):
    lk = dlock.lock(["guard:k1", "guard:k2"], using=alias)
    assert lk.acquire(timeout=0)
    with pytest.raises(dlock.LockLost, match="k2"), lk.guard():
        _elsewhere(alias, LOSSES["taken over"], "lock:guard:k2")
        _write(alias, "A")
    assert _read(alias) == "-"
    with pytest.raises(dlock.LockLost):
        lk.release()


def test_aguard_runs_the_writes_in_a_guarded_transaction(alias):
    def steal_then_write() -> None:
        _elsewhere(alias, LOSSES["taken over"], "lock:guard:async")
        _write(alias, "B")

    async def main() -> None:
        lk = dlock.lock("guard:async", using=alias)
        assert await lk.aacquire(timeout=0)
        await lk.aguard(lambda: _write(alias, "A"))
        assert await sync_to_async(_read)(alias) == "A"
        with pytest.raises(dlock.LockLost):
            await lk.aguard(steal_then_write)
        with pytest.raises(dlock.LockLost):
            await lk.arelease()

    asyncio.run(main())
    assert _read(alias) == "A"


# -- a guard inside the caller's transaction (a view under ATOMIC_REQUESTS) -------------

#: a lease long enough that a release waiting for its own pin shows (PostgreSQL
#: ends the caller's session after it, MariaDB gives up after 50 s)
VIEW_TTL = 10.0


@pytest.mark.parametrize("then", ["release", "extend"])
def test_a_release_or_extend_in_the_transaction_of_its_guard_does_not_wait_for_itself(alias, then):
    # The natural shape of a view: the request's transaction, a guarded
    # write, the lock given back (or extended) before the view returns.
    lk = dlock.lock("guard:view", using=alias, ttl=VIEW_TTL)
    started = time.monotonic()
    with transaction.atomic(using=alias):
        assert lk.acquire(timeout=5)
        with lk.guard():
            _write(alias, "A")
        if then == "extend":
            lk.extend(VIEW_TTL)
            with lk.guard():
                _write(alias, "B")
        lk.release()
        _write(alias, "C")  # the rest of the view
    assert time.monotonic() - started < VIEW_TTL / 2  # it never waited for its own pin
    assert _read(alias) == "C"
    assert not lk.locked()  # released when the transaction committed
    assert not lk.lost
    with dlock.lock("guard:view", using=alias, timeout=0):  # anyone can take it now
        pass


def test_a_read_lock_released_in_the_transaction_of_its_guard_does_not_wait_for_itself(alias):
    # A reader's guard share-locks the key's row: its release in the same
    # transaction must not wait for it either.
    lk = dlock.lock("guard:view-reader", using=alias, ttl=VIEW_TTL, shared=True)
    started = time.monotonic()
    with transaction.atomic(using=alias):
        assert lk.acquire(timeout=5)
        with lk.guard():
            _write(alias, "A")
        lk.release()
    assert time.monotonic() - started < VIEW_TTL / 2  # it never waited for its own pin
    assert _read(alias) == "A"
    assert not lk.locked()
    with dlock.lock("guard:view-reader", using=alias, timeout=0):  # a writer gets in now
        pass


def test_a_renewed_lock_released_in_the_transaction_of_its_guard_is_not_lost(alias):
    # renew=True: the renewer, on a thread of its own, must not wait for the
    # row the holder's transaction pinned (and the release, which stops the
    # renewer first, for the renewer).
    ttl = 3.0
    lk = dlock.lock("guard:view-renewed", using=alias, ttl=ttl, renew=True)
    with transaction.atomic(using=alias):
        assert lk.acquire(timeout=5)
        with lk.guard():
            _write(alias, "A")
        time.sleep(ttl / 3 + 0.5)  # the renewer's first renewal falls in the transaction
        lk.release()
    assert not lk.lost
    assert _read(alias) == "A"
    assert not lk.locked()


def test_a_release_in_a_transaction_that_rolls_back_still_frees_the_lock(alias):
    # The release was part of the transaction that rolled back: it is made
    # again once the transaction has ended, so the key is not kept until
    # its lease runs out.
    lk = dlock.lock("guard:view-rollback", using=alias, ttl=60)
    with pytest.raises(RuntimeError), transaction.atomic(using=alias):
        assert lk.acquire(timeout=5)
        with lk.guard():
            _write(alias, "A")
        lk.release()
        raise RuntimeError("the view fails after the release")
    assert _read(alias) == "-"  # nothing of the transaction was written
    wait_until(lambda: not lk.locked())  # well before the lease's 60 s
    with dlock.lock("guard:view-rollback", using=alias, timeout=0):
        pass


# -- the guard's session ends (PostgreSQL: pg_terminate_backend) ----------------------


def _end_session(connection: Any) -> None:
    """End ``connection``'s server session from another one (PostgreSQL
    ``pg_terminate_backend``, MariaDB ``KILL``), and wait until it is gone."""
    alias = connection.alias
    other = connections[alias].copy(alias)
    if connection.vendor == "postgresql":
        pid = connection.connection.info.backend_pid
        end = "SELECT pg_terminate_backend(%s)"
        listed = "SELECT count(*) FROM pg_stat_activity WHERE pid = %s"
    else:
        pid = connection.connection.thread_id()
        end = "KILL %s"
        listed = "SELECT count(*) FROM information_schema.processlist WHERE id = %s"
    try:
        with other.cursor() as cur:
            cur.execute(end, [pid])

            def gone() -> bool:
                cur.execute(listed, [pid])
                return cur.fetchone()[0] == 0

            wait_until(gone)
    finally:
        other.close()


@pytest.fixture
def fresh_pg(pg: str) -> Iterator[str]:
    """PostgreSQL, on a new session of the test's thread (closed after: it may be broken)."""
    _probe(pg)
    connections[pg].close()
    yield pg
    connections[pg].close()
    dlock.close_connections()


@pytest.fixture(params=["default", "mysql"], ids=["postgresql", "mariadb"])
def fresh(request: pytest.FixtureRequest) -> Iterator[str]:
    """:func:`fresh_pg` on PostgreSQL and MariaDB."""
    _probe(request.param)
    connections[request.param].close()
    yield request.param
    connections[request.param].close()
    dlock.close_connections()


def test_a_guard_whose_session_ended_while_idle_begins_on_a_new_one(fresh):
    # The session ended before the guard began (nothing of it was sent):
    # the guarded transaction begins on a new connection.
    lk = dlock.lock("guard:ended-idle", using=fresh, ttl=30)
    assert lk.acquire(timeout=0)
    connections[fresh].ensure_connection()  # (the lock's statements may use another)
    _end_session(connections[fresh])
    with lk.guard():
        _write(fresh, "A")
    assert _read(fresh) == "A"
    assert lk.owned()
    lk.release()


@pytest.mark.parametrize("then", ["write", "exit"])
def test_a_guard_whose_session_ends_inside_its_block_raises_lock_lost(fresh_pg, then):
    # Ended inside the block: the block's next statement, or the check at its
    # end, finds the session gone; the writes were rolled back.
    lk = dlock.lock("guard:ended-inside", using=fresh_pg, ttl=30)
    assert lk.acquire(timeout=0)
    with pytest.raises(dlock.LockLost, match="rolled back: the session") as caught, lk.guard():
        _write(fresh_pg, "A")
        _end_session(connections[fresh_pg])
        if then == "write":
            _write(fresh_pg, "B")
    assert isinstance(caught.value.__cause__, DatabaseError)  # the driver's error, chained
    assert _read(fresh_pg) == "-"
    assert lk.owned()  # the lease itself is still the holder's
    lk.release()


@pytest.mark.parametrize("strategy", ["row", "advisory_xact"])
def test_a_guard_of_a_transaction_lock_whose_session_ended_raises_lock_lost(fresh_pg, strategy):
    # The lock lived in the transaction the server ended: the guard's
    # SAVEPOINT finds it gone.
    with pytest.raises(dlock.LockLost) as caught, transaction.atomic(using=fresh_pg):
        lk = dlock.lock("guard:ended-xact", using=fresh_pg, strategy=strategy)
        assert lk.acquire(timeout=0)
        _end_session(connections[fresh_pg])
        with lk.guard():
            _write(fresh_pg, "A")
    assert isinstance(caught.value.__cause__, DatabaseError)
    assert _read(fresh_pg) == "-"


def test_a_release_after_the_session_of_its_guards_transaction_ended(fresh_pg):
    # The guard pinned the lease row in the caller's transaction, whose
    # session then ended (a holder frozen past its idle bound): the release
    # no longer has a transaction to join, and releases the usual way.
    lk = dlock.lock("guard:ended-outer", using=fresh_pg, ttl=30)
    with pytest.raises(DatabaseError), transaction.atomic(using=fresh_pg):  # (Django's commit)
        assert lk.acquire(timeout=0)
        with lk.guard():
            _write(fresh_pg, "A")
        _end_session(connections[fresh_pg])
        lk.release()
    assert _read(fresh_pg) == "-"
    assert not lk.locked()


def test_a_guard_whose_session_ends_after_its_commit_ran_returns(fresh_pg, monkeypatch):
    # The check and COMMIT go out in a pipeline; the server runs them and
    # ends the session before it reaches the pipeline's sync point. The
    # writes committed: the guard returns normally, and the connection's
    # next use opens a new one.
    from django_dlock import guard

    lk = dlock.lock("guard:ended-commit", using=fresh_pg, ttl=30)
    assert lk.acquire(timeout=0)
    connection = connections[fresh_pg]
    committed: list[str] = []

    def end_after_commit(pgconn: Any) -> None:
        while pgconn.flush():  # the steps go out (the sync point is not sent yet)
            time.sleep(0.01)
        wait_until(lambda: _read(fresh_pg) == "A")  # the server ran the COMMIT
        _end_session(connection)

    monkeypatch.setattr(guard, "_sending", end_after_commit)
    with lk.guard():
        _write(fresh_pg, "A")
        transaction.on_commit(lambda: committed.append("A"), using=fresh_pg)
    monkeypatch.undo()
    assert _read(fresh_pg) == "A"
    assert committed == ["A"]  # its on_commit callbacks ran
    assert lk.owned()
    with lk.guard():  # and the connection works again
        _write(fresh_pg, "B")
    assert _read(fresh_pg) == "B"
    lk.release()


# -- transaction-scoped strategies: the lock lives in the caller's transaction ----------


@pytest.mark.parametrize(
    ("strategy", "db"), [("row", "default"), ("row", "mysql"), ("advisory_xact", "default")]
)
def test_a_transaction_scoped_lock_guards_with_its_own_transaction(strategy, db):
    _probe(db)
    lk = dlock.lock("guard:xact", strategy=strategy, using=db)
    with pytest.raises(RuntimeError), transaction.atomic(using=db), lk:
        with lk.guard():
            _write(db, "A")
        assert _read(db) == "-"  # a savepoint: it commits with the lock's transaction
        raise RuntimeError("the lock's transaction rolls back")
    assert _read(db) == "-"
    with transaction.atomic(using=db), lk:
        with lk.guard():
            _write(db, "B")
        with pytest.raises(dlock.GuardNotSupported):
            lk.guard(using="sqlite").__enter__()
    assert _read(db) == "B"


# -- strategies whose lock no transaction keeps ------------------------------------------


@pytest.mark.django_db(transaction=True, databases=["default", *QUORUM])
@pytest.mark.parametrize("kind", ["advisory", "quorum"])
def test_session_and_quorum_locks_refuse_a_guard_and_point_to_fencing(kind):
    if kind == "advisory":
        lk = dlock.lock("guard:refused", strategy="advisory", using="default")
    else:
        lk = dlock.lock("guard:refused", using=QUORUM)
    with lk, pytest.raises(dlock.GuardNotSupported, match="fence"), lk.guard():
        pass
    dlock.close_connections()


@pytest.mark.django_db(transaction=True, databases=["default", *QUORUM])
def test_a_quorum_lock_refuses_a_guard_and_names_the_quorum():
    lk = dlock.lock("guard:quorum", using=QUORUM)
    with lk, pytest.raises(dlock.GuardNotSupported) as refused, lk.guard():
        pass

    async def aguard() -> BaseException:
        async with lk:
            with pytest.raises(dlock.GuardNotSupported) as arefused:
                await lk.aguard(lambda: None)
        return arefused.value

    for exc in (refused.value, async_to_sync(aguard)()):
        message = str(exc)
        assert "quorum lock" in message and repr(QUORUM) in message, message
        assert "lease strategy" not in message, message
    dlock.close_connections()


@pytest.mark.django_db(transaction=True, databases=["default", "mysql"])
@pytest.mark.parametrize("db", ["default", "mysql"], ids=["postgresql", "mariadb"])
def test_a_guard_whose_session_an_administrator_ended_says_so(db):
    """The server ends the guard's session at once (pg_terminate_backend, KILL):
    LockLost says the session was ended, not that it stayed silent."""
    _probe(db)
    pid_sql = "SELECT pg_backend_pid()" if db == "default" else "SELECT CONNECTION_ID()"
    lk = dlock.lock("guard:terminated", using=db, ttl=30)
    with lk, pytest.raises(dlock.LockLost) as lost, lk.guard():
        with connections[db].cursor() as cur:
            cur.execute(pid_sql)
            pid = cur.fetchone()[0]
        in_thread(lambda: (end_server_session(db, pid), connections.close_all()))
        _write(db, "x")
    message = str(lost.value)
    assert "rolled back" in message and "ended" in message, message
    if db == "default":
        assert "stayed silent" not in message and "pg_terminate_backend" in message, message
    else:
        assert "killed" in message, message
    assert _read(db) == "-"


# -- a holder paused past its lease (real processes, SIGSTOP) ----------------------------


def _paused_lock(alias: str, kind: str, **options: Any) -> dlock.Lock:
    """The lock of the paused-holder tests: a lock, a semaphore's permit, or a
    read lock (``kind``)."""
    if kind == "permit":
        return dlock.semaphore("guard:paused", permits=1, using=alias, **options)
    return dlock.lock("guard:paused", using=alias, shared=kind == "reader", **options)


def _paused_holder(alias: str, folder: str, ttl: float, outer: bool, kind: str = "lock") -> None:
    """Hold the lock, write under a guard, and wait there (paused) for ``go``.

    ``outer``: the guard is inside an outer transaction, and the wait comes
    after it (the lease row pinned until the outer transaction ends).
    """
    from django_dlock.exceptions import LockLost

    base = Path(folder)
    lk = _paused_lock(alias, kind, ttl=ttl)
    assert lk.acquire(timeout=10)

    def wait_for_go() -> None:
        (base / "ready").write_text("ready")
        while not (base / "go").exists():
            time.sleep(0.02)

    try:
        if outer:
            with transaction.atomic(using=alias):
                with lk.guard():
                    _write(alias, "A")
                wait_for_go()
        else:
            with lk.guard():
                _write(alias, "A")
                wait_for_go()
        outcome = "committed"
    except LockLost:
        outcome = "LockLost"
    except Exception as exc:  # the outer transaction's commit on an ended session
        outcome = f"{type(exc).__name__}: {exc}"
    (base / "outcome").write_text(outcome)
    with contextlib.suppress(DLockError):
        lk.release()


@contextlib.contextmanager
def _paused(
    alias: str, tmp_path: Path, ttl: float, outer: bool = False, kind: str = "lock"
) -> Iterator[Path]:
    """A holder process inside its guard (or after it, ``outer``), SIGSTOPped."""
    proc = procs.start(_paused_holder, alias, str(tmp_path), ttl, outer, kind)
    wait_until(lambda: (tmp_path / "ready").exists(), timeout=60)
    assert proc.pid is not None
    os.kill(proc.pid, signal.SIGSTOP)
    try:
        yield tmp_path
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        (tmp_path / "go").write_text("go")
        proc.join(60)
        assert proc.exitcode == 0


def _next_holder_writes(alias: str, kind: str = "lock") -> None:
    # after a paused reader, a writer: it is kept out while any reader holds
    lk = _paused_lock(alias, "permit" if kind == "permit" else "lock", ttl=30, timeout=45)
    with lk, lk.guard():
        _write(alias, "B")


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["lock", "permit", "reader"])
def test_a_holder_paused_past_its_lease_inside_its_guard_commits_nothing(alias, tmp_path, kind):
    ttl = 2.0
    with _paused(alias, tmp_path, ttl, kind=kind) as folder:
        if alias != "sqlite":
            # While it is frozen: its lease runs out, the next holder takes the
            # lock (the permit), and its guarded write goes through once the
            # server has ended the frozen holder's silent session (the bound:
            # the lease).
            in_thread(_next_holder_writes, alias, kind)  # bounded: fails if it waits
            assert _read(alias) == "B"
        else:
            # SQLite: the frozen holder keeps every writer out until it
            # resumes; its lease runs out meanwhile.
            time.sleep(ttl + 0.5)
    assert (folder / "outcome").read_text() == "LockLost"  # it committed nothing
    if alias == "sqlite":
        with _paused_lock(alias, kind, timeout=10) as lk, lk.guard():
            _write(alias, "B")
    assert _read(alias) == "B"


@pytest.mark.slow
@pytest.mark.django_db(transaction=True, databases=["default"])
def test_a_holder_frozen_with_its_lease_pinned_keeps_the_key_only_as_long_as_its_lease(
    tmp_path,
):
    # PostgreSQL: the guard pinned the lease row inside an outer transaction,
    # then the holder froze in it. The next holder waits for the row until the
    # server ends the frozen session (idle in transaction for a lease's length).
    _probe("default")
    with _paused("default", tmp_path, 2.0, outer=True) as folder:
        in_thread(_next_holder_writes, "default")  # bounded: fails if it waits for the thaw
        assert not (folder / "outcome").exists()  # taken while the first is still frozen
    assert (folder / "outcome").read_text() != "committed"
    assert _read("default") == "B"


def _paused_in_transaction(alias: str, strategy: str, folder: str) -> None:
    """Take a transaction-scoped lock, write under its guard, wait (paused) for ``go``."""
    base = Path(folder)
    with transaction.atomic(using=alias):
        lk = dlock.lock("guard:paused-txn", using=alias, strategy=strategy)
        assert lk.acquire(timeout=10)
        with lk.guard():
            _write(alias, "A")
            (base / "ready").write_text("ready")
            while not (base / "go").exists():
                time.sleep(0.02)
    (base / "outcome").write_text("committed")


@pytest.mark.slow
@pytest.mark.parametrize(
    ("strategy", "db"),
    [("row", "default"), ("row", "mysql"), ("advisory_xact", "default")],
    ids=["row-postgresql", "row-mariadb", "advisory_xact-postgresql"],
)
def test_a_frozen_holder_of_a_transaction_scoped_lock_keeps_it_and_nobody_writes_meanwhile(
    strategy, db, tmp_path
):
    # row and advisory_xact: the lock is the guarded transaction's own. A
    # frozen holder keeps it (there is no lease to run out): the next holder
    # cannot get in, and the first one's writes commit when it resumes,
    # before the next holder's.
    _probe(db)
    proc = procs.start(_paused_in_transaction, db, strategy, str(tmp_path))
    wait_until(lambda: (tmp_path / "ready").exists(), timeout=60)
    assert proc.pid is not None
    os.kill(proc.pid, signal.SIGSTOP)

    def next_holder(timeout: float) -> bool:
        with transaction.atomic(using=db):
            lk = dlock.lock("guard:paused-txn", using=db, strategy=strategy)
            if not lk.acquire(timeout=timeout):
                return False
            with lk.guard():
                _write(db, "B")
            return True

    try:
        assert in_thread(next_holder, 1.5) is False  # frozen, it still holds the lock
        assert _read(db) == "-"
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        (tmp_path / "go").write_text("go")
        proc.join(60)
    assert proc.exitcode == 0
    assert (tmp_path / "outcome").read_text() == "committed"
    assert _read(db) == "A"
    assert in_thread(next_holder, 10) is True
    assert _read(db) == "B"


# -- a leadership term -------------------------------------------------------------------

FAST = {"lease": 2.0, "renew_deadline": 1.5, "retry": 0.4}


def _leading(alias: str, name: str = "guard-leader") -> dlock.LeaderElection:
    election = dlock.LeaderElection(name, using=alias, **FAST)
    election.start()
    wait_until(lambda: election.is_leader)
    return election


def test_a_leaders_guarded_writes_commit_only_during_its_term(alias):
    election = _leading(alias)
    try:
        leadership = election._leadership
        assert leadership is not None
        with leadership.guard():
            _write(alias, "A")
        assert _read(alias) == "A"
        with pytest.raises(dlock.LockLost, match="rolled back"), leadership.guard():
            _elsewhere(alias, LOSSES["taken over"], "leader:guard-leader")
            _write(alias, "B")
        assert _read(alias) == "A"
    finally:
        election.stop()


@pytest.mark.django_db(transaction=True, databases=["default", *QUORUM])
def test_a_leadership_on_a_quorum_refuses_a_guard_and_points_to_the_term():
    election = dlock.LeaderElection("guard-quorum", using=QUORUM, **FAST)
    election.start()
    try:
        wait_until(lambda: election.is_leader)
        leadership = election._leadership
        assert leadership is not None
        with pytest.raises(dlock.GuardNotSupported, match="term"):
            leadership.guard().__enter__()
    finally:
        election.stop()
        dlock.close_connections()


class _Done(Exception):
    """The frozen leader's target is done (whatever its term became)."""


def _frozen_leader(alias: str, folder: str) -> None:
    """Lead, write under the term's guard, and wait there (paused) for ``go``."""
    from django_dlock.exceptions import LockLost

    base = Path(folder)
    outcome: list[str] = []

    def lead(leadership) -> None:
        try:
            with leadership.guard():
                _write(alias, "A")
                (base / "ready").write_text("ready")
                while not (base / "go").exists():
                    time.sleep(0.02)
            outcome.append("committed")
        except LockLost:
            outcome.append("LockLost")
        except Exception as exc:
            outcome.append(f"{type(exc).__name__}: {exc}")
        raise _Done  # run() stands by again after a lost term: end it

    election = dlock.LeaderElection("guard-frozen", using=alias, **FAST)
    with contextlib.suppress(_Done):
        election.run(lead)
    (base / "outcome").write_text(outcome[0] if outcome else "never led")


@pytest.mark.slow
def test_a_frozen_leaders_guarded_job_commits_nothing_after_its_successor_began(alias, tmp_path):
    proc = procs.start(_frozen_leader, alias, str(tmp_path))
    wait_until(lambda: (tmp_path / "ready").exists(), timeout=60)
    assert proc.pid is not None
    os.kill(proc.pid, signal.SIGSTOP)
    successor = dlock.LeaderElection("guard-frozen", using=alias, **FAST)
    try:
        successor.start()
        if alias != "sqlite":
            # the successor leads once the frozen leader's lease ran out, and its
            # guarded write goes through while the first is still frozen
            wait_until(lambda: successor.is_leader, timeout=30)
            leadership = successor._leadership
            assert leadership is not None
            in_thread(_guarded_write, leadership, alias, "B")
            assert _read(alias) == "B"
        else:
            time.sleep(FAST["lease"] + 0.5)  # SQLite: the frozen one keeps the writers out
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        (tmp_path / "go").write_text("go")
    proc.join(60)
    try:
        assert (tmp_path / "outcome").read_text() == "LockLost"  # it committed nothing
        if alias == "sqlite":
            wait_until(lambda: successor.is_leader, timeout=30)
            leadership = successor._leadership
            assert leadership is not None
            _guarded_write(leadership, alias, "B")
        assert _read(alias) == "B"
    finally:
        successor.stop()


def _guarded_write(leadership: object, alias: str, value: str) -> None:
    with leadership.guard():  # type: ignore[attr-defined]
        _write(alias, value)


# -- TaskLock runs and Celery tasks ------------------------------------------------------


def test_a_tasklock_run_guards_its_writes(alias):
    task = dlock.TaskLock("guard-task", min_hold=0, using=alias)
    with pytest.raises(dlock.LockLost, match="was lost"), task as run:  # leaving: lost
        assert run
        with task.guard():
            _write(alias, "A")
        with pytest.raises(dlock.LockLost, match="rolled back"), task.guard():
            _elsewhere(alias, LOSSES["taken over"], "task:guard-task")
            _write(alias, "B")
    assert _read(alias) == "A"


celery_app = Celery("guard", set_as_current=False)


@celery_app.task(base=SingleInstanceTask, bind=True, lock_args=["value"], name="guard.write")
def guarded_task(self: SingleInstanceTask, alias: str, value: str, steal: bool) -> str:
    with self.guard(using=alias):
        if steal:
            name = "lock:" + self.lock_key((alias, value, steal), {})
            _elsewhere(alias, LOSSES["taken over"], name)
        _write(alias, value)
    return value


def test_a_celery_task_guards_its_writes_with_its_runs_lock(alias, monkeypatch):
    monkeypatch.setattr(guarded_task, "lock_using", alias)
    assert guarded_task(alias, "A", False) == "A"  # a direct call runs the body here
    assert _read(alias) == "A"
    with pytest.raises(dlock.LockLost):
        guarded_task(alias, "B", True)
    assert _read(alias) == "A"
    with pytest.raises(dlock.DLockError, match="body of a running task"):
        guarded_task.guard()
