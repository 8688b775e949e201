"""The ``advisory`` strategy on MySQL and MariaDB: ``GET_LOCK`` user locks.

``GET_LOCK(name, timeout)`` / ``RELEASE_LOCK(name)`` / ``IS_USED_LOCK(name)``
on a dedicated connection of the holder (see :mod:`django_dlock.strategies.advisory.mysql_session`
for the connection model, the same as on PostgreSQL). The lock is held until
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
"""

from __future__ import annotations

import hashlib
import logging
import math
import re

from django.db import connections
from django.db.backends.base.base import BaseDatabaseWrapper

from django_dlock.exceptions import DLockError, StrategyNotSupported
from django_dlock.keys import Key
from django_dlock.retry import Deadline
from django_dlock.strategies.advisory import mysql_session
from django_dlock.strategies.advisory.acquire import AsyncWait, SessionAsyncAcquire
from django_dlock.strategies.advisory.session import (
    Session,
    WaitCancelled,
)
from django_dlock.strategies.base import Grant, Request, Strategy
from django_dlock.strategies.connection import fetch_one, lock_connection

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
    pool_kind = mysql_session.MySQLPool

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
        assert isinstance(session, mysql_session.MySQLSession)
        name = name_of(req)
        acquired = session.query(TRY, (name, 0))[0] == 1
        if not acquired and not deadline.expired():
            acquired = self._wait(session, req, name, deadline, waiter)
        return Grant(None) if acquired else None

    def _wait(
        self,
        session: mysql_session.MySQLSession,
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
            except mysql_session.driver().Error as exc:
                if mysql_session.error_number(exc) not in _DEADLOCK:
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
        assert isinstance(session, mysql_session.MySQLSession)
        return bool(session.query(HOLDS, (name_of(req),))[0] == 1)

    def _unlock(self, session: Session, req: Request) -> bool:
        assert isinstance(session, mysql_session.MySQLSession)
        return bool(session.query(RELEASE, (name_of(req),))[0] == 1)

    def _database_error(self) -> type[Exception]:
        error: type[Exception] = mysql_session.driver().Error
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
