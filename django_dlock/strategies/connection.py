"""Where a lock statement runs: its connection, how it runs, and its deadline.

Lock connections. A lock statement commits on its own, never as part of
the caller's transaction (a private connection of the thread when the
caller is inside ``transaction.atomic``), is retried once on a new
connection when the old one had dropped, fails with
:class:`~django_dlock.DatabaseUnavailable` (the driver's error chained)
when the database cannot be reached, and runs as a server-side prepared
statement on PostgreSQL when no pooler is in between (see the PostgreSQL
docs, "PREPARE"). While an acquire's deadline is watched, a statement that
takes a lock through a pooler commits only once its result is back in
time, and SQLite waits for another writer only until the deadline.

The deadline. PgBouncer in transaction mode queues a statement until one of its server
connections is free, up to its ``query_wait_timeout`` (minutes by default),
and ignores a cancel request for a client that waits in that queue
(PgBouncer 1.18 logs "cancel request for idle client"; see the PgBouncer
docs, "Configuration"). So while an acquire runs, each statement sent
through a pooler is watched: at the lock's deadline it is cancelled (which
stops it if it already runs on a server), then its socket is shut down
(which ends the wait in the queue). The statement fails, the connection is
closed (the next statement reconnects) and the acquire reports a timeout.
``timeout=None`` is never watched.

A direct connection needs no watch while its server answers (the server
ends a lock wait itself), but a server that stops answering altogether (a
frozen VM, a stalled disk) would keep a statement, and the caller, waiting
past any timeout. So the lock statements of an acquire with a timeout are
given up on direct connections too, with :data:`DIRECT_GRACE` more time: a
statement still unanswered then is given up the same way. A statement
prepared on a direct connection is not watched by the watchdog thread: its
own thread waits for the answer, no longer than that (libpq's asynchronous
calls and ``poll``), so that a process sending many statements wakes no
other thread.

Whether a connection goes through a pooler at all is found out here too
(:func:`behind_pooler`): that question is itself a watched statement, and
a direct connection takes the watch off.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import logging
import math
import os
import re
import select
import socket
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, NoReturn, TypeVar

from django.conf import settings
from django.db import (
    DatabaseError,
    Error,
    InterfaceError,
    OperationalError,
    connections,
    transaction,
)
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.backends.signals import connection_created
from django.db.backends.utils import CursorWrapper

from django_dlock.exceptions import DatabaseUnavailable, LockTimeout, NotMigrated
from django_dlock.retry import Deadline
from django_dlock.tables import FENCE_FLOOR_TABLE

__all__ = [
    "DIRECT_GRACE",
    "LONGEST_WAIT",
    "STATEMENT_FLOOR",
    "began",
    "Abandoned",
    "LockWaitEnded",
    "behind_pooler",
    "may_prepare",
    "close_private_connections",
    "committed_view",
    "cursor",
    "deadline_end",
    "direct_alias",
    "execute",
    "fetch_one",
    "guard_statements",
    "in_savepoint",
    "lock_wait_ended",
    "lock_connection",
    "not_migrated",
    "psycopg3",
    "require_postgresql",
    "statement_deadline",
    "tables_missing",
    "unreachable",
    "unwatched",
    "uses_django_pool",
    "watch_end",
    "watched_raw",
    "with_reconnect",
]

T = TypeVar("T")

logger = logging.getLogger("django_dlock")


class Abandoned(LockTimeout):
    """A lock statement was given up at the lock's deadline; its connection is closed.

    Raised while waiting for a pooler (PgBouncer's client queue) that has no
    free server connection. Lock acquisitions turn it into their usual
    timeout (``acquire()`` returns ``False``, ``with`` raises
    :class:`~django_dlock.LockTimeout`).
    """


#: the least time the statements of an acquire get, counted from its start: a
#: try-once (``timeout=0``) still has time for one round trip through the pooler
STATEMENT_FLOOR = 0.5
#: on a direct connection, how long past the deadline (and the floor) a lock
#: statement may still take before its server is taken for frozen
DIRECT_GRACE = 0.5
#: the longest single wait of a thread here, in seconds: a longer one goes in
#: steps (``poll`` counts milliseconds in a C int, about 24 days; a condition's
#: wait stops at ``threading.TIMEOUT_MAX``)
LONGEST_WAIT = 3600.0

_deadline: ContextVar[float | None] = ContextVar("django_dlock_statement_deadline", default=None)

#: when the last statement that takes a lock on SQLite began to run, after
#: waiting here for another writer (see :func:`began`)
_sqlite_began: ContextVar[float] = ContextVar("django_dlock_sqlite_began", default=0.0)


def began(sent_at: float) -> float:
    """When a lock statement of this thread, sent at ``sent_at``, began to run.

    A server stamps a lease with the time its statement began
    (PostgreSQL's ``statement_timestamp()``, MySQL's ``NOW()``): at or after
    it was sent, also when it then waited for a row. SQLite runs in this
    process, and a statement that waits for another writer waits here,
    before it begins: its lease starts when it got the write lock, maybe
    long after it was sent (a writer paused inside its transaction), and a
    lease counted from ``sent_at`` would look run out at once.
    """
    return max(sent_at, _sqlite_began.get())


class statement_deadline:  # noqa: N801 (used like a function: ``with statement_deadline(...)``)
    """Watch the lock statements sent through a pooler until ``deadline``.

    Used around a strategy's ``acquire`` on ``alias``; a deadline of ``None``
    (wait forever) watches nothing.
    """

    __slots__ = ("end", "alias", "token")

    def __init__(self, deadline: Deadline, alias: str) -> None:
        self.end = None if deadline.timeout is None else watch_end(deadline, time.monotonic())
        self.alias = alias
        self.token: Any = None

    def __enter__(self) -> None:
        # (the connection a statement runs on is guarded where it is picked:
        # lock_connection, a transactional strategy's caller's connection)
        if self.end is not None:
            self.token = _deadline.set(self.end)

    def __exit__(self, *exc: object) -> None:
        if self.token is not None:
            _deadline.reset(self.token)


def watch_end(deadline: Deadline, now: float) -> float:
    """When the statements of an acquire with ``deadline`` that starts at ``now`` are
    given up: at the deadline, and never sooner than :data:`STATEMENT_FLOOR` after
    the start, so that a try-once still has time for one round trip through a pooler.

    Every statement of the acquire shares that one end: one sent just before it is
    given up at it (not a floor later).
    """
    return max(deadline.end, now + STATEMENT_FLOOR)


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
        and _pooler_seen.get(_pooler_key(connection)) is not False
    ):
        connection.execute_wrappers.insert(0, _watch_statement)  # pop() of others keeps it
        init = connection.init_connection_state

        def init_connection_state() -> None:
            if _deadline.get() is None or _pooler_seen.get(_pooler_key(connection)) is False:
                init()
            else:
                _watched(connection, init)

        connection.init_connection_state = init_connection_state  # type: ignore[method-assign]


class _Watch:
    """One statement's watch. ``done`` and ``fired`` change under the
    watchdog's mutex (one per process: a watch is held for microseconds)."""

    __slots__ = ("raw", "at", "cancel", "done", "fired", "finished")

    def __init__(self, raw: Any, at: float, cancel: bool) -> None:
        self.raw = raw
        self.at = at
        #: send a cancel request first (through a pooler, whose server answers)
        self.cancel = cancel
        self.done = False
        self.fired = False
        #: set once a fired watch has shut the socket (made when it fires: most never do)
        self.finished: threading.Event | None = None


class _Watchdog:
    """One daemon thread that fires the watches whose time has come."""

    def __init__(self) -> None:
        self.mutex = threading.Lock()
        self.cond = threading.Condition(self.mutex)
        self.heap: list[tuple[float, int, _Watch]] = []
        self.seq = itertools.count()
        self.thread: threading.Thread | None = None

    def add(self, watch: _Watch) -> None:
        with self.mutex:  # (the condition's lock)
            # none yet (or forked: see _forked), or ended (the interpreter shuts down)
            if self.thread is None or not self.thread.is_alive():
                self.thread = threading.Thread(
                    target=self._run, name="django-dlock-statement-watch", daemon=True
                )
                self.thread.start()
            heapq.heappush(self.heap, (watch.at, next(self.seq), watch))
            if self.heap[0][2] is watch:
                self.cond.notify()

    def finish(self, watch: _Watch) -> bool:
        """The statement of ``watch`` has returned: whether the watch fired first."""
        with self.mutex:
            watch.done = True
            if not watch.fired:
                watch.raw = None  # (the watch may stay queued until its time: hold nothing)
            return watch.fired

    def _forked(self) -> None:
        """In a forked child: the parent's thread and watches are not the child's."""
        self.mutex = threading.Lock()
        self.cond = threading.Condition(self.mutex)
        self.heap = []
        self.thread = None

    def _run(self) -> None:
        # Every statement of the process that has a deadline counts on this
        # thread: an error in it is logged, and it carries on.
        while True:
            try:
                self._serve()
            except Exception:
                logger.exception("django-dlock: the statement watchdog failed; it carries on")
                time.sleep(STATEMENT_FLOOR)  # (never a busy loop)

    def _serve(self) -> None:
        while True:
            with self.cond:
                while not self.heap or self.heap[0][0] > time.monotonic():
                    if self.heap:
                        self.heap = [entry for entry in self.heap if not entry[2].done]
                        heapq.heapify(self.heap)
                    # (in steps: a watch can be due in years, past what a wait can count)
                    left = self.heap[0][0] - time.monotonic() if self.heap else LONGEST_WAIT
                    self.cond.wait(min(left, LONGEST_WAIT))
                _, _, watch = heapq.heappop(self.heap)
                if watch.done:
                    continue
                watch.fired = True
                watch.finished = threading.Event()
            _fire(watch)


_watchdog = _Watchdog()
os.register_at_fork(after_in_child=_watchdog._forked)


def _fire(watch: _Watch) -> None:
    finished = watch.finished
    assert finished is not None  # (made when it was marked fired)
    try:
        # Stops the statement if it runs on a server (PgBouncer forwards the
        # cancel); a client still in PgBouncer's queue is not cancelled...
        # (Not on a direct connection: its server stopped answering, and a
        # cancel request would wait for it, holding the GIL.)
        if watch.cancel:
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
        finished.set()


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


def _watched(
    connection: BaseDatabaseWrapper,
    run: Callable[[], T],
    grace: float = 0.0,
    cancel: bool = True,
) -> T:
    """``run()`` (one statement on ``connection``), given up at the current deadline
    plus ``grace`` (see :func:`watched_raw`); a connection given up is closed."""
    try:
        return watched_raw(connection.connection, run, grace, cancel)
    except Abandoned:
        connection.close()
        raise


def watched_raw(raw: Any, run: Callable[[], T], grace: float = 0.0, cancel: bool = True) -> T:
    """``run()``, one statement on the driver connection ``raw``, given up at the
    current deadline (one sent after it: :data:`STATEMENT_FLOOR` after it was
    sent) plus ``grace``: its socket is shut
    down (after a cancel request, with ``cancel``), the statement fails and
    :class:`Abandoned` is raised. The caller closes the connection then."""
    end = _deadline.get()
    if end is None or raw is None:
        return run()
    watch = _Watch(raw, given_up_at(end) + grace, cancel)
    _watchdog.add(watch)
    error: BaseException | None = None
    try:
        result = run()
    except BaseException as exc:
        error = exc
    if _watchdog.finish(watch):
        assert watch.finished is not None  # (made before fired was set)
        watch.finished.wait()
        raise Abandoned(
            "a lock statement got no answer by the lock's deadline (a connection "
            "pooler with no free server connection, or a server that stopped "
            "answering); its connection was closed"
        ) from error
    if error is not None:
        raise error
    return result


def given_up_at(end: float) -> float:
    """When a statement sent now, in an acquire whose statements end at ``end``,
    is given up: at ``end`` if sent before it; one sent after it (giving back a
    place or a ticket once the acquire has failed) still gets one round trip."""
    now = time.monotonic()
    return end if now < end else now + STATEMENT_FLOOR


def deadline_end() -> float | None:
    """The ``time.monotonic()`` at which the statements of the current acquire are
    given up, or ``None`` when none is watched."""
    return _deadline.get()


_pooler_mutex = threading.Lock()
_pooler_seen: dict[tuple[Any, ...], bool] = {}


def behind_pooler(connection: BaseDatabaseWrapper) -> bool:
    """Whether a PostgreSQL connection goes through a pooler such as PgBouncer.

    A pooler answers the client's connection with a cancel key of its own
    (it must route cancel requests), so the process id in it differs from
    the server's ``pg_backend_pid()``; a direct connection reports the same
    pid. Found out once per process and database (one query), then cached.
    """
    found: bool | None = connection.__dict__.get("_dlock_behind_pooler")
    if found is not None:  # (kept on the wrapper: asked for every lock statement)
        return found
    if connection.vendor != "postgresql":
        return False
    key = _pooler_key(connection)
    found = _pooler_seen.get(key)
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
            _pooler_seen[key] = found
        if not found:  # a direct connection: its statements need no watch
            with contextlib.suppress(ValueError):
                connection.execute_wrappers.remove(_watch_statement)
    connection.__dict__["_dlock_behind_pooler"] = found
    return found


def _pooler_key(connection: BaseDatabaseWrapper) -> tuple[Any, ...]:
    # (asked for every lock statement: kept on the wrapper, whose settings are its own)
    key: tuple[Any, ...] | None = connection.__dict__.get("_dlock_pooler_key")
    if key is None:
        get = connection.settings_dict.get
        key = connection.__dict__["_dlock_pooler_key"] = (
            get("HOST"),
            get("PORT"),
            get("NAME"),
            get("USER"),
        )
    return key


_private = threading.local()

#: a statement's parameters: positional (``%s``) or named (``%(name)s``)
Params = list[Any] | dict[str, Any]


def thread_connection(alias: str) -> BaseDatabaseWrapper:
    """``connections[alias]``: Django's connection of the calling thread.

    Outside an event loop, Django keeps a thread's connections in a plain
    ``threading.local`` inside asgiref's ``Local``. Read there directly, a
    connection the thread already has costs one attribute look-up instead
    of asgiref's, which raises and catches a ``RuntimeError`` (from
    ``asyncio.get_running_loop()``) at every call: about a microsecond,
    twice per acquire and release. Everything else (an event loop running
    in the thread, a connection not made yet, an asgiref that keeps them
    otherwise) goes through ``connections``.
    """
    storage = getattr(getattr(connections, "_connections", None), "_storage", None)
    if type(storage) is threading.local and asyncio._get_running_loop() is None:
        found: BaseDatabaseWrapper | None = getattr(storage, alias, None)
        if found is not None:
            return found
    return connections[alias]


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
    connection = thread_connection(alias)
    if (
        _deadline.get() is not None  # (a worker thread's connection of an async acquire)
        and connection.__dict__.get("_dlock_behind_pooler") is not False  # (direct: no watch)
    ):
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


def committed_view(alias: str) -> BaseDatabaseWrapper:
    """This thread's private connection to ``alias``, in autocommit: it reads
    what is committed, never the caller's open transaction."""
    return _thread_private(alias)


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


def _failed(connection: BaseDatabaseWrapper, exc: Error) -> NoReturn:
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
    if lock_wait_ended(exc):
        raise LockWaitEnded(
            f"a lock statement on database {connection.alias!r} waited for a row "
            "that another session holds until its bound (innodb_lock_wait_timeout)"
        ) from exc
    raise exc


#: what each database says of a table or sequence that is not there, and
#: (PostgreSQL) of a column or function that a later migration adds
_MISSING = re.compile(
    r"(relation \"django_dlock_\w+\" does not exist"  # PostgreSQL (42P01)
    r"|column (l\.)?\"?queued\"? (of relation \"django_dlock_lock\" )?does not exist"  # 0007
    r"|function django_dlock_\w+\(.*\) does not exist"  # 0004, 0007
    r"|no such table: django_dlock_"  # SQLite
    r"|table '[^']*django_dlock_\w+' doesn't exist)",  # MySQL/MariaDB (1146)
    re.IGNORECASE,
)


def tables_missing(exc: BaseException) -> bool:
    """Whether ``exc`` says that a django-dlock table (or sequence) does not
    exist, or (PostgreSQL) a column or function of a later migration."""
    return _MISSING.search(str(exc)) is not None


def not_migrated(alias: str) -> NotMigrated:
    """The error for django-dlock's tables missing on ``alias``."""
    from django.apps import apps

    if not apps.is_installed("django_dlock"):  # "migrate django_dlock" would fail
        from django_dlock.conf import NOT_INSTALLED

        return NotMigrated(NOT_INSTALLED)
    option = "" if alias == "default" else f" --database {alias}"
    return NotMigrated(
        f"django-dlock's tables are missing or behind this version on database {alias!r}: run "
        f"`python manage.py migrate django_dlock{option}`"
    )


@contextmanager
def cursor(connection: BaseDatabaseWrapper) -> Iterator[CursorWrapper]:
    """A cursor for lock statements: a database that cannot be reached raises
    :class:`DatabaseUnavailable`, and a broken connection is closed so the
    next call reconnects. On MySQL/MariaDB, while an acquire's deadline is
    watched, a statement waits for another session's row lock no longer
    than the deadline (:class:`LockWaitEnded` then)."""
    if (
        connection.vendor == "mysql"
        and _deadline.get() is not None
        and _bound_lock_wait not in connection.execute_wrappers
    ):
        _mariadb(connection)  # (asked first: Django asks the server, with a statement)
        connection.execute_wrappers.insert(0, _bound_lock_wait)  # pop() of others keeps it
    try:
        with connection.cursor() as cur:
            yield cur
    except Error as exc:  # (an InterfaceError, a closed connection, is no DatabaseError)
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
    except Error as exc:  # (an InterfaceError, a closed connection, is no DatabaseError)
        _failed(connection, exc)


def _usable(connection: BaseDatabaseWrapper) -> bool:
    try:
        return connection.connection is not None and bool(connection.is_usable())
    except Exception:
        return False


def with_reconnect(
    alias: str,
    op: Callable[[BaseDatabaseWrapper], T],
    connection: BaseDatabaseWrapper | None = None,
) -> tuple[T, bool]:
    """Run ``op(connection)``; if the connection had dropped, once more on a new one.

    A holder's connection can be closed under it (``pg_terminate_backend``,
    a database restart, a network cut). :func:`cursor` closes such a broken
    connection, so a second try reconnects. Errors on a working connection
    (lock timeouts, constraint errors) and errors inside the caller's
    transaction are not retried. Returns ``(result, retried)``: a retried
    statement may have run twice, which callers must tolerate.
    ``connection``: :func:`lock_connection` of ``alias``, when the caller
    already has it.

    Raises:
        DatabaseUnavailable: the database could not be reached, also on a
            new connection (the driver's error is its ``__cause__``).
    """
    if connection is None:
        connection = lock_connection(alias)
    try:
        return op(connection), False
    except DatabaseUnavailable:
        if connection.in_atomic_block or connection.connection is not None:
            raise
    return op(lock_connection(alias)), True


try:
    import psycopg
    from psycopg import pq
    from psycopg.adapt import PyFormat, Transformer
except ImportError:  # Django runs PostgreSQL on psycopg2 (or there is none)
    _PSYCOPG3 = False
else:
    _PSYCOPG3 = True
    _AUTO = PyFormat.AUTO
    _TUPLES_OK = pq.ExecStatus.TUPLES_OK
    _COMMAND_OK = pq.ExecStatus.COMMAND_OK
    _IDLE = pq.TransactionStatus.IDLE
    _ACTIVE = pq.TransactionStatus.ACTIVE
    _SQLSTATE = pq.DiagnosticField.SQLSTATE


def psycopg3() -> bool:
    """Whether psycopg 3 can be imported (Django then uses it for PostgreSQL).

    Without it Django runs PostgreSQL on psycopg2: the ``lease``, ``row`` and
    ``advisory_xact`` statements run through Django's cursor, waiters poll
    instead of being woken by ``NOTIFY``, and ``advisory`` (sessions of its
    own, opened with psycopg 3) is refused.
    """
    return _PSYCOPG3


def execute(
    connection: BaseDatabaseWrapper, sql: str, params: Params, takes_lock: bool = False
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
    if may_prepare(connection):
        end = _deadline.get()
        if end is None:
            return _execute_prepared(connection, sql, params)
        # an acquire with a timeout: a server that stopped answering must not
        # keep the caller past it
        try:
            return _execute_prepared(connection, sql, params, given_up_at(end) + DIRECT_GRACE)
        except Abandoned:
            connection.close()
            raise
    if connection.vendor == "sqlite" and not connection.in_atomic_block:
        if takes_lock:
            return _sqlite_take(connection, sql, params)
        if deadline_end() is not None:
            return _sqlite_within_deadline(connection, sql, params)
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


#: how many times a short transaction of the library's own runs when
#: the database picks it as a deadlock's victim
DEADLOCK_RETRIES = 5


def deadlocked(exc: BaseException) -> bool:
    """Whether ``exc`` says that the database rolled back the statement's
    transaction to break a deadlock (MySQL/MariaDB error 1213, PostgreSQL's
    ``deadlock_detected``). Both treat a deadlock between short transactions
    as a normal event: the victim did nothing, and is expected to run again."""
    cause = exc.__cause__ if exc.__cause__ is not None else exc
    args: tuple[Any, ...] = getattr(cause, "args", ())
    if args and args[0] == _MYSQL_DEADLOCK:
        return True
    # (PyMySQL's errors have a ``sqlstate`` too: 40001 for a deadlock)
    state = getattr(cause, "sqlstate", None) or getattr(cause, "pgcode", None)
    return state == _PG_DEADLOCK


def lock_wait_ended(exc: BaseException) -> bool:
    """Whether ``exc`` says that a MySQL/MariaDB statement waited for another
    session's lock and ended without it: a row lock until its bound (the
    lock's deadline, see :func:`cursor`; error 1205, the statement rolled
    back, its transaction still open), or a table's AUTO-INC lock, a wait
    that InnoDB ends, at that bound or in a deadlock, with error 1467
    ("Failed to read auto-increment value from storage engine"). Either way
    the statement wrote nothing."""
    cause = exc.__cause__ if exc.__cause__ is not None else exc
    args: tuple[Any, ...] = getattr(cause, "args", ())
    return bool(args) and args[0] in (_MYSQL_LOCK_WAIT, _MYSQL_AUTOINC_FAILED)


class LockWaitEnded(Abandoned):
    """MySQL/MariaDB: a lock statement waited for a lock that another session
    holds and ended without it (see :func:`lock_wait_ended`). Lock
    acquisitions turn it into their usual timeout; the connection stays open."""


#: MySQL/MariaDB's ER_LOCK_DEADLOCK
_MYSQL_DEADLOCK = 1213
#: PostgreSQL's deadlock_detected
_PG_DEADLOCK = "40P01"
#: MySQL/MariaDB's ER_LOCK_WAIT_TIMEOUT
_MYSQL_LOCK_WAIT = 1205
#: MySQL/MariaDB's ER_AUTOINC_READ_FAILED
_MYSQL_AUTOINC_FAILED = 1467

#: the statements whose lock waits are bounded by the lock's deadline (not
#: START TRANSACTION, COMMIT, ROLLBACK, SET)
_WAITS_FOR_ROWS = re.compile(r"\s*(SELECT|INSERT|UPDATE|DELETE|REPLACE|WITH)\b", re.IGNORECASE)
_MYSQL_SET_WAIT = (
    "SET @django_dlock_lock_wait = @@SESSION.innodb_lock_wait_timeout, "
    "SESSION innodb_lock_wait_timeout = %d"
)
_MYSQL_RESET_WAIT = "SET SESSION innodb_lock_wait_timeout = @django_dlock_lock_wait"


def _mariadb(connection: BaseDatabaseWrapper) -> bool:
    """Whether a MySQL connection's server is MariaDB (Django asks it once)."""
    return bool(connection.mysql_is_mariadb)  # type: ignore[attr-defined]


def _bound_lock_wait(
    execute: Callable[..., Any], sql: str, params: Any, many: bool, context: dict[str, Any]
) -> Any:
    """MySQL/MariaDB, while an acquire's deadline is watched: a statement waits
    for another session's row lock (``innodb_lock_wait_timeout``, whole
    seconds) until the deadline, at least a second, instead of the server's
    bound (50 s by default). MariaDB sets it for the statement alone
    (``SET STATEMENT … FOR``); MySQL sets the session's value around it."""
    end = _deadline.get()
    if end is None or not _WAITS_FOR_ROWS.match(sql):
        return execute(sql, params, many, context)
    seconds = max(1, math.ceil(end - time.monotonic()))
    if _mariadb(context["connection"]):
        bounded = f"SET STATEMENT innodb_lock_wait_timeout = {seconds} FOR {sql}"
        return execute(bounded, params, many, context)
    # (a cursor of its own: the statement's rows stay on the caller's, fetched in full)
    with context["connection"].connection.cursor() as setting:
        setting.execute(_MYSQL_SET_WAIT % seconds)
        try:
            return execute(sql, params, many, context)
        finally:
            with contextlib.suppress(Exception):  # (a connection lost meanwhile has no session)
                setting.execute(_MYSQL_RESET_WAIT)


def again_if_deadlocked(connection: BaseDatabaseWrapper, run: Callable[[], T]) -> T:
    """``run()``, a statement that is a transaction of its own on ``connection``,
    run again when the database rolls it back to break a deadlock: it wrote
    nothing. For a statement that locks several rows, in an order another
    statement may not share (a cleanup batch deletes rows in the order they
    lie in the table; a ticket flags a semaphore's permit rows in slot order).
    Inside the caller's transaction a deadlock rolls back more than the
    statement: it is raised as it is."""
    for _attempt in range(DEADLOCK_RETRIES - 1):
        try:
            return run()
        except OperationalError as exc:
            if connection.in_atomic_block or not deadlocked(exc):
                raise
    return run()


def may_prepare(connection: BaseDatabaseWrapper) -> bool:
    """Whether statements may be prepared on ``connection``'s server session
    (see :func:`execute`): PostgreSQL on psycopg 3 (else Django runs it on
    psycopg2, through its cursor), queries not logged, and a direct
    connection (no ``DISABLE_SERVER_SIDE_CURSORS``, no pooler in front)."""
    return (
        connection.vendor == "postgresql"
        and _PSYCOPG3
        # (queries_logged, inline: asked for every lock statement)
        and not (connection.force_debug_cursor or settings.DEBUG)
        and not connection.settings_dict.get("DISABLE_SERVER_SIDE_CURSORS")
        and (
            connection.__dict__.get("_dlock_behind_pooler") is False
            or not _behind_pooler(connection)
        )
    )


def _behind_pooler(connection: BaseDatabaseWrapper) -> bool:
    """:func:`behind_pooler`, whose first question may be the first statement of all."""
    try:
        return behind_pooler(connection)
    except Error as exc:  # (an InterfaceError, a closed connection, is no DatabaseError)
        _failed(connection, exc)


def _sqlite_within_deadline(
    connection: BaseDatabaseWrapper, sql: str, params: Params
) -> tuple[Any, int]:
    """A statement of an acquire on SQLite (not the one that takes the lock:
    :func:`_sqlite_take`): another writer is contention, not an outage.

    SQLite lets one connection write at a time; another one waits up to its
    busy timeout (the ``timeout`` option, 5 s by default) and then fails with
    "database is locked". While a lock is being acquired, the statement
    waits at most until the lock's deadline, and a database that stays
    locked past it gives the acquire up (:class:`Abandoned`, a timeout),
    never a made-up "no row" (a ticket's renewal that read it as "the ticket
    is gone" put the ticket back under its own number, an ``IntegrityError``).
    """
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
        raise Abandoned(
            "the SQLite database stayed locked by another writer until the lock's deadline"
        ) from exc
    finally:
        if connection.connection is raw:
            raw.execute(f"PRAGMA busy_timeout = {int(saved)}")


#: the longest pause between two tries of a SQLite statement that takes a lock
_SQLITE_PAUSE = 0.02


def _sqlite_take(connection: BaseDatabaseWrapper, sql: str, params: Params) -> tuple[Any, int]:
    """The statement that takes a lock on SQLite, outside the caller's transaction.

    Another writer is contention, not an outage: the statement is tried
    again (SQLite's busy timeout at 0, short pauses here) until the
    database's busy timeout, or within an acquire until its deadline (at
    least :data:`STATEMENT_FLOOR`: a try-once on a free key outlasts
    another writer's short commit); a database that stays locked means "not
    acquired this round" (no row) within an acquire's deadline, and the
    driver's error without one. The try that ran is noted (:func:`began`):
    the lease it wrote starts then, not when the first try was sent.
    """
    end = deadline_end()
    connection.ensure_connection()
    raw = connection.connection
    (saved,) = raw.execute("PRAGMA busy_timeout").fetchone()
    now = time.monotonic()
    wait = int(saved) / 1000
    if end is not None:
        wait = min(wait, max(end - now, STATEMENT_FLOOR))
    until = now + wait
    pause = 0.001
    raw.execute("PRAGMA busy_timeout = 0")
    try:
        while True:
            start = time.monotonic()
            try:
                with cursor(connection) as cur:
                    cur.execute(sql, params)
                    result = (cur.fetchone() if cur.description else None), cur.rowcount
            except OperationalError as exc:
                if "locked" not in str(exc) and "busy" not in str(exc):
                    raise
                left = until - time.monotonic()
                if left <= 0:
                    if end is None:
                        raise
                    return None, 0
                time.sleep(min(pause, left))
                pause = min(pause * 2, _SQLITE_PAUSE)
                continue
            _sqlite_began.set(start)
            return result
    finally:
        if connection.connection is raw:
            raw.execute(f"PRAGMA busy_timeout = {int(saved)}")


def _in_own_transaction(
    connection: BaseDatabaseWrapper, cur: CursorWrapper, sql: str, params: Params
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

#: a query's placeholders: ``%s``, ``%(name)s``, and ``%%`` (a literal ``%``)
_PLACEHOLDER = re.compile(r"%\((\w+)\)s|%s|%%")


@dataclass
class _Numbered:
    """A query in libpq's form: ``$1``, ``$2``... for its placeholders, and
    the parameter names in that order (``None``: positional ``%s``)."""

    sql: bytes
    names: list[str] | None


#: query text -> its libpq form (a lock statement's text is one of a few)
_NUMBERED: dict[str, _Numbered] = {}


def numbered(query: str) -> _Numbered:
    """``query`` in libpq's form (cached per query text)."""
    found = _NUMBERED.get(query)
    if found is None:
        names: list[str] = []
        positional = 0

        def number(match: re.Match[str]) -> str:
            nonlocal positional
            if match.group(0) == "%%":
                return "%"
            if match.group(1) is None:
                positional += 1
                return f"${positional}"
            if match.group(1) not in names:
                names.append(match.group(1))
            return f"${names.index(match.group(1)) + 1}"

        sql = _PLACEHOLDER.sub(number, query)
        if positional and names:
            raise ValueError("a query mixes %s and %(name)s placeholders")
        found = _NUMBERED[query] = _Numbered(sql.encode(), names if names else None)
    return found


class _Prepared:
    """The statements our lock statements have prepared on one server session.

    Kept on the psycopg connection itself, which is that session: Django's
    pool hands one connection from a thread's wrapper to another's, and
    its statements go with it. Names are ``dlock_<n>``, ``n`` counting up
    for as long as the connection lives and never given twice: a name once
    sent may exist on the server whatever came back (a PREPARE whose answer
    never came, a statement dropped while others stay), so a statement is
    never prepared again under a name the session may still have.
    """

    __slots__ = ("names", "numbers")

    def __init__(self) -> None:
        #: (query text, parameter types) -> the name it is prepared under
        self.names: dict[tuple[str, tuple[int, ...]], bytes] = {}
        self.numbers = itertools.count()

    def fresh_name(self) -> bytes:
        return b"dlock_%d" % next(self.numbers)


class _Session:
    """What our lock statements keep for one psycopg connection: an adapter
    for their parameters and rows, and the statements prepared on its server
    session (:class:`_Prepared`)."""

    __slots__ = ("raw", "adapt", "prepared", "names")

    def __init__(self, raw: Any) -> None:
        self.raw = raw
        self.adapt = Transformer(raw)
        # (only the statements live on the connection: this session's adapter refers
        # to the connection, and would make a reference cycle there)
        prepared: _Prepared | None = raw.__dict__.get("_dlock_prepared")
        if prepared is None:
            prepared = raw.__dict__["_dlock_prepared"] = _Prepared()
        self.prepared = prepared
        self.names = prepared.names  # (read for every statement: one look-up less)


#: SQLSTATEs of a prepared statement that is not there (invalid_sql_statement_name)
#: and of a name already taken (duplicate_prepared_statement)
_GONE = b"26000"
_TAKEN = b"42P05"
#: how many names a statement tries when each is found taken on the server
_NAME_TRIES = 3


def _execute_prepared(
    connection: BaseDatabaseWrapper, sql: str, params: Params, until: float | None = None
) -> tuple[Any, int]:
    """Run ``sql`` as a statement prepared on the server session, sent
    through libpq itself (psycopg's ``pgconn``): the parameters and the row
    are adapted by psycopg as its cursor would, without the cursor's own
    work, which costs as much client time as the statement's round trip.
    A connection in the caller's transaction (autocommit off: psycopg begins
    it, and keeps its own prepared statements in step with its rollbacks),
    or in pipeline mode, goes through a psycopg cursor instead.

    ``until``: a ``time.monotonic()`` at which a statement still unanswered
    is given up (:class:`Abandoned`; the connection is closed)."""
    try:
        if connection.connection is None:
            connection.ensure_connection()
        raw = connection.connection
        pgconn = raw.pgconn
        if not raw.autocommit or pgconn.pipeline_status:
            if until is None:
                return _execute_with_cursor(connection, raw, sql, params)
            return watched_raw(
                raw, lambda: _execute_with_cursor(connection, raw, sql, params), DIRECT_GRACE, False
            )
        # kept on Django's wrapper (one per thread), for the driver connection it has now
        session: _Session | None = connection.__dict__.get("_dlock_session")
        if session is None or session.raw is not raw:
            session = connection.__dict__["_dlock_session"] = _Session(raw)
        if isinstance(params, dict):
            values = [params[name] for name in numbered(sql).names or ()]
        else:
            values = params
        try:
            with raw.lock:
                adapt = session.adapt
                dumped = adapt.dump_sequence(values, [_AUTO] * len(values))
                types = tuple(adapt.types or ())
                key = (sql, types)
                name = session.names.get(key)
                if name is None:
                    name = _prepare(raw, session.prepared, key, until)
                if until is None:
                    result = pgconn.exec_prepared(name, dumped, adapt.formats)
                else:
                    pgconn.send_query_prepared(name, dumped, adapt.formats)
                    result = _answer(pgconn, until)
                if result.error_field(_SQLSTATE) == _GONE and pgconn.transaction_status == _IDLE:
                    # gone from the session (DEALLOCATE, DISCARD ALL): prepared again,
                    # under a new name (others may still be there)
                    session.names.pop(key, None)
                    name = _prepare(raw, session.prepared, key, until)
                    result = _run_prepared(pgconn, name, dumped, adapt.formats, until)
                status = result.status
                if status == _TUPLES_OK:
                    count = result.command_tuples
                    if not result.ntuples:
                        return None, 0 if count is None else count
                    adapt.set_pgresult(result)
                    row = adapt.load_row(0, tuple)
                    return row, result.ntuples if count is None else count
                if status == _COMMAND_OK:
                    return None, result.command_tuples or 0
                raise _error(raw, result)
        except psycopg.Error:
            # (Django's error classes, as its cursor raises them)
            with connection.wrap_database_errors:
                raise
        except BaseException:
            # Given up (Abandoned) or interrupted (a signal's exception) before
            # the answer was read: the connection cannot take another statement
            # while that one is in progress. It is closed, its server session
            # with it (a statement the server still completes dies there), and
            # the next statement reconnects.
            if pgconn.transaction_status == _ACTIVE:
                connection.close()
            raise
    except Error as exc:  # (an InterfaceError, a closed connection, is no DatabaseError)
        _failed(connection, exc)


def _prepare(
    raw: Any, prepared: _Prepared, key: tuple[str, tuple[int, ...]], until: float | None
) -> bytes:
    """Prepare the query of ``key`` on ``raw``'s session under a name never used
    there before (another one when the server already has that name); its name."""
    pgconn = raw.pgconn
    sql, types = key
    for _attempt in range(_NAME_TRIES):
        name = prepared.fresh_name()  # (taken before it is sent: never sent twice)
        if until is None:
            made = pgconn.prepare(name, numbered(sql).sql, types)
        else:
            pgconn.send_prepare(name, numbered(sql).sql, types)
            made = _answer(pgconn, until)
        if made.status == _COMMAND_OK:
            prepared.names[key] = name
            return name
        if made.error_field(_SQLSTATE) != _TAKEN or pgconn.transaction_status != _IDLE:
            break
    raise _error(raw, made)


def _run_prepared(pgconn: Any, name: bytes, dumped: Any, formats: Any, until: float | None) -> Any:
    """The result of the statement prepared as ``name``, run on ``pgconn``."""
    if until is None:
        return pgconn.exec_prepared(name, dumped, formats)
    pgconn.send_query_prepared(name, dumped, formats)
    return _answer(pgconn, until)


def _answer(pgconn: Any, until: float) -> Any:
    """The last result of the statement just sent on ``pgconn``, waited for in
    this thread until ``until`` at the latest (:class:`Abandoned` then)."""
    fileno = pgconn.socket
    while pgconn.flush():  # (a statement of ours fits in the socket's buffer)
        _ready(fileno, select.POLLOUT, until)
    result = None
    while True:
        while pgconn.is_busy():
            _ready(fileno, select.POLLIN, until)
            pgconn.consume_input()
        found = pgconn.get_result()
        if found is None:
            return result
        result = found


def _ready(fileno: int, events: int, until: float) -> None:
    """Wait until ``fileno`` is ready for ``events``, or raise :class:`Abandoned` at ``until``."""
    poll = select.poll()
    poll.register(fileno, events)
    while not poll.poll(min(max(0.0, until - time.monotonic()), LONGEST_WAIT) * 1000):
        if time.monotonic() >= until:
            raise Abandoned(
                "a lock statement got no answer by the lock's deadline (a server "
                "that stopped answering); its connection was closed"
            )


def _error(raw: Any, result: Any) -> Exception:
    """The error of a failed result: an ``OperationalError`` when the
    connection broke (as psycopg's cursor raises it), else the server's."""
    if raw.pgconn.status != pq.ConnStatus.OK:
        message = (result.error_message or b"the connection broke").decode(errors="replace")
        return psycopg.OperationalError(message.strip())
    return psycopg.errors.error_from_result(result, encoding=raw.info.encoding)


def _execute_with_cursor(
    connection: BaseDatabaseWrapper, raw: Any, sql: str, params: Params
) -> tuple[Any, int]:
    """:func:`_execute_prepared` through a psycopg cursor (in the caller's
    transaction, which it begins with the connection's options if due)."""
    # Django turns psycopg's automatic preparation off (threshold None),
    # which also disables prepare=True. Lift it for our statement only:
    # the connection's other queries stay unprepared.
    saved = raw.prepare_threshold
    if saved is None:
        raw.prepare_threshold = _NEVER_AUTOMATICALLY
    cur = connection.__dict__.get("_dlock_cursor")
    if cur is None or cur.connection is not raw:
        cur = connection.__dict__["_dlock_cursor"] = psycopg.Cursor(raw)
    try:
        with connection.wrap_database_errors:
            cur.execute(sql, params, prepare=True)
            # (nfields, not .description: that builds column objects)
            result = cur.pgresult
            returns_rows = result is not None and result.nfields > 0
            return (cur.fetchone() if returns_rows else None), cur.rowcount
    finally:
        if saved is None:
            raw.prepare_threshold = None


def fetch_one(
    connection: BaseDatabaseWrapper, sql: str, params: Params, takes_lock: bool = False
) -> Any:
    """The first row of ``sql`` (or ``None``), see :func:`execute`."""
    return execute(connection, sql, params, takes_lock)[0]
