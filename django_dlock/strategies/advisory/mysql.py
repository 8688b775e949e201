"""The ``advisory`` strategy on MySQL and MariaDB: ``GET_LOCK`` user locks.

``GET_LOCK(name, timeout)`` / ``RELEASE_LOCK(name)`` / ``IS_USED_LOCK(name)``
on a dedicated connection of the holder (below; the
connection model is the same as on PostgreSQL). The lock is held until
it is released or the connection ends, so a crashed holder frees it at once.

* **Names.** MySQL limits lock names to 64 characters, and user locks are
  global to the server (not per database). A key maps to the lock name
  given by :func:`lock_name`: a readable prefix (the first 31 characters of
  the key's name, each character outside ``A-Z a-z 0-9 : . _ -`` replaced
  by ``_``), ``#``, and the first 32 hexadecimal digits of
  ``SHA-256(<database name> + "/" + <key name>)``. Distinct keys, and the
  same key in two databases of one server, get distinct names; the name
  depends on nothing else, so every process computes the same one.
* **Acquire.** ``GET_LOCK(name, 0)`` tries once; if the caller may wait, one
  more ``GET_LOCK(name, seconds left)`` waits in the server (MariaDB takes
  fractions of a second; MySQL takes whole seconds, so there the time left
  is rounded up and a wait may end up to a second late). A wait without
  timeout waits a year at a time.
* **Re-entrancy** is counted by django-dlock: ``GET_LOCK`` runs once per
  holding, ``RELEASE_LOCK`` exactly once when the count returns to zero
  (the server counts re-entries of one connection too, since MySQL 5.7 and
  MariaDB 10.0.2, and would keep a lock taken twice after one release).
* **Release** is ``RELEASE_LOCK``; anything but ``1`` (the connection no
  longer holds the lock) is reported: the front object raises
  :class:`~django_dlock.exceptions.LockLost`.
* Not supported: ``shared=True`` (``GET_LOCK`` has no shared mode) and
  fencing numbers (``lock.fence`` is ``None``).

Its sessions: dedicated MySQL/MariaDB sessions for ``GET_LOCK`` user locks.

A MySQL user lock (``GET_LOCK``) belongs to the connection that took it,
exactly like a PostgreSQL session advisory lock belongs to its session, so
the MySQL side of the ``advisory`` strategy reuses the connection model of
:mod:`django_dlock.strategies.advisory.sessions`: one dedicated connection per holder (thread or
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
import hashlib
import logging
import math
import re
import select
from collections.abc import Sequence
from typing import Any, cast

from django.db import connections
from django.db.backends.base.base import BaseDatabaseWrapper

from django_dlock.exceptions import DLockError, StrategyNotSupported
from django_dlock.keys import Key
from django_dlock.retry import Deadline
from django_dlock.strategies.advisory.acquire import AsyncWait, SessionAsyncAcquire
from django_dlock.strategies.advisory.sessions import (
    Cancellable,
    Pool,
    Session,
    SessionLost,
    SessionSwitched,
    WaitCancelled,
)
from django_dlock.strategies.base import Grant, Request, Strategy
from django_dlock.strategies.connection import fetch_one, lock_connection

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


logger = logging.getLogger("django_dlock")

#: MySQL's limit on the length of a lock name
MAX_NAME_LENGTH = 64
#: characters of the key's name kept readable at the front of the lock name
READABLE_LENGTH = 31
#: hexadecimal digits of the SHA-256 digest at the end (128 bits)
DIGEST_LENGTH = 32
#: the longest single wait (seconds): a wait without timeout repeats it
MAX_WAIT = 31_536_000

_UNREADABLE = re.compile(r"[^A-Za-z0-9:._-]")

#: server errors that mean "deadlock" while waiting for a user lock
_DEADLOCK = frozenset({1213, 3058})  # ER_LOCK_DEADLOCK (MariaDB), ER_USER_LOCK_DEADLOCK

TRY = "SELECT GET_LOCK(%s, %s), CONNECTION_ID()"
RELEASE = "SELECT RELEASE_LOCK(%s), CONNECTION_ID()"
HOLDS = "SELECT IS_USED_LOCK(%s) = CONNECTION_ID(), CONNECTION_ID()"
USED = "SELECT IS_USED_LOCK(%s)"


def lock_name(database: str, key_name: str) -> str:
    """The ``GET_LOCK`` name of the key called ``key_name`` in ``database``.

    ``<readable prefix>#<32 hex digits>``, at most 64 characters (see the
    module docstring). The same in SQL::

        CONCAT(LEFT(REGEXP_REPLACE(key_name, '[^A-Za-z0-9:._-]', '_'), 31), '#',
               LEFT(SHA2(CONCAT(CONVERT(DATABASE() USING utf8mb4), '/', key_name), 256), 32))
    """
    readable = _UNREADABLE.sub("_", key_name[:READABLE_LENGTH])
    digest = hashlib.sha256(f"{database}/{key_name}".encode()).hexdigest()
    return f"{readable}#{digest[:DIGEST_LENGTH]}"


def database_name(alias: str) -> str:
    """The name of the database ``alias`` connects to (part of every lock name).

    ``NAME`` of the alias's settings, else ``OPTIONS["database"]`` or
    ``OPTIONS["db"]`` (a database named in an option file only counts as
    ``""``: give it in ``NAME`` so that every process agrees).
    """
    database = connections[alias].settings_dict
    options = database.get("OPTIONS") or {}
    return str(database.get("NAME") or options.get("database") or options.get("db") or "")


def name_of(req: Request) -> str:
    return lock_name(database_name(req.alias), req.key.name)


def refuse_shared(req: Request) -> None:
    if req.shared:
        raise StrategyNotSupported(
            f"shared advisory locks need PostgreSQL; database {req.alias!r} is MySQL/MariaDB, "
            "whose GET_LOCK has no shared mode: take the lock exclusively, or use "
            "the lease strategy"
        )


class MySQLAdvisoryStrategy(SessionAsyncAcquire):
    """``GET_LOCK`` user locks on dedicated connections (module docstring)."""

    name = "advisory"
    family = "advisory"
    shares = False  # GET_LOCK has no shared mode
    pool_kind = MySQLPool

    def check_supported(self, connection: BaseDatabaseWrapper) -> None:
        if connection.vendor != "mysql":
            raise StrategyNotSupported(
                f"the MySQL advisory strategy needs MySQL/MariaDB; database "
                f"{connection.alias!r} is {connection.vendor}"
            )

    def refuse_unsupported(self, req: Request) -> None:
        refuse_shared(req)

    # -- the statements ------------------------------------------------------------

    def _take(
        self, session: Session, req: Request, deadline: Deadline, waiter: AsyncWait | None
    ) -> Grant | None:
        assert isinstance(session, MySQLSession)
        name = name_of(req)
        acquired = session.query(TRY, (name, 0))[0] == 1
        if not acquired and not deadline.expired():
            acquired = self._wait(session, req, name, deadline, waiter)
        return Grant(None) if acquired else None

    def _wait(
        self,
        session: MySQLSession,
        req: Request,
        name: str,
        deadline: Deadline,
        waiter: AsyncWait | None,
    ) -> bool:
        """Wait in the server for the lock, at most until ``deadline``."""
        while True:
            if deadline.timeout is None:
                seconds = float(MAX_WAIT)
            else:
                left = deadline.remaining()
                if left <= 0:
                    return False
                if session.fractional_timeouts:
                    seconds = min(math.ceil(left * 1000) / 1000, float(MAX_WAIT))
                else:  # MySQL rounds to whole seconds: never ask for 0
                    seconds = float(min(math.ceil(left), MAX_WAIT))
            try:
                value = session.query(TRY, (name, seconds), waiter)[0]
            except WaitCancelled:
                return False
            except driver().Error as exc:
                if error_number(exc) not in _DEADLOCK:
                    raise
                logger.warning(
                    "django-dlock: the database detected a deadlock while waiting for %s; "
                    "giving up (take several locks in one lock([...]) to avoid this)",
                    req.key.name,
                )
                return False
            if value == 1:
                return True
            if value is None:
                # Interrupted (our own KILL QUERY, or an operator's): the lock
                # may have been granted just before; find out.
                self._settle(session, req)
                if waiter is not None and waiter.cancelled:
                    return False
            # 0: the time ran out (MySQL rounds to whole seconds: check the deadline)

    def _holds(self, session: Session, req: Request) -> bool:
        assert isinstance(session, MySQLSession)
        return bool(session.query(HOLDS, (name_of(req),))[0] == 1)

    def _unlock(self, session: Session, req: Request) -> bool:
        assert isinstance(session, MySQLSession)
        return bool(session.query(RELEASE, (name_of(req),))[0] == 1)

    def _database_error(self) -> type[Exception]:
        error: type[Exception] = driver().Error
        return error

    def _failed(self, req: Request, exc: Exception) -> DLockError:
        return DLockError(f"the GET_LOCK statement for {req.key.name!r} failed: {exc}")

    # -- inspect -------------------------------------------------------------------

    def locked(self, alias: str, key: Key) -> bool:
        name = lock_name(database_name(alias), key.name)
        row = fetch_one(lock_connection(alias), USED, [name])
        held: bool = row is not None and row[0] is not None
        return held


advisory_mysql = MySQLAdvisoryStrategy()
_implements_strategy: Strategy = advisory_mysql  # (checked by mypy)
