"""Lock statements prepared on Django's PostgreSQL connection: their names stay
unique on the server session whatever fails (a transaction rolled back, a
statement dropped while others stay, a connection handed on by Django's pool,
a PREPARE whose answer never came), and the connection stays usable."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from typing import Any

import django
import pytest
from django.db import connections, transaction

import django_dlock as dlock

from .helpers import in_thread, wait_until

pytestmark = pytest.mark.django_db(transaction=True, databases=["default"])


def _statements(cur: Any) -> list[str]:
    cur.execute("SELECT name FROM pg_prepared_statements WHERE name LIKE 'dlock%%'")
    return sorted(name for (name,) in cur.fetchall())


def _lease_calls(key: str) -> None:
    """The lease statements of a busy thread: acquire, check, extend, release."""
    with dlock.lock(key) as lk:
        assert lk.locked()
        lk.extend()
    assert not dlock.lock(key).locked()
    lk = dlock.lock(key, timeout=2)
    assert lk.acquire()
    lk.release()


@pytest.mark.parametrize("strategy", ["row", "advisory_xact"])
def test_lease_calls_after_a_lock_whose_transaction_an_error_rolled_back(strategy):
    # A row or advisory_xact lock runs in the caller's transaction, on the
    # thread's connection; an error in the block rolls that transaction back,
    # and psycopg then drops every statement prepared on the session. A lease
    # held meanwhile has some of its statements prepared before, some after.
    connections["default"].close()
    for attempt in range(3):
        held = dlock.lock(f"prepared:held-{attempt}")
        assert held.acquire()
        key = f"prepared:{strategy}-{attempt}"
        with (
            contextlib.suppress(ZeroDivisionError),
            transaction.atomic(),
            dlock.lock(key, strategy=strategy) as lk,
        ):
            assert lk.owned()
            1 / 0  # noqa: B018 (the error that rolls the transaction back)
        held.release()
        for call in range(3):
            _lease_calls(f"prepared:after-{attempt}-{call}")


@pytest.fixture
def django_pool() -> Iterator[None]:
    """Django's connection pool on the default alias, two connections."""
    if django.VERSION < (5, 1):
        pytest.skip(f"Django's connection pool needs Django >= 5.1; this is {django.get_version()}")
    pytest.importorskip("psycopg_pool")
    wrapper = connections["default"]
    options = wrapper.settings_dict["OPTIONS"]  # shared by every thread's wrapper
    wrapper.close()
    options["pool"] = {"min_size": 2, "max_size": 2, "timeout": 20}
    try:
        yield
    finally:
        try:
            connections.close_all()
            wrapper.close_pool()
        finally:
            del options["pool"]  # (never left to the tests after this one)


def _backend_and_statements() -> tuple[int, list[str]]:
    with connections["default"].cursor() as cur:
        cur.execute("SELECT pg_backend_pid()")
        return int(cur.fetchone()[0]), _statements(cur)


def test_a_pooled_connection_keeps_its_statements_for_the_next_borrower(django_pool):
    mine, _ = _backend_and_statements()  # (lock statements run on an open connection)
    _lease_calls("prepared:pooled")
    before = _backend_and_statements()[1]

    def elsewhere() -> tuple[int, list[str]]:
        _backend_and_statements()  # the pool's other connection (this thread holds the first)
        _lease_calls("prepared:pooled")
        return _backend_and_statements()

    theirs, their_statements = in_thread(elsewhere)
    assert theirs != mine and their_statements
    # Both connections are back in the pool; this thread borrows each in turn
    # and runs the statements each already has.
    connections["default"].close()
    seen: dict[int, list[str]] = {}
    for _ in range(4):
        pid, _ = _backend_and_statements()
        _lease_calls("prepared:pooled")
        seen[pid] = _backend_and_statements()[1]
        connections["default"].close()
    assert set(seen) == {mine, theirs}
    # prepared once per session, never again under new names
    assert seen[mine] == before and seen[theirs] == their_statements


def test_names_someone_else_took_on_the_session_are_skipped():
    connections["default"].close()
    with connections["default"].cursor() as cur:
        for n in range(2):
            cur.execute(f"PREPARE dlock_{n} AS SELECT {n}")
    _lease_calls("prepared:taken")
    with connections["default"].cursor() as cur:
        assert len(_statements(cur)) > 2


@contextlib.contextmanager
def _lock_table_elsewhere() -> Iterator[Any]:
    """The lease table locked by another session (in a transaction it yields):
    a statement that reads it waits on the server."""
    other = connections["default"].copy("default")
    other.ensure_connection()
    raw = other.connection
    try:
        raw.execute("BEGIN")
        raw.execute("LOCK TABLE django_dlock_lock IN ACCESS EXCLUSIVE MODE")
        yield raw
    finally:
        with contextlib.suppress(Exception):
            raw.execute("ROLLBACK")
        other.close()


def _waiting_on_the_table() -> bool:
    other = connections["default"].copy("default")
    try:
        with other.cursor() as cur:
            cur.execute(
                "SELECT count(*) FROM pg_locks l JOIN pg_class c ON c.oid = l.relation "
                "WHERE c.relname = 'django_dlock_lock' AND NOT l.granted"
            )
            return int(cur.fetchone()[0]) > 0
    finally:
        other.close()


def test_a_prepare_given_up_at_the_deadline_leaves_the_connection_usable():
    # A fresh session: the acquire's first statement is prepared, and the
    # server makes that PREPARE wait behind the table lock. The client gives
    # up at its deadline, the server completes the PREPARE once the table is
    # free; later calls on the thread's connection run as usual.
    dlock.close_connections()
    connections["default"].close()
    seen = threading.Event()

    def watch() -> None:
        try:
            wait_until(_waiting_on_the_table)
            seen.set()
        finally:
            connections.close_all()

    with _lock_table_elsewhere():
        watcher = threading.Thread(target=watch)
        watcher.start()
        assert dlock.lock("prepared:abandoned").acquire(timeout=0) is False
        watcher.join(30)
    assert seen.is_set()  # the server did make the statement wait
    for call in range(3):
        _lease_calls(f"prepared:abandoned-{call}")


class _Interrupted(Exception):
    """What a signal handler raises (a task's soft time limit, a worker's timeout)."""


def test_a_prepare_interrupted_in_flight_leaves_the_connection_usable():
    # The wait for the PREPARE's answer is interrupted by an exception from a
    # signal handler (as a task's soft time limit raises one), while the
    # server completes the PREPARE. The next calls must not find the
    # connection busy with it.
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signal handlers run in the main thread")
    dlock.close_connections()
    connections["default"].close()
    with _lock_table_elsewhere() as blocker:

        def interrupt(signum: int, frame: Any) -> None:
            if not _waiting_on_the_table():
                return  # not waiting yet: try again at the next tick
            signal.setitimer(signal.ITIMER_REAL, 0)
            blocker.execute("ROLLBACK")  # the server completes the PREPARE now
            raise _Interrupted()

        previous = signal.signal(signal.SIGALRM, interrupt)
        signal.setitimer(signal.ITIMER_REAL, 0.2, 0.2)
        try:
            with pytest.raises(_Interrupted):
                dlock.lock("prepared:interrupted").acquire(timeout=30)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
    for call in range(3):
        _lease_calls(f"prepared:interrupted-{call}")
    wait_until(lambda: not dlock.lock("prepared:interrupted").locked())
