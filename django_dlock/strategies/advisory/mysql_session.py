"""Dedicated MySQL/MariaDB sessions for ``GET_LOCK`` user locks.

A MySQL user lock (``GET_LOCK``) belongs to the connection that took it,
exactly like a PostgreSQL session advisory lock belongs to its session, so
the MySQL side of the ``advisory`` strategy reuses the connection model of
:mod:`django_dlock.strategies.advisory.session`: one dedicated connection per holder (thread or
asyncio task) and alias, a small pool of idle connections, the watcher
thread that notices a connection the server ended (``KILL``, a restart, a
network cut) and reports the locks it held as lost, holders that disappear
without releasing, async waits in threads, and ``fork``.

What differs is the driver: these sessions speak the DB-API of the driver
Django's MySQL backend uses (mysqlclient, or PyMySQL installed as
``MySQLdb``), opened with the alias's connection parameters, in autocommit
mode, with ``wait_timeout`` raised to its maximum (a holding connection may
be idle for hours) and the statement time limit (``max_statement_time`` on
MariaDB, ``max_execution_time`` on MySQL) switched off, so that a long wait
in ``GET_LOCK`` is never cut short by the server. Every statement also
returns ``CONNECTION_ID()``: if it ever changes, a proxy (or a reconnecting
driver) switched the server connection under us, which would silently lose
the locks, and :class:`~django_dlock.SessionSwitched` is raised.

A wait is interrupted from another thread (an async task that is cancelled)
with ``KILL QUERY <connection id>`` sent on a short-lived connection of its
own: ``GET_LOCK`` then returns ``NULL`` and the connection lives on.
"""

from __future__ import annotations

import contextlib
import logging
import select
from collections.abc import Sequence
from typing import Any, cast

from django.db import connections

from django_dlock.strategies.advisory.pool import Pool
from django_dlock.strategies.advisory.session import (
    Cancellable,
    Session,
    SessionLost,
    SessionSwitched,
    WaitCancelled,
)

logger = logging.getLogger("django_dlock")

#: the largest ``wait_timeout`` MySQL and MariaDB accept (one year, seconds)
MAX_WAIT_TIMEOUT = 31_536_000

#: server error numbers that mean the connection itself has ended
CONNECTION_ENDED = frozenset(
    {
        1053,  # ER_SERVER_SHUTDOWN
        1152,  # ER_ABORTING_CONNECTION
        1927,  # ER_CONNECTION_KILLED (MariaDB)
        4031,  # ER_CLIENT_INTERACTION_TIMEOUT (MySQL 8)
    }
)


def driver() -> Any:
    """The DB-API module of Django's MySQL backend (``MySQLdb`` or PyMySQL)."""
    from django.db.backends.mysql import base

    return base.Database  # type: ignore[attr-defined]


def error_number(exc: BaseException) -> int | None:
    """The MySQL error number of a driver error (``None`` if it has none)."""
    args = getattr(exc, "args", ())
    if args and isinstance(args[0], int):
        return args[0]
    return None


def connection_ended(exc: BaseException) -> bool:
    """Whether a driver error means that the connection is gone."""
    database = driver()
    if isinstance(exc, database.InterfaceError):
        return True
    number = error_number(exc)
    if number is None:
        return False
    # 2000-2999 are client errors (CR_SERVER_GONE_ERROR, CR_SERVER_LOST, ...)
    return 2000 <= number < 3000 or number in CONNECTION_ENDED


def connect(alias: str) -> Any:
    """A new DB-API connection with the parameters of ``alias`` (autocommit)."""
    params = connections[alias].get_connection_params()
    # A wait in GET_LOCK may last as long as the caller's timeout: no read limit.
    for name in ("read_timeout", "write_timeout"):
        params.pop(name, None)
    raw = driver().connect(**params)
    try:
        raw.autocommit(True)
    except BaseException:
        with contextlib.suppress(Exception):
            raw.close()
        raise
    return raw


def _readable(fd: int) -> bool:
    """Whether the socket ``fd`` has something to read (or was closed), now."""
    if hasattr(select, "poll"):
        poller = select.poll()
        poller.register(fd, select.POLLIN | select.POLLERR | select.POLLHUP)
        return bool(poller.poll(0))
    readable, _, _ = select.select([fd], [], [], 0)
    return bool(readable)


class Link:
    """The driver's connection, with the two calls the watcher makes."""

    def __init__(self, raw: Any) -> None:
        self.raw = raw
        self.closed = False

    def fileno(self) -> int:
        """The socket's file descriptor (mysqlclient: ``fileno()``; PyMySQL: ``_sock``)."""
        fileno = getattr(self.raw, "fileno", None)
        if fileno is not None:
            return int(fileno())
        return int(self.raw._sock.fileno())

    def close(self) -> None:
        self.closed = True
        self.raw.close()


class MySQLSession(Session):
    """One dedicated MySQL connection, owned by at most one holder at a time.

    ``backend_pid`` is the server's ``CONNECTION_ID()`` of the connection.
    """

    def __init__(self, pool: Pool, link: Link, connection_id: int) -> None:
        super().__init__(pool, cast(Any, link), connection_id)
        self.link = link
        #: whether GET_LOCK takes fractions of a second (MariaDB; MySQL rounds)
        self.fractional_timeouts = False

    def query(
        self, sql: str, params: Sequence[Any], waiter: Cancellable | None = None
    ) -> tuple[Any, ...]:
        """Run one statement whose last column is ``CONNECTION_ID()``; its first row.

        With ``waiter`` the statement may wait: :meth:`cancel_wait` then
        interrupts it from another thread.

        Raises:
            WaitCancelled: ``waiter`` was cancelled before the statement began.
            SessionLost: the connection is gone; the locks it held are
                reported lost.
            SessionSwitched: the server connection changed.
            Exception: the driver's error for a failed statement (the
                connection lives on).
        """
        if waiter is not None:
            with self._wait_mutex:
                if waiter.cancelled:
                    raise WaitCancelled()
                self._waiting = True
        ended: BaseException | None = None
        try:
            with self.mutex:
                if self.lost is not None:
                    raise SessionLost(self.lost)
                try:
                    with self.link.raw.cursor() as cur:
                        cur.execute(sql, tuple(params))
                        row = cur.fetchone()
                except driver().Error as exc:
                    if not connection_ended(exc):
                        raise
                    self._end(f"the database connection ended: {exc}")
                    ended = exc
                except BaseException as exc:
                    # Interrupted half way through the protocol (KeyboardInterrupt,
                    # a signal): the connection cannot be trusted any more.
                    self._end(f"a statement was interrupted: {exc!r}")
                    ended = exc
        finally:
            if waiter is not None:
                with self._wait_mutex:
                    self._waiting = False
        if ended is not None:
            self.report_lost()
            if not isinstance(ended, Exception):
                raise ended
            raise SessionLost(self.lost or "the database connection ended") from ended
        if row is None or row[-1] is None or int(row[-1]) != self.backend_pid:
            self._connection_changed(None if row is None else row[-1])
        return tuple(row)

    def _connection_changed(self, found: Any) -> None:
        reason = (
            f"the server connection changed under the session (connection id "
            f"{self.backend_pid}, then {found}): a proxy that multiplexes connections "
            "or a driver that reconnects cannot carry GET_LOCK locks"
        )
        self.fail(reason)
        raise SessionSwitched(
            reason + ". Give the advisory strategy a database alias that connects "
            "directly, or use the lease or row strategy."
        )

    def cancel_wait(self) -> None:
        """Interrupt a statement running in :meth:`query` (``KILL QUERY``).

        The kill is sent while the waiting statement is still marked as
        running (the waiting thread cannot go on to its next statement
        meanwhile), so it never hits a later statement. If the wait ended in
        the server just before, the kill finds the connection idle, and the
        server forgets it when the next statement begins.
        """
        with self._wait_mutex:
            if self._waiting:
                self._kill_query()

    def _kill_query(self) -> None:
        try:
            raw = connect(self.alias)
            try:
                with raw.cursor() as cur:
                    cur.execute("KILL QUERY %s", (self.backend_pid,))
            finally:
                raw.close()
        except Exception as exc:  # the wait ends on its own (deadline, release)
            logger.warning("django-dlock: could not interrupt a GET_LOCK wait: %s", exc)

    def looks_dead(self) -> bool:
        """For the watcher: an idle MySQL connection is readable only when it ended.

        The server never speaks unasked, except to say that it closes the
        connection (``KILL``, ``wait_timeout``, shutdown).
        """
        if not self.mutex.acquire(blocking=False):
            return False  # a statement is running: it will see any failure itself
        try:
            if self.lost is not None or self.link.closed:
                return False
            try:
                fd = self.link.fileno()
                readable = _readable(fd)
            except Exception as exc:
                self._end(f"the database connection ended: {exc}")
                return True
            if readable:
                self._end("the database connection ended (killed, timed out or closed)")
            return readable
        finally:
            self.mutex.release()


class MySQLPool(Pool):
    """The MySQL sessions of one database alias in this process."""

    def _open(self) -> Session:
        raw = connect(self.alias)
        try:
            with raw.cursor() as cur:
                cur.execute("SELECT CONNECTION_ID(), VERSION()")
                row = cur.fetchone()
                mariadb = "mariadb" in str(row[1]).lower()
                limit = "max_statement_time" if mariadb else "max_execution_time"
                cur.execute(f"SET SESSION wait_timeout = {MAX_WAIT_TIMEOUT}, {limit} = 0")
        except BaseException:
            with contextlib.suppress(Exception):
                raw.close()
            raise
        session = MySQLSession(self, Link(raw), int(row[0]))
        session.fractional_timeouts = mariadb
        return session
