"""A client-side deadline for lock statements sent through a pooler.

PgBouncer in transaction mode queues a statement until one of its server
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
watched on direct connections too, with :data:`DIRECT_GRACE` more time: a
statement still unanswered then is given up the same way.

Whether a connection goes through a pooler at all is found out here too
(:func:`behind_pooler`): that question is itself a watched statement, and
a direct connection takes the watch off.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, TypeVar

from django.db import connections
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.backends.signals import connection_created

from django_dlock.exceptions import LockTimeout
from django_dlock.retry import Deadline

__all__ = [
    "DIRECT_GRACE",
    "STATEMENT_FLOOR",
    "Abandoned",
    "behind_pooler",
    "deadline_end",
    "guard_statements",
    "statement_deadline",
    "unwatched",
    "watch_end",
    "watched_direct",
    "watched_raw",
]

T = TypeVar("T")


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

_deadline: ContextVar[float | None] = ContextVar("django_dlock_statement_deadline", default=None)


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
        if self.end is not None:
            guard_statements(connections[self.alias])
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
    #: send a cancel request first (through a pooler, whose server answers)
    cancel: bool = True
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
    now = time.monotonic()
    # a statement sent before the deadline is given up at it; one sent after it
    # (giving back a place or a ticket once the acquire has failed) still gets
    # one round trip
    watch = _Watch(raw, (end if now < end else now + STATEMENT_FLOOR) + grace, cancel=cancel)
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
        raise Abandoned(
            "a lock statement got no answer by the lock's deadline (a connection "
            "pooler with no free server connection, or a server that stopped "
            "answering); its connection was closed"
        ) from error
    if error is not None:
        raise error
    return result


def watched_direct(connection: BaseDatabaseWrapper, run: Callable[[], T]) -> T:
    """``run()``, one lock statement on a direct connection, given up if its server
    has not answered :data:`DIRECT_GRACE` after the current deadline."""
    return _watched(connection, run, DIRECT_GRACE, cancel=False)


def deadline_end() -> float | None:
    """The ``time.monotonic()`` at which the statements of the current acquire are
    given up, or ``None`` when none is watched."""
    return _deadline.get()


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
