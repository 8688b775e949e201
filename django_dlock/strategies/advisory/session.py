"""Dedicated PostgreSQL sessions for session-level advisory locks: one session.

A session-level advisory lock belongs to a database *session*, not to a
thread or a transaction. Two holders (threads, or asyncio tasks in one
thread) that shared a session would share its locks, and a session handed
to the next borrower by a connection pool would hand over its locks too.
So the ``advisory`` strategy never uses Django's connections:

* Each **holder** (thread or task, identified by its token) that holds at
  least one advisory lock on an alias owns one dedicated psycopg connection
  of this process, in autocommit mode, opened with the alias's connection
  parameters (``connections[alias].get_connection_params()``). All its
  advisory locks on that alias live in that session; no one else uses it.
* When the holder holds nothing more on the alias, the connection goes back
  to a small in-process **pool** of idle sessions (at most :data:`MAX_IDLE`
  per alias, closed after :data:`IDLE_TIMEOUT` seconds idle), so the next
  acquisition costs no connect. A session is only ever pooled when it holds
  no lock; one that is in doubt is closed instead (closing a session frees
  its locks).
* A session is checked **before it takes any lock**: if the cancel key of
  the connection does not carry the server's ``pg_backend_pid()``, a pooler
  (PgBouncer) sits in between. The first such session of a pool then asks
  whether the pooler keeps a server session per client (session mode: fine)
  or lends it between transactions (transaction mode): while a second
  connection holds a transaction open, the session asks for its backend pid
  again; in transaction mode the answer changes (or waits for the other
  transaction). Transaction mode is refused with :class:`SessionSwitched`
  before any lock is taken, and every later session of the pool is refused
  without connecting: a session lock taken there would stay with a server
  session that the pooler lends to others.
* Every hot statement also returns ``pg_backend_pid()``: if it ever differs
  from the pid the session started with, the server session was switched
  under the connection, and :class:`SessionSwitched` is raised.
* A **watcher** thread (running only while sessions hold locks, plus a few
  seconds) polls the sockets of idle holding sessions. A socket that becomes
  readable while no statement runs means the server ended the session
  (``pg_terminate_backend``, a restart, a network cut): the session is
  closed and every lock it held is reported lost at once, through the
  callback the holder's lock registered (``Holder.report_lost``: the
  ``lock_lost`` signal and the ``on_lost`` callback of a ``Lock``).
* A holder that disappears (its thread ends, its task is garbage collected)
  while still holding locks has its session closed, which frees the locks.
* After ``fork`` a child starts with empty pools; inherited connections are
  never used nor closed in the child (closing would end the parent's
  session).

Async holders wait in a thread of a small dedicated executor
(:func:`executor`), so a blocking ``pg_advisory_lock`` never blocks the event
loop nor Django's shared sync thread. A cancelled task cancels its
server-side wait (:meth:`Session.cancel_wait`).

Call :func:`close_all` to close every idle session of this process (at
shutdown, and in test suites before the test database is dropped).
"""

from __future__ import annotations

import contextlib
import logging
import select
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import psycopg

from django_dlock.exceptions import DatabaseUnavailable, DLockError, SessionBusy
from django_dlock.strategies.connection import DIRECT_GRACE, Abandoned, deadline_end, watched_raw

if TYPE_CHECKING:
    from django_dlock.identity import Holder
    from django_dlock.strategies.advisory.pool import Pool

logger = logging.getLogger("django_dlock")

T = TypeVar("T")

_CONNECTION_OK = 0  # psycopg.pq.ConnStatus.OK
_COMMAND_OK, _TUPLES_OK = 1, 2  # psycopg.pq.ExecStatus


@dataclass(frozen=True, eq=False)
class Statement:
    """A short statement run with :meth:`Session.run`: ``$n`` placeholders, typed.

    Statements are module constants, found by identity in a session's table
    of prepared statements (no hashing of the SQL text per call).
    """

    sql: str
    #: type oid of each parameter (20 = bigint, 23 = integer, 25 = text)
    types: tuple[int, ...]


def _readable(fds: list[int], timeout: float) -> list[int]:
    """The file descriptors among ``fds`` with something to read."""
    if hasattr(select, "poll"):
        poller = select.poll()
        for fd in fds:
            poller.register(fd, select.POLLIN | select.POLLERR | select.POLLHUP)
        return [fd for fd, _ in poller.poll(timeout * 1000)]
    readable, _, _ = select.select(fds, [], [], timeout)
    return list(readable)


class SessionLost(DatabaseUnavailable):
    """The database session ended (the connection dropped or was terminated).

    Raised by an acquisition whose session ended under it: the session
    holds nothing any more, so the lock is not held.
    """


class SessionSwitched(DLockError):
    """The server session changed between two statements (transaction pooling)."""


class WaitCancelled(Exception):
    """The async task that wanted to wait was cancelled before the wait began."""


class Cancellable(Protocol):
    cancelled: bool


class Session:
    """One dedicated connection, owned by at most one holder at a time."""

    def __init__(self, pool: Pool, conn: psycopg.Connection[Any], backend_pid: int) -> None:
        self.pool = pool
        self.conn = conn
        self.backend_pid = backend_pid
        self.backend_pid_text = str(backend_pid).encode()
        #: statement -> name of its prepared statement on this session
        self.prepared: dict[Statement, bytes] = {}
        #: serialises every use of ``conn`` (holder, renewer, watcher, sync thread)
        self.mutex = threading.Lock()
        #: key name -> shared? for every lock this session holds
        self.held: dict[str, bool] = {}
        self.token: str | None = None
        self.holder_ref: weakref.ReferenceType[Holder] | None = None
        self.family = "advisory"
        #: why the session ended (``None`` while it lives)
        self.lost: str | None = None
        self.idle_since = time.monotonic()
        #: acquisitions in progress on this session (it is not pooled meanwhile)
        self.pins = 0
        self._wait_mutex = threading.Lock()
        self._waiting = False
        #: the key whose two-phase place waits on this session, and the thread
        #: that waits for it (every other thread gets SessionBusy)
        self.place: tuple[str, int] | None = None

    @property
    def alias(self) -> str:
        return self.pool.alias

    # -- statements -------------------------------------------------------

    def run(
        self, stmt: Statement, params: Sequence[bytes], *, check_pid: bool = True
    ) -> tuple[bytes | None, ...]:
        """Run one short prepared statement; return its first row (text values).

        In an acquire with a timeout, a server that has not answered
        :data:`~django_dlock.strategies.connection.DIRECT_GRACE` after the
        deadline is taken for frozen: the session is ended (which frees
        whatever it held, reported lost) and
        :class:`~django_dlock.strategies.connection.Abandoned` is raised.

        The statement goes straight to libpq (``PQexecPrepared``, which
        releases the GIL): a few microseconds instead of a cursor's tens.
        It is prepared on this session the first time. With ``check_pid`` its
        last column must be ``pg_backend_pid()`` and equal this session's pid.

        Raises:
            SessionLost: the connection is gone (the session has ended); the
                locks it held are reported lost.
            SessionSwitched: a pooler switched the server session.
            SessionBusy: a two-phase place waits on the session.
            psycopg.Error: the statement failed (the session lives on).
        """
        if deadline_end() is None:
            return self._run(stmt, params, check_pid)
        return self._watched(lambda: self._run(stmt, params, check_pid))

    def _watched(self, run: Callable[[], T]) -> T:
        """``run()``, given up (the session ended) if the server stopped answering."""
        try:
            return watched_raw(self.conn, run, DIRECT_GRACE, cancel=False)
        except Abandoned:
            self.fail(
                "the database server stopped answering: a lock statement was given up "
                "at the lock's deadline"
            )
            raise

    def _run(
        self, stmt: Statement, params: Sequence[bytes], check_pid: bool
    ) -> tuple[bytes | None, ...]:
        self._refuse_while_placed()
        with self.mutex:
            if self.lost is not None:
                raise SessionLost(self.lost)
            pgconn = self.conn.pgconn
            name = self.prepared.get(stmt)
            if name is None:
                name = b"django_dlock_%d" % len(self.prepared)
                result = pgconn.prepare(name, stmt.sql.encode(), stmt.types)
                if result.status != _COMMAND_OK:
                    error = self._error(result)
                else:
                    self.prepared[stmt] = name
                    error = None
            else:
                error = None
            if error is None:
                result = pgconn.exec_prepared(name, params)
                if result.status == _TUPLES_OK:
                    value = result.get_value
                    row = tuple([value(0, i) for i in range(result.nfields)])
                else:
                    error = self._error(result)
        if error is not None:
            if self.lost is not None:
                self.report_lost()
                raise SessionLost(self.lost) from error
            if isinstance(error, psycopg.errors.InvalidSqlStatementName):
                row = (None, b"-1")  # a pooler gave us a session without our statements
            else:
                raise error
        if check_pid and row[-1] != self.backend_pid_text:
            self._switched(row[-1])
        return row

    def _error(self, result: Any) -> psycopg.Error:
        """The error of a failed result; ends the session if the connection broke."""
        error = psycopg.errors.error_from_result(result, encoding=self.conn.info.encoding)
        if self.conn.pgconn.status != _CONNECTION_OK:
            self._end(f"the database session ended: {error}".strip())
        return error

    def _switched(self, pid: bytes | None) -> None:
        reason = (
            f"the server session changed under the connection (backend pid "
            f"{self.backend_pid}, then {(pid or b'?').decode()}): it goes through a "
            "pooler in transaction mode (such as PgBouncer), which cannot carry "
            "session advisory locks"
        )
        self.fail(reason)
        raise SessionSwitched(
            reason + ". Give the advisory strategy a database alias that connects "
            "directly (or through a session-mode pool), or use the advisory_xact or "
            "lease strategy."
        )

    def wait(
        self, sql: str, params: list[Any], waiter: Cancellable | None = None
    ) -> tuple[Any, ...]:
        """Run a statement that may wait (through psycopg: interruptible).

        Its last column must be ``pg_backend_pid()``. :meth:`cancel_wait`
        interrupts it from another thread.

        Raises:
            WaitCancelled: ``waiter`` was cancelled before the wait began.
            SessionLost, SessionSwitched, SessionBusy, psycopg.Error, Abandoned: as
                :meth:`run`.
        """
        if deadline_end() is None:
            return self._wait(sql, params, waiter)
        return self._watched(lambda: self._wait(sql, params, waiter))

    def _wait(self, sql: str, params: list[Any], waiter: Cancellable | None) -> tuple[Any, ...]:
        self._refuse_while_placed()
        with self._wait_mutex:
            if waiter is not None and waiter.cancelled:
                raise WaitCancelled()
            self._waiting = True
        try:
            failure: BaseException | None = None
            with self.mutex:
                if self.lost is not None:
                    raise SessionLost(self.lost)
                try:
                    row = self.conn.execute(sql, params).fetchone()
                except psycopg.Error as exc:
                    if self.conn.pgconn.status == _CONNECTION_OK and not self.conn.closed:
                        raise
                    self._end(f"the database session ended: {exc}".strip())
                    failure = exc
        finally:
            with self._wait_mutex:
                self._waiting = False
        if failure is not None:
            self.report_lost()
            raise SessionLost(self.lost or "the database session ended") from failure
        assert row is not None
        if row[-1] != self.backend_pid:
            self._switched(str(row[-1]).encode())
        return tuple(row)

    def _refuse_while_placed(self) -> None:
        place = self.place
        if place is not None and place[1] != threading.get_ident():
            raise SessionBusy(
                f"the advisory session of this holder on {self.alias!r} is waiting in the "
                f"server for {place[0]!r} (a place taken by enqueue()): call wait() on that "
                "lock first, or release() to give the place up; or take this lock with "
                "another strategy (lease)"
            )

    def cancel_wait(self) -> None:
        """Cancel the statement running in :meth:`wait`, if one is running."""
        with self._wait_mutex:
            if not self._waiting:
                return
            try:
                cancel = getattr(self.conn, "cancel_safe", None)
                if cancel is not None:
                    cancel()
                else:  # psycopg < 3.2
                    self.conn.cancel()
            except Exception as exc:  # the wait ends on its own (deadline, release)
                logger.warning("django-dlock: could not cancel an advisory wait: %s", exc)

    # -- end of the session -------------------------------------------------

    def _end(self, reason: str) -> None:
        """Close the connection (with ``mutex`` held); the server frees its locks."""
        if self.lost is None:
            self.lost = reason
        with contextlib.suppress(Exception):
            self.conn.close()

    def fail(self, reason: str) -> None:
        """End the session and report its locks lost."""
        with self.mutex:
            self._end(reason)
        self.report_lost()

    def report_lost(self) -> None:
        """Mark the holdings of every lock this session held as lost (once)."""
        self.pool.forget(self)
        holder = self.holder_ref() if self.holder_ref is not None else None
        names, self.held = list(self.held), {}
        if holder is None:
            return
        reason = self.lost or "the database session ended"
        for name in names:
            try:
                # the front object's callback: lock_lost signal, on_lost callback
                holder.report_lost((self.alias, self.family, name), reason)
            except Exception:  # a signal receiver raised: the others still hear
                logger.exception("django-dlock: reporting the loss of %s failed", name)

    def looks_dead(self) -> bool:
        """For the watcher: consume what the idle socket has; true if the session ended."""
        if not self.mutex.acquire(blocking=False):
            return False  # a statement is running: it will see any failure itself
        try:
            if self.lost is not None or self.conn.closed:
                return False
            for _ in range(3):
                try:
                    self.conn.pgconn.consume_input()
                    fd = self.conn.fileno()
                except Exception as exc:
                    self._end(f"the database session ended: {exc}".strip())
                    return True
                if self.conn.pgconn.status != _CONNECTION_OK:
                    self._end("the database session ended")
                    return True
                if not _readable([fd], 0):
                    return False  # a notice or a parameter report: harmless
            return False
        finally:
            self.mutex.release()
