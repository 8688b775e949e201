"""The small protocol every strategy implements, and shared helpers."""

from __future__ import annotations

import contextlib
import heapq
import itertools
import os
import socket
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from django.db import DatabaseError, InterfaceError, OperationalError, connections
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.backends.signals import connection_created
from django.db.backends.utils import CursorWrapper

from django_dlock.conf import RetryInterval
from django_dlock.exceptions import LockTimeout
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
    #: held until the caller's transaction ends (``row``, ``advisory_xact``):
    #: needs ``transaction.atomic``, and cannot be released early
    transaction_scoped: bool

    def ended(self, req: Request) -> bool:
        """Whether the database has dropped the lock on its own (no query).

        True once the transaction of a transaction-scoped holding has ended;
        always False for the other strategies.
        """

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
    if _deadline.get() is not None:  # (a worker thread's connection of an async acquire)
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
    key = _pooler_key(connection)
    found = _behind_pooler.get(key)
    if found is None:
        connection.ensure_connection()
        raw = connection.connection

        def backend_pid() -> Any:
            with connection.wrap_database_errors, raw.cursor() as cur:
                cur.execute("SELECT pg_backend_pid()")
                return cur.fetchone()

        row = _watched(connection, backend_pid)  # it may wait in the pooler's queue
        found = row is not None and int(row[0]) != raw.info.backend_pid
        with _pooler_mutex:
            _behind_pooler[key] = found
        if not found:  # a direct connection: its statements need no watch
            with contextlib.suppress(ValueError):
                connection.execute_wrappers.remove(_watch_statement)
    return found


def _pooler_key(connection: BaseDatabaseWrapper) -> tuple[Any, ...]:
    settings = connection.settings_dict
    return tuple(settings.get(name) for name in ("HOST", "PORT", "NAME", "USER"))


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
        and not connection.queries_logged
        and not connection.settings_dict.get("DISABLE_SERVER_SIDE_CURSORS")
        and not behind_pooler(connection)
    ):
        return _execute_prepared(connection, sql, params)
    if connection.vendor == "sqlite" and _deadline.get() is not None:
        return _sqlite_within_deadline(connection, sql, params)
    with cursor(connection) as cur:
        if not (
            takes_lock
            and _deadline.get() is not None
            and not connection.in_atomic_block
            and behind_pooler(connection)
        ):
            cur.execute(sql, params)
            return (cur.fetchone() if cur.description else None), cur.rowcount
        return _in_own_transaction(connection, cur, sql, params)


def _sqlite_within_deadline(
    connection: BaseDatabaseWrapper, sql: str, params: list[Any]
) -> tuple[Any, int]:
    """A statement of an acquire on SQLite: another writer is contention, not an outage.

    SQLite lets one connection write at a time; another one waits up to its
    busy timeout (the ``timeout`` option, 5 s by default) and then fails with
    "database is locked". While a lock is being acquired, the statement
    waits at most until the lock's deadline, and a database that stays
    locked means "not acquired this round" (no row): the waiter looks again
    within its timeout, and times out as usual.
    """
    if connection.in_atomic_block:  # the caller's transaction: its own busy handling
        with cursor(connection) as cur:
            cur.execute(sql, params)
            return (cur.fetchone() if cur.description else None), cur.rowcount
    end = _deadline.get()
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
        if "locked" in str(exc) or "busy" in str(exc):
            return None, 0
        raise
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
    except DatabaseError:
        if not connection.in_atomic_block and not _usable(connection):
            connection.close()
        raise


def fetch_one(
    connection: BaseDatabaseWrapper, sql: str, params: list[Any], takes_lock: bool = False
) -> Any:
    """The first row of ``sql`` (or ``None``), see :func:`execute`."""
    return execute(connection, sql, params, takes_lock)[0]


# -- a client-side deadline for lock statements sent through a pooler ----------------------
#
# PgBouncer in transaction mode queues a statement until one of its server
# connections is free, up to its ``query_wait_timeout`` (minutes by default),
# and ignores a cancel request for a client that waits in that queue
# (PgBouncer 1.18 logs "cancel request for idle client"). So while an acquire
# runs, each statement sent through a pooler is watched: at the lock's
# deadline it is cancelled (which stops it if it already runs on a server),
# then its socket is shut down (which ends the wait in the queue). The
# statement fails, the connection is closed (the next statement reconnects)
# and the acquire reports a timeout. ``timeout=None`` is never watched.


class Abandoned(LockTimeout):
    """A lock statement was given up at the lock's deadline; its connection is closed.

    Raised while waiting for a pooler (PgBouncer's client queue) that has no
    free server connection. Lock acquisitions turn it into their usual
    timeout (``acquire()`` returns ``False``, ``with`` raises
    :class:`~django_dlock.LockTimeout`).
    """


#: the least time a watched statement gets, also when the deadline is (nearly) past:
#: a try-once (``timeout=0``) still has time for one round trip through the pooler
STATEMENT_FLOOR = 0.5

_deadline: ContextVar[float | None] = ContextVar("django_dlock_statement_deadline", default=None)


class statement_deadline:  # noqa: N801 (used like a function: ``with statement_deadline(...)``)
    """Watch the lock statements sent through a pooler until ``deadline``.

    Used around a strategy's ``acquire`` on ``alias``; a deadline of ``None``
    (wait forever) watches nothing.
    """

    __slots__ = ("end", "alias", "token")

    def __init__(self, deadline: Deadline, alias: str) -> None:
        self.end = None if deadline.timeout is None else deadline.end
        self.alias = alias
        self.token: Any = None

    def __enter__(self) -> None:
        if self.end is not None:
            guard_statements(connections[self.alias])
            self.token = _deadline.set(self.end)

    def __exit__(self, *exc: object) -> None:
        if self.token is not None:
            _deadline.reset(self.token)


@contextmanager
def unwatched() -> Iterator[None]:
    """Statements in this block are not watched (a COMMIT must not be cut in two)."""
    token = _deadline.set(None)
    try:
        yield
    finally:
        _deadline.reset(token)


def guard_statements(connection: BaseDatabaseWrapper, **_: Any) -> None:
    """Install the statement watch on ``connection`` (PostgreSQL; once).

    Installed on every PostgreSQL connection when it connects (and on one
    that was open before, when a lock is acquired on it); it takes itself
    off a connection found to reach the server directly. Django's own
    statements when it connects (it sets the session's time zone) are
    watched too: they wait in the pooler's queue like any other.
    """
    if (
        connection.vendor == "postgresql"
        and _watch_statement not in connection.execute_wrappers
        and _behind_pooler.get(_pooler_key(connection)) is not False
    ):
        connection.execute_wrappers.insert(0, _watch_statement)  # pop() of others keeps it
        init = connection.init_connection_state

        def init_connection_state() -> None:
            if _deadline.get() is None or _behind_pooler.get(_pooler_key(connection)) is False:
                init()
            else:
                _watched(connection, init)

        connection.init_connection_state = init_connection_state  # type: ignore[method-assign]


@dataclass(eq=False)
class _Watch:
    raw: Any
    at: float
    mutex: threading.Lock = field(default_factory=threading.Lock)
    done: bool = False
    fired: bool = False
    finished: threading.Event = field(default_factory=threading.Event)


class _Watchdog:
    """One daemon thread that fires the watches whose time has come."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.heap: list[tuple[float, int, _Watch]] = []
        self.seq = itertools.count()
        self.thread: threading.Thread | None = None
        self.pid = 0

    def add(self, watch: _Watch) -> None:
        with self.cond:
            if self.thread is None or self.pid != os.getpid():  # none yet, or forked
                self.heap.clear()
                self.pid = os.getpid()
                self.thread = threading.Thread(
                    target=self._run, name="django-dlock-statement-watch", daemon=True
                )
                self.thread.start()
            heapq.heappush(self.heap, (watch.at, next(self.seq), watch))
            if self.heap[0][2] is watch:
                self.cond.notify()

    def _run(self) -> None:
        while True:
            with self.cond:
                while not self.heap or self.heap[0][0] > time.monotonic():
                    if self.heap:
                        self.heap = [entry for entry in self.heap if not entry[2].done]
                        heapq.heapify(self.heap)
                    self.cond.wait(self.heap[0][0] - time.monotonic() if self.heap else None)
                _, _, watch = heapq.heappop(self.heap)
            _fire(watch)


_watchdog = _Watchdog()


def _fire(watch: _Watch) -> None:
    with watch.mutex:
        if watch.done:
            return
        watch.fired = True
    try:
        # Stops the statement if it runs on a server (PgBouncer forwards the
        # cancel); a client still in PgBouncer's queue is not cancelled...
        with contextlib.suppress(Exception):
            watch.raw.cancel()
        # ...so end its wait: the blocked read returns, the statement fails.
        # (The statement's thread waits for ``finished`` before it closes the
        # connection, so the descriptor is still this connection's.)
        with contextlib.suppress(Exception):
            sock = socket.socket(fileno=os.dup(watch.raw.fileno()))
            try:
                sock.shutdown(socket.SHUT_RDWR)
            finally:
                sock.close()
    finally:
        watch.finished.set()


def _watch_statement(
    execute: Callable[..., Any], sql: str, params: Any, many: bool, context: dict[str, Any]
) -> Any:
    connection: BaseDatabaseWrapper = context["connection"]
    if _deadline.get() is None:
        return execute(sql, params, many, context)
    if not behind_pooler(connection):  # a direct connection: never watched
        with contextlib.suppress(ValueError):
            connection.execute_wrappers.remove(_watch_statement)
        return execute(sql, params, many, context)
    return _watched(connection, lambda: execute(sql, params, many, context))


connection_created.connect(guard_statements, dispatch_uid="django_dlock_guard_statements")


def _watched(connection: BaseDatabaseWrapper, run: Callable[[], T]) -> T:
    """``run()`` (one statement on ``connection``), given up at the current deadline."""
    end = _deadline.get()
    raw = connection.connection
    if end is None or raw is None:
        return run()
    watch = _Watch(raw, max(end, time.monotonic() + STATEMENT_FLOOR))
    _watchdog.add(watch)
    error: BaseException | None = None
    try:
        result = run()
    except BaseException as exc:
        error = exc
    with watch.mutex:
        watch.done = True
        fired = watch.fired
        if not fired:
            watch.raw = None  # (the watch may stay queued until its time: hold nothing)
    if fired:
        watch.finished.wait()
        connection.close()
        raise Abandoned(
            "a lock statement waited past the lock's deadline for a server connection "
            "of the connection pooler (its pool is busy); its connection was closed"
        ) from error
    if error is not None:
        raise error
    return result
