"""The small protocol every strategy implements, and shared helpers."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from django.db import DatabaseError, InterfaceError, OperationalError, connections
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.backends.utils import CursorWrapper

from django_dlock.conf import RetryInterval
from django_dlock.keys import Key
from django_dlock.retry import Deadline


@dataclass(frozen=True)
class Grant:
    """A successful acquisition: the fencing number, if the strategy issues one."""

    fence: int | None


@dataclass
class Request:
    """What a strategy needs to act for one holder on one key."""

    key: Key
    alias: str
    token: str
    owner: str
    ttl: float
    shared: bool = False


class Strategy(Protocol):
    """One way of holding a lock. All methods are synchronous and blocking."""

    #: name used by ``lock(strategy=...)``
    name: str
    #: holdings of strategies with the same family are the same lock for
    #: re-entrancy (a holder that holds "x" by ``lease`` re-enters "x" by lease)
    family: str

    def check_supported(self, connection: BaseDatabaseWrapper) -> None:
        """Raise :class:`StrategyNotSupported` if ``connection`` cannot do it."""

    def acquire(self, req: Request, deadline: Deadline, policy: RetryInterval) -> Grant | None:
        """Acquire, waiting until ``deadline``; ``None`` when it passed."""

    async def aacquire(
        self, req: Request, deadline: Deadline, policy: RetryInterval
    ) -> Grant | None:
        """Async :meth:`acquire`: must not block the event loop while waiting."""

    def try_acquire(self, req: Request) -> int | None:
        """One attempt: the fencing number if acquired, else ``None``."""

    def release(self, req: Request) -> bool:
        """Release; ``False`` if the database says the caller no longer holds it."""

    def extend(self, req: Request, ttl: float) -> bool:
        """Renew the lease; ``False`` if the caller no longer holds it."""

    def locked(self, alias: str, key: Key) -> bool:
        """Whether anyone holds ``key`` now."""

    def owned(self, req: Request) -> bool:
        """Whether the caller holds ``key`` now, according to the database."""


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
        connection, f"UPDATE {_SQLITE_PROBE_TABLE} SET value = value WHERE 0 = 1", end=None
    )


_SQLITE_PROBE_TABLE = "django_dlock_fencefloor"


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


def _thread_private(alias: str) -> BaseDatabaseWrapper:
    cache: dict[str, BaseDatabaseWrapper] | None = getattr(_private, "connections", None)
    if cache is None:
        cache = _private.connections = {}
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
    return private


_pooler_mutex = threading.Lock()
_behind_pooler: dict[tuple[Any, ...], bool] = {}


def behind_pooler(connection: BaseDatabaseWrapper) -> bool:
    """Whether a PostgreSQL connection goes through a pooler such as PgBouncer.

    A pooler answers the client's connection with a cancel key of its own
    (it must route cancel requests), so the process id in it differs from
    the server's ``pg_backend_pid()``; a direct connection reports the same
    pid. Found out once per process and database (one query), then cached.
    """
    if connection.vendor != "postgresql":
        return False
    settings = connection.settings_dict
    key = tuple(settings.get(name) for name in ("HOST", "PORT", "NAME", "USER"))
    found = _behind_pooler.get(key)
    if found is None:
        connection.ensure_connection()
        raw = connection.connection
        with connection.wrap_database_errors, raw.cursor() as cur:
            cur.execute("SELECT pg_backend_pid()")
            row = cur.fetchone()
        found = row is not None and int(row[0]) != raw.info.backend_pid
        with _pooler_mutex:
            _behind_pooler[key] = found
    return found


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


@contextmanager
def cursor(connection: BaseDatabaseWrapper) -> Iterator[CursorWrapper]:
    """A cursor that closes a broken connection so the next call reconnects."""
    try:
        with connection.cursor() as cur:
            yield cur
    except DatabaseError:
        if not connection.in_atomic_block and not _usable(connection):
            connection.close()
        raise


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
    """
    connection = lock_connection(alias)
    try:
        return op(connection), False
    except (OperationalError, InterfaceError):
        if connection.in_atomic_block or connection.connection is not None:
            raise
    return op(lock_connection(alias)), True


def execute(connection: BaseDatabaseWrapper, sql: str, params: list[Any]) -> tuple[Any, int]:
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
    """
    if (
        connection.vendor == "postgresql"
        and not connection.queries_logged
        and not connection.settings_dict.get("DISABLE_SERVER_SIDE_CURSORS")
        and not behind_pooler(connection)
    ):
        return _execute_prepared(connection, sql, params)
    with cursor(connection) as cur:
        cur.execute(sql, params)
        return (cur.fetchone() if cur.description else None), cur.rowcount


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
    except DatabaseError:
        if not connection.in_atomic_block and not _usable(connection):
            connection.close()
        raise


def fetch_one(connection: BaseDatabaseWrapper, sql: str, params: list[Any]) -> Any:
    """The first row of ``sql`` (or ``None``), see :func:`execute`."""
    return execute(connection, sql, params)[0]
