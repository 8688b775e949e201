"""What the lease statements lock on MySQL/MariaDB.

InnoDB locks the rows a statement *passes*, not only the rows it changes,
and a single-table UPDATE picks its index by estimate. With one live lease in
the table, "expire_at > now" looked as selective as the unique name, so
MariaDB released and extended a lease by scanning the expire_at index,
locking every live lease it passed on the way (other keys', other permits').
Against a semaphore's take, which locks its permits' rows in name order, that
was a deadlock (seen under load: a holder's release failed with error 1213).
A take or a cleanup batch that still meets a deadlock (rows locked in
another order by someone else) is rolled back whole, and runs again.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from django.db import OperationalError, connections, transaction

import django_dlock as dlock
from django_dlock.strategies.connection import lock_connection

from .helpers import wait_until

pytestmark = pytest.mark.django_db(transaction=True, databases=["mysql"])

ALIAS = "mysql"


@contextmanager
def lock_statements() -> Iterator[list[tuple[str, Any]]]:
    """The statements the library runs on its own connection meanwhile."""
    seen: list[tuple[str, Any]] = []

    def record(execute: Callable[..., Any], sql: str, params: Any, many: bool, context: Any):
        seen.append((sql, params))
        return execute(sql, params, many, context)

    with lock_connection(ALIAS).execute_wrapper(record):
        yield seen


def indexes_considered(sql: str, params: Any) -> str | None:
    """The indexes MySQL/MariaDB could use for ``sql`` (EXPLAIN's ``possible_keys``)."""
    with connections[ALIAS].cursor() as cur:
        cur.execute("EXPLAIN " + sql, params)
        names = [column[0] for column in cur.description]
        return cur.fetchone()[names.index("possible_keys")]


def a_transaction_waits() -> bool:
    """Whether a transaction waits for a row lock (InnoDB's view, which it
    refreshes only when nobody read it for 0.1 s)."""
    time.sleep(0.2)
    with connections[ALIAS].cursor() as cur:
        cur.execute(
            "SELECT count(*) FROM information_schema.innodb_trx WHERE trx_state = 'LOCK WAIT'"
        )
        return bool(cur.fetchone()[0])


#: how the heavier transaction of :func:`in_a_deadlock` locks a lease row
LOCK_ROW = "SELECT 1 FROM django_dlock_lock WHERE name = %s FOR UPDATE"


def in_a_deadlock(
    first: str, then: str, victim: Callable[[], Any], lock_first: str = LOCK_ROW
) -> list[Any]:
    """What ``victim()`` returned (or raised), run in a thread against a heavier
    transaction that locks the row ``first`` (with ``lock_first``), waits until
    ``victim`` waits for it, then asks for the row ``then``: a deadlock if
    ``victim`` holds it.
    The heavier transaction writes rows first, so that InnoDB never picks it
    as the deadlock's victim."""
    holds, asks = threading.Event(), threading.Event()
    errors: list[BaseException] = []

    def heavier() -> None:
        try:
            with transaction.atomic(using=ALIAS), connections[ALIAS].cursor() as cur:
                for i in range(50):
                    cur.execute(
                        "INSERT INTO django_dlock_lock (name, token, owner, fence, expire_at) "
                        "VALUES (%s, '', '', 0, UTC_TIMESTAMP(6))",
                        [f"weight-{i}"],
                    )
                cur.execute(lock_first, [first])
                holds.set()
                asks.wait(30)
                cur.execute(LOCK_ROW, [then])
                transaction.set_rollback(True, using=ALIAS)
        except BaseException as exc:
            errors.append(exc)
        finally:
            connections.close_all()

    got: list[Any] = []

    def run_victim() -> None:
        try:
            got.append(victim())
        except BaseException as exc:
            got.append(exc)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=heavier), threading.Thread(target=run_victim)]
    threads[0].start()
    try:
        assert holds.wait(30)
        threads[1].start()
        wait_until(a_transaction_waits)
        asks.set()  # the cycle: InnoDB picks a victim at once
    finally:
        asks.set()
        for thread in threads:
            thread.join(60)
    assert not errors, errors  # the heavier transaction was not the victim
    return got


def updates(seen: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
    return [(sql, params) for sql, params in seen if sql.lstrip().upper().startswith("UPDATE")]


@pytest.mark.parametrize("operation", ["extend", "release", "release-after-min-hold", "permit"])
def test_a_lease_write_finds_its_row_by_name_alone(operation):
    """A write of the caller's lease can find its row only by the unique name:
    whichever plan the optimizer picks, it locks that row alone. (Which plan
    MariaDB picks depends on its statistics, so the test asks which indexes
    the statement could use; the expire_at index must not be one.)"""
    for name in ("a", "b", "c"):  # rows of released locks: present, not live
        with dlock.lock(name, using=ALIAS):
            pass
    if operation == "permit":
        lk: Any = dlock.semaphore("pool", permits=3, using=ALIAS, ttl=60)
    elif operation == "release-after-min-hold":
        lk = dlock.TaskLock("job", min_hold=30, max_hold=60, using=ALIAS)
    else:
        lk = dlock.lock("mine", using=ALIAS, ttl=60)
    assert lk.acquire(timeout=0)
    with lock_statements() as seen:
        if operation == "extend":
            lk.extend(60)
            assert lk.owned()
        lk.release()
    written = updates(seen)
    assert written, seen
    for sql, params in written:
        assert indexes_considered(sql, params) == "name", sql


def test_a_permit_take_chosen_as_a_deadlock_victim_runs_again():
    """A transaction locking a semaphore's permits in another order makes a
    deadlock with a take; InnoDB rolls the lighter one back (the take, which
    has written nothing), and the take runs again and gets its permit."""
    with dlock.semaphore("dl", permits=3, using=ALIAS):  # the permits' rows exist
        pass

    def take() -> bool:  # locks permit 0, then waits for permit 1 (within its timeout)
        sem = dlock.semaphore("dl", permits=3, using=ALIAS, ttl=30)
        taken = sem.acquire(timeout=20)
        sem.release()
        return taken

    got = in_a_deadlock("semaphore:dl#1", "semaphore:dl#0", take)
    assert got == [True], got
    assert not isinstance(got[0], OperationalError)


def test_a_cleanup_batch_chosen_as_a_deadlock_victim_runs_again():
    """A cleanup batch locks the free rows it deletes, then the fence floor's
    row; a transaction holding the floor's row and asking for one of those
    rows makes a deadlock, InnoDB rolls the lighter one back (the batch, which
    has written nothing), and the batch runs again. It skips a row the other
    transaction still holds then; the next run deletes it."""
    from django_dlock.cleanup import delete_free

    with connections[ALIAS].cursor() as cur:
        cur.execute("INSERT IGNORE INTO django_dlock_fencefloor (id, value) VALUES (1, 0)")
        for name in ("dl-free-1", "dl-free-2"):
            cur.execute(
                "INSERT INTO django_dlock_lock (name, token, owner, fence, expire_at) "
                "VALUES (%s, '', '', 0, UTC_TIMESTAMP(6) - INTERVAL 1 HOUR)",
                [name],
            )
    # the batch locks both rows, then waits for the floor's row
    floor = "SELECT 1 FROM django_dlock_fencefloor WHERE id = %s FOR UPDATE"
    got = in_a_deadlock("1", "dl-free-1", lambda: delete_free(using=ALIAS), floor)
    assert got in ([1], [2]), got
    assert got[0] + delete_free(using=ALIAS) == 2


def a_lock(kind: str, timeout: float | None = None) -> Any:
    """The lock of the key ``pinned``: a lock, a read lock, a semaphore's permit."""
    if kind == "permit":
        return dlock.semaphore("pinned", permits=1, using=ALIAS, timeout=timeout)
    return dlock.lock("pinned", using=ALIAS, shared=kind == "shared", timeout=timeout)


@contextmanager
def row_held(kind: str) -> Iterator[None]:
    """Another session holds the key's lease row (created first) ``FOR
    UPDATE`` until the block ends: a stalled transaction."""
    lk = a_lock(kind)
    assert lk.acquire(timeout=0)
    lk.release()
    name = "semaphore:pinned#0" if kind == "permit" else "lock:pinned"
    other = connections[ALIAS].copy()
    try:
        with other.cursor() as cur:
            cur.execute("START TRANSACTION")
            cur.execute("SELECT id FROM django_dlock_lock WHERE name = %s FOR UPDATE", [name])
            assert cur.fetchone() is not None
            yield
            cur.execute("ROLLBACK")
    finally:
        other.close()


@pytest.mark.parametrize("timeout", [0, 2])
@pytest.mark.parametrize("kind", ["exclusive", "shared", "permit"])
def test_an_acquire_behind_a_row_held_elsewhere_times_out_at_its_timeout(timeout, kind):
    """A stalled transaction holds the lock's row: the acquire waits for it no
    longer than its timeout (not innodb_lock_wait_timeout, 50 s by default),
    and says so as a timeout, never the server's error 1205."""
    with row_held(kind):
        lk = a_lock(kind)
        started = time.monotonic()
        assert lk.acquire(timeout=timeout) is False
        assert time.monotonic() - started < timeout + 5
        started = time.monotonic()
        with pytest.raises(dlock.LockTimeout), a_lock(kind, timeout):
            pass
        assert time.monotonic() - started < timeout + 5
    # the row let go: the key is free again
    assert lk.acquire(timeout=timeout)
    lk.release()


def test_a_cleanup_skips_a_row_held_elsewhere_and_keeps_no_acquire_waiting():
    """A stalled transaction holds a free row and a dead waiter's ticket ``FOR
    UPDATE``. A cleanup run meanwhile deletes the other free rows, skips
    those (the next run deletes them) and finishes; an acquire of an
    unrelated new key (which reads the fence floor) never waits for the
    cleanup."""
    import io

    from django.core.management import call_command

    with connections[ALIAS].cursor() as cur:
        cur.execute("INSERT IGNORE INTO django_dlock_fencefloor (id, value) VALUES (1, 0)")
        for name in ("lock:free-1", "lock:stalled", "lock:free-2"):
            cur.execute(
                "INSERT INTO django_dlock_lock (name, token, owner, fence, expire_at) "
                "VALUES (%s, '', '', 7, UTC_TIMESTAMP(6) - INTERVAL 1 HOUR)",
                [name],
            )
        cur.execute(
            "INSERT INTO django_dlock_waiter (name, token, owner, enqueued_at, expire_at) "
            "VALUES ('lock:gone', '', '', UTC_TIMESTAMP(6), UTC_TIMESTAMP(6) - INTERVAL 1 HOUR)"
        )
    outcome: list[Any] = []

    def clean() -> None:
        try:
            call_command("dlock_cleanup", using=ALIAS, stdout=io.StringIO())
            outcome.append("done")
        except BaseException as exc:
            outcome.append(exc)
        finally:
            connections.close_all()

    stalled = connections[ALIAS].copy()
    cleaner = threading.Thread(target=clean)
    try:
        with stalled.cursor() as cur:
            cur.execute("START TRANSACTION")
            cur.execute("SELECT id FROM django_dlock_lock WHERE name = 'lock:stalled' FOR UPDATE")
            cur.execute("SELECT id FROM django_dlock_waiter WHERE name = 'lock:gone' FOR UPDATE")
            cleaner.start()
            wait_until(lambda: bool(outcome) or a_transaction_waits())
            lk = dlock.lock("unrelated-new-key", using=ALIAS)
            assert lk.acquire(timeout=3)
            lk.release()
            wait_until(lambda: bool(outcome), timeout=10)  # not behind the stalled row
            cur.execute("ROLLBACK")
    finally:
        cleaner.join(60)
        stalled.close()
    assert outcome == ["done"], outcome
    with connections[ALIAS].cursor() as cur:
        cur.execute("SELECT name FROM django_dlock_lock WHERE name LIKE 'lock:%%' ORDER BY name")
        assert [row[0] for row in cur.fetchall()] == ["lock:stalled", "lock:unrelated-new-key"]
        cur.execute("SELECT value FROM django_dlock_fencefloor WHERE id = 1")
        assert cur.fetchone()[0] == 7
    call_command("dlock_cleanup", using=ALIAS, stdout=io.StringIO())  # the next run
    with connections[ALIAS].cursor() as cur:
        cur.execute("SELECT count(*) FROM django_dlock_lock WHERE name = 'lock:stalled'")
        assert cur.fetchone()[0] == 0
        cur.execute("SELECT count(*) FROM django_dlock_waiter")
        assert cur.fetchone()[0] == 0


@pytest.mark.parametrize("shared", [False, True], ids=["exclusive", "shared"])
def test_an_acquire_behind_the_tables_auto_increment_lock_times_out_at_its_timeout(shared):
    """Another transaction inserts into the lock table with a bulk insert
    (``INSERT … SELECT``), which holds the table's AUTO-INC lock until the
    statement ends, and that insert waits for a row a stalled transaction
    holds. An acquire that creates a new key's row waits for the AUTO-INC
    lock; InnoDB ends that wait with error 1467 ("Failed to read
    auto-increment value from storage engine"), which is the acquire's
    timeout, never a driver error."""
    with dlock.lock("held", using=ALIAS):  # the row exists
        pass
    stalled = connections[ALIAS].copy()
    inserted: list[Any] = []

    def bulk_insert() -> None:
        bulk = connections[ALIAS].copy()
        try:
            with bulk.cursor() as cur:
                cur.execute(
                    "INSERT IGNORE INTO django_dlock_lock (name, token, owner, fence, expire_at) "
                    "SELECT 'lock:held', '', '', 0, UTC_TIMESTAMP(6)"
                )
            inserted.append("done")
        except BaseException as exc:
            inserted.append(exc)
        finally:
            bulk.close()

    inserting = threading.Thread(target=bulk_insert)
    try:
        with stalled.cursor() as cur:
            cur.execute("START TRANSACTION")
            cur.execute("SELECT id FROM django_dlock_lock WHERE name = 'lock:held' FOR UPDATE")
            inserting.start()
            wait_until(a_transaction_waits)
            lk = dlock.lock("fresh", using=ALIAS, shared=shared)
            started = time.monotonic()
            assert lk.acquire(timeout=2) is False
            assert time.monotonic() - started < 2 + 5
            cur.execute("ROLLBACK")
    finally:
        stalled.close()
        inserting.join(60)
    assert inserted == ["done"], inserted
    assert lk.acquire(timeout=2)
    lk.release()


def test_a_reader_that_creates_its_keys_row_keeps_no_other_insert_waiting():
    """A reader creates its key's missing row while a stalled transaction
    (at REPEATABLE READ, the server's default) holds the gap where it goes,
    and waits. Meanwhile an acquire of an
    unrelated new key inserts its row elsewhere in the table: it never
    waits for the reader (a bulk insert would hold the table's AUTO-INC
    lock while it waits, and the other insert would end with error 1467)."""
    with dlock.lock("m", using=ALIAS):  # a row after the gap of lock:k, before lock:z
        pass
    stalled = connections[ALIAS].copy()
    read: list[Any] = []

    def reader() -> None:
        try:
            lk = dlock.lock("k", using=ALIAS, shared=True)
            read.append(lk.acquire(timeout=30))
            lk.release()
        except BaseException as exc:
            read.append(exc)
        finally:
            connections.close_all()

    reading = threading.Thread(target=reader)
    try:
        with stalled.cursor() as cur:
            cur.execute("SET SESSION TRANSACTION ISOLATION LEVEL REPEATABLE READ")
            cur.execute("START TRANSACTION")
            cur.execute("SELECT id FROM django_dlock_lock WHERE name = 'lock:k' FOR UPDATE")
            reading.start()
            wait_until(lambda: bool(read) or a_transaction_waits())  # the reader's insert
            assert not read, read
            lk = dlock.lock("z", using=ALIAS)
            assert lk.acquire(timeout=3)
            lk.release()
            cur.execute("ROLLBACK")
    finally:
        stalled.close()
        reading.join(60)
    assert read == [True], read


@pytest.mark.parametrize("kind", ["exclusive", "shared", "permit"])
def test_the_session_bound_of_mysql_also_ends_the_wait_and_is_restored(monkeypatch, kind):
    """MySQL has no ``SET STATEMENT``: the bound is the session's
    ``innodb_lock_wait_timeout``, set around each statement and restored.
    That variant, run here on MariaDB (which accepts it too), ends the wait
    at the timeout, leaves the statements' rows alone and the session's
    value as it was."""
    from django_dlock.strategies import connection

    monkeypatch.setattr(connection, "_mariadb", lambda _connection: False)
    with connections[ALIAS].cursor() as cur:
        cur.execute("SELECT @@SESSION.innodb_lock_wait_timeout")
        before = cur.fetchone()[0]
    with row_held(kind):
        lk = a_lock(kind)
        started = time.monotonic()
        assert lk.acquire(timeout=2) is False
        assert time.monotonic() - started < 2 + 5
    with connections[ALIAS].cursor() as cur:
        cur.execute("SELECT @@SESSION.innodb_lock_wait_timeout")
        assert cur.fetchone()[0] == before
    assert lk.acquire(timeout=2)
    lk.release()


def test_a_session_killed_while_its_acquire_waits_is_replaced():
    """An administrator (or a proxy) kills the session of an acquire that
    waits for a row. The driver's error for the dead socket (an
    InterfaceError, raised by the ROLLBACK after the lost statement) means
    the connection is gone: the acquire goes on on a new session (it had
    taken nothing), and no raw driver error reaches the caller, then or at
    the thread's later calls."""
    errors: list[BaseException] = []
    outcomes: list[bool] = []

    def acquire() -> None:
        try:
            lk = a_lock("exclusive")
            try:
                outcomes.append(lk.acquire(timeout=30))
                lk.release()
                outcomes.append(lk.acquire(timeout=0))
                lk.release()
            except BaseException as exc:
                errors.append(exc)
        finally:
            connections.close_all()

    with row_held("exclusive"):
        thread = threading.Thread(target=acquire)
        thread.start()

        def waiting_session() -> int | None:
            with connections[ALIAS].cursor() as cur:
                cur.execute(
                    "SELECT id FROM information_schema.processlist WHERE info LIKE %s "
                    "AND info NOT LIKE %s",
                    ["%django_dlock_lock%FOR UPDATE%", "%processlist%"],
                )
                found = cur.fetchone()
            return None if found is None else int(found[0])

        wait_until(lambda: waiting_session() is not None and a_transaction_waits())
        killed = waiting_session()
        with connections[ALIAS].cursor() as cur:
            cur.execute("KILL %s", [killed])
        # the acquire waits again, on a new session
        wait_until(lambda: waiting_session() not in (None, killed))
    thread.join(60)
    assert not thread.is_alive()
    assert errors == []
    assert outcomes == [True, True]
