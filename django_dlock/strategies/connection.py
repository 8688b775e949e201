"""Lock connections: which connection a lock statement runs on, and how it runs.

A lock statement commits on its own, never as part of the caller's
transaction (a private connection of the thread when the caller is inside
``transaction.atomic``), is retried once on a new connection when the old
one had dropped, fails with :class:`~django_dlock.DatabaseUnavailable`
(the driver's error chained) when the database cannot be reached, and
runs as a server-side prepared statement on PostgreSQL when no pooler is
in between (see the PostgreSQL docs, "PREPARE"). While an
acquire's deadline is watched (:mod:`django_dlock.strategies.deadline`), a
statement that takes a lock through a pooler commits only once its result
is back in time, and SQLite waits for another writer only until the deadline.
"""

from __future__ import annotations

import contextlib
import re
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, NoReturn, TypeVar

from django.db import DatabaseError, InterfaceError, OperationalError, connections, transaction
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.backends.utils import CursorWrapper

from django_dlock.exceptions import DatabaseUnavailable, NotMigrated
from django_dlock.strategies._pg import psycopg3
from django_dlock.strategies.deadline import (
    STATEMENT_FLOOR,
    Abandoned,
    behind_pooler,
    deadline_end,
    guard_statements,
    unwatched,
    watched_direct,
)
from django_dlock.tables import FENCE_FLOOR_TABLE

__all__ = [
    "close_private_connections",
    "cursor",
    "direct_alias",
    "execute",
    "fetch_one",
    "in_savepoint",
    "lock_connection",
    "not_migrated",
    "require_postgresql",
    "tables_missing",
    "unreachable",
    "uses_django_pool",
    "with_reconnect",
]

T = TypeVar("T")

_private = threading.local()


def lock_connection(alias: str) -> BaseDatabaseWrapper:
    """The connection a lock statement runs on, committed on its own.

    * In autocommit mode: the thread's own Django connection, once it is
      open. A thread whose connection is not open yet, on an alias that uses
      Django's connection pool, uses its private connection (below) instead
      of waiting for the pool.
    * Inside the caller's ``transaction.atomic`` block a lock write must not
      join the caller's transaction (others would not see it until the
      caller commits, and a rollback would undo it), so it runs on a
      **private connection** of this thread, opened once and reused. It
      never comes from Django's pool (a pool whose connections are all held
      by transactions that wait for a lock would never hand one out), and
      with ``DLOCK_DIRECT_DATABASES`` it connects through the alias named
      there (the same database without a pooler in between).
    * SQLite inside a transaction that has written (or, outside WAL mode,
      read): the caller's own connection. SQLite has one writer at a time,
      and a second connection would wait for the caller's own lock on the
      database. The lock row is then part of the caller's transaction:
      others see it when the caller commits (nobody else can write before
      that anyway), and a rollback undoes the acquisition. A transaction
      that has not touched the database yet uses the private connection,
      like on the other databases (:func:`_sqlite_caller_writes`).
    """
    connection = connections[alias]
    if deadline_end() is not None:  # (a worker thread's connection of an async acquire)
        guard_statements(connection)
    if not connection.in_atomic_block:
        if connection.connection is not None or not uses_django_pool(connection):
            return connection
    elif connection.vendor == "sqlite" and _sqlite_caller_writes(connection, alias):
        return connection
    return _thread_private(alias)


def _sqlite_caller_writes(connection: BaseDatabaseWrapper, alias: str) -> bool:
    """Whether the caller's SQLite transaction keeps a second connection from writing.

    The private connection tries to take the database without waiting
    (``BEGIN EXCLUSIVE``, then ``ROLLBACK``): that fails while another
    connection writes, and also while one holds a read lock, which (outside
    WAL mode) would keep the private connection from committing until the
    caller's transaction ends. When it cannot, the caller's
    connection tries a write that changes nothing, without waiting either:
    it succeeds only if no other connection holds the write lock, that is if
    the caller holds it (or now does: then nobody else can write until the
    caller's transaction ends, which makes it the only writer all the same).
    """
    private = _thread_private(alias)
    if _sqlite_try_write(private, "BEGIN EXCLUSIVE", end="ROLLBACK"):
        return False
    return _sqlite_try_write(
        connection, f"UPDATE {FENCE_FLOOR_TABLE} SET value = value WHERE 0 = 1", end=None
    )


def _sqlite_try_write(connection: BaseDatabaseWrapper, sql: str, end: str | None) -> bool:
    """Run ``sql`` with SQLite's busy timeout at 0; False if the database was locked."""
    connection.ensure_connection()
    raw = connection.connection
    (saved,) = raw.execute("PRAGMA busy_timeout").fetchone()
    raw.execute("PRAGMA busy_timeout = 0")
    try:
        raw.execute(sql)
    except Exception as exc:
        if "locked" in str(exc) or "busy" in str(exc):
            return False
        raise
    finally:
        raw.execute(f"PRAGMA busy_timeout = {int(saved)}")
    if end is not None:
        raw.execute(end)
    return True


class _ThreadEnd:
    """Kept in a thread's local data: when the thread ends, it goes, and with it
    that thread's private connections are closed (never left to the garbage
    collector: a Django connection is full of reference cycles)."""


def _close_when_thread_ends(cache: dict[str, BaseDatabaseWrapper]) -> None:
    for private in list(cache.values()):
        raw = private.connection  # (its thread is gone: nobody else uses it)
        if raw is not None:
            with contextlib.suppress(Exception):
                raw.close()
    cache.clear()


def _thread_private(alias: str) -> BaseDatabaseWrapper:
    cache: dict[str, BaseDatabaseWrapper] | None = getattr(_private, "connections", None)
    if cache is None:
        cache = _private.connections = {}
        _private.end = _ThreadEnd()
        weakref.finalize(_private.end, _close_when_thread_ends, cache)
    private = cache.get(alias)
    if private is None:
        private = _private_connection(alias)
        cache[alias] = private
    return private


def uses_django_pool(connection: BaseDatabaseWrapper) -> bool:
    """Whether ``connection``'s alias uses Django's connection pool (Django 5.1+)."""
    return bool((connection.settings_dict.get("OPTIONS") or {}).get("pool"))


def direct_alias(alias: str) -> str:
    """The alias that reaches ``alias``'s database without a pooler (``DLOCK_DIRECT_DATABASES``)."""
    from django_dlock.conf import conf

    return conf.DIRECT_DATABASES.get(alias, alias)


def _private_connection(alias: str) -> BaseDatabaseWrapper:
    """A new connection like ``alias``'s (or its direct alias's), outside Django's pool."""
    source = connections[direct_alias(alias)]
    private = source.copy(alias)
    private.settings_dict.setdefault("OPTIONS", {}).pop("pool", None)
    guard_statements(private)
    return private


def require_postgresql(strategy: str, connection: BaseDatabaseWrapper) -> None:
    """Refuse ``strategy`` on a database other than PostgreSQL, saying what to use."""
    if connection.vendor != "postgresql":
        from django_dlock.exceptions import StrategyNotSupported

        raise StrategyNotSupported(
            f"the {strategy} strategy needs PostgreSQL; database {connection.alias!r} is "
            f"{connection.vendor}: use the lease strategy (or row on MySQL/MariaDB)"
        )


def close_private_connections() -> None:
    """Close this thread's private lock connections (if any)."""
    cache: dict[str, BaseDatabaseWrapper] = getattr(_private, "connections", {})
    for private in cache.values():
        private.close()
    cache.clear()


#: SQLSTATEs of a PostgreSQL server that is shutting down, crashed or is starting up
#: (admin_shutdown, crash_shutdown, cannot_connect_now); class 08 is "connection exception"
_PG_GONE = ("57P01", "57P02", "57P03")
#: MySQL/MariaDB errors of a connection that is gone: server shutdown, connection
#: killed, cannot connect (socket, TCP), server has gone away, lost connection,
#: lost connection to the server, disconnected for inactivity
_MYSQL_GONE = frozenset({1053, 1927, 2002, 2003, 2006, 2013, 2055, 4031})


def unreachable(connection: BaseDatabaseWrapper, exc: BaseException) -> bool:
    """Whether ``exc``, raised by a statement on ``connection``, means the database
    could not be reached (rather than a refusal by a server that answered).

    An ``InterfaceError`` (the connection is closed) always does. An
    ``OperationalError`` does when the driver's connection is now closed or
    was never opened, or when its code says the connection failed or the
    server is going away; a lock wait that timed out, a deadlock or a
    cancelled statement leave the connection working and are not outages.
    SQLite has no server: its ``OperationalError`` (a locked database) never is.
    """
    if isinstance(exc, InterfaceError):
        return True
    if not isinstance(exc, OperationalError) or connection.vendor == "sqlite":
        return False
    raw = connection.connection
    if raw is None or _closed(raw):
        return True
    cause = exc.__cause__
    state = getattr(cause, "sqlstate", None) or getattr(cause, "pgcode", None)
    if state:
        return str(state).startswith("08") or state in _PG_GONE
    args: tuple[Any, ...] = getattr(cause, "args", ())
    return bool(args) and args[0] in _MYSQL_GONE


def _closed(raw: Any) -> bool:
    """Whether a driver's connection is closed (psycopg: also broken)."""
    closed = getattr(raw, "closed", None)
    if isinstance(closed, (bool, int)):  # psycopg 3 (a broken one too), psycopg2
        return bool(closed)
    is_open = getattr(raw, "open", None)  # PyMySQL, mysqlclient
    return isinstance(is_open, (bool, int)) and not is_open


def _failed(connection: BaseDatabaseWrapper, exc: DatabaseError) -> NoReturn:
    """Raise what a failed lock statement on ``connection`` means.

    A connection left broken outside the caller's transaction is closed, so
    the next statement reconnects. An error that means the database could
    not be reached becomes :class:`DatabaseUnavailable`, the driver's error
    chained; any other is raised as it is.
    """
    gone = unreachable(connection, exc)
    if not connection.in_atomic_block and not _usable(connection):
        connection.close()
    if gone:
        raise DatabaseUnavailable(
            f"database {connection.alias!r} could not be reached: {str(exc).strip()}"
        ) from exc
    if tables_missing(exc):
        raise not_migrated(connection.alias) from exc
    raise exc


#: what each database says of a table or sequence that is not there
_MISSING = re.compile(
    r"(relation \"django_dlock_\w+\" does not exist"  # PostgreSQL (42P01)
    r"|no such table: django_dlock_"  # SQLite
    r"|table '[^']*django_dlock_\w+' doesn't exist)",  # MySQL/MariaDB (1146)
    re.IGNORECASE,
)


def tables_missing(exc: BaseException) -> bool:
    """Whether ``exc`` says that a django-dlock table (or sequence) does not exist."""
    return _MISSING.search(str(exc)) is not None


def not_migrated(alias: str) -> NotMigrated:
    """The error for django-dlock's tables missing on ``alias``."""
    option = "" if alias == "default" else f" --database {alias}"
    return NotMigrated(
        f"django-dlock's tables are missing on database {alias!r}: run "
        f"`python manage.py migrate django_dlock{option}`"
    )


@contextmanager
def cursor(connection: BaseDatabaseWrapper) -> Iterator[CursorWrapper]:
    """A cursor for lock statements: a database that cannot be reached raises
    :class:`DatabaseUnavailable`, and a broken connection is closed so the
    next call reconnects."""
    try:
        with connection.cursor() as cur:
            yield cur
    except DatabaseError as exc:
        _failed(connection, exc)


@contextmanager
def in_savepoint(connection: BaseDatabaseWrapper) -> Iterator[CursorWrapper]:
    """:func:`cursor` inside a savepoint of the caller's transaction.

    A statement that fails (a lock wait that timed out) rolls back only
    the savepoint, and the caller's transaction stays usable.
    """
    try:
        with transaction.atomic(using=connection.alias), connection.cursor() as cur:
            yield cur
    except DatabaseError as exc:
        _failed(connection, exc)


def _usable(connection: BaseDatabaseWrapper) -> bool:
    try:
        return connection.connection is not None and bool(connection.is_usable())
    except Exception:
        return False


def with_reconnect(alias: str, op: Callable[[BaseDatabaseWrapper], T]) -> tuple[T, bool]:
    """Run ``op(connection)``; if the connection had dropped, once more on a new one.

    A holder's connection can be closed under it (``pg_terminate_backend``,
    a database restart, a network cut). :func:`cursor` closes such a broken
    connection, so a second try reconnects. Errors on a working connection
    (lock timeouts, constraint errors) and errors inside the caller's
    transaction are not retried. Returns ``(result, retried)``: a retried
    statement may have run twice, which callers must tolerate.

    Raises:
        DatabaseUnavailable: the database could not be reached, also on a
            new connection (the driver's error is its ``__cause__``).
    """
    connection = lock_connection(alias)
    try:
        return op(connection), False
    except DatabaseUnavailable:
        if connection.in_atomic_block or connection.connection is not None:
            raise
    return op(lock_connection(alias)), True


def execute(
    connection: BaseDatabaseWrapper, sql: str, params: list[Any], takes_lock: bool = False
) -> tuple[Any, int]:
    """Run one statement; return ``(its first row or None, its row count)``.

    On PostgreSQL the statement runs as a server-side prepared statement on
    Django's own psycopg connection: the server parses and plans each lock
    statement once per session instead of at every call (about a quarter of
    an uncontended acquire + release; see the benchmarks). It falls back to
    Django's cursor when queries are being logged (``DEBUG``), when
    ``DISABLE_SERVER_SIDE_CURSORS`` is set (Django's flag for PgBouncer in
    transaction mode), and when the connection goes through a pooler
    (:func:`behind_pooler`): a pooler in transaction mode hands the server
    session to other clients between statements, so a statement prepared on
    it would be missing, or already there, for the next one.

    ``takes_lock``: the statement takes a lock when it commits (a lease
    acquire). Through a pooler, while an acquire's deadline is watched (see
    :func:`statement_deadline`), it then runs in a transaction of its own,
    committed only once its result is back in time: a statement given up at
    the deadline is rolled back with its closed connection, so a lease can
    never be taken for a caller that already gave up.
    """
    if (
        connection.vendor == "postgresql"
        and psycopg3()  # (else Django runs PostgreSQL on psycopg2: its cursor)
        and not connection.queries_logged
        and not connection.settings_dict.get("DISABLE_SERVER_SIDE_CURSORS")
        and not _behind_pooler(connection)
    ):
        if deadline_end() is None:
            return _execute_prepared(connection, sql, params)
        # an acquire with a timeout: a server that stopped answering must not
        # keep the caller past it
        return watched_direct(connection, lambda: _execute_prepared(connection, sql, params))
    if connection.vendor == "sqlite" and deadline_end() is not None:
        return _sqlite_within_deadline(connection, sql, params, takes_lock)
    with cursor(connection) as cur:
        if not (
            takes_lock
            and deadline_end() is not None
            and not connection.in_atomic_block
            and behind_pooler(connection)
        ):
            cur.execute(sql, params)
            return (cur.fetchone() if cur.description else None), cur.rowcount
        return _in_own_transaction(connection, cur, sql, params)


def _behind_pooler(connection: BaseDatabaseWrapper) -> bool:
    """:func:`behind_pooler`, whose first question may be the first statement of all."""
    try:
        return behind_pooler(connection)
    except DatabaseError as exc:
        _failed(connection, exc)


def _sqlite_within_deadline(
    connection: BaseDatabaseWrapper, sql: str, params: list[Any], takes_lock: bool
) -> tuple[Any, int]:
    """A statement of an acquire on SQLite: another writer is contention, not an outage.

    SQLite lets one connection write at a time; another one waits up to its
    busy timeout (the ``timeout`` option, 5 s by default) and then fails with
    "database is locked". While a lock is being acquired, the statement
    waits at most until the lock's deadline. For the statement that takes
    the lock (``takes_lock``), a database that stays locked means "not
    acquired this round" (no row): the waiter looks again within its
    timeout, and times out as usual. Any other statement of the acquire (a
    waiter's ticket, its renewal) has no such answer: a database locked past
    the deadline gives the acquire up (:class:`Abandoned`, a timeout),
    never a made-up "no row" (a renewal that read it as "the ticket is
    gone" put the ticket back under its own number, an ``IntegrityError``).
    """
    if connection.in_atomic_block:  # the caller's transaction: its own busy handling
        with cursor(connection) as cur:
            cur.execute(sql, params)
            return (cur.fetchone() if cur.description else None), cur.rowcount
    end = deadline_end()
    assert end is not None
    connection.ensure_connection()
    raw = connection.connection
    (saved,) = raw.execute("PRAGMA busy_timeout").fetchone()
    # like a statement through a pooler, each gets at least STATEMENT_FLOOR: a
    # try-once (timeout=0) on a free key outlasts another writer's short commit
    wait_ms = min(int(saved), int(max(end - time.monotonic(), STATEMENT_FLOOR) * 1000))
    raw.execute(f"PRAGMA busy_timeout = {wait_ms}")
    try:
        with cursor(connection) as cur:
            cur.execute(sql, params)
            return (cur.fetchone() if cur.description else None), cur.rowcount
    except OperationalError as exc:
        if "locked" not in str(exc) and "busy" not in str(exc):
            raise
        if takes_lock:
            return None, 0
        raise Abandoned(
            "the SQLite database stayed locked by another writer until the lock's deadline"
        ) from exc
    finally:
        if connection.connection is raw:
            raw.execute(f"PRAGMA busy_timeout = {int(saved)}")


def _in_own_transaction(
    connection: BaseDatabaseWrapper, cur: CursorWrapper, sql: str, params: list[Any]
) -> tuple[Any, int]:
    """``sql`` between BEGIN and a COMMIT that is never given up half-way."""
    cur.execute("BEGIN")  # (this is the statement that waits for a server)
    try:
        cur.execute(sql, params)
        found = (cur.fetchone() if cur.description else None), cur.rowcount
    except BaseException:
        if connection.connection is not None:  # not closed (given up): end the transaction
            with unwatched(), contextlib.suppress(DatabaseError):
                cur.execute("ROLLBACK")
        raise
    with unwatched():
        cur.execute("COMMIT")
    return found


#: a preparation threshold no query reaches by repetition alone
_NEVER_AUTOMATICALLY = 2**31


def _execute_prepared(
    connection: BaseDatabaseWrapper, sql: str, params: list[Any]
) -> tuple[Any, int]:
    import psycopg

    try:
        if connection.connection is None:
            connection.ensure_connection()
        raw = connection.connection
        # Django turns psycopg's automatic preparation off (threshold None),
        # which also disables prepare=True. Lift it for our statement only:
        # the connection's other queries stay unprepared.
        saved = raw.prepare_threshold
        if saved is None:
            raw.prepare_threshold = _NEVER_AUTOMATICALLY
        try:
            with connection.wrap_database_errors, psycopg.Cursor(raw) as cur:
                cur.execute(sql, params, prepare=True)
                # (nfields, not .description: that builds column objects)
                result = cur.pgresult
                returns_rows = result is not None and result.nfields > 0
                return (cur.fetchone() if returns_rows else None), cur.rowcount
        finally:
            if saved is None:
                raw.prepare_threshold = None
    except DatabaseError as exc:
        _failed(connection, exc)


def fetch_one(
    connection: BaseDatabaseWrapper, sql: str, params: list[Any], takes_lock: bool = False
) -> Any:
    """The first row of ``sql`` (or ``None``), see :func:`execute`."""
    return execute(connection, sql, params, takes_lock)[0]
